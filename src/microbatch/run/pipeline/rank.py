"""What one pipeline rank does: build the model, keep its stages, run torch's schedule, measure.

One rank runs the stages it owns (v of them with interleaved schedules, two with ZB-V) under
torch's own schedule classes, for N optimizer steps, and records what happened:

- **Busy time** of every forward (F), full backward (B), input backward (I) and weight
  backward (W): the stage's ``forward_one_chunk`` / ``backward_one_chunk`` /
  ``backward_weight_one_chunk`` are wrapped (``time.perf_counter`` on the CPU, CUDA events on a
  GPU; see :mod:`microbatch.run.pipeline.instrument`). The last stage's loss is timed as part of its forward.
- **In flight**: micro-batches whose forward is done and whose backward (W for a split backward)
  is not, counted per rank over all its virtual stages; the maximum over the step.
- **Saved activations**: bytes packed by autograd (``saved_tensors_hooks``) during each forward
  (parameters excluded, storages deduplicated), per micro-batch; the peak of the saved storages
  actually alive (freed through weak references, :class:`~microbatch.run.pipeline.instrument.LiveBytes`);
  and the sum the schedule's in-flight count implies (``counted_activation_bytes``).
- **Host peak memory** per step: the process's high-water mark (``VmHWM``) reset before the step
  (:mod:`microbatch.measure.hostmem`); it includes the model, gradients and optimizer.
- **CUDA peak memory** on a GPU (``max_memory_allocated`` / ``max_memory_reserved`` after
  ``reset_peak_memory_stats``).

Loss scaling: every schedule is built with ``scale_grads=False`` and the loss of a micro-batch is
the *sum* of its token cross-entropies divided by the number of tokens in the whole global batch,
so the gradients equal the unsplit model's mean-loss gradient and one optimizer step follows each
global batch. Weights shared between stages on different ranks (tied embeddings) have their
gradients all-reduced among the ranks that hold them before the optimizer step.

:func:`run_rank` returns the raw per-rank records, gathered on rank 0;
:func:`microbatch.run.pipeline.summary.summarize` reduces them to the report. Processes are started
by :mod:`microbatch.run.pipeline.launch` (``microbatch pipeline``) or by ``torchrun``.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from microbatch.errors import ConfigError, ScheduleError
from microbatch.measure.hostmem import peak_rss_bytes, reset_peak_rss
from microbatch.run.pipeline.config import FACTORY_SEQ, PipelineConfig
from microbatch.run.pipeline.grad_check import grad_error
from microbatch.run.pipeline.instrument import (
    StageRecorder,
    instrument_stage,
    make_loss_fn,
    split_backward_kept,
)
from microbatch.run.pipeline.resolved import ResolvedRun
from microbatch.run.pipeline.split import (
    balanced_split,
    dropout_modules,
    load_factory,
    model_units,
    split_units,
    token_embedding,
    unit_param_counts,
    unit_times_s,
)

__all__ = ["build_full_model", "make_batch", "params_split", "run_rank"]


def build_full_model(run: ResolvedRun) -> tuple[Any, int, int]:
    """The unsplit model (same weights on every rank), its vocabulary and sequence length."""
    import torch

    cfg, shape = run.cfg, run.shape
    dtype = getattr(torch, cfg.dtype)
    if shape is None:
        factory = load_factory(cfg.model)  # checked in the launching process first (inspect_factory)
        with torch.random.fork_rng(devices=[]), contextlib.redirect_stdout(sys.stderr):  # stdout: the result
            torch.manual_seed(cfg.seed)
            model = factory()
        if not isinstance(model, torch.nn.Module):  # it returned a module in the launcher's check
            raise ConfigError(
                f"model factory {cfg.model} returned {type(model).__name__} on this rank, not a torch.nn.Module; "
                "a factory must build the same model wherever it is called"
            )
        model = model.to(dtype)
        vocab = token_embedding(model).num_embeddings
        return model, vocab, cfg.seq or FACTORY_SEQ
    from microbatch.measure.gpt import build_model

    return build_model(shape, dtype=dtype, seed=cfg.seed), shape.vocab, shape.seq


def params_split(run: ResolvedRun, units: list[Any]) -> list[int]:
    """Units per stage split by parameter count: the resolved run's split where it is known before
    building (a built-in model), else from the built ``units`` (a ``module:function`` factory)."""
    if run.split is not None:
        return list(run.split)
    return balanced_split(unit_param_counts(units), run.cfg.total_stages)


def make_batch(cfg: PipelineConfig, vocab: int, seq: int, step: int) -> tuple[Any, Any]:
    """Synthetic next-token data of step ``step``: inputs and targets ``(B, s)``, the same on every rank."""
    import torch

    g = torch.Generator().manual_seed(1_000_003 * (cfg.seed + 1) + step)
    tokens = torch.randint(0, vocab, (cfg.batch, seq + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _schedule_kwargs(cls: Any) -> dict[str, Any]:
    """``scale_grads=False`` where torch's schedule class takes it (we scale the loss ourselves)."""
    import inspect

    params = inspect.signature(cls.__init__).parameters
    return {"scale_grads": False} if "scale_grads" in params else {}


