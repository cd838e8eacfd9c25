"""The plan's choice among its candidates: their order (fitting, fastest, then less recompute, lower ZeRO, less
memory), the knee (least memory within the tolerance of the fastest), and the contenders simulated so that both
stand on the event simulator, not on the closed forms that ranked them. Split from :mod:`microbatch.predict.plan`,
which re-exports :func:`knee_candidate`."""

from __future__ import annotations

from collections.abc import Sequence

from microbatch.predict.candidate import Candidate, Context, simulation_key, with_simulation
from microbatch.predict.plan_config import PLAN_MARGIN, PLAN_TOLERANCE

__all__ = ["PLAN_CONTENDER_ACTIONS", "PLAN_ROW_ACTIONS", "contenders_simulated", "knee_candidate", "sort_key"]


_RECOMPUTE_RANK = {"none": 0, "selective": 1, "op": 2, "full": 3}

MEMORY_TIE = 0.01
"""Peaks within 1% of the least are one memory to the knee: the memory fit's own error at the largest probe is under
1% (:data:`microbatch.hardware.DEFAULT_HEADROOM`, BENCHMARKS.md), so a smaller saving is not one the prediction can
promise. Without it a selective recompute under flash attention, which saves only the kernel's log-sum-exp (4·a·s·b/t
bytes a layer, ~0.05% of Llama 3 8B's at s 8,192), was taken over no recompute for a slower step. At the knee's own
b_m, 1% of the memory budget too, where that is under τ of the peak: the recompute, ZeRO stage or schedule chosen
there saves memory only where memory is short (a small model on an A100 took full recompute, 5% slower, to save
0.07 GiB, 9% of its peak, of 36: a user's walk-through); τ keeps a small model's tie from doubling its peak (a
review: gpt2 on a B200 took 3.05 GiB for 0.4% over 1.51)."""


def sort_key(c: Candidate) -> tuple[bool, float, int, int, float]:
    """Fitting first, fastest first; ties (to 6 digits) go to less recompute, lower ZeRO, less memory."""
    primary = float(f"{c.step_time_s:.6g}") if c.fits else c.peak_memory_bytes
    return (not c.fits, primary, _RECOMPUTE_RANK[c.recompute], c.zero, c.peak_memory_bytes)


PLAN_CONTENDER_ACTIONS = 300_000
"""The schedule actions the planner simulates beyond its leaders to settle the fastest and the knee (about 1 s at
the simulator's measured 3.6 µs an action, :data:`~microbatch.schedules.limits.MAX_SIMULATED_ACTIONS`): past it the
remaining contenders keep their closed-form times."""


PLAN_ROW_ACTIONS = 300_000
"""The schedule actions the planner simulates, apart from :data:`PLAN_CONTENDER_ACTIONS`, to settle the best
candidate at each b_m (the rows of ``plan``'s table): past it a row may show a schedule whose closed form ranked it
first (a sweep of 2,296 plans: 20% had a row whose schedule was not the fastest at its b_m, up to +47%)."""


def _lower_bound_s(c: Candidate) -> float:
    """A floor under ``c``'s simulated step: its closed-form step less its closed-form bubble (no rank finishes
    before its own work; the rest of the step, gradient reduction and optimizer, is the same in both)."""
    return c.step_time_s - float(c.time.get("bubble_s", 0.0))


def contenders_simulated(ctx: Context, cands: list[Candidate], model_flops: float) -> list[Candidate]:
    """``cands`` with every fitting contender simulated, re-sorted once. The closed forms of interleaved 1F1B, ZB-H1
    and DualPipeV overstate their bubble (a grid of 323 plans: the same candidate up to 3.3% faster simulated), so a
    candidate outside the simulated leaders was ranked on them, and a narrower search found a faster one than the whole
    search's fastest. Two passes: (1) in order of their floors (:func:`_lower_bound_s`), each candidate whose floor is
    under the fastest step found so far, which settles the fastest (no floor left under it can beat it); (2) with the
    knee's line now fixed, in order of memory, each one under the knee's memory whose floor is under the line but whose
    closed form is over it, until one reaches the line (the least memory that does: the knee). Simulations the cache
    holds (a sibling ZeRO row's) are free; the others spend :data:`PLAN_CONTENDER_ACTIONS`."""
    cfg = ctx.cfg
    if cfg.pipeline_parallel == 1 or not cands[0].fits:
        return cands
    done: dict[int, Candidate] = {}  # id of a candidate -> it simulated
    budget = [PLAN_CONTENDER_ACTIONS]
    fits = [c for c in cands if c.fits]
    _settle_fastest(ctx, fits, model_flops, done, budget)
    fits = _rows_settled(ctx, [done.get(id(c), c) for c in fits], model_flops, done)
    best = min(c.step_time_s for c in fits)  # with the rows': one may be faster where the first budget ended
    knee = knee_candidate(fits, cfg.tolerance, cfg.margin, cfg.memory_budget_bytes)
    line_s = best / ((1.0 - cfg.tolerance) * (1.0 + cfg.margin))
    below = [c for c in fits if not c.simulated and c.peak_memory_bytes < knee.peak_memory_bytes]
    for c in sorted(below, key=lambda c: c.peak_memory_bytes):
        if budget[0] <= 0:
            break
        if c.step_time_s > line_s >= _lower_bound_s(c):
            sim = done[id(c)] = _simulate(ctx, c, model_flops, budget)
            if sim.step_time_s <= line_s:
                break  # the least memory within the line: no later one can be the knee
    return sorted((done.get(id(c), c) for c in cands), key=sort_key)


