"""The planner: enumerate micro-batching choices, predict memory and step time, recommend one.

For a model, an accelerator and a layout (d data-parallel replicas, p pipeline stages, t tensor
ranks) the planner holds B_global fixed and enumerates every b_m that divides B/d (so m = g =
B/(d·b_m) micro-batches per flush, one flush per step), every schedule that can serve (p, m, v),
every v for interleaved 1F1B (v = 2 for DualPipeV), every recompute mode and every ZeRO stage — the joint search
DeepSpeed's autotuner runs by experiment. For each it predicts per-stage peak memory
(:mod:`microbatch.predict.memory`), step time (:mod:`microbatch.predict.roofline` plus the pipeline's bubble),
tokens/s and MFU, and whether it fits with the headroom asked. Screening uses closed forms;
the leading candidates (and any uneven split) are replayed with :func:`microbatch.schedules.simulate.simulate`.

Each candidate's prediction is :mod:`microbatch.predict.candidate`'s; :func:`lint` and :func:`what_would_fit`
give the pitfalls and, when nothing fits, what would. The library never prints:
:mod:`microbatch.show.plan_report` gives text for the CLI and the report.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any, Literal, NoReturn

from microbatch.batch import check_data_parallel, divisors, grad_accum_for, per_replica
from microbatch.errors import ConfigError, ScheduleError, check_instance
from microbatch.hardware import DEFAULT_HEADROOM, Accelerator
from microbatch.model import ModelShape
from microbatch.predict.activations import RECOMPUTE_MODES
from microbatch.predict.candidate import (
    Candidate,
    Context,
    make_context,
    to_candidate,
    with_simulation,
)
from microbatch.predict.plan_advice import (
    Advice,
    Alternative,
    Lint,
    advice_to_dict,
    lint_to_dict,
)
from microbatch.predict.plan_choice import contenders_simulated, knee_candidate
from microbatch.predict.plan_choice import sort_key as _sort_key
from microbatch.predict.plan_config import CHOICES, PLAN_MARGIN, PLAN_TOLERANCE, PlanConfig
from microbatch.predict.plan_lints import KNEE_TOLERANCE, lint
from microbatch.predict.roofline import model_flops_per_step
from microbatch.predict.screen import Screened, ZeroRow, screen
from microbatch.predict.state import ZERO_STAGES
from microbatch.schedules.registry import (
    DEFAULT_SCHEDULE,
    get_spec,
    schedule_names,
)
from microbatch.schedules.virtual import virtual_options

__all__ = [
    "PlanConfig",
    "Plan",
    "make_plan",
    "compare_gpus",
    "search_layouts",
    "lint",
    "what_would_fit",
    "DEFAULT_HEADROOM",
    "KNEE_TOLERANCE",
    "CHOICES",
    "PLAN_TOLERANCE",
    "PLAN_MARGIN",
    "knee_candidate",
    "MAX_PLAN_BYTES",
    "plan_bytes",
    "candidate_count",
    "check_plan_size",
]


def _count(n: int) -> str:
    """A small count in words (two), as the messages write it."""
    return {1: "one", 2: "two", 3: "three", 4: "four"}.get(n, str(n))


@dataclass(frozen=True, kw_only=True)
class Plan:
    """The planner's answer for one accelerator."""

    config: PlanConfig
    """What was planned."""
    candidates: tuple[Candidate, ...]
    """Every candidate, fitting ones first, fastest first."""
    recommended: Candidate | None
    """The candidate chosen by ``config.choose`` (the knee by default, else the fastest) among those
    that fit; None when nothing fits."""
    lints: tuple[Lint, ...] = ()
    """Pitfalls found on the recommendation (seed 002's list; :func:`lint`)."""
    advice: Advice | None = None
    """When nothing fits: what would, with the numbers (:func:`what_would_fit`)."""
    fastest: Candidate | None = None
    """The fastest candidate that fits (the recommendation under ``choose="fastest"``)."""
    knee: Candidate | None = None
    """The knee among the candidates that fit (:func:`knee_candidate`; the default recommendation)."""

    @property
    def evaluated(self) -> int:
        """Candidates evaluated."""
        return len(self.candidates)

    def to_dict(self) -> dict[str, Any]:
        """Data only: the configuration, the recommendation, every candidate, the lints and the advice as
        numbers (:mod:`microbatch.predict.plan_advice`).

        The same in words (as ``plan --json`` writes it) is :func:`microbatch.show.plan_report.plan_dict`'s.
        """
        d = self.config.to_dict()
        d.update(
            {
                "recommended": self.recommended.to_dict() if self.recommended else None,
                "fastest": self.fastest.to_dict() if self.fastest else None,
                "knee": self.knee.to_dict() if self.knee else None,
                "candidates": [c.to_dict() for c in self.candidates],
                "lints": [lint_to_dict(x) for x in self.lints],
                "advice": advice_to_dict(self.advice) if self.advice is not None else None,
            }
        )
        return d


