"""Recorded curves as users write them (a helper's review, 2026-12-08): columns in another case or under another
name, notes that reach --json, a dense flat sweep, the reason no bound was fitted, a knee exactly on the line."""

from __future__ import annotations

import json

from test_recorded_curves_s32 import _csv as _file
from test_recorded_curves_s32 import run

from microbatch.choose.bound import bound_or_why
from microbatch.choose.curve import CurvePoint
from microbatch.choose.knee import flattened
from microbatch.choose.noise import indistinguishable

UPPER = (
    "micro_batch,throughput,Peak_Memory_Bytes,OOM\n1,1000,2000000000,0\n2,1900,2300000000,0\n4,3400,2900000000,0\n"
    "8,5000,4100000000,0\n16,5600,6500000000,0\n32,6000,9000000000,1\n"
)


def test_known_columns_in_another_case_are_read(tmp_path, capsys):
    upper = _file(tmp_path, "u.csv", UPPER)
    lower = _file(
        tmp_path, "l.csv", UPPER.splitlines()[0].lower() + "\n" + "\n".join(UPPER.splitlines()[1:]) + "\n"
    )
    answers = []
    for f in (upper, lower):
        rc, out, _ = run(capsys, "recommend", "-m", f, "--memory-budget", "5GiB", "--json")
        d = json.loads(out)
        answers.append((rc, d["micro_batch"], d["fastest_fitting"]["micro_batch"]))
    # 16 (6.5 GB) is over the budget and 32 ran out of memory: before, the upper-case header chose 16 and 32
    assert answers == [(0, 8, 8), (0, 8, 8)]
    rows = [{"micro_batch": 8, "throughput": 5000}, {"micro_batch": 16, "throughput": 5600},
            {"micro_batch": 32, "throughput": 7000, "OOM": True}]  # fmt: skip
    js = _file(tmp_path, "j.json", json.dumps(rows))
    rc, out, _ = run(capsys, "recommend", "-m", js, "--json")
    assert rc == 0 and json.loads(out)["fastest_fitting"]["micro_batch"] == 16  # 32 was no run


def test_a_peak_or_oom_under_another_name_is_refused(tmp_path, capsys):
    for header, word in (("peak_memory_gib", "peak_memory_bytes"), ("peak_mem_MiB", "peak_memory_bytes"),
                         ("out_of_memory", "oom"), ("is_oom", "oom")):  # fmt: skip
        f = _file(tmp_path, "g.csv", f"micro_batch,throughput,{header}\n1,100,1\n2,180,2\n")
        rc, _, err = run(capsys, "recommend", "-m", f)
        assert rc == 2 and f"column {header!r} is not read, and there is no {word}" in err, err
    both = _file(
        tmp_path, "b.csv", "micro_batch,throughput,peak_memory_bytes,peak_mem_reserved\n1,10,100000000,1\n"
    )
    rc, out, _ = run(capsys, "recommend", "-m", both, "--json")  # the real one is there: the other only named
    assert rc == 0 and any("'peak_mem_reserved' is not read" in n for n in json.loads(out)["notes"])
    two = _file(tmp_path, "t.csv", "micro_batch,throughput,oom,OOM\n1,10,0,0\n")
    rc, _, err = run(capsys, "recommend", "-m", two)
    assert rc == 2 and "columns 'oom' and 'OOM' both name oom" in err


def test_throughput_se_is_read_from_a_csv_as_from_json(tmp_path, capsys):
    rows = [(1, 1000), (4, 3200), (8, 5000), (16, 5600)]
    csv = _file(
        tmp_path,
        "se.csv",
        "micro_batch,throughput,throughput_se\n" + "".join(f"{b},{t},0.05\n" for b, t in rows),
    )
    js = _file(
        tmp_path,
        "se.json",
        json.dumps([{"micro_batch": b, "throughput": t, "throughput_se": 0.05} for b, t in rows]),
    )
    got = []
    for f in (csv, js):
        rc, out, err = run(capsys, "recommend", "-m", f, "--json")
        d = json.loads(out)
        got.append((rc, d["noise_from"], d["indistinguishable"]))
        assert "throughput_se" not in err  # no "is not read" note
    assert got[0] == got[1] and got[0][1] == "repeats"


