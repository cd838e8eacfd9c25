"""Recorded curves as people and other tools write them (a review of 2026-12-07): the knee's indistinguishable set,
the bound at any unit's scale, budgets given as floats or text, repeats and zeros in the public knee functions,
out-of-memory rows written other ways, lines named as an editor numbers them, and settings with nothing to act on."""

from __future__ import annotations

import json

import numpy as np
import pytest

from microbatch.choose.bound import throughput_bound
from microbatch.choose.config import ChoiceConfig
from microbatch.choose.curve import CurvePoint
from microbatch.choose.knee import find_knee, recommend
from microbatch.choose.rows import points_from_records
from microbatch.cli import main
from microbatch.errors import ConfigError

SATURATING = [(1, 1000), (2, 1900), (4, 3400), (8, 5000), (16, 5600)]


def pts(rows, se=None):
    return [CurvePoint(micro_batch=b, throughput=t, throughput_se=se) for b, t in rows]


def test_a_larger_point_that_surely_fails_the_line_is_not_indistinguishable():
    # the knee 8 could fail its line at 3% noise, so 16 (as fast) and 64 (surely past it) could be chosen; 32 runs
    # at 27% of the best and could never be the knee
    rows = [(1, 1000), (2, 1900), (4, 3400), (8, 4900), (16, 4800), (32, 1500), (64, 5600)]
    r = recommend(pts(rows, se=0.03))
    assert r.knee.micro_batch == 8
    assert r.indistinguishable == (8, 16, 64)


@pytest.mark.parametrize("scale", [1e-250, 1e-150, 1e150, 1e200])
def test_the_bound_is_the_same_fit_in_any_unit(scale):
    one = throughput_bound(pts(SATURATING))
    far = throughput_bound(pts([(b, t * scale) for b, t in SATURATING]))
    assert one is not None and far is not None
    assert far.relative_error == pytest.approx(
        one.relative_error, rel=1e-9
    )  # was 0 at 1e200, an overflow at 1e-250
    assert far.max_residual == pytest.approx(one.max_residual, rel=1e-9)
    assert far.throughput == pytest.approx(one.throughput * scale, rel=1e-9)
    assert far.slope == pytest.approx(one.slope / scale, rel=1e-9)
    assert far.intercept == pytest.approx(one.intercept / scale, rel=1e-9)
    assert recommend(pts([(b, t * scale) for b, t in SATURATING]), reference="bound").knee.micro_batch == 16


@pytest.mark.parametrize("budget", [1.2e10, np.float64(1.2e10), "12e9B", 12_000_000_000])
def test_a_budget_may_be_a_whole_float_or_a_size(budget):
    assert ChoiceConfig(memory_budget_bytes=budget).memory_budget_bytes == 12_000_000_000
    assert ChoiceConfig(memory_budget_bytes="12GiB").memory_budget_bytes == 12 * 2**30


def test_find_knee_refuses_a_repeat_whatever_its_order_and_a_curve_of_zeros():
    a, b = CurvePoint(micro_batch=8, throughput=5000), CurvePoint(micro_batch=8, throughput=1000)
    top = CurvePoint(micro_batch=16, throughput=5600)
    for order in ([a, b, top], [b, a, top]):
        with pytest.raises(ConfigError, match=r"micro_batch 8 is measured twice \(points 1 and 2\)"):
            find_knee(order)
    for rule in ("fraction", "gain"):
        with pytest.raises(ConfigError, match=r"every measured throughput is 0 \(b_m 8, 16\)"):
            find_knee(pts([(8, 0), (16, 0)]), rule=rule)


@pytest.mark.parametrize("cell", ["oom", "OOM", "NaN", "inf", "out of memory", 0, "0.0"])
def test_a_run_that_did_not_happen_written_in_the_throughput_is_refused_with_the_oom_column(cell):
    rows = [{"micro_batch": 8, "throughput": 5000}, {"micro_batch": 16, "throughput": cell}]
    with pytest.raises(ConfigError, match=r"f: row 2: throughput .* written with oom true"):
        points_from_records(rows, source="f")
    with pytest.raises(ConfigError, match=r"f: line 9: throughput"):  # a CSV's rows named by their lines
        points_from_records(rows, source="f", lines=[5, 9])
    with pytest.raises(ConfigError, match=r"row 2 has no 'throughput'; .* written with oom true"):
        points_from_records([rows[0], {"micro_batch": 16}], source="f")
    with pytest.raises(ConfigError, match=r"'abc' is not a number$"):  # any other text keeps its own message
        points_from_records([{"micro_batch": 8, "throughput": "abc"}], source="f")


