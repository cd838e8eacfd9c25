"""Knee rules, memory fit and recommendation over measured curves."""

from __future__ import annotations

import json
import math

import pytest
from _published import PUBLISHED
from hypothesis import given, settings
from hypothesis import strategies as st

from microbatch.choose.bound import BOUND_CONFIDENCE, BOUND_MARGIN, BOUND_SLACK, throughput_bound
from microbatch.choose.config import DEFAULT_RULE, DEFAULT_TOLERANCE
from microbatch.choose.curve import CurvePoint, gain_per_doubling
from microbatch.choose.knee import TIE, find_knee, flattened, points_from_records, recommend
from microbatch.choose.memory_fit import MemoryFit, fit_memory, max_fitting_micro_batch
from microbatch.errors import ConfigError

SEED = [(1, 1000), (4, 3200), (8, 5000), (16, 5600)]


def curve(pairs, mem=None):
    return [
        CurvePoint(micro_batch=b, throughput=t, peak_memory_bytes=None if mem is None else mem(b))
        for b, t in pairs
    ]


def test_seed_curve_default_rule_picks_8():
    if PUBLISHED is not None:
        seed = PUBLISHED["seed_throughput_curve"]
        pts = points_from_records(seed["points"])
        expected = seed["expected_knee"]
    else:
        pts, expected = curve(SEED), 8
    assert find_knee(pts).micro_batch == expected == 8
    for rule in ("fraction", "gain"):
        assert find_knee(pts, rule=rule, tolerance=DEFAULT_TOLERANCE).micro_batch == 8
    assert DEFAULT_RULE == "fraction"


def test_tolerance_boundary_on_seed():
    # 5000/5600 = 0.893: within tau of the best only when tau > 0.107
    pts = curve(SEED)
    assert find_knee(pts, tolerance=0.10).micro_batch == 16
    assert find_knee(pts, tolerance=0.11).micro_batch == 8
    assert find_knee(pts, tolerance=0.40).micro_batch == 8  # 3200 < 0.6 * 5600 = 3360
    assert find_knee(pts, tolerance=0.45).micro_batch == 4  # 3200 >= 0.55 * 5600 = 3080


def test_gain_per_doubling_normalises_uneven_steps():
    # 1 -> 4 at 4x throughput is two doublings of 2x: 100% per doubling
    assert gain_per_doubling(1, 1.0, 4, 4.0) == pytest.approx(1.0)
    assert gain_per_doubling(4, 3200, 8, 5000) == pytest.approx(5000 / 3200 - 1)
    assert gain_per_doubling(8, 5000, 16, 5600) == pytest.approx(0.12)
    # same total gain over 1 doubling or 3 doublings: the per-doubling figure differs
    assert gain_per_doubling(2, 1.0, 16, 1.3) < gain_per_doubling(2, 1.0, 4, 1.3)


def test_falling_curve_is_seen():
    # CPU-like: throughput peaks at 4 and falls once the working set leaves the cache
    pts = curve([(1, 100), (2, 180), (4, 200), (8, 150), (16, 120)])
    assert find_knee(pts, rule="fraction", tolerance=0.15).micro_batch == 2  # 180 >= 170
    assert find_knee(pts, rule="fraction", tolerance=0.05).micro_batch == 4
    assert find_knee(pts, rule="gain", tolerance=0.15).micro_batch == 2  # 2->4 gains 11% < 15%
    assert find_knee(pts, rule="gain", tolerance=0.05).micro_batch == 4  # past 4 it falls
    assert flattened(pts, 0.15)
    r = recommend(pts, tolerance=0.05)
    assert r.fastest.micro_batch == 4 and r.knee.micro_batch == 4


def test_gain_rule_ignores_single_noisy_dip():
    pts = curve([(1, 100), (2, 195), (4, 190), (8, 390), (16, 400)])
    # the 2 -> 4 step dips, but 2 -> 8 still doubles per doubling: not the knee
    assert find_knee(pts, rule="gain", tolerance=0.15).micro_batch == 8


