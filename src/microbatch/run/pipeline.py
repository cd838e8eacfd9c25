"""Pipeline-parallel training on ``torch.distributed.pipelining``, instrumented.

One rank runs the stages it owns (v of them with interleaved schedules, two with ZB-V) under
torch's own schedule classes, for N optimizer steps, and records what happened:

- **Busy time** of every forward (F), full backward (B), input backward (I) and weight
  backward (W): the stage's ``forward_one_chunk`` / ``backward_one_chunk`` /
  ``backward_weight_one_chunk`` are wrapped (``time.perf_counter`` on the CPU, CUDA events on a
  GPU). The last stage's loss is timed as part of its forward.
- **Idle** = step wall time − busy; the **measured bubble** = Σ idle / (p × step wall time), the
  same definition the simulator uses, measured over the steps after the first (warm-up).
- **In flight**: micro-batches whose forward is done and whose backward (W for a split backward)
  is not, counted per rank over all its virtual stages; the maximum over the step.
- **Saved activations**: bytes packed by autograd (``saved_tensors_hooks``) during each forward
  (parameters excluded, storages deduplicated), per micro-batch and the peak resident sum.
- **CUDA peak memory** on a GPU (``max_memory_allocated`` after ``reset_peak_memory_stats``).

Loss scaling: every schedule is built with ``scale_grads=False`` and the loss of a micro-batch is
the *sum* of its token cross-entropies divided by the number of tokens in the whole global batch,
so the gradients equal the unsplit model's mean-loss gradient and one optimizer step follows each
global batch. Weights shared between stages on different ranks (tied embeddings) have their
gradients all-reduced among the ranks that hold them before the optimizer step.

Processes are started by :mod:`microbatch.run.launch` (``microbatch pipeline``) or by ``torchrun``;
this module holds what one rank does, the model split and torch's action order; the wrappers
that measure a stage live in :mod:`microbatch.run.instrument`.
"""

from __future__ import annotations

import importlib
import math
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from microbatch.errors import ConfigError, PipelineError, ScheduleError, check_positive_int
from microbatch.run.instrument import StageRecorder, instrument_stage, make_loss_fn
from microbatch.schedules.schedule import ScheduleSpec, get_spec
from microbatch.schedules.schedule import check_servable as _check_servable
from microbatch.schedules.schedule import stage_to_rank as _stage_to_rank

__all__ = [
    "PipelineConfig",
    "SCHEDULES",
    "StageRecorder",
    "balanced_split",
    "check_servable",
    "instrument_stage",
    "make_loss_fn",
    "model_units",
    "rank_stages",
    "run_rank",
    "split_units",
    "stage_to_rank",
    "torch_order",
]

SCHEDULES: dict[str, ScheduleSpec] = {
    name: get_spec(name) for name in ("gpipe", "1f1b", "interleaved-1f1b", "zb-interleaved", "zbv")
}
"""Schedules this module runs, by our name: their :mod:`microbatch.schedules.schedule` specs, which give torch's
class (``torch_name``), the placement and the (p, m, v) rules."""

_ALIASES = {
    "interleaved": "interleaved-1f1b",
    "zb": "zb-interleaved",
    "zb-v": "zbv",
    "zero-bubble": "zb-interleaved",
    "zb-h1": "zb-interleaved",  # torch's ScheduleInterleavedZeroBubble with v = 1 runs ZB-H1's order
}


def schedule_name(name: str) -> str:
    """Our canonical name of a schedule, or :class:`ScheduleError` listing the known ones."""
    key = str(name).strip().lower()
    key = _ALIASES.get(key, key)
    if key not in SCHEDULES:
        raise ScheduleError(f"schedule {name!r} is not known; use one of {', '.join(SCHEDULES)}")
    return key


@dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    """One pipeline-parallel run: what to split, how to schedule it, for how long."""

    schedule: str = "1f1b"
    """Schedule name: gpipe, 1f1b, interleaved-1f1b, zb-interleaved (torch's ZB1P) or zbv."""
    stages: int = 2
    """p: pipeline ranks (processes)."""
    microbatches: int = 4
    """m: micro-batches per global batch (per optimizer step)."""
    virtual: int = 1
    """v: stages per rank (interleaved schedules; zbv needs 2). Total stages = p·v."""
    model: str = "tiny"
    """A preset of :mod:`microbatch.model` built by :mod:`microbatch.measure.gpt`, or ``module:function``
    returning a stack of layers (``nn.Sequential`` or embed/layers/head) that maps token ids
    ``(b, s)`` to logits ``(b, s, V)``."""
    global_batch: int | None = None
    """B: sequences per optimizer step; None means one sequence per micro-batch (B = m)."""
    seq: int | None = None
    """s: tokens per sequence; None means the model's default."""
    steps: int = 3
    """N: optimizer steps. Measurements average the steps after the first (warm-up)."""
    backend: str = "gloo"
    """torch.distributed backend: gloo (CPU) or nccl (one GPU per rank)."""
    balance: str = "params"
    """How layers are split into stages: ``params`` (equal parameter counts) or ``time``
    (equal measured forward+backward time per layer, timed on rank 0 and broadcast)."""
    check_gradients: bool = False
    """Compare the gradients after the first step with the unsplit model on the same batch."""
    trace: bool = False
    """Return every compute interval (for ``--trace`` and the timeline drawing)."""
    lr: float = 1e-3
    """Adam learning rate."""
    seed: int = 0
    """Seed of the weights (same on every rank) and of the synthetic token batches."""
    dtype: str = "float32"
    """Parameter dtype: float32, bfloat16 or float16."""
    timeout_s: float = 120.0
    """Collective timeout of the process group and the launcher's deadline for the whole run."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "schedule", schedule_name(self.schedule))
        check_positive_int("stages", self.stages, fix="give --stages 2 or more ranks")
        check_positive_int("microbatches", self.microbatches, fix="give --microbatches 1 or more")
        check_positive_int("virtual", self.virtual, fix="give --virtual 1 or more stages per rank")
        check_positive_int("steps", self.steps, fix="give --steps 1 or more")
        if self.stages < 2:
            raise ConfigError(
                f"stages {self.stages} is not a pipeline; pipelining needs p >= 2; give --stages 2"
            )
        if self.global_batch is not None:
            check_positive_int("global batch", self.global_batch)
            if self.global_batch % self.microbatches:
                m = self.microbatches
                lo, hi = (self.global_batch // m) * m, (self.global_batch // m + 1) * m
                near = ", ".join(str(x) for x in (lo, hi) if x > 0)
                raise ConfigError(
                    f"global batch {self.global_batch} is not divisible by {m} micro-batches; every "
                    f"micro-batch holds B/m whole sequences; nearest valid global batches: {near}"
                )
        if self.seq is not None:
            check_positive_int("seq", self.seq)
        if self.backend not in ("gloo", "nccl"):
            raise ConfigError(f"backend {self.backend!r} is not supported; use gloo (CPU) or nccl (GPU)")
        if self.balance not in ("params", "time"):
            raise ConfigError(f"balance {self.balance!r} is not known; use 'params' or 'time'")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype {self.dtype!r} is not supported; use float32, bfloat16 or float16")
        if not (self.timeout_s > 0 and math.isfinite(self.timeout_s)):
            raise ConfigError(f"timeout {self.timeout_s!r} s must be a positive number of seconds")
        check_servable(self.schedule, self.stages, self.microbatches, self.virtual)

    @property
    def batch(self) -> int:
        """B: sequences per optimizer step."""
        return self.global_batch if self.global_batch is not None else self.microbatches

    @property
    def micro_batch(self) -> int:
        """b_m = B / m sequences per micro-batch."""
        return self.batch // self.microbatches

    @property
    def total_stages(self) -> int:
        """p·v stages in all."""
        return self.stages * self.virtual

    def to_dict(self) -> dict:
        return asdict(self)


def check_servable(schedule: str, stages: int, microbatches: int, virtual: int = 1) -> None:
    """Raise :class:`ScheduleError` (rule and fix) if torch's schedule cannot run (p, m, v).

    The rules are torch's own, kept with the generators in :mod:`microbatch.schedules.schedule`:
    ``Schedule1F1B`` needs m >= p; the interleaved schedules split m into max(1, m // p) rounds and
    need m % rounds == 0; ``ScheduleZBVZeroBubble`` needs exactly two stages per rank; GPipe and
    1F1B hold one stage per rank.
    """
    _check_servable(schedule_name(schedule), stages, microbatches, virtual)


# -- placement ------------------------------------------------------------------------


def stage_to_rank(schedule: str, stages: int, virtual: int) -> list[int]:
    """Rank of every stage index: looped (stage s on rank s mod p) or, for zbv, a V (rank r holds
    stages r and 2p−1−r, torch's ``generate_stage_to_rank_mapping(style="v")``); the schedule's
    placement (its spec's) under the rules of :func:`microbatch.schedules.schedule.stage_to_rank`."""
    placement = SCHEDULES[schedule_name(schedule)].placement
    return [_stage_to_rank(s, stages, placement) for s in range(stages * virtual)]


def rank_stages(schedule: str, stages: int, virtual: int, rank: int) -> list[int]:
    """Stage indices held by ``rank``, in increasing order."""
    return [s for s, r in enumerate(stage_to_rank(schedule, stages, virtual)) if r == rank]


# -- splitting a model ----------------------------------------------------------------


def model_units(model: Any) -> list[Any]:
    """The ordered layers of a model that pipelining may cut between.

    A GPT-like module (``embed``, ``layers``, ``head``) gives ``[embed, *layers, head]``; an
    ``nn.Sequential`` (or any list of modules) gives its children. Each unit maps the previous
    unit's output to its own, the first takes token ids and the last returns logits.
    """
    from torch import nn

    if all(hasattr(model, a) for a in ("embed", "layers", "head")):
        return [model.embed, *model.layers, model.head]
    if isinstance(model, (nn.Sequential, nn.ModuleList, list, tuple)):
        units = list(model)
        if units:
            return units
    raise ConfigError(
        f"cannot split a {type(model).__name__} into stages; pipelining needs a stack of layers: an "
        "nn.Sequential, or a module with .embed, .layers (nn.ModuleList) and .head"
    )


def balanced_split(weights: Sequence[float], parts: int) -> list[int]:
    """Contiguous split of ``weights`` into ``parts`` non-empty groups minimising the heaviest.

    Returns the group sizes. Exact dynamic programme (linear partition, O(parts·n²)); among
    equally good splits the earliest cut wins (lighter leading stages).
    """
    n = len(weights)
    if parts > n:
        raise ConfigError(
            f"{parts} stages but the model has only {n} layers to split (embedding, blocks, head); each "
            f"stage needs at least one; use fewer stages (p·v <= {n}) or a deeper model"
        )
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))
    inf = float("inf")
    # best[k][i]: minimal heaviest group splitting the first i units into k groups
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i] - 1e-12:
                    best[k][i], cut[k][i] = cost, j
    sizes, i = [], n
    for k in range(parts, 0, -1):
        j = cut[k][i]
        sizes.append(i - j)
        i = j
    return sizes[::-1]


