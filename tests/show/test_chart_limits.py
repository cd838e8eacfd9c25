"""Charts and op lists are bounded by what they draw, not only by ranks (a helper's runs at p = 4, m = 125,000: a
144 MB SVG in 10 s, 115 MB of --intervals JSON, and a report of it 99 s long and 217 MB)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from microbatch.cli import main
from microbatch.show.html import build_report
from microbatch.show.timeline import MAX_CHART_ACTIONS


@pytest.mark.parametrize("flag", [["--svg", "x.svg"], ["--png", "x.png"], ["--intervals", "--json"]])
def test_a_chart_or_op_list_past_the_limit_is_refused_before_the_simulation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, flag: list[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    t0 = time.monotonic()
    assert main(["simulate", "-p", "4", "-m", "125000", "-s", "1f1b", "--no-diagram", *flag]) == 2
    out = capsys.readouterr()
    said = json.loads(out.out)["error"] if "--json" in flag else out.err
    assert f"this schedule has 1,000,000 ops, over the limit of {MAX_CHART_ACTIONS:,}" in said
    assert time.monotonic() - t0 < 5 and not (tmp_path / flag[-1]).exists()
    # the numbers alone are simulated whole: a million ops is under the simulation's own limit
    assert main(["simulate", "-p", "4", "-m", "125000", "-s", "1f1b", "--no-diagram", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["bubble_fraction"] > 0


def test_a_report_of_a_simulation_past_the_limit_says_so_instead_of_drawing_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    main(["simulate", "-p", "2", "-m", "4", "-s", "gpipe", "--intervals", "--json"])
    sim = json.loads(capsys.readouterr().out)
    per_rank = MAX_CHART_ACTIONS // 2 + 1  # the same ops over and over: more than the limit in all
    sim["intervals"] = [[rank[i % len(rank)] for i in range(per_rank)] for rank in sim["intervals"]]
    t0 = time.monotonic()
    html = build_report([sim], tmp_path / "r.html", png=False).html_path.read_text()
    assert f"Its {2 * per_rank:,} ops are not drawn (over {MAX_CHART_ACTIONS:,})" in html
    assert time.monotonic() - t0 < 20 and len(html) < 2_000_000
