"""Inputs a read-only sweep of recommend, validate, simulate and noise found mishandled (2026-12-06): each refused
with the rule and the fix, or answered with a note, not silently."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from microbatch.choose.memory_fit import MemoryFit, max_fitting_micro_batch
from microbatch.cli import main
from microbatch.run.noise import b_simple
from microbatch.show.answers import render_noise

RECORDED = Path(__file__).resolve().parents[2] / "bench" / "results" / "h200-2026-11-30" / "ours_gpt2.json"


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    rc = main(list(args))
    out = capsys.readouterr()
    return rc, out.out, out.err


def _csv(tmp_path: Path, name: str, text: str) -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_a_micro_batch_measured_with_and_without_checkpointing_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two curves in one file: the table showed one row, the choice the other ('false' and 'False' were two)."""
    f = _csv(
        tmp_path,
        "ck.csv",
        "micro_batch,throughput,checkpointing\n1,100,false\n2,300,true\n2,120,False\n4,150,false\n",
    )
    rc, _, err = _run(capsys, "recommend", "-m", f)
    assert rc == 2 and "micro_batch 2 appears 2 times (lines 3, 4) (with checkpointing on and off" in err


def test_a_knee_measured_with_checkpointing_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """tune --checkpointing auto: b_m 8 ran out of memory without, then ran with it; the choice says to run it so."""
    f = _csv(tmp_path, "auto.csv", "micro_batch,throughput,oom,checkpointing\n1,100,false,false\n2,150,false,false\n"
             "4,150,false,false\n8,,true,false\n8,200,false,true\n")  # fmt: skip
    rc, out, _ = _run(capsys, "recommend", "-m", f, "--json")
    d = json.loads(out)
    assert rc == 0 and d["micro_batch"] == 8
    assert any("the knee and the fastest that fits, b_m = 8, were measured with activation checkpointing on" in n
               for n in d["notes"])  # fmt: skip


def test_a_point_without_a_measured_peak_is_judged_by_the_memory_fit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f = _csv(
        tmp_path,
        "part.csv",
        "micro_batch,throughput,peak_memory_bytes\n1,100,1e9\n2,180,2e9\n4,300,\n8,340,\n",
    )
    rc, out, _ = _run(capsys, "recommend", "-m", f, "--memory-budget", "2.5GB", "--json")
    d = json.loads(out)
    assert rc == 0 and d["max_fitting_micro_batch"] == 2 and d["micro_batch"] == 2  # 4 and 8: over by the fit
    assert d["fastest_fitting"]["micro_batch"] == 2


def test_sizes_past_any_device_are_refused_and_the_fit_stays_finite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f = _csv(
        tmp_path, "flat.csv", "micro_batch,throughput,peak_memory_bytes\n1,100,1000\n2,150,1000\n4,170,1000\n"
    )
    rc, _, err = _run(capsys, "recommend", "-m", f, "--memory-budget", "1e300")
    assert rc == 2 and "past any device's memory" in err
    big = _csv(tmp_path, "big.csv", "micro_batch,throughput,peak_memory_bytes\n1,100,1e300\n2,150,1.7e308\n")
    rc, _, err = _run(capsys, "recommend", "-m", big)
    assert rc == 2 and "peak_memory_bytes 1e+300 must be from 0 to 1 EiB" in err
    fit = MemoryFit(intercept_bytes=0.0, slope_bytes_per_sample=1e-300, fitted_on=(1, 2))
    assert max_fitting_micro_batch(fit, 1e300) is None  # past float's range: nothing to say, no OverflowError


