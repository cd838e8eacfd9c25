"""The planner's pitfalls and advice as typed values: what :func:`microbatch.predict.plan.lint` finds on a
candidate (seed 002's list) and what :func:`microbatch.predict.plan.what_would_fit` finds when nothing fits.

Numbers only; :mod:`microbatch.show.plan_report` writes the sentences (the library speaks no English).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal

from microbatch.predict.candidate import Candidate

__all__ = [
    "Advice",
    "Alternative",
    "BubbleNotBuried",
    "FarPastKnee",
    "GlobalBatchChanged",
    "HoldsEveryMicrobatch",
    "Lint",
    "TooFewMicrobatches",
    "ZeroWithPipeline",
    "advice_from_dict",
    "advice_to_dict",
    "lint_from_dict",
    "lint_to_dict",
]


@dataclass(frozen=True, kw_only=True)
class GlobalBatchChanged:
    """b_m × g × d differs from the B_global asked."""

    micro_batch: int
    grad_accum: int
    data_parallel: int
    global_batch: int


@dataclass(frozen=True, kw_only=True)
class TooFewMicrobatches:
    """m < p: some stages never overlap."""

    microbatches: int
    stages: int
    bubble_pct: float
    max_micro_batch: int
    """The largest b_m that gives m >= p: max(1, B/(d·p))."""
    per_replica: int | None = None
    """B_global / d: the most micro-batches any b_m gives; below p no b_m reaches m >= p."""
    data_parallel: int = 1


@dataclass(frozen=True, kw_only=True)
class BubbleNotBuried:
    """m < 4p: the bubble is a visible share of the step."""

    microbatches: int
    stages: int
    bubble_pct: float
    better_micro_batch: int | None = None
    """The largest b_m dividing B/d with m >= 4p, if any."""
    better_microbatches: int = 0
    """Its m."""
    better_bubble_pct: float = 0.0
    """Its bubble, %: 100·(p−1)/(m+p−1)."""


@dataclass(frozen=True, kw_only=True)
class HoldsEveryMicrobatch:
    """The schedule holds all m micro-batches' activations where another (its
    :attr:`~microbatch.schedules.registry.ScheduleSpec.lighter_equivalent`) holds at most p."""

    schedule: str
    lighter: str
    microbatches: int
    stages: int
    activations_bytes: float
    lighter_peak_bytes: float | None
    """The lighter schedule's peak at the same b_m, recompute and ZeRO, when planned."""


@dataclass(frozen=True, kw_only=True)
class ZeroWithPipeline:
    """ZeRO 2/3 with pipeline stages (torchtitan runs it; DeepSpeed's engine and Megatron-LM do not)."""

    zero: int
    stages: int
    alternative: Candidate | None
    """The fastest fitting candidate at ZeRO <= 1 and the same b_m, if any."""
    tokens_per_s: float = 0.0
    """This candidate's tokens/s (the alternative's is its own)."""
    each: bool = False
    """Gradients reduce-scattered after every micro-batch (``pipeline_grad_reduce="each"``), not once."""
    planned_low: bool = True
    """Whether the plan searched ZeRO <= 1 at all (False when its ZeRO stages were given without them)."""


@dataclass(frozen=True, kw_only=True)
class FarPastKnee:
    """b_m is at least 4× the kernel-efficiency knee, which reaches nearly the same throughput."""

    micro_batch: int
    knee: int
    knee_efficiency: float
    efficiency: float
    knee_tokens_per_s: float
    """The knee's tokens/s (the fitting candidate at the knee's b_m)."""
    tokens_per_s: float
    """This candidate's."""
    saved_bytes: float
    """Activation bytes the knee saves."""


Lint = (
    GlobalBatchChanged
    | TooFewMicrobatches
    | BubbleNotBuried
    | HoldsEveryMicrobatch
    | ZeroWithPipeline
    | FarPastKnee
)
"""One pitfall found on a candidate."""


@dataclass(frozen=True, kw_only=True)
class Alternative:
    """A layout change tried when nothing fits, and the best it gives."""

    setting: Literal[
        "zero", "recompute", "schedules", "micro_batches", "sequence_parallel", "pipeline_parallel",
        "tensor_parallel", "data_parallel",
    ]  # fmt: skip
    """What changes: a choice the user pinned left to the planner on the same GPUs (ZeRO, recompute, the schedule, b_m;
    ``value`` 0), sequence parallelism at the plan's t (Megatron-Core's, NeMo's and torchtitan's with t > 1), p, t
    (with sequence parallelism) or d (with ZeRO-3; ZeRO-1 under a pipeline, where FSDP2 holds its gradients whole)."""
    value: int
    best: Candidate
    """The fastest candidate that fits, or (when none does) the one with the least peak."""
    fits: bool


@dataclass(frozen=True, kw_only=True)
class Advice:
    """When nothing fits: the budget, the smallest peak found and what would fit."""

    budget_bytes: float
    memory_bytes: float
    headroom: float
    smallest: Candidate
    """The candidate with the least peak memory."""
    alternatives: tuple[Alternative, ...] = ()


def _data(value: object) -> dict[str, Any]:
    return {
        f.name: (v.to_dict() if isinstance(v, Candidate) else v)
        for f in fields(value)  # type: ignore[arg-type]
        for v in (getattr(value, f.name),)
    }


def lint_to_dict(lint: Lint) -> dict[str, Any]:
    """A pitfall as data: its kind and its numbers (a candidate by its ``to_dict``)."""
    return {"kind": type(lint).__name__, **_data(lint)}


_KINDS: dict[str, type[Lint]] = {
    k.__name__: k
    for k in (
        GlobalBatchChanged, TooFewMicrobatches, BubbleNotBuried, HoldsEveryMicrobatch, ZeroWithPipeline, FarPastKnee
    )
}  # fmt: skip


def lint_from_dict(d: dict[str, Any]) -> Lint:
    """:func:`lint_to_dict` read back."""
    kw = {k: v for k, v in d.items() if k != "kind"}
    if isinstance(kw.get("alternative"), dict):
        kw["alternative"] = Candidate.from_dict(kw["alternative"])
    return _KINDS[str(d["kind"])](**kw)


def advice_to_dict(advice: Advice) -> dict[str, Any]:
    """The advice as data: the budget, the smallest candidate and each alternative."""
    return {**_data(advice), "alternatives": [_data(a) for a in advice.alternatives]}


def advice_from_dict(d: dict[str, Any]) -> Advice:
    """:func:`advice_to_dict` read back."""
    alts = tuple(
        Alternative(**{**a, "best": Candidate.from_dict(a["best"])}) for a in d.get("alternatives", ())
    )
    return Advice(
        budget_bytes=d["budget_bytes"], memory_bytes=d["memory_bytes"], headroom=d["headroom"],
        smallest=Candidate.from_dict(d["smallest"]), alternatives=alts,
    )  # fmt: skip
