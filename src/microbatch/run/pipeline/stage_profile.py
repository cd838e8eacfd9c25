"""A per-stage profile of a pipeline's model on one process: each stage's forward (the last stage
with its loss), full backward, input-gradient and weight-gradient time of one micro-batch, timed as
torch's runtime runs them (:func:`profile_stages`) — the op times of the prediction made before a
run (:mod:`microbatch.run.pipeline.before_run`) and of the calibration's in-op costs
(:mod:`microbatch.run.pipeline.calibrate`) — and the bytes each stage's forward saves for one
micro-batch (:func:`stage_saved_bytes`), the calibration of the per-rank memory prediction
(:mod:`microbatch.run.pipeline.memory`)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from microbatch.errors import MicrobatchError, PipelineError
from microbatch.run.pipeline.resolved import ResolvedRun

__all__ = ["in_launcher", "profile_stages", "stage_saved_bytes"]


def _torch_split_backward() -> tuple[Any, Any] | None:
    """torch's ``stage_backward_input`` and ``stage_backward_weight`` (the functions its zero-bubble
    runtime runs as I and W), or None where this torch has none. Timing W as ``autograd.grad`` over
    the parameters instead re-runs the input-gradient chain: on ``small``'s last stage 30.7 ms against
    torch's 16.1 ms W (I 15.4 ms, full backward 34.8 ms; measured on the 2-core dev machine)."""
    try:
        from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
    except ImportError:  # a torch without the split backward (private API)
        return None
    return stage_backward_input, stage_backward_weight


def _timed(fn: Any, idle_s: float) -> tuple[float, float]:
    """Wall and thread-CPU seconds of one ``fn()`` after ``idle_s`` asleep."""
    if idle_s:
        time.sleep(idle_s)
    c0, t0 = time.thread_time(), time.perf_counter()
    fn()
    return time.perf_counter() - t0, time.thread_time() - c0


@contextmanager
def in_launcher(
    run: ResolvedRun, what: str, deadline_s: float | None = None,
    fix: str = "fix the model (predict=False runs it on the ranks without this step)",
    when: str = "before any rank started",
) -> Iterator[None]:  # fmt: skip
    """The user's model run in the launcher's own process, bounded as the ranks are: past the run's deadline
    (``deadline_s``, or ``timeout_s`` plus the start-up allowance,
    :meth:`~microbatch.run.pipeline.config.PipelineConfig.deadline`) a :class:`~microbatch.errors.PipelineError`
    (SIGALRM in the main thread: a forward stuck in Python ends, one stuck in a native call when it returns), and an
    error of the model one line, not a traceback, with ``fix``; ``when`` says where in the run it was. What the
    model prints goes to stderr: stdout is the command's one JSON object (a review: a forward that printed broke
    ``--json``). A timer the caller had running (a test runner's) is set again afterwards with what is left of it."""
    import contextlib
    import signal
    import sys
    import threading
    import time

    from microbatch.measure.device import short_error

    seconds, _ = run.cfg.deadline(deadline_s)
    armed = threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer")
    outer = signal.getitimer(signal.ITIMER_REAL) if armed else (0.0, 0.0)
    t0 = time.monotonic()

    def expire(signum: int, frame: Any) -> None:
        raise PipelineError(
            f"{what} passed its deadline of {seconds:.0f} s (timeout_s {run.cfg.timeout_s:g} s + start-up): the "
            "model's code (its factory, forward or backward) did not return; check it for a hang, or raise timeout_s"
        )

    previous = signal.signal(signal.SIGALRM, expire) if armed else None
    if armed:
        signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    except (MicrobatchError, KeyboardInterrupt):
        raise
    except Exception as e:  # noqa: BLE001 - the user's model raised it
        raise PipelineError(
            f"{what} failed ({short_error(e)}): the model's forward or backward raised it on one process, {when}; "
            f"{fix}"
        ) from e
    finally:
        if armed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
            if outer[0] > 0:  # the caller's timer, less the time spent here (at least a tick: it still fires)
                signal.setitimer(signal.ITIMER_REAL, max(1e-3, outer[0] - (time.monotonic() - t0)), outer[1])