def test_a_dense_sweep_flat_by_the_doubling_has_flattened():
    rates = [8000.0, 8888.9, 9230.8, 9411.8, 9523.8, 9600.0, 9655.2, 9987.9]
    pts = [CurvePoint(micro_batch=8 * (i + 1), throughput=t) for i, t in enumerate(rates)]
    assert flattened(pts, 0.15)  # 64 over 56 is 3.4%, not 3.4% raised to 1/0.19 of a doubling (~19%)
    rising = [CurvePoint(micro_batch=b, throughput=t) for b, t in ((8, 1000.0), (16, 2000.0))]
    assert not flattened(rising, 0.15)


def test_the_reason_no_bound_was_fitted_is_the_true_one():
    def pts(rows):
        return [CurvePoint(micro_batch=b, throughput=t) for b, t in rows]

    assert "fewer than the 4" in bound_or_why(pts([(1, 10.0), (2, 19.0), (4, 30.0)]))
    linear = bound_or_why(pts([(b, 100.0 * b) for b in (8, 16, 32, 64, 128)]))
    assert "does not grow with b_m" in linear  # the old text said: fewer than 4 points, or misses a line
    bent = bound_or_why(pts([(1, 100.0), (2, 190.0), (4, 400.0), (8, 410.0), (16, 1200.0)]))
    assert "misses a line by" in bent
    assert not isinstance(bound_or_why(pts([(b, 1e4 * b / (b + 8)) for b in (4, 8, 16, 32, 64)])), str)


def test_a_knee_exactly_on_the_line_without_noise_has_no_company():
    pts = [CurvePoint(micro_batch=b, throughput=10000 * b / (b + 8)) for b in (1, 2, 4, 8, 16, 32, 64, 128)]
    knee = next(p for p in pts if p.micro_batch == 32)  # 8000 = 0.85 × 9411.76: on the line
    line = 0.85 * max(p.throughput for p in pts)
    assert indistinguishable(pts, knee, line, 0.0) == (32,)  # 64 was listed beside it at a scatter of 4e-16


def test_columns_named_with_memory_or_oom_words_are_refused_only_as_whole_words(tmp_path, capsys):
    """A review of the first version, which matched substrings: memory_headroom held 'oom' and was refused."""
    for header in ("memory_headroom", "Notes about memory", "zoom"):
        f = _file(
            tmp_path,
            "h.csv",
            f"micro_batch,throughput,peak_memory_bytes,{header}\n1,100,1e9,1\n2,180,2e9,1\n",
        )
        rc, out, err = run(capsys, "recommend", "-m", f, "--json")
        assert rc == 0, (header, err)
    for header in ("max_mem_MiB", "rss_kb", "OOMed"):
        f = _file(tmp_path, "h.csv", f"micro_batch,throughput,{header}\n1,100,1\n2,180,1\n")
        rc, _, err = run(capsys, "recommend", "-m", f)
        assert rc == 2 and "is not read, and there is no" in err, header


def test_flattened_compares_over_a_whole_doubling_as_tune_stops():
    def pts(rows):
        return [CurvePoint(micro_batch=b, throughput=float(t)) for b, t in rows]

    rising = pts([(8, 50), (16, 80), (32, 95), (48, 100), (64, 110)])  # 64 over 32: +15.8% a doubling
    assert not flattened(rising, 0.15)
    assert flattened(pts([(8, 50), (16, 80), (32, 100), (48, 100), (64, 110)]), 0.15)  # +10% over 32


def test_a_throughput_se_in_the_rates_units_is_refused(tmp_path, capsys):
    f = _file(tmp_path, "se.csv", "micro_batch,throughput,throughput_se\n1,100,2\n2,180,3\n4,300,5\n")
    rc, _, err = run(capsys, "recommend", "-m", f)
    assert rc == 2 and "relative standard error" in err
