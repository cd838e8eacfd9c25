"""An out-of-memory point caps what is chosen (a helper's review, 2026-12-07): a larger b_m that was measured (a
``tune --refine`` halfway probe, a file of measurements) was chosen past it, and a knee that ran out of memory when
re-measured was kept (the OOM runs were left out of the median)."""

from __future__ import annotations

import pytest

from microbatch.choose.config import ChoiceConfig
from microbatch.choose.curve import CurvePoint
from microbatch.choose.knee import recommend, recommend_measured
from microbatch.choose.tune.confirm import confirm_knee
from microbatch.choose.tune.search import SearchLog, curve_point
from microbatch.errors import ConfigError
from microbatch.measure.probes import Measurement


def test_a_b_m_above_one_that_ran_out_of_memory_is_left_out():
    pts = [CurvePoint(micro_batch=b, throughput=t, peak_memory_bytes=b * 10**9)
           for b, t in ((1, 100), (2, 180), (4, 300))]  # fmt: skip
    pts += [CurvePoint(micro_batch=8, oom=True), CurvePoint(micro_batch=16, throughput=400)]
    r = recommend(pts, memory_budget_bytes=40 * 2**30)
    assert r.knee.micro_batch == 4 and r.fastest.micro_batch == 4  # was 16
    assert (16, "above b_m 8, which ran out of memory (memory does not fall as b_m grows)") in r.left_out
    assert r.max_fitting_micro_batch == 7  # the fit alone said 36
    # in another checkpointing mode the larger b_m stands: it recomputes instead of keeping activations
    ckpt = [*pts[:4], CurvePoint(micro_batch=16, throughput=400, checkpointing=True)]
    assert recommend(ckpt).knee.micro_batch == 16
    # an OOM beside a success at the same b_m (a transient one, retried) caps nothing
    again = [CurvePoint(micro_batch=8, oom=True), CurvePoint(micro_batch=8, throughput=350), pts[4]]
    r = recommend([*pts[:3], *again])
    assert r.fastest.micro_batch == 16 and not r.left_out
    with pytest.raises(ConfigError, match="b_m <= 1 .out of memory there"):
        recommend([CurvePoint(micro_batch=1, oom=True), CurvePoint(micro_batch=2, throughput=5)])


def test_a_knee_that_runs_out_of_memory_when_re_measured_is_out_of_memory():
    speeds = {1: 300, 2: 550, 4: 800, 8: 900, 16: 1000}
    pts = [Measurement(micro_batch=b, throughput=t, repeats=3, spread=0.01, peak_memory_bytes=b * 10**9)
           for b, t in speeds.items()]  # fmt: skip
    pts.append(Measurement(micro_batch=32, oom=True))
    log = SearchLog()
    log.seconds = {(b, False): 0.1 for b in speeds}

    def measure(b, ckpt):
        if b == 8:
            return Measurement(micro_batch=8, oom=True, error="CUDA out of memory")
        return Measurement(
            micro_batch=b, throughput=speeds[b], repeats=3, spread=0.01, peak_memory_bytes=b * 10**9
        )

    choice = ChoiceConfig(reference="measured")
    assert recommend_measured([curve_point(p) for p in pts], choice).knee.micro_batch == 8  # before
    out = confirm_knee(measure, pts, choice, log)
    eight = next(p for p in out if p.micro_batch == 8)
    assert eight.oom and "b_m 8 ran out of memory when re-measured" in log.stop_reason
    r = recommend_measured([curve_point(p) for p in out], choice)
    assert r.knee.micro_batch == 4 and r.fastest.micro_batch == 4  # 16 is above 8: left out too


@pytest.mark.parametrize("scale", [1.0, 0.07, 3.0, 1e-3])
def test_an_exact_tie_is_met_at_every_scale(scale):
    """On the line in decimal: met whatever the float rounding (80 of 100 at τ 0.2 gave 1, 5.6 of 7 gave 2)."""
    pts = [
        CurvePoint(micro_batch=1, throughput=80 * scale),
        CurvePoint(micro_batch=2, throughput=100 * scale),
    ]
    assert recommend(pts, tolerance=0.2).knee.micro_batch == 1
    gain = [
        CurvePoint(micro_batch=1, throughput=100 * scale),
        CurvePoint(micro_batch=2, throughput=115 * scale),
    ]
    assert (
        recommend(gain, rule="gain", tolerance=0.15).knee.micro_batch == 1
    )  # 15.0% per doubling: flat enough


def test_an_oom_without_checkpointing_does_not_cap_the_checkpointing_fit():
    """tune's automatic checkpointing: out of memory at 8 without it, then 8, 16, 32 with it; the memory fit reads
    the checkpointing points (the largest's mode), which that out-of-memory does not bound (it said 7, not 104)."""
    pts = [
        CurvePoint(micro_batch=b, throughput=100 * b**0.5, peak_memory_bytes=(4 + b) * 2**30)
        for b in (1, 2, 4)
    ]
    pts.append(CurvePoint(micro_batch=8, oom=True))
    pts += [CurvePoint(micro_batch=b, throughput=90 * b**0.5, peak_memory_bytes=(2 + b * 0.3) * 2**30, checkpointing=True)
            for b in (8, 16, 32)]  # fmt: skip
    r = recommend(pts, memory_budget_bytes=40 * 2**30)
    assert r.max_fitting_micro_batch is not None and r.max_fitting_micro_batch > 32


def test_a_point_left_out_above_an_oom_is_not_re_measured():
    speeds = {1: 300, 2: 550, 4: 800, 8: 900, 16: 1000}
    pts = [Measurement(micro_batch=b, throughput=t, repeats=3, spread=0.01, peak_memory_bytes=b * 10**9)
           for b, t in speeds.items()]  # fmt: skip
    log = SearchLog()
    log.seconds = {(b, False): 0.1 for b in speeds}
    calls: list[int] = []

    def measure(b, ckpt):
        calls.append(b)
        if b == 8:
            return Measurement(micro_batch=8, oom=True)
        return Measurement(
            micro_batch=b, throughput=speeds[b], repeats=3, spread=0.01, peak_memory_bytes=b * 10**9
        )

    confirm_knee(measure, pts, ChoiceConfig(reference="measured"), log)
    after = calls[calls.index(8) + 1 :] if 8 in calls else calls
    rounds_after_oom = [b for b in after if b == 16]
    assert 8 in calls and "knee 4 checked" in log.stop_reason
    assert not any("16 re-measured" in part for part in log.stop_reason.split(";") if "knee 4" in part)
    assert len(rounds_after_oom) <= 2  # the round that was under way when 8 ran out, no more