def _fault(rank: int, where: str) -> None:
    """Test hook: ``MICROBATCH_PIPELINE_FAULT=rank:kind[:where]`` makes a rank fail on purpose."""
    spec = os.environ.get("MICROBATCH_PIPELINE_FAULT")
    if not spec:
        return
    parts = spec.split(":")
    if int(parts[0]) != rank or (parts[2] if len(parts) > 2 else "step") != where:
        return
    kind = parts[1]
    if kind == "raise":
        raise RuntimeError(f"injected fault on rank {rank} ({where})")
    if kind == "shape":
        import torch

        torch.zeros(2, 3) @ torch.zeros(4, 5)
    if kind == "oom":
        from microbatch.measure.device import torch_oom_types

        raise torch_oom_types()[0](f"injected out-of-memory on rank {rank}")
    if kind == "exit":
        os._exit(3)
    if kind == "kill":
        import signal

        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "hang":
        time.sleep(10_000)


def run_rank(
    run: ResolvedRun,
    *,
    rank: int,
    world_size: int,
    device: Any = None,
    on_step: Callable[[str, dict[str, Any]], object] | None = None,
) -> dict[str, Any] | None:
    """Run ``cfg`` as rank ``rank`` of an initialised process group; return the gathered result on
    rank 0 (``None`` elsewhere). The result holds raw per-rank measurements; :mod:`microbatch.run.pipeline.launch`
    turns them into the report. ``on_step(kind, record)``, if given, receives this rank's record of
    each finished step (``"step"``), preceded after the first by the rest of what the rank reports
    (``"setup"``): what a Ctrl-C keeps (:mod:`microbatch.run.pipeline.progress`)."""
    import torch
    import torch.distributed as dist

    cfg = run.cfg
    if world_size != cfg.stages:
        raise ConfigError(
            f"world size {world_size} differs from stages {cfg.stages}; each rank holds one pipeline "
            f"position; start {cfg.stages} processes or give stages {world_size}",
            params=("stages",),
        )
    device = torch.device(device or "cpu")
    cuda = device.type == "cuda"
    rec = StageRecorder(rank=rank, cuda=cuda)
    _fault(rank, "setup")

    full, vocab, seq, sizes, modules = _split_model(run, rank)
    mine = run.stages_of(rank)
    shared = _SharedParameters.of(full, modules, list(run.placement))
    total_tokens = cfg.batch * seq
    stage_objs, kept_after_input_grad = _build_stages(cfg, modules, mine, vocab, seq, device)
    for st in stage_objs:
        instrument_stage(st, rec)
    sched = _make_schedule(run, stage_objs, make_loss_fn(total_tokens, rec))
    params = [p for s in mine for p in modules[s].parameters()]
    params = list({id(p): p for p in params}.values())
    opt = torch.optim.Adam(params, lr=cfg.lr)

    steps_out: list[dict[str, Any]] = []
    grad_err: tuple[float, float] | None = None
    for step in range(cfg.steps):
        inputs, targets = make_batch(cfg, vocab, seq, step)
        inputs, targets = inputs.to(device), targets.to(device)
        rec.reset()
        opt.zero_grad(set_to_none=True)
        times = _timed_step(cfg, sched, rec, rank, mine, inputs, targets, device)
        shared.all_reduce_gradients(rank, device)
        if cfg.check_gradients and step == 0:
            grad_err = grad_error(
                lambda: build_full_model(run)[0],
                run.cfg.dtype,
                mine,
                modules,
                (inputs, targets, total_tokens),
                device,
            )
        opt.step()
        steps_out.append(_step_record(rank, mine, rec, times, device))
        if on_step is not None:
            if step == 0:
                on_step(
                    "setup", _rank_info(rank, mine, sizes, kept_after_input_grad, grad_err, sched, modules)
                )
            on_step("step", steps_out[-1])
    mine_info = {
        **_rank_info(rank, mine, sizes, kept_after_input_grad, grad_err, sched, modules),
        "steps": steps_out,
    }
    gathered: list[Any] | None = [None] * world_size if rank == 0 else None
    dist.gather_object(mine_info, gathered, dst=0)
    if rank != 0:
        return None
    return {
        "config": cfg.to_dict(),
        "torch_version": torch.__version__,
        "device": str(device),
        "ranks": gathered,
    }


