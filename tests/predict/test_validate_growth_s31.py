"""validate's memory verdict on a CPU (a helper's review, 2026-12-07): the calibrated growth fits a slope to the same
points, so it read 0.0% for GPT-2 and Gemma 2 whose activation formula is 2.3x low; the uncalibrated growth — the
formula's own bytes per sample against the machine's — is now said beside it. The data: a tune of a 4-layer GPT-2
config (h 256, s 256, fp32, eager loss) on this task's 2-core VM, by that helper."""

from __future__ import annotations

from pathlib import Path

import pytest

from microbatch.cli import main

DATA = Path(__file__).resolve().parents[1] / "data" / "tune_hf_gpt2_cpu.json"


def test_the_uncalibrated_growth_shows_what_the_calibrated_one_cannot(capsys):
    import json

    assert main(["validate", "--calibration", str(DATA), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    rows, e = d["points"], d["errors"]
    first, last = rows[0], rows[-1]
    grown = last["memory_measured"] - first["memory_measured"]
    by_hand = (last["memory_uncal"] - first["memory_uncal"] - grown) / grown
    assert e["memory_growth_uncalibrated"] == pytest.approx(by_hand)
    assert (
        e["memory_growth_uncalibrated"] < -0.4
    )  # the formula keeps under half what GPT-2's eager code keeps
    assert abs(e["memory_growth_calibrated"]) < 0.01  # fitted to the same linear points: it cannot tell
    assert "uncalibrated -5" in d["summary"]
