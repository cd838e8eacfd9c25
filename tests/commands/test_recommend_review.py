"""recommend's answers as a review of recorded curves found them misstated (2026-12-05): a negative step time
passed a latency limit, the bound's line was stated against the bound where the best measured was the
reference, 'reaches the line' was claimed where none did, and 'predicted to fit: 0' sat beside a larger knee."""

from __future__ import annotations

import json

from _cli import run_json

from microbatch.cli import main

# a tune of a 2-layer Llama-style config (16 heads of 32 on 64) on this CPU, as recorded (tune --json points)
HD = [
    {"micro_batch": 1, "throughput": 8556.381944590958, "step_time_s": 0.007479796999999344, "peak_memory_bytes": 379486208},
    {"micro_batch": 2, "throughput": 9516.776031523434, "step_time_s": 0.013449933000000414, "peak_memory_bytes": 381267968},
    {"micro_batch": 4, "throughput": 9765.017070470549, "step_time_s": 0.026216031999999778, "peak_memory_bytes": 384856064},
    {"micro_batch": 8, "throughput": 9292.788654434322, "step_time_s": 0.055096486000000056, "peak_memory_bytes": 391106560},
]  # fmt: skip
SEED = [{"micro_batch": 1, "throughput": 1000}, {"micro_batch": 4, "throughput": 3200},
        {"micro_batch": 8, "throughput": 5000}, {"micro_batch": 16, "throughput": 5600}]  # fmt: skip


def _text(tmp_path, capsys, points, *args) -> str:
    path = tmp_path / "m.json"
    path.write_text(json.dumps(points))
    capsys.readouterr()
    assert main(["recommend", "-m", str(path), *args]) == 0
    return capsys.readouterr().out


def test_a_negative_step_time_is_refused(tmp_path, capsys):
    path = tmp_path / "neg.json"
    path.write_text(
        json.dumps(
            [{"micro_batch": 1, "throughput": 10, "step_time_s": -1}, {"micro_batch": 2, "throughput": 20}]
        )
    )
    assert main(["recommend", "-m", str(path), "--max-latency-ms", "1"]) == 2
    assert "row 1: step_time_s -1.0 must be > 0" in capsys.readouterr().err


def test_the_line_is_stated_against_the_reference_the_rule_used(tmp_path, capsys):
    d = run_json(["recommend", "-m", str(_write(tmp_path, HD)), "--reference", "bound"], capsys)
    bound, ref = d["throughput_bound"]["throughput"], d["reference_throughput"]
    assert ref > bound  # the best measured beat the bound: it is the reference
    text = _text(tmp_path, capsys, HD, "--reference", "bound")
    line = (1 - d["tolerance"]) * (1 + d["bound_margin"])
    assert f"the best measured, {ref:,.1f}" in text and f"{100 * line:.1f}% of the reference" in text


def test_no_claim_that_the_knee_reaches_a_line_none_reached(tmp_path, capsys):
    d = run_json(["recommend", "-m", str(_write(tmp_path, SEED)), "--reference", "bound"], capsys)
    assert d["fraction_of_reference"] < (1 - d["tolerance"]) * (1 + d["bound_margin"])
    text = _text(tmp_path, capsys, SEED, "--reference", "bound")
    assert "none reaches the line, so the knee is the fastest measured" in text
    assert "that reaches the line" not in text


def test_predicted_to_fit_none_beside_a_measured_knee(tmp_path, capsys):
    # a budget the fitted line (with its 10% headroom) puts under b_m 1, which the points measured inside it
    text = _text(tmp_path, capsys, HD, "--memory-budget", "400MiB")
    assert "with 10% headroom: none (the knee, b_m = " in text and "within the budget" in text


def _write(tmp_path, points):
    path = tmp_path / "w.json"
    path.write_text(json.dumps(points))
    return path


def test_a_budget_with_no_peaks_to_act_on_says_so(tmp_path, capsys):
    path = _write(tmp_path, SEED)  # throughput only
    d = run_json(["recommend", "-m", str(path), "--memory-budget", "1GiB"], capsys)
    assert any("--memory-budget had nothing to act on" in n for n in d["notes"])
    capsys.readouterr()
    assert main(["recommend", "-m", str(path), "--memory-budget", "1GiB"]) == 0
    assert "note: --memory-budget had nothing to act on" in capsys.readouterr().err
    assert "notes" not in run_json(
        ["recommend", "-m", str(_write(tmp_path, HD)), "--memory-budget", "1GiB"], capsys
    )