def split_units(units: Sequence[Any], sizes: Sequence[int]) -> list[Any]:
    """``nn.Sequential`` stage modules holding ``sizes[k]`` consecutive units each."""
    from torch import nn

    out, i = [], 0
    for k in sizes:
        out.append(nn.Sequential(*units[i : i + k]))
        i += k
    return out


def unit_param_counts(units: Sequence[Any]) -> list[int]:
    """Parameters of every unit (a weight shared by two units counts in both: both compute with it)."""
    return [sum(p.numel() for p in u.parameters()) for u in units]


def unit_times_s(units: Sequence[Any], tokens: Any, repeats: int = 3) -> list[float]:
    """Measured forward + backward seconds of every unit on ``tokens`` (best of ``repeats``)."""
    import torch

    times = []
    x = tokens
    for u in units:
        best = float("inf")
        for _ in range(repeats):
            inp = x.detach().requires_grad_(x.is_floating_point())
            t0 = time.perf_counter()
            y = u(inp)
            y.float().square().mean().backward()
            best = min(best, time.perf_counter() - t0)
        u.zero_grad(set_to_none=True)
        with torch.no_grad():
            x = u(x)
        times.append(best)
    return times


# -- torch's action order without a process group -------------------------------------


def torch_order(schedule: str, stages: int, microbatches: int, virtual: int = 1) -> dict[int, list[str]]:
    """The compute actions every rank runs, in order, as strings like ``"2F0"``, ``"1I3"``.

    For the multi-stage schedules this is torch's own ``pipeline_order``, computed by the schedule
    class's ``_calculate_single_rank_operations`` on an instance that has no process group and no
    stages (idle slots dropped). GPipe and 1F1B follow the loops of their ``_step_microbatches``
    (torch 2.13's ``Schedule1F1B._get_pipeline_order`` does not match what it runs): GPipe does
    every forward then every backward; 1F1B does min(m, p − i) forwards, then alternates B and F.
    """
    name = schedule_name(schedule)
    check_servable(name, stages, microbatches, virtual)
    p, m, v = stages, microbatches, virtual
    if name == "gpipe":
        return {r: [f"{r}F{i}" for i in range(m)] + [f"{r}B{i}" for i in range(m)] for r in range(p)}
    if name == "1f1b":
        out = {}
        for r in range(p):
            warm = min(m, p - r)
            ops = [f"{r}F{i}" for i in range(warm)]
            f = warm
            for b in range(m):
                ops.append(f"{r}B{b}")
                if f < m:
                    ops.append(f"{r}F{f}")
                    f += 1
            out[r] = ops
        return out
    from torch.distributed.pipelining import schedules as ts

    cls = getattr(ts, SCHEDULES[name].torch_name, None)
    if cls is None:
        import torch

        raise ScheduleError(
            f"{name} needs torch.distributed.pipelining.{SCHEDULES[name].torch_name}, absent in torch "
            f"{torch.__version__}; upgrade torch or use --schedule interleaved-1f1b"
        )
    obj = object.__new__(cls)
    obj.pp_group_size = p
    obj._n_microbatches = m
    obj.n_local_stages = v
    obj.num_stages = obj._num_stages = p * v
    obj.number_of_rounds = max(1, m // p)
    obj.microbatches_per_round = m // obj.number_of_rounds
    try:
        order = {r: obj._calculate_single_rank_operations(r) for r in range(p)}
    except Exception as e:  # torch internals moved: say so plainly
        raise ScheduleError(
            f"cannot derive {SCHEDULES[name].torch_name}'s order on this torch ({type(e).__name__}: {e}); "
            "compare with --schedule 1f1b or gpipe"
        ) from None
    return {r: [str(a) for a in ops if a is not None] for r, ops in order.items()}


# -- one rank -------------------------------------------------------------------------


def build_full_model(cfg: PipelineConfig) -> tuple[Any, int, int]:
    """The unsplit model (same weights on every rank), its vocabulary and sequence length."""
    import torch

    dtype = getattr(torch, cfg.dtype)
    if ":" in cfg.model:
        mod_name, fn_name = cfg.model.split(":", 1)
        try:
            factory = getattr(importlib.import_module(mod_name), fn_name)
        except (ImportError, AttributeError) as e:
            raise ConfigError(
                f"model factory {cfg.model!r} cannot be loaded ({e}); give module:function"
            ) from None
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            model = factory().to(dtype)
        vocab = next(m.num_embeddings for m in model.modules() if isinstance(m, torch.nn.Embedding))
        return model, vocab, cfg.seq or 16
    from microbatch.measure.gpt import build_model
    from microbatch.model import get_model

    shape = get_model(cfg.model, seq=cfg.seq)
    return build_model(shape, dtype=dtype, seed=cfg.seed), shape.vocab, shape.seq


def make_batch(cfg: PipelineConfig, vocab: int, seq: int, step: int):
    """Synthetic next-token data of step ``step``: inputs and targets ``(B, s)``, the same on every rank."""
    import torch

    g = torch.Generator().manual_seed(1_000_003 * (cfg.seed + 1) + step)
    tokens = torch.randint(0, vocab, (cfg.batch, seq + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _schedule_kwargs(cls: type) -> dict:
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
        import torch

        oom = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError
        raise oom(f"injected out-of-memory on rank {rank}")
    if kind == "exit":
        os._exit(3)
    if kind == "kill":
        import signal

        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "hang":
        time.sleep(10_000)


def run_rank(cfg: PipelineConfig, *, rank: int, world_size: int, device: Any = None) -> dict | None:
    """Run ``cfg`` as rank ``rank`` of an initialised process group; return the gathered result on
    rank 0 (``None`` elsewhere). The result holds raw per-rank measurements; :mod:`microbatch.run.launch`
    turns them into the report."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules as ts

    if world_size != cfg.stages:
        raise ConfigError(
            f"world size {world_size} differs from --stages {cfg.stages}; each rank holds one pipeline "
            f"position; start {cfg.stages} processes or give --stages {world_size}"
        )
    device = torch.device(device or "cpu")
    cuda = device.type == "cuda"
    rec = StageRecorder(rank=rank, cuda=cuda)
    _fault(rank, "setup")

    full, vocab, seq = build_full_model(cfg)
    units = model_units(full)
    n_stages = cfg.total_stages
    if cfg.balance == "time":
        sizes = None
        if rank == 0:
            tok, _ = make_batch(cfg, vocab, seq, -1)
            sizes = balanced_split(unit_times_s(units, tok[: cfg.micro_batch]), n_stages)
        box = [sizes]
        dist.broadcast_object_list(box, src=0)
        sizes = box[0]
        full, vocab, seq = build_full_model(cfg)  # fresh weights and gradients after timing
        units = model_units(full)
    else:
        sizes = balanced_split(unit_param_counts(units), n_stages)
    modules = split_units(units, sizes)
    placement = stage_to_rank(cfg.schedule, cfg.stages, cfg.virtual)
    mine = [s for s in range(n_stages) if placement[s] == rank]

    # parameters shared by stages on different ranks (tied embeddings): all-reduce their gradients
    names = {id(p): n for n, p in full.named_parameters()}
    holders: dict[int, set[int]] = {}
    for s, mod in enumerate(modules):
        for p in mod.parameters():
            holders.setdefault(id(p), set()).add(placement[s])
    shared = sorted((names[i] for i, rs in holders.items() if len(rs) > 1), key=list(names.values()).index)
    by_name = dict(full.named_parameters())

    mb, b = cfg.micro_batch, cfg.batch
    with torch.no_grad():
        tok, _ = make_batch(cfg, vocab, seq, -1)
        x = tok[:mb]
        boundary = []
        for mod in modules:
            x = mod(x)
            boundary.append(x)
    for s in mine:  # after the example pass on the CPU (the shared weight moves with its owner)
        modules[s].to(device)
    stage_objs = []
    for s in mine:
        inp = tok[:mb].to(device) if s == 0 else boundary[s - 1].to(device).requires_grad_(True)
        # example outputs must say requires_grad, or the previous stage expects no gradient back
        out = boundary[s].to(device).detach().requires_grad_(boundary[s].is_floating_point())
        stage_objs.append(PipelineStage(modules[s], s, n_stages, device, input_args=inp, output_args=out))
    for st in stage_objs:
        instrument_stage(st, rec)

    total_tokens = b * seq
    loss_fn = make_loss_fn(total_tokens, rec)
    cls = getattr(ts, SCHEDULES[cfg.schedule].torch_name, None)
    if cls is None:
        raise ScheduleError(f"{cfg.schedule} needs a newer torch than {torch.__version__}")
    single = cfg.schedule in ("gpipe", "1f1b")
    sched = cls(
        stage_objs[0] if single else stage_objs, cfg.microbatches, loss_fn=loss_fn, **_schedule_kwargs(cls)
    )
    params = [p for s in mine for p in modules[s].parameters()]
    params = list({id(p): p for p in params}.values())
    opt = torch.optim.Adam(params, lr=cfg.lr)

    first = 0 in mine
    last = (n_stages - 1) in mine
    steps_out = []
    grad_err: float | None = None
    for step in range(cfg.steps):
        inputs, targets = make_batch(cfg, vocab, seq, step)
        inputs, targets = inputs.to(device), targets.to(device)
        rec.reset()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        dist.barrier()
        wall0 = time.time()
        t0 = rec.now()
        _fault(rank, "step")
        losses: list = []
        kwargs: dict[str, Any] = {}
        if last:
            kwargs["target"], kwargs["losses"] = targets, losses
        if first:
            sched.step(inputs, **kwargs)
        else:
            sched.step(**kwargs)
        t_end = rec.now()
        if cuda:
            torch.cuda.synchronize(device)
            span = lambda a, b_: a.elapsed_time(b_) / 1e3  # noqa: E731
        else:
            span = lambda a, b_: b_ - a  # noqa: E731
        wall1 = wall0 + span(t0, t_end)
        for name in shared:
            prm = by_name[name]
            mine_too = rank in holders[id(prm)] and prm.grad is not None
            g = prm.grad if mine_too else torch.zeros(prm.shape, dtype=prm.dtype, device=device)
            dist.all_reduce(g)  # every rank joins (zeros where it does not hold the weight)
            if rank in holders[id(prm)]:
                prm.grad = g
        if cfg.check_gradients and step == 0:
            grad_err = _grad_error(cfg, mine, modules, inputs, targets, total_tokens, device)
        opt.step()
        steps_out.append(
            {
                "rank": rank,
                "stages": mine,
                "start_wall_s": wall0,
                "end_wall_s": wall1,
                "intervals": [
                    (k, s, i, wall0 + span(t0, a), wall0 + span(t0, e)) for (k, s, i, a, e) in rec.intervals
                ],
                "order": list(rec.order),
                "peak_in_flight": rec.peak_in_flight,
                "per_microbatch_bytes": list(rec.per_microbatch_bytes),
                "peak_activation_bytes": rec.peak_resident_bytes,
                "cuda_peak_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
                "loss": float(sum(x.item() for x in losses)) if last and losses else None,
            }
        )
    mine_info = {
        "rank": rank,
        "stages": mine,
        "layers_per_stage": sizes,
        "steps": steps_out,
        "max_grad_rel_error": grad_err,
        "torch_order": {
            str(k): [str(a) for a in v if a is not None] for k, v in _pipeline_order(sched).items()
        },
    }
    gathered = [None] * world_size if rank == 0 else None
    dist.gather_object(mine_info, gathered, dst=0)
    if rank != 0:
        return None
    return {
        "config": cfg.to_dict(),
        "torch_version": torch.__version__,
        "device": str(device),
        "ranks": gathered,
    }


def _pipeline_order(sched: Any) -> dict:
    order = getattr(sched, "pipeline_order", None)
    return order if isinstance(order, dict) else {}


def _grad_error(cfg, mine, modules, inputs, targets, total_tokens, device) -> float:
    """Largest ‖g_pipe − g_ref‖ / ‖g_ref‖ over this rank's parameters, against the unsplit model."""
    import torch.nn.functional as F

    ref, _, _ = build_full_model(cfg)
    ref.to(device)
    logits = ref(inputs)
    loss = F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(), reduction="sum") / total_tokens
    loss.backward()
    ref_units = model_units(ref)
    sizes = [len(m) for m in modules]
    starts = [sum(sizes[:k]) for k in range(len(sizes))]
    worst = 0.0
    for s in mine:
        for j in range(sizes[s]):
            mine_unit, ref_unit = modules[s][j], ref_units[starts[s] + j]
            for (n, p), (_, q) in zip(mine_unit.named_parameters(), ref_unit.named_parameters(), strict=True):
                if q.grad is None:
                    continue
                if p.grad is None:
                    raise PipelineError(f"parameter {n} of stage {s} got no gradient from the pipeline")
                ref_norm = q.grad.double().norm().item()
                diff = (p.grad.double() - q.grad.double()).norm().item()
                worst = max(worst, diff / ref_norm if ref_norm > 0 else diff)
    return worst
