"""The pipeline runtime's own costs on this machine, measured before a run (for
:mod:`microbatch.run.pipeline.before_run`'s prediction).

- **The bare calibration** (:func:`calibrate_runtime`): a short run of the same schedule, p, m, v
  and micro-batch through ``torch.distributed.pipelining`` on a model whose ops are element-wise
  (microseconds, :func:`calibration_model`) but whose stage boundary has the real model's shape
  (b_m × s × h), so that it sends the same bytes: its step is almost all runtime and hand-off.
  From its intervals, :func:`microbatch.run.pipeline.replay.runtime_terms` measures the time
  between ops where it goes: the sender's cost after an op that hands its output to another rank
  (per direction), after an op that does not, the hand-off as the waiting rank sees it (per
  direction), and the step's start and end; and the runtime's own work inside each stage call.
- **The loaded calibration** for gloo ranks on the CPU (:func:`needs_loaded_calibration`,
  :func:`calibrate_loaded`): the between-op terms again from a run whose stages spin for the real
  stages' profiled CPU time (:func:`loaded_calibration_model`), so that its ranks load the cores
  and wait for each other as the real ones will (on the 2-core dev machine, small p = 4: the gap
  after a send 3.6-4.6 ms in the real run, 0.9-1.1 ms in the bare calibration). At most
  ``LOADED_BUDGET_S`` of stage work (:func:`loaded_steps`).
- **The machine** (:func:`machine_load`): its cores, the other programs' runnable threads, and the
  scheduler's time slice, measured with busy loops (:func:`scheduler_slice_s`).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

from microbatch.run.pipeline.config import PipelineConfig
from microbatch.run.pipeline.resolved import ResolvedRun, resolve

__all__ = [
    "CALIBRATION_STEPS",
    "LOADED_BUDGET_S",
    "MAX_LOADED_STEPS",
    "MIN_LOADED_STEPS",
    "SLICE_S",
    "calibrate_loaded",
    "calibrate_runtime",
    "calibration_model",
    "loaded_calibration_model",
    "loaded_steps",
    "machine_load",
    "needs_loaded_calibration",
    "scheduler_slice_s",
]


def calibration_model(width: int = 8) -> Any:
    """A stack of 18 units whose ops are element-wise (vocabulary 32): embedding, 16 residual
    scalings x + x·w (w of size ``width``; the output is never a view, which torch's split backward
    refuses), head — the model of :func:`calibrate_runtime` (p·v up to 18 stages). Its stage
    boundary is b_m × s × ``width``: with the real model's width its sends carry the real bytes.
    ``module:calibration_model_<width>`` names it for the pipeline's model factory."""
    import torch
    from torch import nn

    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.full((width,), 0.01))

        def forward(self, x: Any) -> Any:
            return x + x * self.w

    return nn.Sequential(nn.Embedding(32, width), *[Scale() for _ in range(16)], nn.Linear(width, 32))


LOAD_ENV = "MICROBATCH_CALIBRATION_LOAD"
"""The environment variable that carries :func:`loaded_calibration_model`'s per-stage CPU seconds
(JSON ``[[F, I, W], ...]``) to the calibration's ranks."""