def _split_model(run: ResolvedRun, rank: int) -> tuple[Any, int, int, list[int], list[Any]]:
    """The full model (vocabulary, sequence length), units per stage and the stages' modules: the
    resolved run's split (:func:`params_split`); with ``balance="time"`` rank 0 times the units and
    broadcasts the split, and the model is rebuilt."""
    import torch.distributed as dist

    cfg = run.cfg
    full, vocab, seq = build_full_model(run)
    units = model_units(full)
    n_stages = cfg.total_stages
    if cfg.balance == "time":
        box: list[Any] = [None]
        if rank == 0:
            tok, _ = make_batch(cfg, vocab, seq, -1)
            box[0] = balanced_split(unit_times_s(units, tok[: cfg.micro_batch]), n_stages)
        dist.broadcast_object_list(box, src=0)
        sizes: list[int] = box[0]
        full, vocab, seq = build_full_model(run)  # fresh weights and gradients after timing
        units = model_units(full)
    else:
        sizes = params_split(run, units)
    return full, vocab, seq, sizes, split_units(units, sizes)


@dataclass(frozen=True)
class _SharedParameters:
    """Parameters held by stages on different ranks (tied embeddings), whose gradients are all-reduced."""

    names: list[str]
    by_name: dict[str, Any]
    holders: dict[int, set[int]]
    """id(parameter) -> the ranks that hold it."""

    @classmethod
    def of(cls, full: Any, modules: list[Any], placement: list[int]) -> _SharedParameters:
        names = {id(p): n for n, p in full.named_parameters()}
        holders: dict[int, set[int]] = {}
        for s, mod in enumerate(modules):
            for p in mod.parameters():
                holders.setdefault(id(p), set()).add(placement[s])
        shared = sorted(
            (names[i] for i, rs in holders.items() if len(rs) > 1), key=list(names.values()).index
        )
        return cls(names=shared, by_name=dict(full.named_parameters()), holders=holders)

    def all_reduce_gradients(self, rank: int, device: Any) -> None:
        """Sum each shared parameter's gradient over the ranks (every rank joins, with zeros where it
        does not hold the weight)."""
        import torch
        import torch.distributed as dist

        for name in self.names:
            prm = self.by_name[name]
            mine_too = rank in self.holders[id(prm)] and prm.grad is not None
            g = prm.grad if mine_too else torch.zeros(prm.shape, dtype=prm.dtype, device=device)
            dist.all_reduce(g)  # every rank joins (zeros where it does not hold the weight)
            if rank in self.holders[id(prm)]:
                prm.grad = g