def test_not_flattened_picks_largest_by_gain():
    pts = curve([(1, 100), (2, 200), (4, 400)])
    assert find_knee(pts, rule="gain").micro_batch == 4
    assert not flattened(pts, 0.15)


def test_memory_fit_exact_on_a_line_and_prediction():
    mem = lambda b: 1_000_000 + 250_000 * b  # noqa: E731
    pts = curve([(1, 10), (2, 19), (4, 30), (8, 35)], mem)
    fit = fit_memory(pts)
    assert fit.intercept_bytes == pytest.approx(1_000_000)
    assert fit.slope_bytes_per_sample == pytest.approx(250_000)
    assert fit.fitted_on == (2, 4, 8)  # the largest three
    # budget 10 MB, headroom 10%: (9e6 - 1e6) / 2.5e5 = 32
    assert max_fitting_micro_batch(fit, 10_000_000, memory_headroom=0.1) == 32
    assert max_fitting_micro_batch(fit, 10_000_000, memory_headroom=0.0) == 36
    assert max_fitting_micro_batch(fit, 500_000) == 0
    assert max_fitting_micro_batch(None, 10_000_000) is None
    assert max_fitting_micro_batch(MemoryFit(intercept_bytes=1, slope_bytes_per_sample=0), 10) is None


def test_fit_uses_largest_probes_not_the_noisy_small_ones():
    # b=1 is dominated by allocator granularity: off the line
    mem = {1: 5_000_000, 2: 2_000_000 + 100_000 * 2, 4: 2_000_000 + 100_000 * 4, 8: 2_000_000 + 100_000 * 8}
    pts = [CurvePoint(micro_batch=b, throughput=float(b), peak_memory_bytes=m) for b, m in mem.items()]
    fit = fit_memory(pts, largest=3)
    assert fit.slope_bytes_per_sample == pytest.approx(100_000)
    assert fit_memory(pts[:1]) is None


def test_budget_excludes_points_and_fastest_fitting():
    mem = lambda b: 1000 * b  # noqa: E731
    pts = curve(SEED, mem)
    r = recommend(pts, memory_budget_bytes=8000)
    assert r.fastest.micro_batch == 8
    assert r.knee.micro_batch == 8  # 3200 < 0.85 * 5000 = 4250
    assert r.to_dict()["fraction_of_best"] == 1.0
    r2 = recommend(pts, memory_budget_bytes=4000)
    assert r2.fastest.micro_batch == r2.knee.micro_batch == 4


def test_recommend_to_dict_fields_and_grad_accum():
    mem = lambda b: 1_000_000 + 1000 * b  # noqa: E731
    pts = curve(SEED, mem) + [CurvePoint(micro_batch=32, oom=True)]
    r = recommend(pts, global_batch=256, data_parallel=4, memory_budget_bytes=2_000_000)
    d = r.to_dict()
    assert d["micro_batch"] == 8 and d["grad_accum"] == 256 // (8 * 4) == 8
    assert d["throughput"] == 5000
    assert d["fraction_of_best"] == pytest.approx(5000 / 5600)
    assert d["peak_memory_bytes"] == mem(8)
    assert d["fastest_fitting"]["micro_batch"] == 16 and d["fastest_fitting"]["grad_accum"] == 4
    assert d["fastest_fitting"]["fraction_of_best"] == 1.0
    assert d["memory_fit"]["slope_bytes_per_sample"] == pytest.approx(1000)
    # the fit says 800 would fit, but 32 ran out of memory: below it
    assert math.floor((2_000_000 * 0.9 - 1_000_000) / 1000) == 800 and d["max_fitting_micro_batch"] == 31
    assert d["rule"] == "fraction" and d["tolerance"] == 0.15
    json.dumps(d)


def test_global_batch_divisibility_restricts_candidates():
    pts = curve([(1, 1000), (3, 3000), (6, 5000), (12, 5100)])
    r = recommend(pts, global_batch=16)
    assert r.knee.micro_batch == 1  # 3, 6, 12 do not divide 16
    with pytest.raises(ConfigError, match="divides global batch"):
        recommend(curve([(3, 1), (6, 2)]), global_batch=16)


