"""Recorded curves as users' tools write them (a helper's review, 2026-12-07): units misread, spreadsheet rows,
JSON Lines, headers with units, and what the noise of a curve without repeats is."""

from __future__ import annotations

import json

from microbatch.cli import main

GPU = [
    (1, 4100, 6),
    (2, 8000, 7),
    (4, 14900, 9),
    (8, 24100, 13),
    (16, 30200, 21),
    (32, 32100, 37),
    (64, 32600, 69),
]


def run(capsys, *args):
    rc = main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


def _csv(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def _curve(scale):
    return "micro_batch,throughput,peak_memory_bytes\n" + "".join(f"{b},{t},{g * scale}\n" for b, t, g in GPU)


def test_peaks_in_gib_or_kib_under_the_bytes_column(tmp_path, capsys):
    right = _csv(tmp_path, "bytes.csv", _curve(2**30))
    rc, out, _ = run(capsys, "recommend", "-m", right, "--memory-budget", "20GiB", "--json")
    assert rc == 0 and json.loads(out)["micro_batch"] == 8  # 16 (21 GiB) is over the budget
    gib = _csv(tmp_path, "gib.csv", _curve(1))  # GiB as bytes: every point would pass; refused
    rc, out, _ = run(capsys, "recommend", "-m", gib, "--memory-budget", "20GiB", "--json")
    assert rc == 2 and "the column holds GiB or MiB read as bytes" in json.loads(out)["error"]
    kib = _csv(tmp_path, "kib.csv", _curve(2**20))  # KiB (ru_maxrss) as bytes: 6-69 MiB, plausible; said
    rc, out, _ = run(capsys, "recommend", "-m", kib, "--memory-budget", "20GiB", "--json")
    d = json.loads(out)
    assert rc == 0 and any("under 1% of the 20.00 GiB budget" in n and "KiB" in n for n in d["notes"])
    rc, out, _ = run(
        capsys, "recommend", "-m", right, "--memory-budget", "80", "--json"
    )  # 80 bytes meant as GiB
    assert rc == 2 and "write the budget with its unit (--memory-budget 80GiB)" in json.loads(out)["error"]
    small = _csv(
        tmp_path, "s.csv", "micro_batch,throughput,peak_memory_bytes\n1,100,50\n2,180,70\n4,200,3000000\n"
    )
    rc, out, _ = run(
        capsys, "recommend", "-m", small, "--memory-budget", "80", "--json"
    )  # some peaks of its scale
    assert rc == 0 and any("a number without a unit is bytes" in n for n in json.loads(out)["notes"])


def test_spreadsheet_rows_and_cells(tmp_path, capsys):
    trailing = _csv(tmp_path, "t.csv", "micro_batch,throughput\n1,100\n2,180\n4,200\n,\n,\n")
    rc, out, _ = run(capsys, "recommend", "-m", trailing, "--json")
    assert rc == 0 and json.loads(out)["micro_batch"] == 2
    empty = _csv(tmp_path, "e.csv", "micro_batch,throughput\n1,100\n2,180\n4,\n")
    rc, _, err = run(capsys, "recommend", "-m", empty)
    assert rc == 2 and "line 4: micro_batch 4 has an empty throughput" in err and "a column oom in CSV" in err
    both = _csv(tmp_path, "o.csv", "micro_batch,throughput,oom\n1,100,false\n2,180,false\n4,150,true\n")
    rc, out, _ = run(capsys, "recommend", "-m", both, "--json")
    d = json.loads(out)
    assert rc == 0 and any(
        "line 4: micro_batch 4 is marked oom and gives a throughput (150)" in n for n in d["notes"]
    )
    nan = _csv(tmp_path, "n.csv", "micro_batch,throughput,peak_memory_bytes\n1,100,NaN\n2,180,5e9\n")
    rc, _, err = run(capsys, "recommend", "-m", nan)
    assert rc == 2 and "leave a value not measured empty" in err


def test_formats_named_in_the_error(tmp_path, capsys):
    lines = _csv(
        tmp_path, "p.jsonl", '{"micro_batch": 1, "throughput": 100}\n{"micro_batch": 2, "throughput": 180}\n'
    )
    rc, _, err = run(capsys, "recommend", "-m", lines)
    assert rc == 2 and "it is JSON Lines" in err
    tsv = _csv(tmp_path, "p.tsv", "micro_batch\tthroughput\n1\t100\n")
    rc, _, err = run(capsys, "recommend", "-m", tsv)
    assert rc == 2 and "separates its columns with a tab" in err
    units = _csv(tmp_path, "u.csv", "Micro_Batch,throughput (tokens/s)\n1,100\n")
    rc, _, err = run(capsys, "recommend", "-m", units)
    # a known name in another case is that column (2026-12-08); a unit after one is refused with its rename
    assert rc == 2 and "rename 'throughput (tokens/s)' to throughput" in err and "Micro_Batch" not in err
    utf16 = tmp_path / "w.csv"
    utf16.write_bytes("micro_batch,throughput\n1,100\n".encode("utf-16"))
    rc, _, err = run(capsys, "recommend", "-m", str(utf16))
    assert rc == 2 and "UTF-16" in err


def test_the_noise_of_a_curve_without_repeats_is_called_its_scatter(tmp_path, capsys):
    curve = _csv(tmp_path, "c.csv", _curve(2**30))
    rc, out, _ = run(capsys, "recommend", "-m", curve, "--memory-budget", "22GiB", "--json")
    d = json.loads(out)
    assert rc == 0 and d["noise_from"] == "scatter" and 8 in d["indistinguishable"]
    rc, text, _ = run(capsys, "recommend", "-m", curve, "--memory-budget", "22GiB")
    assert "indistinguishable at the curve's own scatter (no repeats measured" in text
    assert "at the measured noise" not in text


NOISY = [(8, 96.8), (16, 140.5), (24, 163.7), (32, 180.3), (40, 191.2), (48, 195.8), (56, 201.4), (64, 211.3),
         (72, 211.5), (80, 214.5), (88, 222.2), (96, 221.0), (104, 225.4), (112, 224.7), (120, 227.4), (128, 225.4)]  # fmt: skip


def test_rule_gain_reads_gains_over_a_doubling_not_between_neighbours():
    """A sweep in steps of 8 with ±1.5% noise: 56 → 64 gained 4.9%, read as 28% per doubling, and rule gain chose 64
    where the same curve without its noise chose 48. Gains are now read against b_m at least twice as large: the
    noisy curve and the same curve without its noise choose alike, and every gain so read from the knee is within τ."""
    from microbatch.choose.curve import CurvePoint, gain_per_doubling
    from microbatch.choose.knee import knee_gain

    noisy = [CurvePoint(micro_batch=b, throughput=t) for b, t in NOISY]
    clean = [97.6, 140.4, 164.4, 179.8, 190.5, 198.3, 204.4, 209.2, 213.0, 216.2, 218.9, 221.2, 223.2, 224.9, 226.4,
             227.8]  # fmt: skip
    smooth = [CurvePoint(micro_batch=b, throughput=t) for (b, _), t in zip(NOISY, clean, strict=True)]
    k_noisy, k_smooth = knee_gain(noisy, 0.15).micro_batch, knee_gain(smooth, 0.15).micro_batch
    assert k_noisy == k_smooth == 40, (k_noisy, k_smooth)  # were 64 and 48
    t = dict(NOISY)
    assert all(gain_per_doubling(k_noisy, t[k_noisy], b, t[b]) <= 0.15 for b in t if b >= 2 * k_noisy)
    powers = [CurvePoint(micro_batch=b, throughput=260 * b / (b + 18)) for b in (1, 2, 4, 8, 16, 32, 64, 128)]
    assert knee_gain(powers, 0.15).micro_batch == 64  # every later point at least a doubling away: as before
    # one dip at the end does not stop the search: 32 → 48 gains 23% (under a doubling, taken as it is)
    dip = [
        CurvePoint(micro_batch=8 * (i + 1), throughput=t)
        for i, t in enumerate([100, 180, 250, 300, 340, 370, 390, 300])
    ]
    assert knee_gain(dip, 0.15).micro_batch == 40


def test_a_latency_limit_nothing_meets_gives_the_shortest_step(tmp_path, capsys):
    ms = _csv(
        tmp_path, "ms.csv", "micro_batch,throughput,step_time_s\n1,45,22.2\n2,85,23.5\n4,160,25.0\n"
    )  # ms as s
    rc, _, err = run(capsys, "recommend", "-m", ms, "--max-latency-ms", "40")
    assert rc == 2 and "the shortest step measured 22,200.0 ms; if step_time_s holds milliseconds" in err
    s = _csv(tmp_path, "s.csv", "micro_batch,throughput,step_time_s\n1,45,0.0222\n2,85,0.0235\n4,160,0.025\n")
    rc, _, err = run(capsys, "recommend", "-m", s, "--max-latency-ms", "10")
    assert rc == 2 and "the shortest step measured 22.2 ms)" in err and "holds milliseconds" not in err


def test_a_rename_hint_names_the_micro_batch_column_not_the_global_one(tmp_path, capsys):
    cols = _csv(tmp_path, "c.csv", "global_batch,micro_bs,throughput\n1,2,3\n")
    rc, _, err = run(capsys, "recommend", "-m", cols)
    assert rc == 2 and "rename 'micro_bs' to micro_batch" in err and "'global_batch' to" not in err
    big = _csv(tmp_path, "b.csv", _curve(2**30))
    rc, _, err = run(capsys, "recommend", "-m", big, "--memory-budget", "500000")
    assert rc == 2 and "(--memory-budget 80GiB, 500MB)" in err  # not 500,000GiB


def test_batch_past_every_valid_global_batch_says_none_is():
    from microbatch.batch import solve
    from microbatch.errors import ConfigError

    try:
        solve(global_batch=1000, micro_batch=100_000, data_parallel=100_000)
    except ConfigError as e:
        assert "no global batch up to the limit of 1,000,000,000 is a multiple of 10,000,000,000" in str(e)
    else:
        raise AssertionError("accepted")


def test_recommend_on_a_tunes_result_reads_the_noise_its_repeats_measured(tmp_path, capsys):
    """tune saves each point's spread and repeats (its throughput_se null): recommend dropped them and called the noise
    the curve's scatter, "no repeats measured", where tune had said "the measured noise" (a user's walk-through)."""
    from microbatch.choose.noise import relative_se

    points = [
        {"micro_batch": b, "throughput": t, "spread": 0.08, "repeats": 3, "throughput_se": None, "oom": False}
        for b, t in ((1, 980.0), (2, 1700.0), (4, 2600.0), (8, 2700.0))
    ]
    path = tmp_path / "result.json"
    path.write_text(json.dumps({"command": "tune", "version": "0.1.0", "points": points, "model": "tiny", "seq": 64,
                                "precision": "fp32", "device": "cpu"}))  # fmt: skip
    rc, out, _ = run(capsys, "recommend", "-m", str(path), "--json")
    d = json.loads(out)
    assert rc == 0 and d["noise_from"] == "repeats"
    from microbatch.choose.rows import points_from_records

    assert points_from_records(points)[0].throughput_se == relative_se(0.08, 3) > 0


def test_a_negative_spread_is_no_noise_not_an_error_about_a_field_not_written():
    from microbatch.choose.rows import points_from_records

    pts = points_from_records([{"micro_batch": 1, "throughput": 100.0, "spread": -0.5, "repeats": 3}])
    assert pts[0].throughput_se is None


def test_the_largest_b_m_predicted_to_fit_names_the_largest_a_held_global_batch_allows(tmp_path, capsys):
    """ "largest b_m predicted to fit ...: 36" under -B 64 named a b_m no step can run (a walk-through)."""
    curve = _csv(tmp_path, "c.csv", "micro_batch,throughput,peak_memory_bytes\n1,100,2000000000\n2,180,3000000000\n"
                 "4,250,5000000000\n8,270,9000000000\n")  # fmt: skip
    rc, text, _ = run(capsys, "recommend", "-m", curve, "--memory-budget", "40GiB", "-B", "64")
    assert rc == 0 and "headroom: 37 (the largest dividing B/d = 64: 32)" in text
    rc, text, _ = run(capsys, "recommend", "-m", curve, "--memory-budget", "40GiB")
    assert rc == 0 and "headroom: 37\n" in text + "\n" and "dividing" not in text
