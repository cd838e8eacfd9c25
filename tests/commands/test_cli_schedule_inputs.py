"""`bubble` and `simulate` on bad or extreme input: one line and exit 2, or a note, never a traceback."""

from __future__ import annotations

import json
import math

import pytest
from _cli import run, run_json

from microbatch.cli import main
from microbatch.units import format_number

SIM_1F1B = ["simulate", "-p", "4", "-m", "8", "-s", "1f1b"]


def assert_refused(args, capsys, pattern):
    code, out, err = run(args, capsys)
    assert code == 2, (out, err)
    assert len(err.strip().splitlines()) == 1, err
    assert pattern in err, err
    return err


# --- large p: the closed form, no p-row diagram ---------------------------------------------


def test_bubble_of_many_stages_is_the_closed_form_without_a_diagram(capsys):
    p, m = 2000, 4
    d = run_json(["bubble", "-p", str(p), "-m", str(m)], capsys)
    assert d["bubble_fraction"] == pytest.approx((p - 1) / (m + p - 1))
    assert d["simulated_bubble_fraction"] is None  # not simulated: the diagram is not drawn
    assert d["peak_in_flight"] == [m] * p  # GPipe's in-flight rule, not a simulation
    assert any("over the diagram limit of 1,000 rows" in n for n in d["notes"])
    code, out, _ = run(["bubble", "-p", str(p), "-m", str(m)], capsys)
    assert code == 0 and "rank 0 |" not in out and "over the diagram limit" in out


def test_simulate_of_many_stages_prints_the_numbers_without_a_diagram(capsys):
    code, out, _ = run(["simulate", "-p", "1500", "-m", "1", "-s", "gpipe"], capsys)
    assert code == 0
    assert "rank 0 |" not in out and "p = 1,500 ranks is over the diagram limit" in out
    assert "makespan         4500" in out  # (m + p − 1)(T_F + T_B) with T_B = 2


# --- overflowing times ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "x,text", [(math.inf, "inf"), (-math.inf, "-inf"), (math.nan, "nan"), (1e300, "1e+300")]
)
def test_format_number_of_huge_and_non_finite_numbers(x, text):
    assert format_number(x) == text


def test_format_number_keeps_its_short_forms():
    assert [format_number(x) for x in (3.0, 121.0, 2.5, 1 / 3)] == ["3", "121", "2.5", "0.3333"]


@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_simulate_refuses_times_whose_makespan_overflows(capsys, json_flag):
    args = [
        *SIM_1F1B,
        "--comm-time",
        "1e308",
        "--no-diagram",
        *json_flag,
    ]
    code, out, err = run(args, capsys)
    assert code == 2
    assert "the op times given overflow: the makespan is inf" in err and "below ~1e300" in err
    if json_flag:
        assert json.loads(out)["kind"] == "bad_input"


def test_forward_time_whose_default_backward_overflows_names_the_flag(capsys):
    err = assert_refused(
        ["simulate", "-p", "4", "-m", "8", "-s", "1f1b", "--forward-time", "1e308"],
        capsys,
        "--forward-time 1e+308 makes the default backward time 2 × --forward-time = inf",
    )
    assert "backward_time" not in err and "--backward-time" in err


# --- --width and --stage-times ---------------------------------------------------------------


@pytest.mark.parametrize("width", ["0", "-5", "9"])
@pytest.mark.parametrize(
    "command", [["bubble", "-p", "4", "-m", "4"], ["simulate", "-p", "4", "-m", "4", "-s", "1f1b"]]
)
def test_width_below_the_diagram_minimum_is_refused(capsys, command, width):
    err = assert_refused(
        [*command, "--width", width],
        capsys,
        f"'--width': {width} columns is below the diagram's minimum of 10; give --width 10 or more",
    )
    assert "Traceback" not in err and err.startswith("error: ")


def test_width_at_the_minimum_is_accepted(capsys):
    code, out, _ = run(["bubble", "-p", "2", "-m", "2", "--width", "10"], capsys)
    assert code == 0 and "rank 1 |" in out


@pytest.mark.parametrize("text", ["", " "])
def test_empty_stage_times_are_refused(capsys, text):
    err = assert_refused(
        ["simulate", "-p", "4", "-m", "8", "-s", "1f1b", "--stage-times", text],
        capsys,
        "--stage-times is empty",
    )
    assert "Traceback" not in err and err.startswith("error: ")


@pytest.mark.parametrize(
    "schedule,text,message",
    [
        (
            "1f1b",
            "1,1,-1,1",
            "--stage-times entry 2 is '-1' (entries count from 0, one per virtual stage; 4 given): "
            "the factor -1 must be a finite number > 0",
        ),
        ("1f1b", "1,1,nan,1", "--stage-times entry 2 is 'nan'"),
        ("1f1b", "1:2,1:0,1:2,1:2", "--stage-times entry 1 is '1:0'"),
        ("zb-h1", "1:1:1,1:1:1,1:1:-1,1:1:1", "the weight-gradient time W -1 must be a finite number >= 0"),
    ],
)
def test_bad_stage_times_name_the_flag_and_the_entry(capsys, schedule, text, message):
    err = assert_refused(
        ["simulate", "-p", "4", "-m", "8", "-s", schedule, "--stage-times", text], capsys, message
    )
    assert "forward_time" not in err and "weight_time" not in err


def test_stage_times_that_overflow_name_the_flag(capsys):
    err = assert_refused(
        [
            *SIM_1F1B,
            "--stage-times",
            "1,1,1e306,1",
            "--forward-time",
            "1e5",
        ],
        capsys,
        "--stage-times entry 2: the factor 1e+306 × the forward time 100000 = inf",
    )
    assert "Traceback" not in err and err.startswith("error: ")


# --- options that a schedule does not use -----------------------------------------------------


def test_split_times_on_a_full_backward_schedule_are_used_as_the_backward_and_noted(capsys):
    d = run_json(
        ["simulate", "-p", "4", "-m", "8", "-s", "1f1b", "--input-time", "4", "--weight-time", "6"], capsys
    )
    full = run_json(["simulate", "-p", "4", "-m", "8", "-s", "1f1b", "--backward-time", "10"], capsys)
    assert d["makespan"] == full["makespan"] == pytest.approx((8 + 4 - 1) * 11)
    assert any(
        "1f1b runs a full backward: --input-time + --weight-time = 10 is used as T_B" in n for n in d["notes"]
    )
    assert any("zero-bubble and DualPipeV" in n for n in d["notes"])
    assert full["notes"] == []


def test_intervals_without_json_is_noted(capsys):
    code, out, _ = run(
        ["simulate", "-p", "2", "-m", "2", "-s", "1f1b", "--intervals", "--no-diagram"], capsys
    )
    assert code == 0 and "note: --intervals adds every op's (start, end) to the --json output only" in out
    d = run_json(["simulate", "-p", "2", "-m", "2", "-s", "1f1b", "--intervals"], capsys)
    assert "intervals" in d and not any("--intervals" in n for n in d["notes"])


def test_pipeline_width_and_large_charts_are_refused_before_any_work(capsys, tmp_path):
    assert main(["pipeline", "--width", "0"]) == 2  # the same option as bubble's and simulate's
    assert "below the diagram's minimum of 10" in capsys.readouterr().err
    png = tmp_path / "t.png"
    assert main(["simulate", "-p", "2000", "-m", "4", "-s", "gpipe", "--png", str(png)]) == 2
    err = capsys.readouterr().err
    assert "over the chart limit of 1,000" in err and not png.exists()