def _build_stages(
    cfg: PipelineConfig, modules: list[Any], mine: list[int], vocab: int, seq: int, device: Any
) -> tuple[list[Any], dict[int, Any]]:
    """torch's ``PipelineStage`` for each stage of this rank, with example shapes from one pass on
    the CPU, and what torch's split backward keeps of each stage's saved bytes between I and W."""
    import torch
    from torch.distributed.pipelining import PipelineStage

    n_stages = cfg.total_stages
    mb = cfg.micro_batch
    with torch.no_grad():
        tok, tgt = make_batch(cfg, vocab, seq, -1)
        x = tok[:mb]
        boundary: list[Any] = []
        for mod in modules:
            x = mod(x)
            boundary.append(x)
    for s in mine:  # after the example pass on the CPU (the shared weight moves with its owner)
        modules[s].to(device)
    stage_objs: list[Any] = []
    for s in mine:
        # detached: on a CPU .to() is the tensor itself, and requires_grad_ on it made the kept-bytes probe's clone
        # below a non-leaf whose saved alias was not found (the last rank of zb-h1 over-predicted by 8.6%, a review)
        inp = tok[:mb].to(device) if s == 0 else boundary[s - 1].to(device).detach().requires_grad_(True)
        # example outputs must say requires_grad, or the previous stage expects no gradient back
        out = boundary[s].to(device).detach().requires_grad_(boundary[s].is_floating_point())
        stage_objs.append(PipelineStage(modules[s], s, n_stages, device, input_args=inp, output_args=out))
    total_tokens = cfg.batch * seq
    # what torch's split backward keeps of each stage's saved bytes between I and W (measured here)
    kept_after_input_grad = {
        s: split_backward_kept(
            modules[s],
            tok[:mb].to(device)
            if s == 0
            else boundary[s - 1].to(device).detach().clone().requires_grad_(True),
            first=s == 0,
            loss_fn=make_loss_fn(total_tokens) if s == n_stages - 1 else None,
            target=tgt[:mb].to(device),
        )
        for s in mine
    }
    return stage_objs, kept_after_input_grad


def _make_schedule(run: ResolvedRun, stage_objs: list[Any], loss_fn: Any) -> Any:
    """torch's schedule object of the run's schedule over this rank's stages."""
    import torch
    from torch.distributed.pipelining import schedules as ts

    cfg = run.cfg
    cls = getattr(ts, run.torch_class, None)
    if cls is None:
        raise ScheduleError(f"{cfg.schedule} needs a newer torch than {torch.__version__}")
    single = issubclass(cls, ts.PipelineScheduleSingle)  # one stage object per rank (GPipe, 1F1B)
    return cls(
        stage_objs[0] if single else stage_objs, cfg.microbatches, loss_fn=loss_fn, **_schedule_kwargs(cls)
    )


@dataclass(frozen=True)
class _StepTimes:
    """What one timed step read: its wall-clock start and end, the recorder's clock at its start and
    how to turn two readings into seconds, the host's peak and the last stage's losses."""

    wall0: float
    wall1: float
    t0: Any
    span: Callable[[Any, Any], float]
    host_peak: int | None
    losses: list[Any]


