"""Results read back, as a sweep chained them: a byte-order mark is no error, JSON's own wording is not doubled, a
validate result is not points to choose from, a decoding tune is not exported as training and an interrupted one
says so, a multi-GPU plan's comparison reaches the report, the figures folder's checks, a CSV column not read."""

from __future__ import annotations

import json

import pytest
from _cli import run

from microbatch._json import load_json
from microbatch.errors import ConfigError
from microbatch.records import result_points
from microbatch.show.export import export_tune

TUNE = {
    "command": "tune", "version": "0", "mode": "train", "micro_batch": 4, "grad_accum": 4, "global_batch": 16,
    "data_parallel": 1, "precision": "fp32", "model": "tiny", "device": "cpu",
    "points": [{"micro_batch": 4, "throughput": 10.0, "oom": False}],
}  # fmt: skip


def test_a_byte_order_mark_is_read_and_json_errors_are_worded_once(tmp_path):
    f = tmp_path / "r.json"
    f.write_bytes(b"\xef\xbb\xbf" + json.dumps(TUNE).encode())
    assert load_json(f)["micro_batch"] == 4
    f.write_text('{"a": "unterminated')
    with pytest.raises(ConfigError) as e:
        load_json(f)
    assert "starting at at" not in str(e.value) and "Unterminated string starting at line 1" in str(e.value)


def test_a_validate_result_is_not_points_to_choose_from():
    with pytest.raises(ConfigError, match=r"holds a validate result \(written by `microbatch validate`\)"):
        result_points(
            {"command": "validate", "version": "0", "points": [{"micro_batch": 1}]}, source="v.json"
        )
    assert result_points(TUNE, source="t.json") == TUNE["points"]


def test_a_decoding_tune_is_not_a_training_config_and_an_interrupted_one_says_so():
    with pytest.raises(ConfigError, match=r"measured in mode 'decode'"):
        export_tune({**TUNE, "mode": "decode"}, "deepspeed")
    done = export_tune(TUNE, "deepspeed")
    assert not any("interrupted" in n for n in done.notes)
    cut = export_tune({**TUNE, "interrupted": True, "stop_reason": "interrupted (Ctrl-C)"}, "deepspeed")
    assert any("the tune was interrupted (interrupted (Ctrl-C))" in n for n in cut.notes)
    assert cut.config["train_micro_batch_size_per_gpu"] == 4


def test_a_multi_gpu_plan_keeps_its_comparison_in_the_report(tmp_path, capsys):
    code, out, _ = run(["plan", "--model", "gpt2", "--gpu", "a100-80gb,h100-sxm", "-B", "64", "-d", "8", "--json"],
                       capsys)  # fmt: skip
    assert code == 0
    (tmp_path / "multi.json").write_text(out)
    html = tmp_path / "r.html"
    code, _, err = run(["report", str(tmp_path / "multi.json"), "--no-png", "--out", str(html)], capsys)
    assert code == 0, err
    text = html.read_text()
    assert "compared across accelerators" in text
    per_gpu = {p["gpu"]["name"]: p["recommended"]["tokens_per_s"] / 8 for p in json.loads(out)["plans"]}
    assert all(f"{v:,.0f}" in text for v in per_gpu.values())


def test_the_figures_folder_checks(tmp_path, capsys):
    (tmp_path / "t.json").write_text(json.dumps(TUNE))
    (tmp_path / "z-figures").write_text("x")
    code, _, err = run(["report", str(tmp_path / "t.json"), "--out", str(tmp_path / "z.html")], capsys)
    assert code == 2 and "which is a file, not a folder" in err
    (tmp_path / "y-figures").mkdir()
    (tmp_path / "y-figures" / "notes.txt").write_text("mine")  # not a PNG: no figure replaces it
    code, _, err = run(["report", str(tmp_path / "t.json"), "--out", str(tmp_path / "y.html")], capsys)
    assert code == 0, err
    assert (tmp_path / "y-figures" / "notes.txt").read_text() == "mine"


def test_a_csv_column_recommend_does_not_read_is_named(tmp_path, capsys):
    f = tmp_path / "typo.csv"
    f.write_text("micro_batch,throughput,step_time\n1,100,1000\n2,180,2000\n4,300,4000\n")
    code, _, err = run(["recommend", "-m", str(f)], capsys)
    assert code == 0 and "column 'step_time' is not read (did you mean 'step_time_s'?)" in err
    f.write_text("micro_batch,throughput,peak_memory\n1,100,1000\n2,180,2000\n4,300,4000\n")
    code, _, err = run(["recommend", "-m", str(f)], capsys)  # a peak under another name: refused, not dropped
    assert code == 2 and "column 'peak_memory' is not read, and there is no peak_memory_bytes" in err


def test_validate_seq_alone_keeps_the_files_model(capsys):
    """--seq names no model: the file's stands, and the note says --seq was not taken (it was refused as a model
    lacking --layers, --hidden, --heads and --vocab)."""
    from pathlib import Path

    f = Path(__file__).resolve().parents[2] / "bench" / "results" / "h200-2026-11-30" / "ours_gpt2.json"
    code, out, err = run(["validate", "--calibration", str(f), "--seq", "128"], capsys)
    assert code == 0, err
    assert "--seq 128 not taken: the file says its points were measured at s = 1024" in out + err
