"""The pure part of confirming the knee: which points to compare it with, which of a point's
measurements to keep, and the noise the re-measurements show.

:mod:`microbatch.choose.tune.confirm` measures the points again (its budget, its rounds); these rules
only read measurements: no clock, no probe. Why the confirmation exists: that module's docstring.
"""

from __future__ import annotations

import math
from dataclasses import replace

from microbatch.choose.knee import Recommendation
from microbatch.choose.noise import between_se, relative_se
from microbatch.measure.probes import Measurement

__all__ = ["comparison_group", "median_measurement", "pooled_scatter", "with_pooled_noise"]


def median_measurement(ms: list[Measurement]) -> Measurement:
    """The measurement of ``ms`` with the median throughput (the lower middle one of an even count of
    measurements that did not run out of memory), with the largest peak memory of all, and its
    standard error: the larger of its repeats' and of the re-measurements' own scatter
    (:func:`microbatch.choose.noise.between_se`: the machine's drift between probes)."""
    ok = sorted((m for m in ms if not m.oom and m.throughput), key=lambda m: m.throughput or 0.0)
    mid = ok[(len(ok) - 1) // 2]
    peaks = [m.peak_memory_bytes for m in ms if m.peak_memory_bytes is not None]
    repeats = sum(m.repeats for m in ok)
    se = max(relative_se(mid.spread, repeats), between_se([m.throughput or 0.0 for m in ok]))
    return replace(mid, peak_memory_bytes=max(peaks) if peaks else None, repeats=repeats, throughput_se=se)


def pooled_scatter(groups: list[list[float]]) -> float:
    """The relative standard deviation of one probe, pooled over every re-measured point:
    √(Σ_g Σ_i (t_gi / mean_g − 1)² / Σ_g (n_g − 1)) (the pooled within-group variance, here the machine's
    drift between probes of one b_m); 0 with no group of two or more."""
    dof = sum(len(g) - 1 for g in groups if len(g) >= 2)
    if dof == 0:
        return 0.0
    ss = 0.0
    for g in groups:
        if len(g) >= 2:
            mean = sum(g) / len(g)
            ss += sum((t / mean - 1.0) ** 2 for t in g)
    return math.sqrt(ss / dof)


def with_pooled_noise(
    pts: list[Measurement], confirmed: set[int], groups: list[list[float]], rounds: int
) -> list[Measurement]:
    """``pts`` with every point's standard error at least what the re-measurements show of the machine's
    noise (:func:`pooled_scatter`, σ): σ for a point measured once (one draw of that noise), and
    √(π/2)·σ/√n for a median of n. Pooled over all the re-measured points (6 or more degrees of
    freedom where one point's three measurements give 2): a set of indistinguishable b_m read off
    three values alone named only the knee where the next run chose another (BENCHMARKS.md)."""
    sigma = pooled_scatter(groups)
    if sigma <= 0:
        return pts
    out = []
    for i, p in enumerate(pts):
        floor = sigma if i not in confirmed else math.sqrt(math.pi / 2) * sigma / math.sqrt(rounds + 1)
        se = p.throughput_se if p.throughput_se is not None else relative_se(p.spread, p.repeats)
        out.append(p if p.oom or se >= floor else replace(p, throughput_se=floor))
    return out


def comparison_group(rec: Recommendation, index: dict[int, int]) -> list[int]:
    """The b_m to compare the knee with: the fastest point, the next measured above the knee, and
    the largest below it that the noise cannot tell from it."""
    knee = rec.knee.micro_batch
    above = [b for b in index if b > knee]
    # and the largest b_m below the knee that the noise cannot tell from it: the knee it would be;
    # a knee that is the largest and fastest point has only that point to be compared with, so
    # the one below it is measured again whatever the noise estimate says (one dip of it, as
    # 4 at 80% of 8 between 2 and 8 at 83% and 100%, is what put the knee at the end)
    below = [b for b in rec.indistinguishable if b < knee and b in index]
    if not above and rec.fastest.micro_batch == knee:
        below += [b for b in index if b < knee]
    group = sorted(
        {
            knee,
            rec.fastest.micro_batch,
            *([min(above)] if above else []),
            *([max(below)] if below else []),
        }
    )
    return group