def run(capsys, *args):
    rc = main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


def test_recommend_names_csv_lines_and_notes_settings_with_nothing_to_act_on(tmp_path, capsys):
    csv = tmp_path / "c.csv"
    csv.write_text("micro_batch,throughput\n\n4,100\n8,abc\n")  # a blank line: the bad row is on line 4
    rc, _, err = run(capsys, "recommend", "-m", str(csv))
    assert rc == 2 and "c.csv: line 4: throughput 'abc' is not a number" in err

    gib = tmp_path / "gib.csv"  # the peaks in GiB under the bytes column
    gib.write_text("micro_batch,throughput,peak_memory_bytes\n1,100,1.5\n2,180,2.5\n4,200,4.5\n")
    rc, out, err = run(capsys, "recommend", "-m", str(gib), "--memory-budget", "6GiB", "--json")
    # refused since 2026-12-07 (every point would pass the budget: a knee chosen as if memory were free)
    assert rc == 2 and "every peak_memory_bytes is under 1 MiB (the largest 4)" in json.loads(out)["error"]
    rc, out, err = run(
        capsys, "recommend", "-m", str(gib), "--memory-budget", "6", "--json"
    )  # a budget of its scale
    notes = json.loads(out)["notes"]
    assert rc == 0 and any("every peak_memory_bytes is under 1 MiB (the largest 4 B)" in n for n in notes)
    rc, out, _ = run(capsys, "recommend", "-m", str(gib), "--json")  # no budget: the peaks decide nothing
    assert rc == 0 and not any("under 1 MiB" in n for n in json.loads(out).get("notes", []))

    rc, out, err = run(
        capsys, "recommend", "-m", str(gib), "--rule", "gain", "--reference", "bound", "--json"
    )
    assert rc == 0 and any("--reference bound had nothing to act on" in n for n in json.loads(out)["notes"])

    js = tmp_path / "j.json"
    js.write_text(json.dumps([{"micro_batch": 1, "throughput": 5, "step_time_ms": 1, "run_id": "a"}]))
    rc, _, err = run(capsys, "recommend", "-m", str(js))
    assert rc == 0 and "key 'step_time_ms' is not read (did you mean 'step_time_s'?)" in err
    assert "run_id" not in err  # a JSON list may carry anything else: only a near miss is named
    # a peak under another name is refused since 2026-12-08: dropped, the knee was chosen as if memory were free
    js.write_text(json.dumps([{"micro_batch": 1, "throughput": 5, "peak_memory_gib": 1}]))
    rc, _, err = run(capsys, "recommend", "-m", str(js))
    assert rc == 2 and "key 'peak_memory_gib' is not read, and there is no peak_memory_bytes" in err


def test_a_rate_that_vanishes_beside_the_largest_gives_no_bound_and_no_error():
    rows = [(1, 1e-320), (2, 1e5), (4, 2e5), (8, 3e5), (16, 3.5e5)]  # 1e-320 / 3.5e5 underflows to 0
    assert throughput_bound(pts(rows)) is None
    assert recommend(pts(rows), reference="bound").knee.micro_batch == 16


def test_limits_that_leave_only_zero_rates_say_so():
    points = [
        CurvePoint(micro_batch=1, throughput=0.0, peak_memory_bytes=10),
        CurvePoint(micro_batch=2, throughput=50.0, peak_memory_bytes=100),
    ]
    with pytest.raises(
        ConfigError, match=r"every b_m that meets the limits \(b_m 1\) measured a throughput of 0"
    ):
        recommend(points, memory_budget_bytes=50)


def test_a_list_of_tunes_own_points_gets_no_did_you_mean(tmp_path, capsys):
    row = {"micro_batch": 1, "throughput": 5.0, "peak_memory_bytes": 10, "micro_step_s": 0.1,
           "peak_allocated_bytes": 9, "throughput_se": 0.01}  # fmt: skip
    f = tmp_path / "points.json"
    f.write_text(json.dumps([row, {**row, "micro_batch": 2, "throughput": 9.0}]))
    rc, _, err = run(capsys, "recommend", "-m", str(f))
    assert rc == 0 and "did you mean" not in err