def _timed_step(
    cfg: PipelineConfig,
    sched: Any,
    rec: StageRecorder,
    rank: int,
    mine: list[int],
    inputs: Any,
    targets: Any,
    device: Any,
) -> _StepTimes:
    """One ``sched.step`` between a barrier and the device's synchronisation, timed."""
    import torch
    import torch.distributed as dist

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    rss_reset = reset_peak_rss()
    dist.barrier()
    wall0 = time.time()
    t0 = rec.now()
    _fault(rank, "step")
    losses: list[Any] = []
    kwargs: dict[str, Any] = {}
    if (cfg.total_stages - 1) in mine:
        kwargs["target"], kwargs["losses"] = targets, losses
    if 0 in mine:
        sched.step(inputs, **kwargs)
    else:
        sched.step(**kwargs)
    t_end = rec.now()
    if cuda:
        torch.cuda.synchronize(device)
    host_peak = peak_rss_bytes() if rss_reset else None
    rec.leak.clear()  # an injected leak ends with the step
    span = _cuda_span if cuda else _cpu_span
    return _StepTimes(
        wall0=wall0, wall1=wall0 + span(t0, t_end), t0=t0, span=span, host_peak=host_peak, losses=losses
    )


def _step_record(
    rank: int, mine: list[int], rec: StageRecorder, times: _StepTimes, device: Any
) -> dict[str, Any]:
    """This rank's record of one step (times, order, memory, loss), read after the optimizer step."""
    import torch

    cuda = device.type == "cuda"
    wall0, t0, span, losses = times.wall0, times.t0, times.span, times.losses
    return {
        "rank": rank,
        "stages": mine,
        "start_wall_s": wall0,
        "end_wall_s": times.wall1,
        "intervals": [
            (k, s, i, wall0 + span(t0, a), wall0 + span(t0, e)) for (k, s, i, a, e) in rec.intervals
        ],
        "order": list(rec.order),
        "cpu_s": list(rec.cpu_s),
        "live_trace": list(rec.live_trace),
        "peak_in_flight": rec.peak_in_flight,
        "per_microbatch_bytes": list(rec.per_microbatch_bytes),
        "per_microbatch_shared_bytes": list(rec.per_microbatch_shared_bytes),
        "counted_activation_bytes": rec.counted_peak_bytes,
        "peak_activation_bytes": rec.live.peak,
        "live_bytes_after_step": rec.live.bytes,
        "host_peak_bytes": times.host_peak,
        "cuda_peak_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
        "cuda_reserved_bytes": torch.cuda.max_memory_reserved(device) if cuda else None,
        "loss": float(sum(x.item() for x in losses)) if losses else None,  # filled on the last stage only
    }


def _rank_info(
    rank: int,
    mine: list[int],
    sizes: list[int],
    kept: dict[int, Any],
    grad_err: tuple[float, float] | None,
    sched: Any,
    modules: list[Any],
) -> dict[str, Any]:
    """What a rank reports besides its steps: its stages, the split, what torch's split backward
    keeps, the gradient check, the random modules it trains with and torch's planned order."""
    return {
        "rank": rank,
        "stages": mine,
        "layers_per_stage": sizes,
        "kept_after_input_grad": {str(s): f for s, f in kept.items()},
        "max_grad_rel_error": None if grad_err is None else grad_err[0],
        "unsplit_grad_rel_error": None if grad_err is None else grad_err[1],
        "dropout_modules": [name for s in mine for name in dropout_modules(modules[s], f"stage {s}")],
        "torch_order": {
            str(k): [str(a) for a in v if a is not None] for k, v in _pipeline_order(sched).items()
        },
    }


def _cuda_span(a: Any, b: Any) -> float:
    """Seconds between two recorded CUDA events."""
    return float(a.elapsed_time(b)) / 1e3


def _cpu_span(a: Any, b: Any) -> float:
    """Seconds between two ``time.perf_counter`` readings."""
    return float(b - a)


def _pipeline_order(sched: Any) -> dict[Any, Any]:
    """torch's planned order of a schedule object (empty for single-stage classes without one)."""
    order = getattr(sched, "pipeline_order", None)
    return order if isinstance(order, dict) else {}
