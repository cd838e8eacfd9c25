"""The planner's answer as text: the trade-off table, the comparison across accelerators, the
recommendation in words. Plain data in, strings out (the library never prints; the commands do).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from microbatch.predict.candidate import Candidate
    from microbatch.predict.plan import Plan

__all__ = ["TABLE_COLUMNS", "comparison_rows", "explain", "gib", "plan_table_rows"]


def gib(x: float) -> str:
    """Bytes as GiB with one decimal: ``"57.0 GiB"``."""
    return f"{x / 2**30:.1f} GiB"


TABLE_COLUMNS = (
    "b_m",
    "m",
    "schedule",
    "v",
    "recompute",
    "ZeRO",
    "bubble",
    "peak",
    "step",
    "tokens/s",
    "MFU",
    "fits",
)


def _row(c: Candidate) -> list[str]:
    return [
        str(c.micro_batch),
        str(c.microbatches),
        c.schedule if c.pipeline_parallel > 1 else "-",
        str(c.virtual),
        c.recompute,
        str(c.zero),
        f"{100 * c.bubble_fraction:.1f}%",
        gib(c.peak_memory_bytes),
        f"{c.step_time_s:.3g} s",
        f"{c.tokens_per_s:,.0f}",
        f"{100 * c.mfu:.1f}%",
        "yes" if c.fits else "no",
    ]


def plan_table_rows(plan: Plan, *, per_micro_batch: bool = True, limit: int = 12) -> list[list[str]]:
    """Rows for a text table, header first.

    ``per_micro_batch``: the best candidate at each b_m (the trade-off across b_m; the
    recommendation marked ``*``); otherwise the ``limit`` best candidates.
    """
    rows = [list(TABLE_COLUMNS)]
    if per_micro_batch:
        seen: dict[int, Candidate] = {}
        for c in plan.candidates:  # sorted: first seen is the best at that b_m
            seen.setdefault(c.micro_batch, c)
        chosen = [seen[b] for b in sorted(seen)]
    else:
        chosen = list(plan.candidates[:limit])
    for c in chosen:
        r = _row(c)
        if c is plan.recommended:
            r[0] = r[0] + "*"
        rows.append(r)
    return rows


def comparison_rows(plans: list[Plan]) -> list[list[str]]:
    """One row per accelerator: its recommendation (header first)."""
    rows = [["gpu", "memory", "b_m", "m", "schedule", "recompute", "ZeRO", "peak", "step", "tokens/s",
             "tokens/s/GPU", "MFU"]]  # fmt: skip
    for pl in plans:
        c = pl.recommended
        g = pl.config.gpu
        if c is None:
            rows.append(
                [g.name, gib(g.memory_bytes), "-", "-", "-", "-", "-", "nothing fits", "-", "-", "-", "-"]
            )
            continue
        rows.append([
            g.name, gib(g.memory_bytes), str(c.micro_batch), str(c.microbatches), c.schedule, c.recompute,
            str(c.zero), gib(c.peak_memory_bytes), f"{c.step_time_s:.3g} s", f"{c.tokens_per_s:,.0f}",
            f"{c.tokens_per_s / pl.config.num_gpus:,.0f}", f"{100 * c.mfu:.1f}%",
        ])  # fmt: skip
    return rows


def explain(plan: Plan) -> str:
    """The trade-off in words: bubble against kernel efficiency against memory."""
    c = plan.recommended
    cfg = plan.config
    if c is None:  # the headline; the rest of the advice (what would fit) is listed after it
        return plan.advice[0] if plan.advice else "nothing fits"
    p = cfg.pipeline_parallel
    parts = [
        f"Recommended b_m = {c.micro_batch} (m = g = {c.microbatches}, "
        f"{c.schedule if p > 1 else 'no pipeline'}"
        + (f", v = {c.virtual}" if c.virtual > 1 else "")
        + f", recompute {c.recompute}, ZeRO {c.zero}): {c.step_time_s:.3g} s per step, "
        f"{c.tokens_per_s:,.0f} tokens/s, MFU {100 * c.mfu:.1f}%, peak {gib(c.peak_memory_bytes)} of "
        f"{gib(cfg.budget_bytes)} usable."
    ]
    best_at: dict[int, Candidate] = {}
    for x in plan.candidates:
        best_at.setdefault(x.micro_batch, x)
    smaller = [x for b, x in sorted(best_at.items()) if b < c.micro_batch]
    larger = [x for b, x in sorted(best_at.items()) if b > c.micro_batch]
    if smaller:
        s = smaller[-1]
        if not s.fits:
            why = f"does not fit ({gib(s.peak_memory_bytes)})"
        elif p == 1:
            why = (
                f"would save {gib(c.peak_memory_bytes - s.peak_memory_bytes)} but its GEMMs reach "
                f"{100 * s.gemm_efficiency:.0f}% of peak (vs {100 * c.gemm_efficiency:.0f}%) and its step takes "
                f"{s.step_time_s:.3g} s"
            )
        else:
            why = (
                f"would cut the bubble to {100 * s.bubble_fraction:.1f}% (from {100 * c.bubble_fraction:.1f}%) "
                f"but its GEMMs reach {100 * s.gemm_efficiency:.0f}% of peak (vs {100 * c.gemm_efficiency:.0f}%) "
                f"and its step takes {s.step_time_s:.3g} s"
            )
        parts.append(f"Smaller b_m = {s.micro_batch} {why}.")
    if larger:
        g = larger[0]
        if not g.fits:
            why = f"does not fit: {gib(g.peak_memory_bytes)} > {gib(cfg.budget_bytes)}"
        else:
            why = (
                f"would run GEMMs at {100 * g.gemm_efficiency:.0f}% of peak but leave "
                f"{100 * g.bubble_fraction:.1f}% of the pipeline idle" if p > 1 else
                f"would run GEMMs at {100 * g.gemm_efficiency:.0f}% of peak for {gib(g.peak_memory_bytes)}"
            )  # fmt: skip
            why += f"; its step takes {g.step_time_s:.3g} s"
        parts.append(f"Larger b_m = {g.micro_batch} {why}.")
    if plan.lints:
        parts.append("Check: " + " ".join(plan.lints))
    return " ".join(parts)