def test_latency_limit():
    pts = [
        CurvePoint(micro_batch=b, throughput=t, step_time_s=b / t)
        for b, t in [(1, 100), (2, 190), (4, 360), (8, 400)]
    ]
    r = recommend(pts, max_latency_ms=12, tolerance=0.05)  # 8/400 = 20 ms is too slow
    assert r.fastest.micro_batch == 4 and r.knee.micro_batch == 4
    with pytest.raises(ConfigError, match="^max_latency_ms needs step_time_s for every point") as err:
        recommend(curve([(1, 1)]), max_latency_ms=5)
    assert err.value.params == ("max_latency_ms",)


def test_all_oom_says_so():
    with pytest.raises(
        ConfigError,
        match=r"micro-batch 1 is already out of memory; .*with checkpointing on \(training: .*\), a shorter seq or",
    ) as err:
        recommend([CurvePoint(micro_batch=1, oom=True), CurvePoint(micro_batch=2, oom=True)])
    assert "--" not in str(err.value) and err.value.params == ("checkpointing", "seq")
    # a search that started past 1 (decode's --start 1024): a smaller start first, the only advice decoding can take
    # besides the sequence and the budget
    with pytest.raises(
        ConfigError, match=r"micro-batch 1024 is already out of memory; .* with a smaller start"
    ) as e:
        recommend([CurvePoint(micro_batch=1024, oom=True)])
    assert e.value.params == ("start", "checkpointing", "seq")


@pytest.mark.parametrize(
    "rows,msg",
    [
        ([{"throughput": 3}], "no 'micro_batch'"),
        ([{"micro_batch": 2}], "no 'throughput'"),
        ([{"micro_batch": 0, "throughput": 3}], "micro_batch"),
        ([{"micro_batch": 1.5, "throughput": 3}], "whole number"),
        ([{"micro_batch": 2, "throughput": -1}], "throughput"),
        ([{"micro_batch": 2, "throughput": "fast"}], "not a number"),
        ([{"micro_batch": 2, "throughput": 1, "peak_memory_bytes": -5}], "peak_memory_bytes"),
        ([{"micro_batch": 2, "throughput": 1, "oom": "maybe"}], "oom"),
        ([], "no rows"),
        ([3], "not an object"),
    ],
)
def test_bad_records(rows, msg):
    with pytest.raises(ConfigError, match=msg):
        points_from_records(rows)


def test_bad_rule_and_tolerance():
    with pytest.raises(ConfigError, match="rule"):
        find_knee(curve(SEED), rule="elbow")
    with pytest.raises(ConfigError, match="tolerance"):
        find_knee(curve(SEED), tolerance=1.5)


def test_oom_records_parsed():
    pts = points_from_records([{"micro_batch": 1, "throughput": 5}, {"micro_batch": 2, "oom": "true"}])
    assert pts[1].oom and pts[1].throughput is None
    assert recommend(pts).knee.micro_batch == 1


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(min_value=1.0, max_value=1e6, allow_nan=False), min_size=1, max_size=8),
    st.floats(min_value=0.0, max_value=0.9),
)
def test_fraction_knee_properties(ts, tol):
    pts = curve([(2**i, t) for i, t in enumerate(ts)])
    k = find_knee(pts, rule="fraction", tolerance=tol)
    best = max(ts)
    assert k.throughput >= (1 - tol) * best - 1e-9
    # nothing smaller meets the bar
    assert all(p.throughput < (1 - tol) * best * (1 - TIE) for p in pts if p.micro_batch < k.micro_batch)
    g = find_knee(pts, rule="gain", tolerance=tol)
    # the gain knee: no later point gains τ per doubling over it, and every earlier point has one that does

    def best_gain(p):
        later = [q for q in pts if q.micro_batch > p.micro_batch]
        return max((gain_per_doubling(p.micro_batch, p.throughput, q.micro_batch, q.throughput) for q in later),
                   default=-1.0)  # fmt: skip

    assert best_gain(g) <= tol + TIE or g.micro_batch == pts[-1].micro_batch  # a tie meets it (TIE)
    assert all(best_gain(p) > tol + TIE for p in pts if p.micro_batch < g.micro_batch)


