"""The typed pipeline report: one JSON form, read back from this version's files and earlier ones."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from microbatch.run.pipeline.report import PipelineReport, RankStats, StepIntervals
from microbatch.show.pipeline_report import render

OLD = pathlib.Path(__file__).parents[2] / "data" / "pipeline_result_v0_1f1b.json"
"""``microbatch pipeline --model tiny --stages 2 --microbatches 4 --schedule 1f1b --steps 3 --json``
written before the report was typed (issue 31): nested dicts, keys read by string."""


def _old() -> dict:
    return json.loads(OLD.read_text())


def test_an_old_result_file_reads_into_the_typed_report_and_writes_back_the_same_keys_and_values():
    old = _old()
    rep = PipelineReport.from_json(old)
    assert isinstance(rep.measured.stage_stats[1], RankStats)
    assert rep.measured.stage_stats[1].busy_s == old["measured"]["stage_stats"][1]["busy_s"]
    assert rep.memory[0].predicted_bytes == old["memory"][0]["predicted_bytes"]
    assert rep.before_run is not None and rep.before_run.runtime["loaded"] is True
    assert isinstance(rep.step_intervals[0], StepIntervals)
    assert rep.predicted.with_comm.comm_time_s == old["predicted"]["with_comm"]["comm_time_s"]
    back = rep.to_json()
    assert back == {k: v for k, v in old.items() if k not in ("command", "version")}
    assert list(back) == [k for k in old if k not in ("command", "version")]  # the same order


def test_the_json_form_keeps_outputs_and_interruption_and_leaves_out_what_is_absent():
    from dataclasses import replace

    rep = PipelineReport.from_json(_old())
    plain = replace(rep, before_run=None).to_json()
    # before_run stays, null: one schema with or without a prediction
    assert plain["before_run"] is None and "interrupted" not in plain and "steps_asked" not in plain
    assert "stop_reason" not in plain
    cut = replace(rep, interrupted=True, steps_asked=9, outputs={"trace": "t.json"}).to_json()
    assert (cut["interrupted"], cut["steps_asked"], cut["trace"]) == (True, 9, "t.json")
    again = PipelineReport.from_json(cut)
    assert (again.interrupted, again.steps_asked, again.outputs) == (True, 9, {"trace": "t.json"})


def test_render_reads_the_typed_report():
    rep = PipelineReport.from_json(_old())
    text = render(rep, 80)
    m = rep.measured
    assert f"{m.bubble_fraction:.1%}" in text and f"{rep.before_run.bubble_fraction:.1%}" in text
    assert "pipeline 1f1b: p = 2 ranks, m = 4 micro-batches" in text
    assert text.count("\n  ") >= 2 * rep.stages  # a row per rank in both tables


@pytest.mark.timeout(120)
def test_microbatch_report_still_reads_an_old_pipeline_result(tmp_path):
    out = tmp_path / "r.html"
    r = subprocess.run(
        [sys.executable, "-m", "microbatch", "report", str(OLD), "--out", str(out), "--no-png", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["sections"] == ["pipeline"]
    html = out.read_text()
    assert f"{_old()['measured']['bubble_fraction']:.1%}" in html
