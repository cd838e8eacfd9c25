"""`microbatch report` after a review: figures named per result, an interrupted tune said, units chosen
by magnitude, a result without a knee refused, ids unique across the inline SVGs, recommend's table."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pytest

from microbatch.cli import main
from microbatch.errors import ConfigError
from microbatch.show.figures import prefix_svg_ids
from microbatch.show.html import build_report, load_results
from microbatch.show.html_parts import bytes_column, seconds_column

MIB = 2**20


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MICROBATCH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)


def _tune(mode: str = "train", **over) -> dict:
    """A tune result as `tune --json` writes it, its peaks 232.10-242.13 MiB and its steps 0.33 and 0.32 ms
    (the decode run the review read)."""
    pts = [(1, 0.33e-3, 232.10), (2, 0.32e-3, 232.48), (4, 0.37e-3, 242.13)]
    d = {
        "command": "tune",
        "version": "0.1.0",
        "model": "tiny",
        "mode": mode,
        "device": "cpu",
        "micro_batch": 2,
        "throughput": 2 * 64 / 0.32e-3,
        "fraction_of_best": 1.0,
        "peak_memory_bytes": 232.48 * MIB,
        "rule": "fraction",
        "tolerance": 0.15,
        "fastest_fitting": {
            "micro_batch": 4,
            "throughput": 4 * 64 / 0.37e-3,
            "peak_memory_bytes": 242.13 * MIB,
        },
        "stop_reason": "reached the largest micro-batch allowed (4)",
        "interrupted": False,
        "points": [
            {
                "micro_batch": b,
                "throughput": b * 64 / s,
                "step_time_s": s,
                "peak_memory_bytes": m * MIB,
                "oom": False,
            }
            for b, s, m in pts
        ],
    }
    d.update(over)
    return d


def _write(path: Path, obj: object) -> str:
    path.write_text(json.dumps(obj))
    return str(path)


# 6. one PNG per figure, and the count said is the count written -------------------------------------
def test_each_result_has_its_own_figure_files_and_the_count_is_the_files_written(tmp_path, capsys):
    files = [
        _write(tmp_path / "a.json", _tune()),
        _write(tmp_path / "b.json", _tune(model="small")),
        _write(tmp_path / "c.json", _tune("decode")),
    ]
    out = tmp_path / "rep" / "report.html"
    assert main(["report", *files, "--out", str(out), "--json"]) == 0
    figs = json.loads(capsys.readouterr().out)["figures"]
    assert len(figs) == 6 and len(set(figs)) == 6, figs
    folder = tmp_path / "rep" / "report-figures"
    assert sorted(p.name for p in folder.iterdir()) == sorted(Path(f).name for f in figs)
    assert {Path(f).name for f in figs} == {
        "throughput-train-0.png", "memory-train-0.png", "throughput-train-1.png", "memory-train-1.png",
        "throughput-decode-2.png", "memory-decode-2.png",
    }  # fmt: skip
    html = out.read_text()
    for f in figs:
        assert html.count(f"<figure id='fig-{Path(f).stem}'>") == 1
    # a second report in the same place: its figures, as many as it says, none of the first's left over
    assert main(["report", files[0], "--out", str(out), "--force"]) == 0
    said = re.search(r"(\d+) PNG figures in (\S+)", capsys.readouterr().out)
    assert said and int(said.group(1)) == 2 and Path(said.group(2)) == folder
    assert sorted(p.name for p in folder.iterdir()) == ["memory-train-0.png", "throughput-train-0.png"]


# 7. an interrupted tune, and why a search stopped ---------------------------------------------------
def test_an_interrupted_tune_says_so_with_its_stop_reason(tmp_path):
    stop = "interrupted (Ctrl-C); the points measured so far are kept"
    res = _tune(interrupted=True, stop_reason=stop, points=_tune()["points"][:2])
    html = build_report([res], tmp_path / "r.html", png=False).html_path.read_text()
    assert "<h2>Measured: tiny — train on cpu — interrupted</h2>" in html
    assert (
        "<b>Interrupted</b> after 2 measured points: the knee is chosen from the points measured so far"
        in html
    )
    assert f"Stopped: {stop}." in html
    answers = html[html.index("<h2>Answers</h2>") : html.index("</ul>")]
    assert "<b>interrupted</b>: chosen from the 2 points measured before it stopped" in answers
    finished = build_report([_tune()], tmp_path / "f.html", png=False).html_path.read_text()
    assert (
        "nterrupted" not in finished and "Stopped: reached the largest micro-batch allowed (4)." in finished
    )


def test_a_probe_timeout_is_shown_as_the_reason_the_search_stopped(tmp_path):
    stop = (
        "micro-batch 8 took longer than --probe-timeout 30 s and was stopped; give a larger --probe-timeout"
    )
    html = build_report([_tune(stop_reason=stop)], tmp_path / "r.html", png=False).html_path.read_text()
    assert f"<p class='stopped'>Stopped: {stop}.</p>" in html


# 9. units by magnitude -----------------------------------------------------------------------------
def test_the_points_table_keeps_distinct_peaks_and_step_times_distinct(tmp_path):
    html = build_report([_tune()], tmp_path / "r.html", png=False).html_path.read_text()
    table = html[html.rindex("<table>") :]
    assert "<th>step (ms)</th>" in table
    rows = re.findall(r"<tr><td>(\d+)</td><td>[^<]*</td><td>([^<]*)</td><td>([^<]*)</td></tr>", table)
    assert rows == [("1", "0.33", "232.10 MiB"), ("2", "0.32", "232.48 MiB"), ("4", "0.37", "242.13 MiB")]
    assert "peak 232.48 MiB" in html and "0.23 GiB" not in html and "0.0003" not in html


def test_columns_choose_their_unit_by_magnitude_and_digits_to_stay_distinct():
    assert bytes_column([232.10 * MIB, 242.13 * MIB, None]) == ["232.10 MiB", "242.13 MiB", "—"]
    assert bytes_column([3 * 2**30, 0.5 * 2**30]) == ["3.00 GiB", "0.50 GiB"]  # one unit down a column
    assert bytes_column([5.001 * 2**30, 5.002 * 2**30]) == ["5.001 GiB", "5.002 GiB"]
    assert seconds_column([0.33e-3, 0.32e-3]) == ("ms", ["0.33", "0.32"])
    assert seconds_column([0.5, 2.0]) == ("s", ["0.50", "2.00"])
    assert seconds_column([1.2345, 1.2346]) == ("s", ["1.234", "1.235"])
    assert seconds_column([None]) == ("s", ["—"])


# 17. a result with no answer in it ------------------------------------------------------------------
def test_a_tune_without_a_knee_or_points_is_refused_before_anything_is_written(tmp_path, capsys):
    bad = _write(tmp_path / "weird.json", {"command": "tune", "points": []})
    good = _write(tmp_path / "good.json", _tune())
    out = tmp_path / "rep" / "report.html"
    assert main(["report", good, bad, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert lines == [
        f"error: {bad}: a tune result with no knee (micro_batch) and no measured points (points): missing, "
        "null or empty, so there is nothing to report; give the whole JSON a microbatch tune wrote (its JSON "
        "output, or the result.json of its output folder)"
    ]
    assert not (tmp_path / "rep").exists()
    with pytest.raises(ConfigError, match=r"good\.json: a recommend result with no knee \(micro_batch\):"):
        load_results([_write(tmp_path / "good.json", {"command": "recommend", "micro_batch": None})])
    with pytest.raises(ConfigError, match=r"^result 1: a tune result with no measured points \(points\):"):
        build_report([_tune(points=[])], tmp_path / "x.html", png=False)
    assert not (tmp_path / "x.html").exists()


# element ids across the inline SVGs -----------------------------------------------------------------
def test_every_id_in_the_page_is_unique_and_every_reference_resolves(tmp_path):
    html = build_report([_tune(), _tune("decode")], tmp_path / "r.html", png=False).html_path.read_text()
    ids = re.findall(r"""\bid=["']([^"']+)["']""", html)
    assert len(ids) > 50  # the figures' own ids are there
    assert [i for i, n in Counter(ids).items() if n > 1] == []
    refs = {a or b for a, b in re.findall(r"""url\(#([^)]+)\)|href=["']#([^"']+)""", html)}
    assert refs and refs <= set(ids)


def test_prefix_svg_ids_renames_definitions_and_their_references_only():
    svg = '<svg><g id="figure_1"><path id="p1"/><use xlink:href="#p1"/><g clip-path="url(#p1)"/></g>' \
        '<a href="#elsewhere"/></svg>'  # fmt: skip
    assert prefix_svg_ids(svg, "f") == (
        '<svg><g id="f-figure_1"><path id="f-p1"/><use xlink:href="#f-p1"/><g clip-path="url(#f-p1)"/></g>'
        '<a href="#elsewhere"/></svg>'
    )


# 8. recommend: a table of its choice ----------------------------------------------------------------
def test_a_recommend_result_gets_a_table_of_its_knee(tmp_path):
    rec = {k: v for k, v in _tune().items() if k not in ("points", "model", "mode", "device", "stop_reason")}
    rec.update(command="recommend", step_time_s=0.32e-3)
    html = build_report([rec], tmp_path / "r.html", png=False).html_path.read_text()
    # measurements made elsewhere: the file's own unit, not said
    assert "<th></th><th>b_m</th><th>throughput (per s)</th><th>step (ms)</th><th>peak memory</th>" in html
    assert "<tr><td>knee</td><td>2</td><td>400,000</td><td>0.32</td><td>232.48 MiB</td></tr>" in html
    assert (
        "<tr><td>fastest that fits</td><td>4</td><td>691,892</td><td>—</td><td>242.13 MiB</td></tr>" in html
    )
