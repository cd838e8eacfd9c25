"""The report says what the text says of a knee, draws the line where the choice drew it, writes nothing when it
fails and names each section's file (a read-only review, 2026-12-07 14:40 UTC on). The two tune results in
tests/data were measured by `microbatch tune --mode decode` on the tiny and a 16-layer model on a 2-core CPU."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from microbatch.cli import main
from microbatch.show.figures import throughput_figure
from microbatch.show.html import build_report, load_results
from microbatch.show.html_sections import validate_section
from microbatch.show.recommendation import render_tune

DATA = Path(__file__).parent.parent / "data"
UNFLATTENED = DATA / "tune_decode_unflattened.json"  # knee 16, margin 23.1%: the line above the bound
LATENCY = DATA / "tune_decode_latency.json"  # b_m 8 left out past 5 ms, the knee 4


def _labels(fig) -> dict[str, object]:
    ax = fig.get_axes()[0]
    return {
        a.get_label(): a
        for a in [*ax.patches, *ax.lines, *ax.collections]
        if not a.get_label().startswith("_")
    }


def test_the_report_says_what_the_text_says_of_an_unfinished_knee(tmp_path: Path) -> None:
    t = json.loads(UNFLATTENED.read_text(encoding="utf-8"))
    text = render_tune(t)
    html = build_report(load_results([UNFLATTENED]), tmp_path / "r.html", png=False).html_path.read_text()
    for words in ("had not flattened", "no measured b_m reached it", "largest b_m predicted to fit"):
        assert words in text and words in html, words
    assert f"<p class='source'>from {UNFLATTENED}</p>" in html


def test_a_line_over_the_bound_is_drawn_as_a_line_not_a_band_above_it() -> None:
    t = json.loads(UNFLATTENED.read_text(encoding="utf-8"))
    line = t["reference_throughput"] * (1 - t["tolerance"]) * (1 + t["bound_margin"])
    assert line > t["reference_throughput"]  # the case: (1 − 0.15)(1 + 23.1%) = 104.6% of it
    labels = _labels(throughput_figure(t))
    assert not [k for k in labels if k.startswith("within")]
    drawn = next(a for k, a in labels.items() if "none reaches it" in k)
    assert drawn.get_ydata()[0] == pytest.approx(line)


def test_the_band_is_taken_from_the_points_the_choice_kept() -> None:
    t = json.loads(LATENCY.read_text(encoding="utf-8"))
    kept = max(p["throughput"] for p in t["points"] if p["micro_batch"] != 8)
    assert (
        max(p["throughput"] for p in t["points"]) > 1.3 * kept
    )  # the left-out b_m 8 is the fastest measured
    labels = _labels(throughput_figure(t))
    band = next(a for k, a in labels.items() if k.startswith("within"))
    assert band.get_y() + band.get_height() == pytest.approx(kept)
    assert labels["left out (past a limit)"].get_xdata()[0] == 8


def test_a_report_that_fails_writes_no_figure_and_keeps_an_earlier_reports(tmp_path: Path, capsys) -> None:
    out = tmp_path / "rep" / "report.html"
    assert main(["report", str(LATENCY), "--out", str(out)]) == 0
    figures = sorted((tmp_path / "rep" / "report-figures").glob("*.png"))
    assert figures
    before = {f: hashlib.sha256(f.read_bytes()).hexdigest() for f in figures}
    html = out.read_text(encoding="utf-8")
    bad = tmp_path / "bad.json"
    capsys.readouterr()
    main(["simulate", "-p", "2", "-m", "4", "-s", "1f1b", "--json"])
    sim = json.loads(capsys.readouterr().out)
    sim["bubble_fraction"] = "27%"  # a hand edit the report cannot draw
    bad.write_text(json.dumps(sim), encoding="utf-8")
    assert main(["report", str(UNFLATTENED), str(bad), "--out", str(out)]) == 2
    assert out.read_text(encoding="utf-8") == html
    assert {f: hashlib.sha256(f.read_bytes()).hexdigest() for f in figures} == before
    fresh = tmp_path / "new" / "fresh.html"
    assert main(["report", str(UNFLATTENED), str(bad), "--out", str(fresh)]) == 2
    assert not (tmp_path / "new").exists()


def test_the_validate_table_has_the_texts_digits() -> None:
    rows = [{"micro_batch": 1, "step_ms": 1.551, "step_uncal_ms": 1.548, "step_uncal_err_%": -0.2}]
    html = validate_section({"rows": rows})
    assert ">1.55<" in html and ">-0.2<" in html and ">1.6<" not in html


def test_recommend_on_a_decode_tune_says_tokens_per_second(capsys) -> None:
    assert main(["recommend", "--measurements", str(LATENCY), "--max-latency-ms", "5"]) == 0
    knee = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("knee"))
    assert "tokens/s" in knee and "per s" not in knee.replace("tokens/s", "")


def test_a_memory_result_shows_its_bytes_in_binary_units_under_names_without_bytes(
    tmp_path: Path, capsys
) -> None:
    assert (
        main(["memory", "--model", "megatron-22b", "--micro-batch", "4", "--tensor-parallel", "8", "--json"])
        == 0
    )
    res = json.loads(capsys.readouterr().out)
    layers = res["stages"][0]["activation_terms"]["layers"]
    html = build_report([("memory", res)], tmp_path / "m.html", png=False).html_path.read_text()
    assert f"layers {layers / 2**30:.2f} GiB" in html and f"{layers:.4g}" not in html
    assert "<th>peak_memory</th>" in html and "peak_memory_bytes" not in html


def test_a_pipeline_section_shows_each_ranks_memory_and_the_step_times(tmp_path: Path) -> None:
    source = DATA / "pipeline_result_v0_1f1b.json"
    res = json.loads(source.read_text(encoding="utf-8"))
    html = build_report(load_results([source]), tmp_path / "p.html", png=False).html_path.read_text()
    for rank in res["memory"]:
        row = (
            f"<td>{rank['rank']}</td><td>{rank['measured_peak_bytes'] / 2**10:.2f} KiB</td>"
            f"<td>{rank['predicted_bytes'] / 2**10:.2f} KiB</td><td>{rank['error_pct']:+.1f}%</td>"
        )
        assert row in html, row
    assert "<td>step time (ms)</td>" in html
    assert f"hand-offs not drawn: bubble {100 * res['predicted']['bubble_fraction']:.1f}%" in html


@pytest.mark.parametrize(
    ("kind", "path", "value"),
    [("simulate", ("bubble_fraction",), "27%"), ("tune", ("fraction_of_best",), "1.0"),
     ("pipeline", ("measured", "bubble_fraction"), "0.3")],
)  # fmt: skip
def test_text_in_a_number_field_is_refused_naming_the_field(
    tmp_path: Path, capsys, kind, path, value
) -> None:
    sources = {"simulate": None, "tune": LATENCY, "pipeline": DATA / "pipeline_result_v0_1f1b.json"}
    if sources[kind] is None:
        main(["simulate", "-p", "2", "-m", "4", "-s", "1f1b", "--json"])
        res = json.loads(capsys.readouterr().out)
    else:
        res = json.loads(sources[kind].read_text(encoding="utf-8"))
    node = res
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(res), encoding="utf-8")
    assert main(["report", str(bad), "--out", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err
    assert f"{kind}.{'.'.join(path)} is '{value}', where the {kind} result holds a number" in err
    assert not (tmp_path / "r.html").exists()


def test_a_plan_calibrated_from_a_kernel_benchmark_is_drawn(tmp_path: Path, capsys) -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).parent.parent / "predict"))
    from test_kernel_calibration import synthetic

    bench = tmp_path / "h100.json"
    bench.write_text(synthetic().to_json(), encoding="utf-8")
    args = [
        "plan",
        "--model",
        "llama-2-7b",
        "--gpu",
        "h100-sxm",
        "-B",
        "64",
        "-d",
        "8",
        "--calibration",
        str(bench),
    ]
    assert main([*args, "--json"]) == 0
    plan = tmp_path / "plan.json"
    plan.write_text(capsys.readouterr().out, encoding="utf-8")
    assert "term_sources" in plan.read_text(encoding="utf-8")  # words under names like attention_fraction
    assert main(["report", str(plan), "--out", str(tmp_path / "r.html"), "--no-png"]) == 0


def test_a_python_plans_advice_reads_as_sentences_in_the_report(tmp_path: Path) -> None:
    from microbatch.hardware import get_accelerator
    from microbatch.model import get_model
    from microbatch.predict.plan import make_plan
    from microbatch.predict.plan_config import PlanConfig

    cfg = PlanConfig(
        shape=get_model("llama-3-70b").with_seq(8192), gpu=get_accelerator("a100-80gb"), global_batch=64,
        data_parallel=8, tensor_parallel=8, micro_batches=(8,), zero=(3,), recompute=("full",),
    )  # fmt: skip
    data = make_plan(cfg).to_dict()  # the advice as data, not sentences
    assert isinstance(data["advice"], dict)
    html = build_report([("plan", data)], tmp_path / "p.html", png=False).html_path.read_text()
    assert "sequence parallel (at tensor-parallel 8) would fit" in html
    assert "budget_bytes" not in html


def test_a_recommend_result_keeps_its_unit_in_the_report(tmp_path: Path, capsys) -> None:
    assert main(["recommend", "--measurements", str(LATENCY), "--max-latency-ms", "5", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["throughput_unit"] == "tokens/s"
    html = build_report([("recommend", res)], tmp_path / "r.html", png=False).html_path.read_text()
    assert "tokens/s" in html and " per s" not in html


def test_simulate_refuses_a_figure_on_stdout_beside_its_json(capsys) -> None:
    assert main(["simulate", "-p", "4", "-m", "8", "-s", "1f1b", "--svg", "/dev/stdout", "--json"]) == 2
    out = json.loads(capsys.readouterr().out)  # the refusal itself is one JSON document
    assert "would share stdout" in out["error"]


def test_parameter_counts_read_as_counts(tmp_path: Path, capsys) -> None:
    assert (
        main(["memory", "--model", "megatron-22b", "--micro-batch", "4", "--tensor-parallel", "8", "--json"])
        == 0
    )
    res = json.loads(capsys.readouterr().out)
    html = build_report([("memory", res)], tmp_path / "m.html", png=False).html_path.read_text()
    params = res["stages"][0]["params"]
    assert f"<td>{params / 1e9:.2f} B</td>" in html and f"{params:.4g}" not in html