# -- the bound on larger b_m (reference="bound") ----------------------------------------
def affine(a, c, bs=(1, 2, 4, 8, 16, 32, 64)):
    """T(b) = b / (a + c·b): step time per unit of throughput affine in b."""
    return [(b, b / (a + c * b)) for b in bs]


def test_bound_on_affine_step_time_is_the_asymptote_and_knee_is_closed_form():
    a, c, tau = 0.05, 0.004, 0.15
    pts = curve(affine(a, c))
    bound = throughput_bound(pts)
    assert bound is not None and bound.fitted_on == (4, 8, 16, 32, 64)  # the five largest
    assert bound.throughput == pytest.approx(1 / c)
    assert bound.slope == pytest.approx(c) and bound.intercept == pytest.approx(a)
    assert bound.max_residual == pytest.approx(0.0, abs=1e-12)
    # on an exact line the bound has no error, so the margin mu = 2 SE is 0: the knee is the
    # smallest b with b/(a+cb) >= x/c, x = (1-tau)(1+mu), i.e. b >= x/(1-x) * a/c
    assert bound.relative_error == pytest.approx(0.0, abs=1e-9)
    rec = recommend(pts, reference="bound", tolerance=tau)
    assert rec.margin == pytest.approx(0.0, abs=1e-9)
    x = (1 - tau) * (1 + rec.margin)
    b_star = x / (1 - x) * a / c  # 70.8: no measured point reaches it yet
    assert rec.knee.micro_batch == 64 == rec.fastest.micro_batch and rec.reference == "bound"
    assert rec.reference_throughput == pytest.approx(1 / c)
    more = curve(affine(a, c, bs=(1, 2, 4, 8, 16, 32, 64, 128, 256)))
    k = recommend(more, reference="bound", tolerance=tau).knee.micro_batch
    assert k == 128 == min(b for b, _ in affine(a, c, (128, 256)) if b >= b_star)
    # against the best measured alone the same curve gives a smaller knee, further from 1/c
    assert recommend(more, tolerance=tau).knee.micro_batch == 64
    assert find_knee(curve(affine(a, c, bs=(1, 2, 4, 8, 16, 32, 72, 96, 128))), bound=1 / c).micro_batch == 72
    # a margin raises the line: with 5% it is 103.8, past 72 and 96
    odd = curve(affine(a, c, bs=(1, 2, 4, 8, 16, 32, 72, 96, 128)))
    assert find_knee(odd, bound=1 / c, margin=BOUND_MARGIN).micro_batch == 128


def test_bound_relative_error_is_the_least_squares_standard_error_of_the_slope():
    """SE(c)/c against the matrix form of ordinary least squares (numpy), on a noisy tail."""
    np = pytest.importorskip("numpy")
    pts = [(4, 150.0), (8, 176.0), (16, 221.0), (32, 226.0), (64, 241.0)]
    bound = throughput_bound(curve(pts))
    assert bound is not None
    b = np.array([p[0] for p in pts], dtype=float)
    u = b / np.array([p[1] for p in pts])
    X = np.column_stack([np.ones_like(b), b])
    coef, rss, *_ = np.linalg.lstsq(X, u, rcond=None)
    cov = rss[0] / (len(b) - 2) * np.linalg.inv(X.T @ X)
    assert bound.slope == pytest.approx(coef[1])
    assert bound.relative_error == pytest.approx(math.sqrt(cov[1, 1]) / coef[1])
    assert 0.01 < bound.relative_error < 0.2
    rec = recommend(curve(pts), reference="bound")
    assert rec.margin == pytest.approx(BOUND_CONFIDENCE * bound.relative_error)
    # the same tail with its noise halved (residuals about the same line halved): half the margin
    line = {bb: coef[0] + coef[1] * bb for bb in b}
    calmer = [(int(bb), bb / (line[bb] + (uu - line[bb]) / 2)) for bb, uu in zip(b, u, strict=True)]
    assert throughput_bound(curve(calmer)).relative_error == pytest.approx(bound.relative_error / 2, rel=1e-6)


