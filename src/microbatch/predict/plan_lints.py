"""The plan's pitfalls (seed 002), checked on one candidate: :func:`lint`. Split from :mod:`microbatch.predict.plan`,
which runs it on the recommendation; :func:`microbatch.show.plan_report.lint_sentence` writes each."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Protocol

from microbatch.batch import check_data_parallel, divisors, global_batch_of, grad_accum_for
from microbatch.predict.candidate import Candidate, Context, layer_costs, make_context
from microbatch.predict.plan_advice import (
    BubbleNotBuried,
    FarPastKnee,
    GlobalBatchChanged,
    HoldsEveryMicrobatch,
    Lint,
    TooFewMicrobatches,
    ZeroWithPipeline,
)
from microbatch.predict.plan_config import PlanConfig
from microbatch.schedules.closed_forms import bubble_fraction, fill_drain_step_time
from microbatch.schedules.registry import get_spec


class Plan(Protocol):
    """What :func:`lint` reads of a :class:`microbatch.predict.plan.Plan` (named so, not imported: the plan runs the
    lints)."""

    @property
    def config(self) -> PlanConfig: ...
    @property
    def candidates(self) -> Sequence[Candidate]: ...
    @property
    def recommended(self) -> Candidate | None: ...


__all__ = ["KNEE_TOLERANCE", "lint"]

KNEE_TOLERANCE = 0.1
"""A b_m whose kernel throughput is within 10% of the best is at the knee (DESIGN: "the smallest b_m
whose throughput is within a tolerance of the best")."""
_KNEE_FACTOR = 4
"""Lint b_m at least this many times the knee ("far past the knee")."""


def _knee_micro_batch(ctx: Context, bms: list[int]) -> int:
    rates = {b: layer_costs(ctx, b).gemm_efficiency for b in bms}
    top = max(rates.values())
    return min(b for b, r in rates.items() if r >= (1 - KNEE_TOLERANCE) * top)


def _sizes_for(B: int, d: int, m: int) -> list[int]:
    """The b_m that give at least ``m`` micro-batches a replica at global batch ``B`` over ``d``."""
    return [b for b in divisors(check_data_parallel(B, d)) if grad_accum_for(B, b, d) >= m]


def _buried(plan: Plan, c: Candidate, B: int, d: int, p: int) -> Candidate | None:
    """The candidate the bubble lint suggests: the largest b_m giving m >= 4p on ``c``'s schedule, v, recompute and
    ZeRO that the plan has (so its own schedule's bubble, and one its rules serve), fits, and idles less than ``c``;
    None where there is none."""
    sizes = _sizes_for(B, d, 4 * p)
    same = [x for x in plan.candidates if x.micro_batch in sizes and x.schedule == c.schedule and x.virtual == c.virtual
            and x.recompute == c.recompute and x.zero == c.zero and x.fits and x.bubble_fraction < c.bubble_fraction]  # fmt: skip
    return max(same, key=lambda x: x.micro_batch, default=None)


def _zero_with_pipeline(plan: Plan, c: Candidate) -> ZeroWithPipeline:
    """ZeRO 2/3 with pipeline stages: FSDP with PP in torchtitan; DeepSpeed's PipelineEngine asserts ZeRO <= 1 and
    Megatron-LM shards only the optimizer state (its distributed optimizer). The best ZeRO <= 1 alternative at the same
    b_m, and whether ZeRO 0 or 1 was searched at all (not left out by the config's ZeRO stages)."""
    low = [x for x in plan.candidates if x.fits and x.zero <= 1 and x.micro_batch == c.micro_batch]
    best = max(low, key=lambda x: x.tokens_per_s) if low else None
    return ZeroWithPipeline(
        zero=c.zero, stages=plan.config.pipeline_parallel, alternative=best, tokens_per_s=c.tokens_per_s,
        each=plan.config.pipeline_grad_reduce == "each", planned_low=any(x.zero <= 1 for x in plan.candidates),
    )  # fmt: skip


def lint(plan: Plan, candidate: Candidate | None = None) -> list[Lint]:
    """Seed 002's pitfalls, checked on ``candidate`` (default: the recommendation, else the best row);
    :func:`microbatch.show.plan_report.lint_sentence` writes each."""
    cfg = plan.config
    c = candidate or plan.recommended or (plan.candidates[0] if plan.candidates else None)
    if c is None:
        return []
    out: list[Lint] = []
    p, d, B = cfg.pipeline_parallel, cfg.data_parallel, cfg.global_batch
    if global_batch_of(c.micro_batch, c.grad_accum, d) != B:
        out.append(
            GlobalBatchChanged(
                micro_batch=c.micro_batch, grad_accum=c.grad_accum, data_parallel=d, global_batch=B
            )
        )
    spec = get_spec(c.schedule)
    if p > 1 and c.microbatches < p:
        out.append(
            TooFewMicrobatches(
                microbatches=c.microbatches,
                stages=p,
                bubble_pct=c.bubble_pct,
                max_micro_batch=max(1, B // (d * p)),
                per_replica=B // d,
                data_parallel=d,
            )
        )
    elif (
        p > 1
        and c.microbatches < 4 * p
        # lint only a bubble larger than 1F1B's at m = 4p: an interleaved, zero-bubble or DualPipeV step may idle
        # less at fewer micro-batches than 1F1B would at 4p (a helper's review, 2026-12-07: interleaved at 6%
        # was told to take a b_m at "11%", which ran slower)
        and c.bubble_fraction > bubble_fraction(p, 4 * p)
    ):
        found = BubbleNotBuried(microbatches=c.microbatches, stages=p, bubble_pct=c.bubble_pct)
        if (alt := _buried(plan, c, B, d, p)) is not None:
            found = replace(found, better_micro_batch=alt.micro_batch, better_microbatches=alt.microbatches,
                            better_bubble_pct=alt.bubble_pct)  # fmt: skip
        elif spec.step_time is fill_drain_step_time and c.virtual == 1 and (sizes := _sizes_for(B, d, 4 * p)):
            # b_m pinned, on GPipe or 1F1B: their closed form
            m4 = grad_accum_for(B, max(sizes), d)
            found = replace(found, better_micro_batch=max(sizes), better_microbatches=m4,
                            better_bubble_pct=100 * bubble_fraction(p, m4))  # fmt: skip
        out.append(found)
    if spec.lighter_equivalent is not None and p > 1 and c.microbatches > p:
        alt = next(
            (x for x in plan.candidates if x.schedule == spec.lighter_equivalent and x.micro_batch == c.micro_batch
             and x.recompute == c.recompute and x.zero == c.zero),
            None,
        )  # fmt: skip
        out.append(
            HoldsEveryMicrobatch(
                schedule=c.schedule, lighter=spec.lighter_equivalent, microbatches=c.microbatches, stages=p,
                activations_bytes=c.memory["activations"], lighter_peak_bytes=alt.peak_memory_bytes if alt else None,
            )
        )  # fmt: skip
    if p > 1 and c.zero >= 2:
        out.append(_zero_with_pipeline(plan, c))
    ctx = make_context(cfg)
    bms = sorted({x.micro_batch for x in plan.candidates})
    if len(bms) > 1:
        knee = _knee_micro_batch(ctx, bms)
        at_knee = next((x for x in plan.candidates if x.micro_batch == knee and x.fits), None)
        if (
            c.micro_batch >= _KNEE_FACTOR * knee
            and at_knee is not None
            and at_knee.tokens_per_s >= (1 - KNEE_TOLERANCE) * c.tokens_per_s
        ):
            out.append(
                FarPastKnee(
                    micro_batch=c.micro_batch, knee=knee, knee_efficiency=layer_costs(ctx, knee).gemm_efficiency,
                    efficiency=c.gemm_efficiency, knee_tokens_per_s=at_knee.tokens_per_s, tokens_per_s=c.tokens_per_s,
                    saved_bytes=c.memory["activations"] - at_knee.memory["activations"],
                )
            )  # fmt: skip
    return out
