"""What a read-only sweep of the HTML report found (2026-12-06): a simulate of uneven stages drawn, a model name
with dollar signs drawn as written, an interrupted pipeline run and a plan where nothing fits said as such, the
plan table's cut said, the tune's device named, throughput with its unit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from microbatch.cli import main
from microbatch.show.html import build_report


def _json(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    main([*args, "--json"])
    return json.loads(capsys.readouterr().out)


def test_a_simulate_of_uneven_stages_is_drawn(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sim = _json(
        capsys, "simulate", "-p", "4", "-m", "8", "-s", "1f1b", "--stage-times", "1,1.5,1,2", "--intervals"
    )
    html = build_report([sim], tmp_path / "r.html", png=False).html_path.read_text()
    assert "time (stage 0&#x27;s forward = 1)" in html or "time (stage 0's forward = 1)" in html


def test_a_name_with_dollar_signs_is_drawn_as_written() -> None:
    from microbatch.show.figures import literal, new_figure, render_figure

    fig = new_figure()
    ax = fig.add_subplot()
    ax.plot([1, 2], [1, 2])
    ax.set_title(literal(r"hf_$\frac{x$_&"))
    fig.tight_layout()  # matplotlib's TeX parser raised here on the name
    assert "<svg" in render_figure(fig, "t", "t", None).svg


def test_a_plan_where_nothing_fits_shows_its_advice_and_a_long_plan_says_its_cut(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    nofit = _json(capsys, "plan", "--model", "llama-2-7b", "--gpu", "l4", "-B", "64", "-p", "4")
    assert nofit["recommended"] is None and nofit["advice"]
    html = build_report([nofit], tmp_path / "n.html", png=False).html_path.read_text()
    assert "would fit" in html and "the recommended one is highlighted" not in html
    assert "plan llama-2-7b on l4: <b>nothing fits</b>" in html  # in the answers at the top
    many = _json(capsys, "plan", "--model", "gpt2", "--gpu", "h100-sxm", "-B", "55440")
    html = build_report([many], tmp_path / "m.html", png=False).html_path.read_text()
    assert "The 20 smallest of 120 b_m are shown (b_m 28 and larger left out" in html


def test_a_comparison_of_accelerators_has_a_line_per_plan_in_the_answers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    multi = _json(capsys, "plan", "--model", "llama-2-7b", "--gpu", "a100-80gb,l4", "-B", "64", "-p", "4")
    html = build_report([multi], tmp_path / "c.html", png=False).html_path.read_text()
    assert (
        "plan llama-2-7b on a100-80gb: b_m = <b>" in html
        and "plan llama-2-7b on l4: <b>nothing fits</b>" in html
    )


def test_validate_shows_its_warnings() -> None:
    from microbatch.show.html_sections import validate_section

    res = {"rows": [{"micro_batch": 1, "mem_MiB": 10.0}], "warnings": ["this CPU's peak was measured now"]}
    assert "<li>this CPU&#x27;s peak was measured now</li>" in validate_section(res)


def test_an_interrupted_pipeline_and_the_tunes_device_are_said(tmp_path: Path) -> None:
    run = {"command": "pipeline", "schedule": "1f1b", "stages": 2, "microbatches": 4, "model": "tiny",
           "device": "cpu", "steps": 3, "measured_steps": 3, "steps_asked": 10, "interrupted": True,
           "measured": {"bubble_fraction": 0.3}, "predicted": {"bubble_fraction": 0.28}}  # fmt: skip
    html = build_report([run], tmp_path / "p.html", png=False).html_path.read_text()
    assert "p = 2, m = 4 — interrupted" in html and "tiny on cpu, 3 measured steps of 10 asked" in html
    tune = {"command": "tune", "model": "tiny", "mode": "train", "device": "cuda", "device_name": "NVIDIA H100",
            "micro_batch": 2, "throughput": 100.0, "peak_memory_bytes": 1e9,
            "points": [{"micro_batch": b, "throughput": 50.0 * b, "peak_memory_bytes": 5e8 * b, "step_time_s": 0.1,
                        "oom": False, "tokens_per_s": 50.0 * b} for b in (1, 2)]}  # fmt: skip
    html = build_report([tune], tmp_path / "t.html", png=False).html_path.read_text()
    assert "Measured: tiny — train on NVIDIA H100 (cuda)" in html and "at 100 tokens/s" in html