def test_margin_follows_the_fit_on_a_recorded_h200_curve():
    """gpt2 on an H200 (bench/results/h200-2026-11-30b/rerun/tune/ours_gpt2.json, CUDA events):
    the bound over 2..32 is 167,807 tokens/s with a relative standard error of 1.9%. With a fixed
    5% margin the line was 0.85 × 1.05 × 167,807 = 149,768 and 16 (148,737) missed it by 0.7%, so
    the knee was 32; with two standard errors (3.7%) the line is 147,961 and the knee is 16
    (95.8% of 32's throughput, half its activations)."""
    gpt2 = [(1, 42344.6), (2, 69005.0), (4, 105594.8), (8, 135842.0), (16, 148737.0), (32, 155308.4)]
    rec = recommend(curve(gpt2), reference="bound")
    assert rec.bound is not None and rec.bound.fitted_on == (2, 4, 8, 16, 32)
    assert rec.bound.throughput == pytest.approx(167807, rel=1e-4)
    assert rec.bound.relative_error == pytest.approx(0.0186, abs=5e-4)
    assert rec.margin == pytest.approx(2 * rec.bound.relative_error)
    assert rec.knee.micro_batch == 16
    assert find_knee(curve(gpt2), bound=rec.bound.throughput, margin=BOUND_MARGIN).micro_batch == 32


def test_bound_fit_averages_noise_that_a_secant_would_amplify():
    # affine truth u = 0.05 + 0.004 b; the 32 probe 8% slow. The last two secants' slopes differ
    # by 29% (the former three-point rule, at 10%, refused), but every point is within 15% of the
    # fitted line, and T-hat stays within 5% of the true 1/c = 250
    pts = [(b, t * (0.92 if b == 32 else 1.0)) for b, t in affine(0.05, 0.004)]
    u = {b: b / t for b, t in pts}
    s1, s2 = (u[32] - u[16]) / 16, (u[64] - u[32]) / 32
    assert abs(s2 / s1 - 1) > 0.25
    bound = throughput_bound(curve(pts))
    assert bound is not None and bound.max_residual < BOUND_SLACK
    assert bound.throughput == pytest.approx(250.0, rel=0.05)


def test_bound_none_when_tail_bends_or_too_few_points():
    # three points: a line through them has one degree of freedom left; no bound
    assert throughput_bound(curve([(1, 100.0), (2, 104.0), (4, 135.0)])) is None
    assert throughput_bound(curve(affine(0.05, 0.004, bs=(1, 2, 4)))) is None
    assert throughput_bound(curve(affine(0.05, 0.004, bs=(1, 2, 4, 8)))) is not None
    # 1 -> 2 -> 4 -> 8 of a CPU decode: u = b/T falls from 2 to 4 (matrix-vector kernels giving
    # way to matrix-matrix ones): a bend, not a line
    assert throughput_bound(curve([(1, 24.0), (2, 26.0), (4, 58.0), (8, 94.0)])) is None
    # flat step time up to 8 (latency-bound), then linear: a hinge misses any line by > 15%
    hinge = [(b, b / max(0.1, 0.0125 * b)) for b in (2, 4, 8, 16, 32)]
    bound = throughput_bound(curve(hinge))
    assert bound is None
    assert throughput_bound(curve(hinge), slack=math.inf) is not None
    # u not growing at all (throughput linear in b): no slope, no bound
    assert throughput_bound(curve([(b, 10.0 * b) for b in (1, 2, 4, 8)])) is None