def _spin(seconds: float) -> None:
    """Keep this thread busy for ``seconds`` of its own CPU time (what an op of that CPU time takes
    from a core, however the cores are shared)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def loaded_calibration_model(width: int, spins: list[list[float]]) -> Any:
    """:func:`calibration_model`'s runtime with the real stages' CPU load: one unit per stage
    (``len(spins)`` stages; the first with the embedding, the last with the head, so a split by
    parameters gives each stage exactly one), whose forward spins for the stage's profiled forward CPU
    time, whose input gradient for its I (or its whole backward) and whose weight gradient for its W.
    ``spins[s] = [F, I, W]`` in CPU seconds. With it the calibration run's ranks compete for the
    cores as the real ranks will, so the time between ops it measures is the time under that
    contention (:func:`calibrate_runtime`, ``loaded``)."""
    import torch
    from torch import nn

    class Spin(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Any, fwd_s: float, bwd_s: float) -> Any:
            ctx.bwd_s = bwd_s
            _spin(fwd_s)
            return x.view_as(x) * 1.0

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            _spin(ctx.bwd_s)
            return grad, None, None

    spin: Any = Spin.apply

    class Unit(nn.Module):
        def __init__(self, f: float, i: float, w: float) -> None:
            super().__init__()
            self.f, self.i, self.w_s = f, i, w
            self.w = nn.Parameter(torch.full((width,), 0.01))

        def forward(self, x: Any) -> Any:
            x = spin(x, self.f, self.i)  # forward and input-gradient load
            return x + x * spin(self.w, 0.0, self.w_s)  # weight-gradient load

    units = [Unit(*row) for row in spins]
    first, last = (
        nn.Sequential(nn.Embedding(32, width), units[0]),
        nn.Sequential(units[-1], nn.Linear(width, 32)),
    )
    return (
        nn.Sequential(first, *units[1:-1], last)
        if len(units) > 1
        else nn.Sequential(first, nn.Linear(width, 32))
    )


def __getattr__(name: str) -> Any:
    """``calibration_model_<width>``: :func:`calibration_model` of that width, as a factory;
    ``loaded_calibration_model_<width>``: :func:`loaded_calibration_model` with the spins in the
    environment (``LOAD_ENV``)."""
    for prefix in ("calibration_model_", "loaded_calibration_model_"):
        if name.startswith(prefix) and name[len(prefix) :].isdigit():
            width = int(name[len(prefix) :])
            if prefix.startswith("loaded"):
                return lambda: loaded_calibration_model(width, json.loads(os.environ[LOAD_ENV]))
            return lambda: calibration_model(width)
    raise AttributeError(name)


SLICE_S = 0.004
"""The scheduler's time slice when it cannot be measured: 4 ms, one tick at the common ``HZ=250``
(measured on the 2-core dev machine, Linux 6.18: a busy loop among three on two cores ran 3.98 ms
at a time, median of 190 runs)."""

_SPIN = """
import json, signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the launcher's to handle: no traceback from here
end = time.perf_counter() + float(sys.argv[1])
last = start = time.perf_counter()
runs = []
while last < end:
    now = time.perf_counter()
    if now - last > 5e-5:
        runs.append(last - start)
        start = now
    last = now
