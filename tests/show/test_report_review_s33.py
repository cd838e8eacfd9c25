"""What a review of the HTML report found (2026-12-07, evening): each fixed with a test that fails without it."""

from __future__ import annotations

import pytest

pytest.importorskip("matplotlib")

from microbatch.records_fields import throughput_unit  # noqa: E402
from microbatch.show.figures import throughput_figure  # noqa: E402

LONG = "meta-llama/Meta-Llama-3.1-70B-Instruct-custom-finetune-v2-with-a-longer-name-than-the-figure-is-wide"


def _tune(**kw):
    points = [{"micro_batch": b, "throughput": 1000.0 * b / (1 + b / 8), "peak_memory_bytes": 2**28 + b * 2**20,
               "tokens_per_s": 1000.0 * b / (1 + b / 8), "step_time_s": 0.01} for b in (1, 2, 4, 8)]  # fmt: skip
    return {"command": "tune", "model": LONG, "mode": "train", "micro_batch": 4, "throughput": points[2]["throughput"],
            "points": points, **kw}  # fmt: skip


def test_a_long_title_is_wrapped_inside_the_figure():
    """set_title neither wrapped nor shrank: a long model name was cut off at both edges of the PNG."""
    fig = throughput_figure(_tune())
    fig.canvas.draw()
    ax = fig.axes[0]
    box = ax.title.get_window_extent(fig.canvas.get_renderer())
    assert box.x0 >= 0 and box.x1 <= fig.bbox.width
    assert LONG in ax.get_title().replace("\n", "")  # wrapped, nothing dropped


def test_points_that_name_no_unit_say_per_second_not_samples():
    """A tune result written before points carried tokens_per_s (or a hand-edited one) read as samples/s: for a
    model of token ids that was off by the sequence length."""
    bare = _tune()
    for p in bare["points"]:
        del p["tokens_per_s"]
    assert throughput_unit(bare) == "per s"
    samples = _tune()
    for p in samples["points"]:
        p["samples_per_s"] = p.pop("tokens_per_s")
    assert throughput_unit(samples) == "samples/s"
    assert throughput_unit(_tune()) == "tokens/s"


def test_a_report_without_pngs_leaves_no_earlier_report_s_figures(tmp_path):
    """--no-png skipped the clean-up: the folder beside the report kept the previous model's curves."""
    import json

    from microbatch.show.html import build_report

    src = tmp_path / "tune.json"
    src.write_text(json.dumps(_tune()))
    out = tmp_path / "r" / "report.html"
    out.parent.mkdir()
    first = build_report([_tune()], out, png=True)
    assert first.png_paths and all(p.exists() for p in first.png_paths)
    build_report([_tune()], out, png=False)
    assert not any(p.exists() for p in first.png_paths)


def test_the_answer_leaves_out_what_the_file_does_not_hold():
    from microbatch.show.html_sections import _knee_answer

    text = _knee_answer({"micro_batch": 4, "throughput": 10.0, "fastest_fitting": None}, "tokens/s")
    assert "None" not in text and "Fastest that fits" not in text and "Rule: not recorded" in text
    full = _knee_answer({"micro_batch": 4, "throughput": 10.0, "rule": "fraction", "tolerance": 0.15,
                         "fastest_fitting": {"micro_batch": 8, "throughput": 11.0}}, "tokens/s")  # fmt: skip
    assert "Fastest that fits: b_m = 8" in full and "Rule: fraction, tolerance 0.15" in full


def test_a_one_stage_plan_says_no_pipeline_in_the_report():
    """The answer and the recommendation said "1f1b, bubble 0.0%" for p = 1 (the schedule the planner times one stage
    with), beside the plan's own explanation's "no pipeline"."""
    from microbatch.show.html import _plan_answer, _plan_section

    rec = {
        "micro_batch": 2,
        "microbatches": 4,
        "schedule": "1f1b",
        "pipeline_parallel": 1,
        "bubble_fraction": 0.0,
    }
    one = {"model": "m", "gpu": "g", "recommended": rec, "candidates": []}
    assert "no pipeline" in _plan_answer(one) and "1f1b" not in _plan_answer(one)
    assert "no pipeline" in _plan_section(one)
    four = {**one, "recommended": {**rec, "pipeline_parallel": 4}}
    assert "1f1b" in _plan_answer(four)


def test_a_step_time_reads_the_same_in_the_tune_table_and_the_validation():
    """validate's rows rounded the step to 3 decimals of a ms (0.161095025 s → 161.095) and the report's 2-place
    format rounded again: 161.09 beside the tune table's 161.10 for the same point."""
    from microbatch.predict.validation import ms_row_value

    assert f"{ms_row_value(0.161095025):.2f}" == f"{0.161095025 * 1e3:.2f}" == "161.10"


def test_the_memory_figure_draws_sub_gib_peaks_in_mib():
    """Forced to GiB, a CPU tune's peaks read 0.300-0.335 on the axis beside the report's MiB."""
    from microbatch.show.figures import memory_figure

    small = _tune(
        memory_fit={"intercept_bytes": 2**28, "slope_bytes_per_sample": 2**20}, memory_budget_bytes=2**29
    )
    ax = memory_figure(small).axes[0]
    assert ax.get_ylabel() == "peak memory (MiB)"
    assert ax.lines[0].get_ydata()[0] == pytest.approx((2**28 + 2**20) / 2**20)
    assert any("budget 512.00 MiB" in t.get_text() for t in ax.get_legend().get_texts())
    big = _tune()
    for p in big["points"]:
        p["peak_memory_bytes"] *= 8
    assert memory_figure(big).axes[0].get_ylabel() == "peak memory (GiB)"