def profile_stages(run: ResolvedRun, repeats: int = 7, idle_s: float = 0.0) -> dict[int, dict[str, float]]:
    """:func:`_profile_stages` bounded by the run's deadline, the model's errors in one line (:func:`in_launcher`)."""
    with in_launcher(run, "profiling the stages on one process"):
        return _profile_stages(run, repeats, idle_s)


def _profile_stages(run: ResolvedRun, repeats: int = 7, idle_s: float = 0.0) -> dict[int, dict[str, float]]:
    """Per virtual stage: ``F``, ``B``, ``I`` and ``W`` seconds of one micro-batch (median of
    ``repeats``), measured in this process with one thread on the split the ranks use, and the
    same in thread-CPU seconds (``cpuF`` … ``cpuW``).

    The repeats go round the stages (stage 0's ops, stage 1's, …, then again), so that a drift of
    the machine's speed while profiling (frequency, other programs) moves every stage alike: the
    bubble depends on the stages' ratio. Profiling one stage after the other moved the predicted
    ZB-H1 bubble of ``small`` at p = 2 between 23.7% and 31.0% over five profiles on an idle
    machine (stage 0's backward 16.2-22.3 ms).

    ``idle_s``: sleep that long before each timed call. A rank of a pipeline waits between its
    ops, and while it waits other processes run on its core and take its caches: an op that
    follows a wait runs slower than the same op back to back (measured on the 2-core dev machine at
    load 2: tiny's last-stage forward 0.57 ms back to back, 0.71 / 0.74 / 0.97 ms after 1 / 3 / 6 ms
    asleep). :func:`microbatch.run.pipeline.before_run.predict_run` passes the calibration run's mean gap between ops."""
    import torch

    split_fns = _torch_split_backward()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ops = _stage_ops(run, split_fns, idle_s)
        runs: dict[int, dict[str, list[tuple[float, ...]]]] = {
            s: {"F": [], "B": [], "S": []} for s in range(len(ops))
        }
        # the gradients accumulate across the repeats, as over a step's micro-batches (a fresh
        # allocation per call made the first stage's W, 32 MiB of embedding gradient on small,
        # vary 18.9-25.5 ms between profiles)
        for _ in range(repeats):
            for s, (fwd, full_b, split, wants) in enumerate(ops):
                runs[s]["F"].append(_timed(fwd, idle_s))
                runs[s]["B"].append(full_b())
                runs[s]["S"].append(split() if wants else (0.0, 0.0, 0.0, 0.0))

        def med(xs: list[tuple[float, ...]], k: int) -> float:
            return float(statistics.median(x[k] for x in xs))

        return {
            s: {
                "F": med(r["F"], 0),
                "B": med(r["B"], 0),
                "I": med(r["S"], 0),
                "W": med(r["S"], 1),
                "cpuF": med(r["F"], 1),
                "cpuB": med(r["B"], 1),
                "cpuI": med(r["S"], 2),
                "cpuW": med(r["S"], 3),
            }  # fmt: skip
            for s, r in runs.items()
        }
    finally:
        torch.set_num_threads(threads)


_StageOps = tuple[Callable[[], Any], Callable[[], tuple[float, float]], Callable[[], tuple[float, ...]], bool]
"""Of one stage: its forward, a timed full backward, a timed split backward (I, W wall; I, W CPU
seconds), and whether it has gradients to take."""


