"""Which measured points a choice may take: those within the memory budget, the latency limit and B_global, and
none above a b_m that ran out of memory (:func:`candidates`); the fit's largest fitting b_m kept below such a b_m
(:func:`below_oom`). Split from :mod:`microbatch.choose.knee`, whose recommendation reads them."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from microbatch.batch import nearest_multiples, per_replica
from microbatch.choose.config import ChoiceConfig
from microbatch.choose.curve import CurvePoint
from microbatch.choose.memory_fit import fit_memory
from microbatch.errors import ConfigError, NoChoiceError
from microbatch.units import format_bytes

__all__ = ["below_oom", "candidates"]


def candidates(
    measured: list[CurvePoint], choice: ChoiceConfig, data_parallel: int, ooms: Sequence[CurvePoint] = ()
) -> tuple[list[CurvePoint], list[tuple[int, str]]]:
    """The measured points that fit the budget, the latency limit and B_global (ConfigError if none),
    and the b_m left out with why. ``ooms``: the points that ran out of memory; a larger b_m measured in the same
    checkpointing mode is left out too (memory does not fall as b_m grows: it fitted by chance, or on a run that
    had more free; a ``tune --refine`` halfway probe, a re-measurement)."""
    cands = measured
    why = []
    left: list[tuple[int, str]] = []

    def keep(ok: Callable[[CurvePoint], bool], reason: str) -> list[CurvePoint]:
        left.extend((p.micro_batch, reason) for p in cands if not ok(p))
        return [p for p in cands if ok(p)]

    for ckpt in sorted({p.checkpointing for p in ooms}):
        first = min(p.micro_batch for p in ooms if p.checkpointing == ckpt)
        mode = " with checkpointing" if ckpt else ""
        cands = keep(
            _not_above(first, ckpt),
            f"above b_m {first}, which ran out of memory{mode} (memory does not fall as b_m grows)",
        )
        why.append(f"b_m <= {first}{mode} (out of memory there)")

    budget = choice.memory_budget_bytes
    if budget is not None:
        reason = (
            "over the memory budget (measured; without a measured peak, by a smaller b_m over it or the fit)"
        )
        cands = keep(_fits(measured, budget), reason)
        why.append(f"peak memory <= {format_bytes(budget)}")
    if choice.max_latency_ms is not None:
        if any(p.step_time_s is None for p in cands):
            raise ConfigError(
                "max_latency_ms needs step_time_s for every point; add a step_time_s column",
                params=("max_latency_ms",),
            )
        limit_ms = choice.max_latency_ms
        cands = keep(
            lambda p: p.step_time_s is not None and p.step_time_s * 1e3 <= limit_ms,
            f"step time over {limit_ms:g} ms",
        )
        why.append(f"step time <= {choice.max_latency_ms} ms")
    if choice.global_batch is not None:
        if per_replica(choice.global_batch, data_parallel) is None:
            near = " or ".join(map(str, nearest_multiples(choice.global_batch, data_parallel)))
            raise ConfigError(
                f"global batch {choice.global_batch} is not divisible by data-parallel {data_parallel}: no b_m "
                f"gives B_global = b_m × g × d; use a global batch of {near}, or another data-parallel"
            )
        per = choice.global_batch / data_parallel
        cands = keep(
            lambda p: per == int(per) and int(per) % p.micro_batch == 0,
            f"b_m × d = b_m × {data_parallel} does not divide global batch {choice.global_batch}",
        )
        why.append(f"b_m x d = b_m x {data_parallel} divides global batch {choice.global_batch}")
    if not cands:  # NoChoiceError: a tune keeps its measured points with it
        steps = [p.step_time_s for p in measured if p.step_time_s is not None]
        shortest = ""
        if choice.max_latency_ms is not None and steps:
            ms = 1e3 * min(steps)
            shortest = f" (the shortest step measured {ms:,.1f} ms" + (
                "; if step_time_s holds milliseconds, divide it by 1000)"
                if ms >= 1000 and ms > 100 * choice.max_latency_ms  # a second a step: no decoding's
                else ")"
            )
        raise NoChoiceError(
            f"no measured micro-batch meets {' and '.join(why)}{shortest}; measured: "
            + ", ".join(str(p.micro_batch) for p in measured)
            + "; relax the limit or measure other sizes"
        )
    return cands, left


def _not_above(first: int, ckpt: bool) -> Callable[[CurvePoint], bool]:
    """Whether a point is not above ``first`` (a b_m that ran out of memory) in ``first``'s checkpointing mode."""
    return lambda p: p.checkpointing != ckpt or p.micro_batch <= first


def _fits(measured: list[CurvePoint], budget: int) -> Callable[[CurvePoint], bool]:
    """Whether a point fits ``budget``: its measured peak, or without one, not at or above a b_m measured over it
    (memory does not fall as b_m grows) and under the rising fit's line."""
    fit = fit_memory(measured)
    over = [
        p.micro_batch for p in measured if p.peak_memory_bytes is not None and p.peak_memory_bytes > budget
    ]

    def fits(p: CurvePoint) -> bool:
        if p.peak_memory_bytes is not None:
            return p.peak_memory_bytes <= budget
        if any(b <= p.micro_batch for b in over):
            return False
        if fit is None or fit.slope_bytes_per_sample <= 0:  # no line to read it from
            return True
        return fit.intercept_bytes + fit.slope_bytes_per_sample * p.micro_batch <= budget

    return fits


def below_oom(
    largest: int | None, ooms: Sequence[CurvePoint], measured: Sequence[CurvePoint] = ()
) -> int | None:
    """The fit's largest b_m that fits, below the smallest b_m that ran out of memory in the mode the fit reads (the
    largest measured b_m's, as :func:`~microbatch.choose.memory_fit.fit_memory` takes it: after tune's automatic
    checkpointing, the checkpointing points, which an out-of-memory without it does not cap); ``ooms`` those not
    measured too at their b_m and mode."""
    mode = max(measured, key=lambda p: p.micro_batch).checkpointing if measured else False
    sizes = [p.micro_batch for p in ooms if p.checkpointing == mode]
    if largest is None or not sizes:
        return largest
    return min(largest, min(sizes) - 1)
