"""`microbatch demo` end to end (what `make demo` runs), in its quick form."""

from __future__ import annotations

import json

import pytest

from microbatch.cli import main


@pytest.mark.timeout(240)
def test_demo_runs_every_step_and_writes_the_report(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MICROBATCH_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "demo"
    assert main(["demo", "--quick", "--out", str(out), "--json"]) == 0
    said = capsys.readouterr()
    summary = json.loads(
        said.out
    )  # stdout one JSON document; the progress on stderr (it was silent with --json)
    assert said.err.count("▶ ") >= 6
    # Measured: the knee is never past the fastest point that fits.
    for mode in ("train", "decode"):
        t = summary[f"tune_{mode}"]
        d = json.loads((out / f"tune-{mode}.json").read_text())
        assert t["micro_batch"] <= d["fastest_fitting"]["micro_batch"]
        assert 0.85 - 1e-9 <= t["fraction_of_best"] <= 1.0  # the default tolerance, 15%
        # as tune's own file: the probes' one thread (validate times this CPU at it) and the shape measured
        assert (
            d["threads"] == 1 and d["model_shape"]["name"] == "small" and d["model_shape"]["dropout"] is False
        )
    v = json.loads((out / "validate.json").read_text())
    assert "(1 thread)" in v["accelerator"]["source"]  # was torch's 2: the uncalibrated step 2x too fast
    # Simulated: the same bubble, 1F1B holds min(m, p − i), GPipe m.
    assert summary["simulate_gpipe"]["bubble_fraction"] == pytest.approx(3 / 11)
    assert summary["simulate_1f1b"]["peak_in_flight"] == [4, 3, 2, 1]
    assert summary["simulate_gpipe"]["peak_in_flight"] == [8, 8, 8, 8]
    # Planned: the recommendation fits.
    assert summary["plan"]["fits"] is True
    # Run: the real pipeline's gradients equal the unsplit model's.
    assert summary["pipeline"]["gradients_match"] is True
    assert summary["pipeline"]["max_grad_rel_error"] <= 1e-5
    # measured against the prediction made before the ranks started (not the replay of its own op times)
    run = json.loads((out / "pipeline.json").read_text())
    assert summary["pipeline"]["predicted_bubble_fraction"] == run["before_run"]["bubble_fraction"]
    assert summary["pipeline"]["replayed_bubble_fraction"] == run["predicted"]["bubble_fraction"]
    # Shown: one HTML file with the figures inline, PNGs beside it.
    html = (out / "report.html").read_text()
    assert html.count("<svg") >= 6
    assert "Predicted against measured" in html and "Configs to paste" in html
    assert len(list((out / "report-figures").glob("*.png"))) >= 6


def test_an_interrupted_tune_stops_the_demo_with_what_it_measured(tmp_path, capsys, monkeypatch):
    # Ctrl-C cut the tune's search short, and the demo went on to plan, simulate, run and report, exit 0,
    # showing the cut curve as a finished result
    import microbatch.choose.tune as tune

    real = tune.tune_model

    def interrupted(*args, **kwargs):
        from dataclasses import replace

        kwargs["search"] = replace(kwargs["search"], max_micro_batch=2)
        return replace(real(*args, **kwargs), interrupted=True)

    monkeypatch.setattr(tune, "tune_model", interrupted)
    monkeypatch.setenv("MICROBATCH_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "demo"
    assert main(["demo", "--quick", "--out", str(out)]) == 130
    err = capsys.readouterr().err
    assert (
        "interrupted during tune (train): kept its points" in err and "the steps after it did not run" in err
    )
    assert (out / "tune-train.json").is_file() and (out / "report.html").is_file()
    assert not (out / "tune-decode.json").exists() and not (out / "plan.json").exists()