def _stage_ops(run: ResolvedRun, split_fns: Any, idle_s: float) -> list[_StageOps]:
    """The split the ranks use, and per stage the calls that :func:`profile_stages` times, each on
    the stage's input from one forward pass of the whole model."""
    import torch
    import torch.nn.functional as F

    from microbatch.run.pipeline.rank import build_full_model, make_batch, params_split
    from microbatch.run.pipeline.split import model_units, split_units

    cfg = run.cfg
    full, vocab, seq = build_full_model(run)
    units = model_units(full)
    modules = split_units(units, params_split(run, units))
    tok, tgt = make_batch(cfg, vocab, seq, -1)
    x: Any = tok[: cfg.micro_batch]
    target = tgt[: cfg.micro_batch]
    total = cfg.batch * seq
    last = len(modules) - 1

    def loss(y: Any) -> Any:
        return F.cross_entropy(y.flatten(0, -2).float(), target.flatten(), reduction="sum") / total

    ops: list[_StageOps] = []
    for s, mod in enumerate(modules):
        ops.append(
            _one_stage_ops(
                mod,
                x.detach().requires_grad_(x.is_floating_point()),
                loss if s == last else None,
                split_fns,
                idle_s,
            )
        )
        with torch.no_grad():
            x = mod(x)
    return ops


def _one_stage_ops(
    mod: Any, inp: Any, loss: Callable[[Any], Any] | None, split_fns: Any, idle_s: float
) -> _StageOps:
    """Forward, full backward and split backward of one stage on ``inp`` (``loss``: the last stage's), the forward
    under the ranks' own saved-tensor hooks (:func:`~microbatch.run.pipeline.instrument._saved_bytes_hooks`, each
    saved tensor counted and watched until freed): the run measured pays them (13% of a tiny model's forward and
    backward on one thread, 4% of small's), so the step predicted pays them too."""
    import torch

    from microbatch.run.pipeline.instrument import StageRecorder, _saved_bytes_hooks

    params = [p for p in mod.parameters() if p.requires_grad]
    param_ptrs = {p.untyped_storage().data_ptr() for p in mod.parameters()}
    rec = StageRecorder(0)

    def fwd() -> Any:
        with _saved_bytes_hooks(param_ptrs, {}, rec, (0, 0)):
            y = mod(inp)
            if loss is not None:
                y = loss(y)
        return y

    y = fwd()
    grad = None if loss is not None else torch.ones_like(y)

    def full_b() -> tuple[float, float]:
        y = fwd()
        return _timed(lambda: torch.autograd.backward(y, grad), idle_s)

    def split() -> tuple[float, float, float, float]:
        y = fwd()
        groups: list[Any] = []

        def input_grad() -> None:
            if inp.requires_grad and split_fns is not None:
                # torch's own I: input gradients, keeping what W needs (intermediate gradients)
                groups.append(split_fns[0]([y], None if grad is None else [grad], [inp], iter(params))[1])
            elif inp.requires_grad:
                torch.autograd.grad(y, [inp], grad, retain_graph=True)

        def weight_grad() -> None:
            if groups and split_fns is not None:
                split_fns[1](iter(params), groups[0])  # torch's W: weight gradients from those
            elif params:
                # the first stage (no input gradient: torch runs its whole backward at W,
                # accumulating into .grad), or no split-backward functions in this torch
                torch.autograd.backward(y, grad, inputs=params)

        i_wall, i_cpu = _timed(input_grad, idle_s)
        w_wall, w_cpu = _timed(weight_grad, idle_s)
        return i_wall, w_wall, i_cpu, w_cpu

    return fwd, full_b, split, inp.requires_grad or bool(params)


def stage_saved_bytes(
    run: ResolvedRun, sizes: list[int] | None = None, device: str = "cpu"
) -> dict[int, dict[str, float]]:
    """:func:`_stage_saved_bytes` bounded by the run's deadline, the model's errors in one line (after the run: the
    ranks' measurements are kept, :func:`~microbatch.run.pipeline.memory.memory_rows`)."""
    with in_launcher(
        run, "measuring the stages' saved bytes on one process", when="after the ranks' run",
        fix="the run's measurements are kept; its activation memory is not predicted (check that the model factory "
        "builds the same layers on every call)",
    ):  # fmt: skip
        return _stage_saved_bytes(run, sizes, device)