# -- search ---------------------------------------------------------------------------------------------
def _schedule_options(
    cfg: PlanConfig, m: int, virtuals: dict[str, list[int]] | None = None
) -> list[tuple[str, int]]:
    """(schedule, v) pairs that can serve (p, m, v) under torch's rules, v from the registry
    (:func:`microbatch.schedules.virtual.virtual_options`: interleaved 1F1B with every v that divides the
    layers evenly — on an uneven ``layers_per_stage``, every v that leaves each chunk a layer, a rank's work
    spread evenly over its chunks — DualPipeV with v = 2 when 2p divides the layers); a V schedule only on
    an even split. ``virtuals``: a cache of :func:`_split_virtuals` per schedule (they do not depend on m)."""
    p = cfg.pipeline_parallel
    if p == 1:
        return [(DEFAULT_SCHEDULE, 1)]
    names = cfg.schedules or schedule_names(planned=True)
    out = []
    for name in names:
        spec = get_spec(name)
        form = spec.idle_closed_form
        if form is not None and not form.holds_at(p, m):
            continue  # ZB-H1 at m < p: one round, which only an event simulation times (ms a candidate): simulate it
        vs = virtuals.get(name) if virtuals is not None else None
        if vs is None:
            vs = _split_virtuals(cfg, name)
            if virtuals is not None:
                virtuals[name] = vs
        # check_servable's schedule rule: p, m and v are the config's, checked there
        out += [(name, v) for v in vs if _serves(spec, p, m, v)]
    return out


