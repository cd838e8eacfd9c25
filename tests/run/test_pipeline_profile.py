"""The prediction made before a pipeline run: profile, runtime calibration, simulation."""

from __future__ import annotations

import pytest

from microbatch.run.pipeline_config import PipelineConfig
from microbatch.run.pipeline_profile import predict_before, profile_stages

torch = pytest.importorskip("torch")


def _flat(p: int, f: float = 1e-3, b: float = 2e-3) -> dict[int, dict[str, float]]:
    return {s: {"F": f, "B": b, "I": b / 2, "W": b / 2} for s in range(p)}


def test_equal_stages_without_overhead_give_the_closed_form():
    cfg = PipelineConfig(schedule="1f1b", stages=2, microbatches=4)
    pred = predict_before(cfg, _flat(2), {"comm_s": 0.0, "overhead_s": 0.0})
    assert pred["bubble_fraction"] == pytest.approx(1 / 5)  # (p−1)/(m+p−1)
    assert pred["step_time_s"] == pytest.approx((4 + 1) * 3e-3)


def test_overhead_and_hand_off_lengthen_the_step_and_count_as_idle():
    cfg = PipelineConfig(schedule="1f1b", stages=2, microbatches=4)
    base = predict_before(cfg, _flat(2), {"comm_s": 0.0, "overhead_s": 0.0})
    slow = predict_before(cfg, _flat(2), {"comm_s": 1e-3, "overhead_s": 5e-4})
    assert slow["step_time_s"] > base["step_time_s"] + 8 * 5e-4  # every action on a rank pays it
    assert slow["bubble_fraction"] > base["bubble_fraction"]
    # busy stays the profiled op time: 1 − busy / (p · step)
    assert slow["bubble_fraction"] == pytest.approx(1 - 2 * 4 * 3e-3 / (2 * slow["step_time_s"]))


@pytest.mark.timeout(60)
def test_profile_measures_every_stage_of_the_split_the_ranks_use():
    cfg = PipelineConfig(schedule="zb-h1", stages=2, microbatches=2)
    prof = profile_stages(cfg, repeats=2)
    assert sorted(prof) == [0, 1]
    for row in prof.values():
        assert row["F"] > 0 and row["B"] > 0 and row["W"] > 0
    assert prof[1]["I"] > 0  # stage 1's input comes from stage 0 and needs a gradient
