"""The tune text ends with one plain line a user can act on: ``use b_m = …, g = …``."""

from __future__ import annotations

import re

import pytest

from microbatch.choose.config import ChoiceConfig
from microbatch.choose.curve import CurvePoint
from microbatch.choose.knee import recommend
from microbatch.show.recommendation import render_tune, use_line

CURVE = [(1, 1000.0), (2, 1900.0), (4, 3200.0), (8, 5000.0), (16, 5600.0)]


def _tune_dict(global_batch, data_parallel):
    pts = [CurvePoint(micro_batch=b, throughput=t, peak_memory_bytes=2**20 * (100 + b)) for b, t in CURVE]
    rec = recommend(pts, ChoiceConfig(global_batch=global_batch, data_parallel=data_parallel))
    d = rec.to_dict()
    d.update(
        model="tiny",
        mode="train",
        seq=64,
        precision="fp32",
        device_name="cpu",
        torch_version="x",
        stop_reason="walked to 16",
        probes=5,
        cached=0,
        oom_events=0,
        wall_time_s=1.0,
        memory_method="vmhwm",
        interrupted=False,
        points=[{"micro_batch": b, "throughput": t, "step_time_s": b / t} for b, t in CURVE],
    )
    return d


@pytest.mark.parametrize(("global_batch", "data_parallel"), [(256, 1), (64, 2), (48, 3)])
def test_tune_text_ends_with_the_plain_use_line(global_batch, data_parallel):
    d = _tune_dict(global_batch, data_parallel)
    last = render_tune(d).splitlines()[-1]
    assert last == use_line(d)
    m = re.fullmatch(r"use b_m = (\d+), g = (\d+) \(b_m x g x d = (\d+) x (\d+) x (\d+) = (\d+)\)", last)
    assert m, last
    b_m, g, b2, g2, dp, total = map(int, m.groups())
    # the line holds the knee the text chose, and B_global is kept exactly
    assert (b_m, g, b2, g2, dp) == (d["micro_batch"], d["grad_accum"], b_m, g, data_parallel)
    assert b_m * g * dp == total == global_batch
    assert f"knee (fraction, τ = 0.15): b_m = {b_m}, g = {g}" in render_tune(d)


def test_without_a_global_batch_the_line_says_how_to_get_g():
    d = _tune_dict(None, 1)
    assert render_tune(d).splitlines()[-1] == (
        f"use b_m = {d['micro_batch']} (g = B_global / (b_m x d): no global batch given)"
    )