def test_bound_when_step_time_extrapolates_below_zero_is_the_last_point():
    # u = b/T = -0.002 + 0.011·b (falling throughput): nothing past 16 beats T(16)
    pts = curve([(b, b / (-0.002 + 0.011 * b)) for b in (2, 4, 8, 16)])
    bound = throughput_bound(pts)
    assert bound is not None and bound.throughput == pytest.approx(pts[-1].throughput)
    # a kink (u's slope triples, as when the working set leaves the cache) is left to the flat rule
    kink = curve([(1, 150.0), (2, 190.0), (4, 300.0), (8, 250.0)])
    assert throughput_bound(kink) is None
    # without the slack test the fitted line's bound is looser than the last secant's (valid: c_LS <= s_34)
    loose = throughput_bound(kink, slack=math.inf)
    assert loose.max_residual > BOUND_SLACK and loose.throughput > 250.0


def test_seed_curve_knee_8_measured_and_16_against_the_bound():
    # the requirement: the default (measured reference) picks the seed's own 8
    assert recommend(curve(SEED)).knee.micro_batch == 8
    # the seed's four points fit a line in u = b/T within 11%: T-hat = 7,978, 16 is at 70% of
    # it, so against the bound the curve is still rising and the knee is the fastest, 16
    rec = recommend(curve(SEED), reference="bound")
    assert rec.bound is not None and rec.bound.fitted_on == (1, 4, 8, 16)
    assert rec.bound.max_residual == pytest.approx(0.1067, abs=1e-3)
    assert rec.bound.throughput == pytest.approx(7977.97, rel=1e-4)
    assert rec.knee.micro_batch == 16 == rec.fastest.micro_batch
    # a tighter slack refuses the bend and falls back on the best measured: 8 again
    assert find_knee(curve(SEED), bound=None).micro_batch == 8
    assert throughput_bound(curve(SEED), slack=0.10) is None
    d = rec.to_dict()
    assert d["reference"] == "bound" and d["throughput_bound"]["fitted_on"] == [1, 4, 8, 16]


def test_bound_fields_in_json():
    rec = recommend(curve(affine(0.05, 0.004)), reference="bound")
    d = rec.to_dict()
    assert d["throughput_bound"]["fitted_on"] == [4, 8, 16, 32, 64]
    assert d["reference_throughput"] == pytest.approx(250.0)
    assert d["fraction_of_reference"] == pytest.approx(d["throughput"] / 250.0)
    # reference bound: the margin applies, two standard errors of a fit that has none here
    assert d["bound_margin"] == pytest.approx(0.0, abs=1e-9) and d["bound_margin"] == rec.margin
    assert d["throughput_bound"]["relative_error"] == pytest.approx(0.0, abs=1e-9)
    assert d["throughput_bound"]["max_residual"] == pytest.approx(0.0, abs=1e-12)
    assert recommend(curve(SEED)).to_dict()["bound_margin"] == 0.0  # measured: none


def test_margin_with_the_bound_reference_prefers_the_point_clear_of_the_line():
    # falling throughput: the bound is T(16), under the best measured (T(2) = 100); the margin
    # still applies to the best measured, which is an estimate too
    pts = curve([(1, 80.0), (2, 100.0), (4, 86.0), (8, 84.0), (16, 80.0)])
    assert recommend(pts).knee.micro_batch == 2
    # 86 is within 15% of 100 but not with a 5% margin (89.25): measured 4, bound 2
    pts = curve([(1, 86.0), (2, 100.0), (4, 97.0), (8, 93.0), (16, 90.0)])
    assert recommend(pts).knee.micro_batch == 1
    rec = recommend(pts, reference="bound")  # no bound on this bend: the fixed margin
    assert rec.bound is None and rec.margin == BOUND_MARGIN and rec.knee.micro_batch == 2


def test_bound_knee_is_fastest_when_nothing_is_within_tau():
    # still rising steeply at the last point: T-hat far above every point
    rec = recommend(curve(affine(1.0, 0.001, bs=(1, 2, 4, 8))), reference="bound")
    assert rec.knee.micro_batch == 8 == rec.fastest.micro_batch
    with pytest.raises(ConfigError, match="reference"):
        recommend(curve(SEED), reference="projected")