def _stage_saved_bytes(
    run: ResolvedRun, sizes: list[int] | None = None, device: str = "cpu"
) -> dict[int, dict[str, float]]:
    """Per virtual stage, the bytes autograd saves in its forward (the last stage with its loss) for
    one micro-batch, measured in this process, apart from any run: ``own`` (storages no earlier
    micro-batch saved), ``shared`` (storages an earlier micro-batch of the step saved too and that
    are still alive: the batch's token ids and targets, which the micro-batches take as views, held
    once) and ``input`` (the bytes of the tensor the stage receives where autograd saves that tensor
    itself, else 0, and 0 for the first: measured, so a ``module:function`` model's boundary is known
    without its shape). Measured with the run's own saved-tensor hooks
    (:func:`microbatch.run.pipeline.instrument._saved_bytes_hooks`, parameters never counted) on two
    micro-batches of the run's data (one where m = 1), the second one's bytes kept: the first
    micro-batch also owns the shared storages.

    ``sizes``: units per stage as the ranks split them (the report's ``layers_per_stage``); None
    splits by parameter count, as the ranks do with ``balance="params"``. Placement follows the
    schedule: stages on one rank share their saved storages as on that rank. ``device``: where the
    ranks ran (``"cuda:0"`` for NCCL ranks), since a kernel may save other tensors on another device
    (PyTorch's attention saves its s x s probabilities on one path and only their log-sum-exp on the
    flash path)."""
    import torch.nn.functional as F

    from microbatch.run.pipeline.instrument import StageRecorder, _saved_bytes_hooks
    from microbatch.run.pipeline.rank import build_full_model, make_batch, params_split
    from microbatch.run.pipeline.split import model_units, split_units

    cfg, placement = run.cfg, run.placement
    full, vocab, seq = build_full_model(run)
    units = model_units(full)
    modules = [m.to(device) for m in split_units(units, sizes or params_split(run, units))]
    recorders = {r: StageRecorder(rank=r) for r in set(placement)}
    tok, tgt = (t.to(device) for t in make_batch(cfg, vocab, seq, -1))
    b, total, last = cfg.micro_batch, cfg.batch * seq, len(modules) - 1
    alive: list[Any] = []  # every micro-batch's graph stays alive, as between a forward and its backward
    out: dict[int, dict[str, float]] = {}
    for i in range(min(2, cfg.microbatches)):
        x: Any = tok[i * b : (i + 1) * b]
        target = tgt[i * b : (i + 1) * b]
        for s, mod in enumerate(modules):
            rec = recorders[placement[s]]
            params = {p.untyped_storage().data_ptr() for p in mod.parameters()}
            inp = x if s == 0 else x.detach().requires_grad_(x.is_floating_point())
            seen: dict[int, int] = {}
            shared: dict[int, int] = {}
            held_ids: set[int] = set()
            with _saved_bytes_hooks(params, seen, rec, (s, i), shared, held_ids):
                y = mod(inp)
                if s == last:
                    y = F.cross_entropy(y.flatten(0, -2).float(), target.flatten(), reduction="sum") / total
            rec.step_ptrs.update(dict.fromkeys(seen, (s, i)))
            alive.append(y)
            out[s] = {
                "own": float(sum(seen.values()) - sum(shared.values())),
                "shared": float(sum(shared.values())),
                # the received tensor, where autograd saves it as itself: torch's runtime keeps every micro-batch's
                # (its receive buffers), so it stays among the saved storages the run counts; saved only as a
                # view (a Linear flattening its input) it leaves that count at the backward
                "input": float(inp.numel() * inp.element_size()) if s > 0 and id(inp) in held_ids else 0.0,
            }
            x = y
    del alive
    return out