def _rows_settled(
    ctx: Context, fits: list[Candidate], model_flops: float, done: dict[int, Candidate]
) -> list[Candidate]:
    """``fits`` with the best candidate at each b_m settled on the simulator, as the first pass settles the fastest:
    at each b_m, in order of their floors, each candidate whose floor is under that b_m's fastest step so far is
    simulated (the closed forms only overstate, so the least of them bounds the row's true best from above).
    Within :data:`PLAN_ROW_ACTIONS`; ``done`` records each simulation. Without it, a row showed GPipe at 0.415 s
    where interleaved 1F1B at the same b_m ran 0.348 s in 15 GiB less (its closed form said slower)."""
    budget = [PLAN_ROW_ACTIONS]
    rows: dict[int, list[Candidate]] = {}
    for c in fits:
        rows.setdefault(c.micro_batch, []).append(c)
    for group in rows.values():
        _settle_fastest(ctx, group, model_flops, done, budget)
    return [done.get(id(c), c) for c in fits]


def _settle_fastest(
    ctx: Context, group: list[Candidate], model_flops: float, done: dict[int, Candidate], budget: list[int]
) -> None:
    """Simulate, in order of their floors (:func:`_lower_bound_s`), each of ``group`` whose floor is under the fastest
    step found so far (the closed forms only overstate, so the least of them bounds the true fastest from above),
    until none is or ``budget`` is spent: no floor left under the fastest can beat it. ``done`` records each."""
    best = min(c.step_time_s for c in group)
    for c in sorted((c for c in group if not c.simulated), key=_lower_bound_s):
        if _lower_bound_s(c) >= best or budget[0] <= 0:
            break
        sim = done[id(c)] = _simulate(ctx, c, model_flops, budget)
        best = min(best, sim.step_time_s)


def _simulate(ctx: Context, c: Candidate, model_flops: float, budget: list[int]) -> Candidate:
    """``c`` simulated (:func:`~microbatch.predict.candidate.with_simulation`), its actions taken from ``budget`` where
    the simulation ran (not the cache's, not one past the simulator's limit)."""
    from microbatch.schedules.limits import count_actions

    cached = simulation_key(c) in ctx.sim_cache
    sim = with_simulation(ctx, c, model_flops)
    if sim.simulated and not cached:
        budget[0] -= count_actions(c.schedule, ctx.cfg.pipeline_parallel, c.microbatches, c.virtual)
    return sim


def knee_candidate(
    candidates: Sequence[Candidate], tolerance: float = PLAN_TOLERANCE, margin: float = PLAN_MARGIN,
    budget: float | None = None,
) -> Candidate:  # fmt: skip
    """The knee among the candidates that fit: the least peak memory among those whose tokens/s reach
    (1 − τ)·(1 + μ) of the fastest's — ``tune``'s rule ``fraction`` with a predicted reference
    (``docs/knee.md``), over memory instead of b_m, peaks within :data:`MEMORY_TIE` of the least counted as one (at the
    least one's b_m, within MEMORY_TIE of ``budget`` too, up to τ of the peak). Ties go to the faster, then less
    recompute, lower ZeRO, less memory; and a candidate within the line faster at no more memory is the knee instead.

    Raises ``ValueError`` when nothing fits.
    """
    fits = [c for c in candidates if c.fits]
    if not fits:
        raise ValueError("no candidate fits: there is no knee to choose")
    best = max(c.tokens_per_s for c in fits)
    line = (1.0 - tolerance) * (1.0 + margin) * best
    within = [c for c in fits if c.tokens_per_s >= line]
    smallest = min(within, key=lambda c: c.peak_memory_bytes)
    least, b = smallest.peak_memory_bytes, smallest.micro_batch
    at_b = min(
        MEMORY_TIE * (budget or 0.0), tolerance * least
    )  # under 1% of the device and under τ of the peak
    same = [
        c
        for c in within
        if c.peak_memory_bytes <= least * (1.0 + MEMORY_TIE)
        or (c.micro_batch == b and c.peak_memory_bytes <= least + at_b)
    ]
    knee = min(same, key=_faster_first)
    # never beaten outright: a candidate within the line, faster, at no more memory, is the knee instead
    better = [
        c
        for c in within
        if c.peak_memory_bytes <= knee.peak_memory_bytes and c.tokens_per_s > knee.tokens_per_s
    ]
    return min(better, key=_faster_first) if better else knee


def _faster_first(c: Candidate) -> tuple[float, int, int, float]:
    """The knee's order among ties: faster (to 6 digits), then less recompute, lower ZeRO, less memory."""
    return (-float(f"{c.tokens_per_s:.6g}"), _RECOMPUTE_RANK[c.recompute], c.zero, c.peak_memory_bytes)