def _refuse_v_split(cfg: PlanConfig, only: Any, v: int, per: int) -> NoReturn:
    """ConfigError for a V schedule (v chunks a rank, an even split) that cannot split the layers over the stages,
    naming the p it would split them for and serve at the replica's micro-batches."""
    p, L = cfg.pipeline_parallel, cfg.shape.layers
    if cfg.layers_per_stage is not None and L % (v * p) == 0:  # the split given is the only obstacle
        raise ConfigError(
            f"{only.name} places {v} equal chunks of the layers on each rank and takes no layers_per_stage; "
            "drop layers_per_stage, or use another schedule",
            params=("layers_per_stage", "schedules"),
        )
    most = per // (min(cfg.micro_batches) if cfg.micro_batches else 1)  # the most micro-batches a replica has
    ok = [x for x in range(2, L // v + 1) if L % (v * x) == 0 and _serves(only, x, most, v)]  # p = 1: none
    use = f"use pipeline_parallel among {ok}, or" if ok else f"no pipeline_parallel splits {L} layers so; use"
    raise ConfigError(
        f"{only.name} needs an even split of layers {L} into {v} × stages {p} = {v * p} chunks "
        f"({_count(v)} per rank, no layers_per_stage); {use} another schedule",
        params=("layers_per_stage", "pipeline_parallel"),
    )


def _serves(spec: Any, p: int, m: int, v: int) -> bool:
    """Whether the schedule ``spec`` serves (p, m, v) by its own rule (DualPipeV: m >= 2p)."""
    try:
        spec.check(p, m, v)
    except ScheduleError:
        return False
    return True


def _servable_m(cfg: PlanConfig, m: int) -> int | None:
    """The smallest m' > ``m`` some schedule of ``cfg`` serves at p (:func:`_schedule_options`: torch's rules, the
    whole rounds of the interleaved and zero-bubble schedules included), within 64p; None past that."""
    p = cfg.pipeline_parallel
    return next((k for k in range(m + 1, m + 64 * p + 1) if _schedule_options(cfg, k)), None)


def _split_virtuals(cfg: PlanConfig, name: str) -> list[int]:
    """The v of schedule ``name`` that split the layers over the stages, whatever m is: every v of the registry
    (:func:`~microbatch.schedules.virtual.virtual_options`) that divides the layers evenly into p·v chunks, or,
    on an uneven ``layers_per_stage``, that leaves each chunk a layer; none for a V schedule on an uneven split."""
    p, L, split = cfg.pipeline_parallel, cfg.shape.layers, cfg.layers_per_stage
    if split is not None and get_spec(name).needs_even_split:
        return []
    return [
        v for v in virtual_options(name, L, p, cfg.virtuals or (), split)
        if v == 1 or not (L % (p * v) if split is None else v > min(split))
    ]  # fmt: skip


def _enumerate(cfg: PlanConfig, ctx: Context | None = None, table: Table | None = None) -> list[Candidate]:
    ctx = ctx or make_context(cfg)
    model_flops = model_flops_per_step(cfg.shape, cfg.global_batch, cfg.seq)
    return [
        to_candidate(ctx, head, row, model_flops) for head, rows in _screens(cfg, ctx, table) for row in rows
    ]


def _axes(cfg: PlanConfig) -> tuple[tuple[int, ...], tuple[str, ...], tuple[int, ...]]:
    """The b_m, recompute modes and ZeRO stages the plan searches."""
    bms = cfg.micro_batches or tuple(divisors(check_data_parallel(cfg.global_batch, cfg.data_parallel)))
    rcs = cfg.recompute or RECOMPUTE_MODES
    zs = cfg.zero or (ZERO_STAGES if cfg.zero_group > 1 else (0,))  # nothing to shard over: ZeRO 0
    if cfg.zero is None and cfg.grad_dtype == "bf16+fp32":  # DeepSpeed's bf16 optimizer: ZeRO-1 as it runs
        zs = (1,) if cfg.zero_group > 1 else (0,)
    if cfg.zero is None and cfg.shard_degree is not None:  # hybrid sharding asked for: a sharded stage
        zs = tuple(z for z in zs if z >= 1) or zs
    return tuple(bms), tuple(rcs), tuple(zs)


PLAN_BYTES_PER_CANDIDATE = 3_400
"""Memory a plan holds per candidate: 344,433 candidates at p = 2 peaked at 1.17 GB (a helper's run of ``plan`` on a
small CPU, 2026-12-06), ~0.1 ms each."""

PLAN_BYTES_PER_STAGE = 42
"""And per candidate per pipeline stage (the per-stage times a candidate keeps): 23,685 candidates at p = 5,000
peaked at 5.08 GB in 65 s (measured here, ``/usr/bin/time``), 0.55 µs each."""

MAX_PLAN_BYTES = 2**30
"""The most working memory one plan may take (:func:`plan_bytes`): about 1 GiB, some 30 s on a small CPU."""

Table = list[tuple[int, int, list[tuple[str, int]]]]
"""(b_m, m, the (schedule, v) pairs that serve it) for each b_m a plan searches."""


def _table(cfg: PlanConfig) -> Table:
    virtuals: dict[str, list[int]] = {}
    out = []
    for b in _axes(cfg)[0]:
        m = grad_accum_for(cfg.global_batch, b, cfg.data_parallel)  # m = g: one flush per step
        out.append((b, m, _schedule_options(cfg, m, virtuals)))
    return out


def candidate_count(cfg: PlanConfig, table: Table | None = None) -> int:
    """How many candidates :func:`make_plan` would build: Σ over b_m of the (schedule, v) pairs that serve it, times
    the recompute modes and the ZeRO stages (the pairs, not the candidates: what the search would visit anyway)."""
    _, rcs, zs = _axes(cfg)
    return sum(len(opts) for _, _, opts in (table or _table(cfg))) * len(rcs) * len(zs)


def plan_bytes(candidates: int, stages: int) -> float:
    """Working memory of a plan of ``candidates`` at p = ``stages``: candidates × (:data:`PLAN_BYTES_PER_CANDIDATE` +
    p × :data:`PLAN_BYTES_PER_STAGE`)."""
    return candidates * (PLAN_BYTES_PER_CANDIDATE + stages * PLAN_BYTES_PER_STAGE)


def check_plan_size(cfg: PlanConfig, table: Table | None = None) -> int:
    """:func:`candidate_count`, or a ConfigError where their :func:`plan_bytes` pass :data:`MAX_PLAN_BYTES`, naming
    the axes and how to narrow them, before any candidate is built."""
    n = candidate_count(cfg, table)
    p = cfg.pipeline_parallel
    if plan_bytes(n, p) > MAX_PLAN_BYTES:
        bms, rcs, zs = _axes(cfg)
        most = int(MAX_PLAN_BYTES // (PLAN_BYTES_PER_CANDIDATE + p * PLAN_BYTES_PER_STAGE))
        raise ConfigError(
            f"this plan would search {n:,} candidates ({len(bms):,} sizes of b_m, each with its pipeline schedule "
            f"and v choices, × {len(rcs)} modes of activation recomputation × {len(zs)} ZeRO stages) of {p:,} "
            f"stages each: about {plan_bytes(n, p) / 2**30:.1f} GiB of working memory, over the limit of "
            f"{MAX_PLAN_BYTES / 2**30:.0f} GiB ({most:,} candidates at this p); narrow it: give micro_batches "
            "(the b_m to plan), one recompute, one zero stage, fewer schedules or virtuals",
            params=("micro_batches", "recompute", "zero", "schedules", "virtuals"),
        )
    return n


def _screens(
    cfg: PlanConfig, ctx: Context, table: Table | None = None
) -> Iterator[tuple[Screened, list[ZeroRow]]]:
    """Every (b_m, schedule, v, recompute) of ``cfg`` screened (:func:`~microbatch.predict.screen.screen`), a row
    per ZeRO stage."""
    _, rcs, zs = _axes(cfg)
    for b, m, options in table or _table(cfg):
        for sched, v in options:
            for rc in rcs:
                yield screen(ctx, b, m, sched, v, rc, zs)


def make_plan(cfg: PlanConfig, *, advise: bool = True) -> Plan:
    """Enumerate, predict, simulate the leaders, and recommend the knee (or, with ``choose="fastest"``,
    the fastest candidate) among those that fit; when nothing fits and ``advise``, what would
    (:func:`what_would_fit`, whose own plans do not advise: no recursion)."""
    check_instance("cfg", cfg, PlanConfig, "build a PlanConfig(shape=..., gpu=..., global_batch=...)")
    table = _table(cfg)
    check_plan_size(cfg, table)
    ctx = make_context(cfg)
    cands = _enumerate(cfg, ctx, table)
    if not cands:
        p, per = cfg.pipeline_parallel, check_data_parallel(cfg.global_batch, cfg.data_parallel)
        L = cfg.shape.layers
        only = get_spec(cfg.schedules[0]) if cfg.schedules and len(cfg.schedules) == 1 else None
        v = (only.stages_per_rank if only is not None else None) or 1  # a fixed v > 1: a V schedule
        if v > 1 and (L % (v * p) or cfg.layers_per_stage is not None):
            assert only is not None
            _refuse_v_split(cfg, only, v, per)
        names = list(cfg.schedules or schedule_names(planned=True))
        if not any(_split_virtuals(cfg, name) for name in names):
            ok = [x for x in range(2, L + 1) if any(L % (x * w) == 0 for w in range(2, L // x + 1))]
            among = f"use pipeline_parallel among {ok[:12]}, " if ok else ""
            raise ConfigError(
                f"no schedule in {names} can split layers {L} over stages {p}: interleaving needs an even split "
                f"into v × {p} chunks with v >= 2 (or layers_per_stage), and none exists; {among}give "
                "layers_per_stage, or add schedule 1f1b",
                params=("pipeline_parallel", "schedules"),
            )
        b = min(cfg.micro_batches) if cfg.micro_batches else 1  # m = B/(d·b_m) at the smallest b_m allowed
        m = _servable_m(cfg, per // b)
        raise ConfigError(
            f"no schedule in {names} can serve p = {p} with at most m = B/(d·b_m) = {per // b} micro-batches"
            + (f" (b_m {b})" if b > 1 else "")
            + " (1F1B and ZB-H1 need m >= p, DualPipeV m >= 2p, the interleaved and zero-bubble ones whole "
            "rounds of p)"
            + (f"; raise the global batch to {m * cfg.data_parallel * b} (m = {m})" if m is not None else "")
            + (" or give a smaller micro_batch" if b > 1 else "")
            + ("" if max(cfg.virtuals or (1,)) > 1 else " or use schedules gpipe"),
            params=("schedules", "global_batch") + (("micro_batch",) if b > 1 else ()),
        )
    cands.sort(key=_sort_key)
    model_flops = model_flops_per_step(cfg.shape, cfg.global_batch, cfg.seq)
    uneven = cfg.layers_per_stage is not None
    n_sim = len(cands) if uneven and len(cands) <= 50 else cfg.simulate_top
    lead = [with_simulation(ctx, c, model_flops) if c.fits else c for c in cands[:n_sim]]
    cands = sorted(lead + cands[n_sim:], key=_sort_key)
    if cfg.simulate_top > 0:
        cands = contenders_simulated(ctx, cands, model_flops)
    fastest = cands[0] if cands[0].fits else None
    knee = None
    if fastest is not None:
        knee = knee_candidate(cands, cfg.tolerance, cfg.margin, cfg.memory_budget_bytes)
        if cfg.pipeline_parallel > 1 and not knee.simulated:
            # replay the knee as the leaders were, so both sides of the comparison are simulated
            sim = with_simulation(ctx, knee, model_flops)
            cands = sorted([sim if c is knee else c for c in cands], key=_sort_key)
            fastest = cands[0]
            knee = knee_candidate(cands, cfg.tolerance, cfg.margin, cfg.memory_budget_bytes)
    rec = knee if cfg.choose == "knee" else fastest
    plan = Plan(config=cfg, candidates=tuple(cands), recommended=rec, fastest=fastest, knee=knee)
    advice = what_would_fit(cfg, plan) if rec is None and advise else None
    return replace(plan, lints=tuple(lint(plan)), advice=advice)


def compare_gpus(cfg: PlanConfig, gpus: list[Accelerator]) -> list[Plan]:
    """One plan per accelerator, same model, layout and batch ("fewer larger GPUs or more smaller ones")."""
    return [make_plan(replace(cfg, gpu=g)) for g in gpus]


def search_layouts(
    shape: ModelShape,
    gpu: Accelerator,
    *,
    global_batch: int,
    num_gpus: int,
    tensor_parallel: tuple[int, ...] = (1, 2, 4, 8),
    **options: Any,
) -> tuple[Candidate | None, int, int]:
    """Search t, p, d with t·p·d = num_gpus as well: (best fitting candidate, evaluated, feasible).

    Layouts that break a rule (t not dividing heads, p > layers, d not dividing B) are skipped.
    Only the screening closed forms run (no simulation), as in calculon's search: each candidate's per-stage peak
    memory, whether it fits and its step time (:func:`~microbatch.predict.screen.screen`); a :class:`Candidate`
    (with its tokens/s and MFU, a division each) is built for each new best only.
    """
    best: Candidate | None = None
    evaluated = feasible = 0
    for t in tensor_parallel:
        if num_gpus % t or shape.heads % t:
            continue
        like = None  # the last context at this t: its per-b_m layer and activation caches serve every p and d
        for p in divisors(num_gpus // t):
            if p > shape.layers:
                break
            d = num_gpus // (t * p)
            if per_replica(global_batch, d) is None:
                continue
            try:
                cfg = PlanConfig(
                    shape=shape, gpu=gpu, global_batch=global_batch, data_parallel=d, pipeline_parallel=p,
                    tensor_parallel=t, simulate_top=0, **options,
                )  # fmt: skip
            except ConfigError:
                continue
            like = ctx = make_context(cfg, like)
            for head, rows in _screens(cfg, ctx):
                evaluated += len(rows)
                for row in rows:
                    if row.peak <= ctx.budget:
                        feasible += 1
                        if best is None or row.step_s < best.step_time_s:
                            flops = model_flops_per_step(shape, global_batch, cfg.seq)
                            best = to_candidate(ctx, head, row, flops)
    return best, evaluated, feasible


def what_would_fit(cfg: PlanConfig, plan: Plan | None = None) -> Advice:
    """When nothing fits: the smallest peak found, and what changes (sequence parallelism at the plan's t > 1, p, t
    with sequence parallelism up to a node's GPUs, d with ZeRO-3) would fit; a change that does not fit is kept only where it lowers the smallest peak (a
    pipeline without ZeRO-3 may hold more than ZeRO-3 over d did); :func:`microbatch.show.plan_report.advice_lines`
    writes it."""
    plan = plan or make_plan(cfg)
    Setting = Literal[
        "zero", "recompute", "schedules", "micro_batches", "sequence_parallel", "pipeline_parallel",
        "tensor_parallel", "data_parallel",
    ]  # fmt: skip
    tries: list[tuple[Setting, int, dict[str, Any]]] = []
    # a choice the user pinned, left to the planner on the same GPUs (ZeRO 0 where ZeRO 3 fits on 8: a helper's
    # sweep of the advice found 2-8x the GPUs asked for instead)
    pins: tuple[tuple[Setting, object, dict[str, Any]], ...] = (
        ("zero", cfg.zero, {"zero": None}), ("recompute", cfg.recompute, {"recompute": None}),
        ("schedules", cfg.schedules, {"schedules": None, "virtuals": None}),
        ("micro_batches", cfg.micro_batches, {"micro_batches": None}),
    )  # fmt: skip
    L, heads = cfg.shape.layers, cfg.shape.heads
    if cfg.tensor_parallel > 1 and not cfg.sequence_parallel:  # the same GPUs: TP as the frameworks run it
        tries.append(("sequence_parallel", cfg.tensor_parallel, {"sequence_parallel": True}))
    # then each pinned choice left to the planner, on the same GPUs; then more GPUs
    tries += [(setting, 0, change) for setting, pinned, change in pins if pinned]
    for p2 in (2 * cfg.pipeline_parallel, 4 * cfg.pipeline_parallel, 8 * cfg.pipeline_parallel):
        if p2 <= L:
            tries.append(("pipeline_parallel", p2, {"pipeline_parallel": p2, "layers_per_stage": None}))
    for t2 in (2 * cfg.tensor_parallel, 4 * cfg.tensor_parallel, 8 * cfg.tensor_parallel):
        if heads % t2 == 0 and t2 <= cfg.gpu.gpus_per_node:
            tries.append(("tensor_parallel", t2, {"tensor_parallel": t2, "sequence_parallel": True}))
    if cfg.data_parallel == 1:
        for d2 in (8, 64):
            if per_replica(cfg.global_batch, d2) is not None:
                # ZeRO-3 shards the most without a pipeline; under one (FSDP2 holding its gradients whole in fp32)
                # ZeRO-1's distributed optimizer holds less
                zero = (1,) if cfg.pipeline_parallel > 1 else (3,)
                tries.append(("data_parallel", d2, {"data_parallel": d2, "zero": zero}))
    alternatives = []
    smallest = min(plan.candidates, key=lambda c: c.peak_memory_bytes)
    for setting, value, change in tries:
        try:  # planned as the plan with that change would be, so its recommendation is the one it then shows
            alt = make_plan(replace(cfg, **change), advise=False)
        except ConfigError:  # no schedule serves this layout at this batch: nothing to say of it
            continue
        best = alt.recommended or min(alt.candidates, key=lambda c: c.peak_memory_bytes)
        if alt.recommended is None and best.peak_memory_bytes >= smallest.peak_memory_bytes:
            continue  # no nearer to fitting than the plan itself: not advice
        alternatives.append(
            Alternative(setting=setting, value=value, best=best, fits=alt.recommended is not None)
        )
    return Advice(
        budget_bytes=cfg.memory_budget_bytes, memory_bytes=cfg.gpu.memory_bytes, headroom=cfg.memory_headroom,
        smallest=smallest, alternatives=tuple(alternatives),
    )  # fmt: skip