@settings(max_examples=80, deadline=None)
@given(
    st.lists(
        st.tuples(st.floats(0.0, 5.0), st.floats(1e-3, 2.0)), min_size=1, max_size=3
    ),  # (intercept >= 0, slope > 0) of each resource's time
    st.integers(4, 7),
)
def test_bound_holds_for_every_roofline_curve(lines, n):
    """u(b) = max_r (a_r + c_r·b) (a roofline: convex): T-hat bounds every larger b_m."""
    bs = [2**i for i in range(10)]
    T = {b: b / max(a + c * b for a, c in lines) for b in bs}
    # slack = inf: the convexity argument alone (the default slack also refuses sharp kinks)
    bound = throughput_bound(curve([(b, T[b]) for b in bs[:n]]), slack=math.inf)
    assert bound is not None
    for b in bs[n:]:
        assert T[b] <= bound.throughput * (1 + 1e-9)
    # when a measured point reaches (1 - tau)·T-hat, the knee is within tau of every larger b_m
    pts = curve([(b, T[b]) for b in bs[:n]])
    k = find_knee(pts, bound=bound.throughput)
    ref = max(bound.throughput, max(T[b] for b in bs[:n]))
    if k.throughput >= (1 - DEFAULT_TOLERANCE) * ref:
        assert all(k.throughput >= (1 - DEFAULT_TOLERANCE) * T[b] * (1 - 1e-9) for b in bs[n:])


# -- the settings as one config object --------------------------------------------------------
def test_choice_config_and_keywords_give_the_same_choice():
    from microbatch.choose.config import ChoiceConfig

    pts = curve(SEED, mem=lambda b: 10**6 + 10**5 * b)
    cfg = ChoiceConfig(tolerance=0.05, memory_budget_bytes=3 * 10**6, global_batch=64, data_parallel=2)
    by_config = recommend(pts, cfg).to_dict()
    by_keywords = recommend(
        pts, tolerance=0.05, memory_budget_bytes=3 * 10**6, global_batch=64, data_parallel=2
    ).to_dict()
    assert by_config == by_keywords
    assert by_config["micro_batch"] == 16 and by_config["grad_accum"] == 64 // (16 * 2)
    # a keyword overrides the config's field; the config itself is left as it was
    assert recommend(pts, cfg, tolerance=0.15).knee.micro_batch == 8 and cfg.tolerance == 0.05
    # reference left unset means "measured" for recommend
    assert recommend(pts, cfg).reference == "measured"


@pytest.mark.parametrize(
    "field,value,msg",
    [
        ("rule", "elbow", r"knee rule 'elbow' is not known; use one of fraction, gain"),
        ("tolerance", 1.0, r"tolerance 1.0 must be a number in \[0, 1\), e.g. 0.15"),
        ("reference", "projected", r"reference 'projected' is not known; use one of measured, bound"),
        (
            "memory_budget_bytes",
            0,
            r"memory_budget_bytes 0 is not above zero; give a positive size, e.g. 12GiB",
        ),
        (
            "memory_budget_bytes",
            "12 apples",
            r"memory_budget_bytes '12 apples' is not a size; give a positive number",
        ),
        ("memory_headroom", -0.1, r"memory_headroom -0.1 must be a number in \[0, 1\)"),
        ("max_latency_ms", 0, r"max_latency_ms 0 must be > 0"),
        ("global_batch", 0, r"global_batch must be a whole number >= 1, got 0; e.g. global_batch 512$"),
        ("data_parallel", 2.5, r"data_parallel must be a whole number >= 1, got 2.5"),
    ],
)
def test_choice_config_names_field_value_and_fix(field, value, msg):
    from microbatch.choose.config import ChoiceConfig

    with pytest.raises(ConfigError, match=msg):
        ChoiceConfig(**{field: value})
    with pytest.raises(ConfigError, match=msg):
        recommend(curve(SEED), **{field: value})


def test_misspelt_keyword_is_a_type_error_listing_the_options():
    with pytest.raises(
        TypeError, match=r"recommend\(\) got unexpected option\(s\) 'tolerence'; options: .*tolerance"
    ):
        recommend(curve(SEED), tolerence=0.1)
