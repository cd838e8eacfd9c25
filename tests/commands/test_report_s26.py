"""The HTML report says what the text says (a session's read-back review): a plan's rebalanced split, its notes and
calibration notes; a generic result's None as a dash, a memory breakdown in binary units, nested lists as JSON; the
validate table's figures as the text writes them; and recommend reads a tune result with no envelope as a tune's."""

from __future__ import annotations

import json
from pathlib import Path

from _cli import run, run_json

from microbatch.show.html_sections import _cell


def _report(tmp_path: Path, result: dict, capsys) -> str:
    f = tmp_path / "r.json"
    f.write_text(json.dumps(result))
    out = tmp_path / "r.html"
    code, _, err = run(["report", str(f), "--out", str(out), "--no-png"], capsys)
    assert code == 0, err
    return out.read_text()


def test_a_plans_rebalance_reaches_the_report(tmp_path, capsys):
    d = run_json(["plan", "--model", "llama-3-8b", "--gpu", "h100-sxm", "-B", "1024", "-d", "16", "-p", "4", "--seq",
                  "8192"], capsys)  # fmt: skip
    split = ",".join(map(str, d["rebalance"]["layers_per_stage"]))
    html = _report(tmp_path, d, capsys)
    assert f"{split} layers per stage" in html and "idles 20.9%" in html


def test_generic_cells_say_nothing_as_a_dash_bytes_in_units_and_nesting_as_json():
    assert _cell("accelerator", None) == "—"
    assert "GiB" in _cell("memory", {"weights": 1.685e9, "gradients": 2**31})
    assert _cell("module_fqns_per_model_part", [["tok_embeddings", "layers.0"], ["output"]]) == (
        '[["tok_embeddings", "layers.0"], ["output"]]'
    )


def test_recommend_reads_a_tune_result_with_no_envelope(tmp_path, capsys):
    points = [{"micro_batch": b, "throughput": r, "peak_memory_bytes": 1e8 * b, "step_time_s": b / r}
              for b, r in ((1, 100.0), (2, 150.0), (4, 190.0), (8, 200.0), (16, 400.0))]  # fmt: skip
    (tmp_path / "t.json").write_text(json.dumps({"points": points, "micro_batch": 4, "global_batch": 8}))
    d = run_json(["recommend", "--measurements", str(tmp_path / "t.json")], capsys)
    assert d["micro_batch"] == 4 and any(
        "--global-batch 8" in n for n in d["notes"]
    )  # the Python API's to_dict


def test_a_tunes_left_out_points_reach_the_report(tmp_path, capsys):
    from microbatch.show.html_sections import _knee_answer

    t = {"micro_batch": 4, "throughput": 10.0, "fastest_fitting": {"micro_batch": 4},
         "left_out": [{"micro_batch": 8, "why": "step time over 0.36 ms"}, {"micro_batch": 16, "why": "step time over 0.36 ms"}]}  # fmt: skip
    assert "Left out: b_m 8, 16 (step time over 0.36 ms)." in _knee_answer(t, "tokens/s")
    assert "Left out" not in _knee_answer({**t, "left_out": []}, "tokens/s")
