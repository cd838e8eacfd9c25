"""The development set of published runs (tests/data/published_runs.json) and the uncalibrated
step-time error on it (bench/bench_published.py; issue 17)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DATA = json.loads((ROOT / "tests" / "data" / "published_runs.json").read_text())
DEV_TOLERANCE = 0.20
"""Every row within 20% (the model today: mean 9.6%, max 15.3%, all too fast; the goal, mean 3.5% and
max 8%, is not met yet). A guard against drift, not the target."""


def _bench():
    spec = importlib.util.spec_from_file_location("bench_published", ROOT / "bench" / "bench_published.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_row_names_its_source_and_is_consistent():
    sec = DATA["narayanan_2021_table1"]
    assert sec["_url"].startswith("https://arxiv.org/abs/2104.04473")
    for r in sec["rows"]:
        assert (
            r["gpus"] % (r["tp"] * r["pp"]) == 0
            and r["global_batch"] % (r["gpus"] // (r["tp"] * r["pp"])) == 0
        )
        assert r["hidden"] % r["heads"] == 0
        # parameters 12·L·h²·(1 + 13/(12h) + (V + s)/(12·L·h)) (Narayanan et al. 2021 Eq. 2) match the name
        # (rounded to 2–3 digits in the table: 1.65 → "1.7")
        L, h, V, s = r["layers"], r["hidden"], sec["vocab"], sec["seq"]
        params = 12 * L * h * h * (1 + 13 / (12 * h) + (V + s) / (12 * L * h))
        assert params / 1e9 == pytest.approx(r["params_b"], rel=0.03)
    assert DATA["not_covered"] and not DATA["nemo_dgx_h100_bf16"]["rows"]


def test_measured_step_time_by_hand_and_the_errors_stay_within_the_guard():
    bench = _bench()
    # 529.6B: 96·2520·2048·105·20480²·(1 + 2048/(6·20480) + 51200/(16·105·20480)) / (163e12 · 2520)
    by_hand = (
        96
        * 2520
        * 2048
        * 105
        * 20480**2
        * (1 + 2048 / (6 * 20480) + 51200 / (16 * 105 * 20480))
        / (163e12 * 2520)
    )
    assert by_hand == pytest.approx(54.08, abs=0.01)
    rows = bench.narayanan_rows(DATA)
    assert len(rows) == len(DATA["narayanan_2021_table1"]["rows"])
    r530 = next(r for r in rows if r["gpus"] == 2520)
    assert r530["measured_step_s"] == pytest.approx(by_hand, rel=1e-12)
    for r in rows:
        assert abs(r["error_pct"]) <= 100 * DEV_TOLERANCE, r
