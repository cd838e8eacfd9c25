"""Calibration files (a helper's review, 2026-12-07). A tune result from a GPU not in the accelerator table (a V100,
4x slower in the file) was fitted as if measured on the planned H100: the step 3.6x slower, and the note said the file
named no GPU. The data: a forged tune result (the planner's own predictions scaled 4x, device_name a V100)."""

from __future__ import annotations

import json
from pathlib import Path

from microbatch.cli import main

DATA = Path(__file__).resolve().parents[1] / "data" / "tune_unknown_gpu.json"
PLAN = ["plan", "--model", "gpt2", "--gpu", "h100-sxm", "-B", "64", "-d", "8", "--micro-batch", "8", "--zero", "1",
        "--recompute", "none", "--json"]  # fmt: skip


def test_a_gpu_outside_the_table_is_not_taken_for_the_planned_one(capsys):
    assert json.loads(DATA.read_text())["device_name"].startswith("Tesla V100")
    assert main(PLAN) == 0
    bare = json.loads(capsys.readouterr().out)["recommended"]["step_time_s"]
    assert main([*PLAN, "--calibration", str(DATA)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["recommended"]["step_time_s"] == bare  # its 4x slower times not fitted against the H100
    said = " ".join(out.get("calibration_notes", []))
    assert "measured on Tesla V100-SXM2-16GB, which is not in the accelerator table" in said
    assert "does not name its GPU" not in said


def test_a_kernel_file_of_another_model_says_it_extrapolates(capsys):
    """bench-gpu times gpt2's layer GEMMs by default on a GPU; applied to a llama-2-7b plan at s = 4096 it said
    nothing (a forged H100 record, the test suite's synthetic rates)."""
    bench = DATA.parent / "microbench_forged_h100_gpt2.json"
    args = ["plan", "--model", "llama-2-7b", "--gpu", "h100-sxm", "-B", "64", "-d", "8", "--micro-batch", "4",
            "--zero", "1", "--recompute", "full", "--calibration", str(bench), "--json"]  # fmt: skip
    assert main(args) == 0
    said = " ".join(json.loads(capsys.readouterr().out).get("calibration_notes", []))
    assert "timed the layer GEMMs of model gpt2 at s = 1024, the plan is llama-2-7b at s = 4096" in said


def test_no_measured_b_m_is_predicted_below_its_peak(capsys):
    """A least-squares line through peaks with one point 3 GB high (b_m 1) predicted b_m 8 at 9.37 GiB where it took
    9.81: the line is raised to every measured point, its slope kept, and the miss said."""
    bumped = DATA.parent / "tune_bumped_peak.json"
    peaks = {p["micro_batch"]: p["peak_memory_bytes"] for p in json.loads(bumped.read_text())["points"]}
    for b in (1, 8):
        assert (
            main(
                ["memory", "--model", "gpt2", "--micro-batch", str(b), "--calibration", str(bumped), "--json"]
            )
            == 0
        )
        out = json.loads(capsys.readouterr().out)
        assert out["peak_memory_bytes"] >= peaks[b] * (1 - 1e-9)
    assert any("missed b_m 1's peak" in n for n in out["calibration_notes"])
