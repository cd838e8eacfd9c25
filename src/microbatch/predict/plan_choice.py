"""The plan's choice among its candidates: their order (fitting, fastest, then less recompute, lower ZeRO, less
memory), the knee (least memory within the tolerance of the fastest), and the contenders simulated so that both
stand on the event simulator, not on the closed forms that ranked them. Split from :mod:`microbatch.predict.plan`,
which re-exports :func:`knee_candidate`."""

from __future__ import annotations

from collections.abc import Sequence

from microbatch.predict.candidate import Candidate, Context, with_simulation
from microbatch.predict.plan_config import PLAN_MARGIN, PLAN_TOLERANCE

__all__ = ["PLAN_CONTENDER_ACTIONS", "contenders_simulated", "knee_candidate", "sort_key"]


_RECOMPUTE_RANK = {"none": 0, "selective": 1, "op": 2, "full": 3}


def sort_key(c: Candidate) -> tuple[bool, float, int, int, float]:
    """Fitting first, fastest first; ties (to 6 digits) go to less recompute, lower ZeRO, less memory."""
    primary = float(f"{c.step_time_s:.6g}") if c.fits else c.peak_memory_bytes
    return (not c.fits, primary, _RECOMPUTE_RANK[c.recompute], c.zero, c.peak_memory_bytes)


PLAN_CONTENDER_ACTIONS = 300_000
"""The schedule actions the planner simulates beyond its leaders to settle the fastest and the knee (about 1 s at
the simulator's measured 3.6 µs an action, :data:`~microbatch.schedules.limits.MAX_SIMULATED_ACTIONS`): past it the
remaining contenders keep their closed-form times."""


def _lower_bound_s(c: Candidate) -> float:
    """A floor under ``c``'s simulated step: its closed-form step less its closed-form bubble (no rank finishes
    before its own work; the rest of the step, gradient reduction and optimizer, is the same in both)."""
    return c.step_time_s - float(c.time.get("bubble_s", 0.0))


def _contends(c: Candidate, best_s: float, line_s: float, knee_bytes: float) -> bool:
    """Whether ``c``, simulated, could be the fastest (its floor under ``best_s``), or the knee: under the line's time
    ``line_s`` with less memory than the knee's ``knee_bytes`` where its closed form is over the line."""
    floor = _lower_bound_s(c)
    below_knee = c.peak_memory_bytes < knee_bytes and c.step_time_s > line_s
    return floor < best_s or (below_knee and floor <= line_s)


def contenders_simulated(ctx: Context, cands: list[Candidate], model_flops: float) -> list[Candidate]:
    """``cands`` with every fitting contender simulated: one whose floor (:func:`_lower_bound_s`) is under the fastest
    step found, or under the knee's line where it holds less memory than the knee. The closed forms of interleaved
    1F1B, ZB-H1 and DualPipeV overstate their bubble (a grid of 323 plans: the same candidate up to 3.3% faster
    simulated), so a candidate outside the simulated leaders was ranked on them, and a narrower search found a
    faster one than the full search's fastest. Within :data:`PLAN_CONTENDER_ACTIONS`."""
    from microbatch.schedules.limits import count_actions

    cfg, spent, tried = ctx.cfg, 0, set()
    if cfg.pipeline_parallel == 1 or not cands[0].fits:
        return cands
    while spent < PLAN_CONTENDER_ACTIONS:
        fits = [c for c in cands if c.fits]
        best, knee = fits[0].step_time_s, knee_candidate(fits, cfg.tolerance, cfg.margin)
        line_s = best / ((1.0 - cfg.tolerance) * (1.0 + cfg.margin))
        todo = [
            c for c in fits
            if not c.simulated and id(c) not in tried and _contends(c, best, line_s, knee.peak_memory_bytes)
        ]  # fmt: skip
        if not todo:
            break
        c = min(todo, key=_lower_bound_s)
        tried.add(id(c))
        spent += count_actions(c.schedule, cfg.pipeline_parallel, c.microbatches, c.virtual)
        sim = with_simulation(ctx, c, model_flops)
        if sim is not c:
            tried.add(id(sim))
            cands = sorted([sim if x is c else x for x in cands], key=sort_key)
    return cands


def knee_candidate(
    candidates: Sequence[Candidate], tolerance: float = PLAN_TOLERANCE, margin: float = PLAN_MARGIN
) -> Candidate:
    """The knee among the candidates that fit: the least peak memory among those whose tokens/s reach
    (1 − τ)·(1 + μ) of the fastest's — ``tune``'s rule ``fraction`` with a predicted reference
    (``docs/knee.md``), over memory instead of b_m. Ties go to the faster, then less recompute, lower ZeRO.

    Raises ``ValueError`` when nothing fits.
    """
    fits = [c for c in candidates if c.fits]
    if not fits:
        raise ValueError("no candidate fits: there is no knee to choose")
    best = max(c.tokens_per_s for c in fits)
    line = (1.0 - tolerance) * (1.0 + margin) * best
    within = [c for c in fits if c.tokens_per_s >= line]
    return min(
        within,
        key=lambda c: (
            float(f"{c.peak_memory_bytes:.6g}"),
            -c.tokens_per_s,
            _RECOMPUTE_RANK[c.recompute],
            c.zero,
        ),
    )