print(json.dumps(runs[1:]))
"""


def scheduler_slice_s(cores: int, seconds: float = 0.3) -> float | None:
    """How long the kernel lets a busy thread run before it hands the core to another that waits:
    ``cores + 1`` busy loops for ``seconds``, each noting the runs between its pauses (> 50 µs
    without the CPU); the median run. None when no loop was ever paused."""
    procs: list[subprocess.Popen[str]] = []
    runs: list[float] = []
    try:
        for _ in range(cores + 1):
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", _SPIN, str(seconds)], stdout=subprocess.PIPE, text=True
                )
            )
        for proc in procs:
            out, _ = proc.communicate(timeout=30 + 10 * seconds)
            if proc.returncode == 0 and out.strip():
                runs.extend(json.loads(out))
    finally:  # interrupted: none left spinning (they ignore SIGINT)
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return float(statistics.median(runs)) if runs else None


def machine_load(samples: int = 50, every_s: float = 0.02) -> dict[str, float] | None:
    """Cores this process may use, the mean number of *other* runnable threads on the machine
    (``/proc/loadavg``'s running count, ``samples`` readings ``every_s`` apart, less this reader)
    and the scheduler's time slice (:func:`scheduler_slice_s`); None where the kernel does not say
    (not Linux)."""
    from microbatch.hardware import usable_cores

    try:
        cores = (
            len(os.sched_getaffinity(0)) and usable_cores()
        )  # the affinity (Linux), at most a container's quota
        running = []
        for _ in range(samples):
            with open("/proc/loadavg") as f:
                running.append(int(f.read().split()[3].split("/")[0]))
            time.sleep(every_s)
    except (OSError, AttributeError, ValueError, IndexError):
        return None
    others = max(0.0, statistics.fmean(running) - 1.0)
    try:
        slice_s = scheduler_slice_s(cores)
    except (OSError, ValueError, subprocess.SubprocessError):
        slice_s = None
    return {"cores": float(cores), "others": others, "slice_s": slice_s or SLICE_S}


def _boundary(run: ResolvedRun) -> tuple[int, int]:
    """Width and sequence length of the real model's stage boundary (8 and 8 when unknown)."""
    shape = run.shape
    if shape is None:
        return 8, run.cfg.seq or 8
    return shape.hidden, shape.seq


CALIBRATION_STEPS = 21
"""Steps of the bare calibration run: the terms are means over every case in the steps after the
first."""

MAX_LOADED_STEPS = 61
"""Most steps of a loaded calibration (the first warms up): its between-op terms are means over
the rest, and on a model whose ops take a millisecond a few slow steps move them. Measured on the
2-core dev machine, `tiny` p = 2, one profile, five loaded calibrations each: the predicted 1F1B
bubble ranged 37.3-50.6% with 21 steps (sd 5.3 points) and 44.7-47.7% with 61 (sd 1.3); GPipe
43.9-47.3% (sd 1.3) and 44.3-46.4% (sd 0.9). A loaded step is as long as a real one, so
``LOADED_BUDGET_S`` cuts this for larger models."""

LOADED_BUDGET_S = 10.0
"""Seconds of the real stages' work the loaded calibration may take (its steps cut to fit, never
below ``MIN_LOADED_STEPS``): on `tiny` (steps predicted at 25-95 ms on the 2-core dev machine)
all or most of ``MAX_LOADED_STEPS``, on `small` (0.2-0.5 s) 20-50; a larger model gets fewer
steps, a noisier reading, rather than a calibration many times longer than the run it predicts. A
bound on the user's wait, not a fitted constant."""

MIN_LOADED_STEPS = 5
"""Fewest steps a loaded calibration runs: the first warms up and the terms are means over the rest."""


def loaded_steps(step_s: float, timeout_s: float) -> int | None:
    """Steps of the loaded calibration for a run whose step is predicted at ``step_s`` seconds:
    as many as ``LOADED_BUDGET_S`` holds, between ``MIN_LOADED_STEPS`` and ``MAX_LOADED_STEPS``;
    None (the bare calibration's terms are kept) when even the fewest would take half the run's
    ``timeout_s``."""
    n = MAX_LOADED_STEPS if step_s <= 0 else min(MAX_LOADED_STEPS, int(LOADED_BUDGET_S // step_s))
    n = max(n, MIN_LOADED_STEPS)
    return n if n * step_s < 0.5 * timeout_s else None


def _calibration_run(run: ResolvedRun, factory: str, steps: int = CALIBRATION_STEPS) -> ResolvedRun:
    """The run of ``run``'s schedule, p, m, v and batch on the calibration model ``factory`` (this
    module's ``calibration_model`` or ``loaded_calibration_model``) with the real boundary's width
    and sequence, fp32, ``steps`` steps, no gradient check: a run of its own, resolved here."""
    from dataclasses import replace

    cfg = run.cfg
    width, seq = _boundary(run)
    calibration = replace(
        cfg,
        model=f"microbatch.run.pipeline.calibrate:{factory}_{width}",
        seq=seq,
        global_batch=cfg.batch,
        check_gradients=False,
        balance="params",
        steps=steps,
        dtype="float32",
    )
    return resolve(calibration)


def calibrate_runtime(run: ResolvedRun) -> dict[str, Any]:
    """The runtime's costs between ops for ``run``'s schedule, p, m, v and micro-batch on this
    machine (:func:`microbatch.run.pipeline.replay.runtime_terms`), from a run of
    :func:`calibration_model` with the real boundary's width and sequence (a few seconds)."""
    from microbatch.run.pipeline.launch import run_resolved
    from microbatch.run.pipeline.replay import runtime_terms
    from microbatch.run.pipeline.stage_profile import profile_stages

    load = machine_load()
    tiny = _calibration_run(run, "calibration_model")
    rep = run_resolved(tiny)
    terms = runtime_terms(tiny, rep.step_intervals)
    terms["calibration_step_s"] = float(rep.measured.step_time_s)
    terms["calibration_bubble"] = float(rep.measured.bubble_fraction)
    # the runtime's own work inside each stage call (receive-buffer lookup, caches, output
    # bookkeeping; on a shared machine also the cost of running after a wait): the calibration
    # run's op time less the same op profiled on one process
    alone = profile_stages(tiny)
    terms["in_op_s"] = {
        key: max(0.0, float(t) - alone[int(key[:-1])][key[-1]]) for key, t in rep.measured.op_time_s.items()
    }
    terms["machine"] = load
    return terms


TERM_KEYS = ("after_send_s", "after_send_waiting_s", "after_local_s", "hop_s", "start_s", "end_s")
"""The runtime's between-op terms (:func:`microbatch.run.pipeline.replay.runtime_terms`) a loaded
calibration replaces."""


def needs_loaded_calibration(cfg: PipelineConfig, runtime: dict[str, Any]) -> bool:
    """Gloo ranks on the CPU (a machine reading taken): the time between their ops depends on the work
    the ranks do around it — a rank that computed for a millisecond and one that spun for
    microseconds find the runtime, the other rank and the kernel in different states — and the bare
    calibration's element-wise stages barely load the cores. Measured on the 2-core dev machine:
    `small` p = 4, m = 8, the gap after a send to a waiting rank 3.6-4.6 ms in the real run against
    0.9-1.1 ms in the bare calibration; `tiny` p = 2, GPipe, the gap after a local op 1.08-1.19 ms
    against 0.43-0.54 ms. ``bench/bench_pipeline.py --repeat 3`` with the loaded calibration for
    every p (21 steps; each run measured over 7 steps): 46, 41 and 37 of 48 runs within 5 points of
    the measured bubble, tiny p = 2's mean signed error +0.1 to +2.4 points (bare calibration: 44,
    38 and 39 of 48, tiny p = 2 read 1.8-4.0 points low); with up to ``MAX_LOADED_STEPS`` steps and
    each run measured over at least 3 s of steps: 44 and 44 of 48. NCCL ranks have a device each
    and keep the bare calibration (BENCHMARKS.md, "Run: pipeline")."""
    return cfg.backend == "gloo" and runtime.get("machine") is not None


def calibrate_loaded(
    run: ResolvedRun,
    profile: dict[int, dict[str, float]],
    runtime: dict[str, Any],
    steps: int = MAX_LOADED_STEPS,
) -> dict[str, Any]:
    """``runtime`` with its between-op terms measured again under the real stages' CPU load: a run
    of :func:`loaded_calibration_model` whose stages spin for ``profile``'s CPU times (the forward,
    and the input and weight gradients for split schedules or the whole backward), the boundary's
    real bytes, ``steps`` steps (:func:`loaded_steps`). Those terms already hold the waits for a core, so
    :func:`predict_before` takes them as latency (``runtime["loaded"]``). The bare calibration's
    in-op costs and machine reading are kept."""
    from microbatch.run.pipeline.launch import run_resolved
    from microbatch.run.pipeline.replay import runtime_terms

    split = run.splits_backward

    def cpu(row: dict[str, float], k: str) -> float:
        return float(row.get(f"cpu{k}", row.get(k, 0.0)))

    spins = [
        [cpu(profile[s], "F"), cpu(profile[s], "I" if split else "B"), cpu(profile[s], "W") if split else 0.0]
        for s in range(run.cfg.total_stages)
    ]
    loaded = _calibration_run(run, "loaded_calibration_model", steps)
    before = os.environ.get(LOAD_ENV)
    os.environ[LOAD_ENV] = json.dumps(spins)
    try:
        rep = run_resolved(loaded)
    finally:
        if before is None:
            os.environ.pop(LOAD_ENV, None)
        else:
            os.environ[LOAD_ENV] = before
    terms = runtime_terms(loaded, rep.step_intervals)
    out = dict(runtime)
    out.update({k: terms[k] for k in TERM_KEYS})
    out["loaded"] = True
    out["loaded_steps"] = steps
    out["bare_terms"] = {k: runtime[k] for k in TERM_KEYS}
    out["loaded_step_s"] = float(rep.measured.step_time_s)
    out["loaded_bubble"] = float(rep.measured.bubble_fraction)
    return out