def test_a_headroom_without_a_budget_is_said(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = _csv(tmp_path, "c.csv", "micro_batch,throughput\n1,100\n2,150\n")
    rc, _, err = _run(capsys, "recommend", "-m", f, "--memory-headroom", "0.5")
    assert rc == 0 and "--memory-headroom had nothing to act on" in err


def test_a_negative_noise_estimate_is_not_a_suggestion() -> None:
    """tr(Σ) and |G|² are unbiased differences that can fall below zero: no batch is suggested from either."""
    assert math.isinf(b_simple(trace_sigma=-695.9, g_sq=4.4)) and math.isinf(
        b_simple(trace_sigma=10.0, g_sq=0.0)
    )
    assert b_simple(trace_sigma=10.0, g_sq=2.0) == 5.0
    r: dict[str, Any] = {"model": "tiny", "seq": 64, "global_batch": 2, "micro_batch": 1, "steps": 12, "g_sq": 4.4,
                         "trace_sigma": -695.9, "b_simple_tokens": math.inf, "b_simple_sequences": math.inf,
                         "tokens_per_sequence": 64}  # fmt: skip
    text = render_noise(r)
    assert "tr(Σ) not resolved" in text and "suggestion" not in text


def _recorded(tmp_path: Path, edit: Any) -> str:
    d = json.loads(RECORDED.read_text())
    edit(d["points"])
    p = tmp_path / "r.json"
    p.write_text(json.dumps(d))
    return str(p)


def test_validate_names_the_points_it_leaves_out_and_the_figure_missing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def drop_micro_step(points: list[dict[str, Any]]) -> None:
        for pt in points:
            if pt["micro_batch"] in (8, 16):
                pt.pop("micro_step_s")

    rc, out, _ = _run(capsys, "validate", "--calibration", _recorded(tmp_path, drop_micro_step), "--json")
    assert rc == 0
    assert any(
        "b_m 8, 16 give no micro_step_s (they give step_time_s" in w for w in json.loads(out)["warnings"]
    )

    def no_allocated(points: list[dict[str, Any]]) -> None:
        for pt in points:
            pt["peak_allocated_bytes"] = None

    rc, _, err = _run(
        capsys, "validate", "--calibration", _recorded(tmp_path, no_allocated), "--memory", "allocated"
    )
    assert (
        rc == 2
        and "none of its 5 measured points gives peak_allocated_bytes" in err
        and "--memory peak" in err
    )


def test_validate_says_which_flags_it_did_not_take(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run(capsys, "validate", "--calibration", str(RECORDED), "--model", "gpt2", "--seq", "512",
                      "--cpu-peak-gflops", "50", "--json")  # fmt: skip
    warns = json.loads(out)["warnings"]
    assert rc == 0 and any(
        "--seq 512 not taken: the file says its points were measured at s = 1024" in w for w in warns
    )
    assert any("--cpu-peak-gflops not used: the points were measured on a GPU" in w for w in warns)


def test_simulate_says_what_explicit_stage_times_replace(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run(capsys, "simulate", "-p", "4", "-m", "8", "-s", "1f1b", "--forward-time", "3",
                      "--stage-times", "1:2,1:2,1:2,1:2", "--json")  # fmt: skip
    notes = json.loads(out)["notes"]
    assert rc == 0 and any(
        "--stage-times gives every entry its own times: --forward-time" in n for n in notes
    )
    rc, out, _ = _run(
        capsys, "simulate", "-p", "4", "-m", "8", "-s", "1f1b", "--stage-times", "1:2:3,1,1,1", "--json"
    )
    assert rc == 0 and any("an F:I:W entry's I + W is used as its B" in n for n in json.loads(out)["notes"])


def test_unmeasured_peaks_follow_the_measured_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A b_m without a measured peak is kept where the measured rule would keep it (the same point measured at the
    fit's value) and dropped above a smaller b_m measured over the budget, whatever the fit's slope."""
    head = "micro_batch,throughput,peak_memory_bytes\n1,10,10e9\n2,18,20e9\n4,30,40e9\n"
    unmeasured = _csv(tmp_path, "a.csv", head + "8,40,\n")
    measured = _csv(tmp_path, "b.csv", head + "8,40,80e9\n")
    for f in (unmeasured, measured):
        rc, out, _ = _run(capsys, "recommend", "-m", f, "--memory-budget", "85e9", "--json")
        assert rc == 0 and json.loads(out)["micro_batch"] == 8
    falling = _csv(
        tmp_path,
        "c.csv",
        "micro_batch,throughput,peak_memory_bytes\n1,10,10e9\n2,11,90e9\n4,12,88e9\n8,40,\n",
    )
    rc, out, _ = _run(capsys, "recommend", "-m", falling, "--memory-budget", "85e9", "--json")
    assert rc == 0 and json.loads(out)["micro_batch"] == 1  # 8 is above 2 and 4, measured over
    both = _csv(tmp_path, "d.csv", "micro_batch,throughput,oom\n1,10,false\n2,,true\n2,18,false\n")
    rc, _, err = _run(capsys, "recommend", "-m", both)
    assert rc == 2 and "micro_batch 2 both ran out of memory and ran" in err


def test_one_cpu_figure_given_replaces_its_recorded_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A file recording this CPU's peak and bandwidth: a peak given replaces the recorded peak (it was ignored)."""
    d = json.loads(RECORDED.read_text())
    d.update(device="cpu", device_name="Some CPU", accelerator={"name": "cpu", "peak_flops": 1e15,
                                                              "memory_bandwidth_bytes_per_s": 5e12})  # fmt: skip
    f = tmp_path / "cpu.json"
    f.write_text(json.dumps(d))
    _, _, err = _run(capsys, "validate", "--calibration", str(f), "--cpu-peak-gflops", "50")
    assert "at 50 GFLOP/s and 5e+03 GB/s" in err  # the given peak, the recorded bandwidth


def test_the_json_says_the_unit_and_the_reference_used(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, _ = _run(capsys, "simulate", "-p", "2", "-m", "4", "-s", "1f1b", "--time-unit", "ms", "--json")
    assert rc == 0 and json.loads(out)["time_unit"] == "ms"
    f = _csv(tmp_path, "g.csv", "micro_batch,throughput\n1,100\n2,150\n4,170\n8,175\n")
    rc, out, _ = _run(capsys, "recommend", "-m", f, "--rule", "gain", "--reference", "bound", "--json")
    assert rc == 0 and json.loads(out)["reference"] == "measured"  # rule gain reads no reference line
