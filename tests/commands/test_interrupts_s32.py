"""A helper's review of interrupts and late errors (2026-12-07): a drawing cut short by a full disk replaced the
earlier one in place; the timelines are now written whole or not at all, as every other output."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest


@pytest.mark.parametrize("kind", ["svg", "png"])
def test_a_timeline_cut_short_leaves_the_earlier_drawing_whole(tmp_path, kind):
    target = tmp_path / f"t.{kind}"
    earlier = b"<svg>earlier</svg>" if kind == "svg" else b"\x89PNG earlier"
    target.write_bytes(earlier)
    call = "save_timeline_svg(rows, 200.0, path)" if kind == "svg" else "save_timeline_png(rows, 200.0, path)"
    script = textwrap.dedent(f"""
        import errno, resource
        from microbatch.show.text import save_timeline_svg
        from microbatch.show.figures import save_timeline_png
        rows = [[(3 * i + r, 3 * i + r + 1, "F", i) for i in range(64)] for r in range(8)]
        path = {str(target)!r}
        resource.setrlimit(resource.RLIMIT_FSIZE, (2048, 2048))  # the new drawing is larger: the write fails
        try:
            {call}
        except OSError as e:
            print("failed", e.errno == errno.EFBIG)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["failed", "True"], out.stderr[-2000:]
    assert target.read_bytes() == earlier  # was cut to 2,048 bytes of the new one
    assert sorted(p.name for p in tmp_path.iterdir()) == [target.name]  # no piece left beside it


@pytest.mark.timeout(120)
def test_a_fifo_nobody_reads_fails_at_once_and_the_result_is_printed(tmp_path):
    """A FIFO given as --svg with no reader: a plain open waited forever after the work (its first Ctrl-C retried away,
    the result never printed); it now fails at once, and the answer carries the result and says why."""
    import json
    import os

    fifo = tmp_path / "f.svg"
    os.mkfifo(fifo)
    args = ["-p", "4", "-m", "8", "-s", "1f1b", "--forward-time", "1", "--backward-time", "2", "--json"]
    out = subprocess.run(
        [sys.executable, "-m", "microbatch", "simulate", *args, "--svg", str(fifo)],
        capture_output=True, text=True, timeout=90,
    )  # fmt: skip
    d = json.loads(out.stdout)
    assert out.returncode == 1 and "a FIFO nobody reads" in d["error"] and d["kind"] == "failure"
    assert d["bubble_fraction"] == pytest.approx(3 / 11)  # the result, printed beside the error


def test_a_demo_stopped_in_its_report_keeps_its_summary_and_one_stopped_early_names_files_it_did_not_write(
    tmp_path, capsys, monkeypatch
):
    """Ctrl-C while the demo wrote its report printed only "interrupted" (the five phases' summary lost); and a re-run
    stopped early left an earlier run's pipeline.json and validate.json beside its own results, which `report` mixed:
    they are named, not removed (a review: by mtime, a coarse or skewed clock removed this run's own files, and a
    user's file of the same name went too)."""
    import json
    import os
    import time

    from microbatch.cli import main
    from microbatch.commands import demo

    def tuned(out, model_name, quick, quiet, results, summary):  # type: ignore[no-untyped-def]
        summary["tune_train"] = {"micro_batch": 4}

    def stopped(*args: object, **kw: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(demo, "_tune_both", tuned)
    for name in (
        "_run_small_pipeline",
        "_validate_training",
    ):  # quick stand-ins: nothing of theirs is asked here
        monkeypatch.setattr(demo, name, lambda *a, **k: None)
    monkeypatch.setattr("microbatch.show.html.build_report", stopped)
    out_dir = tmp_path / "d"
    rc = main(["demo", "--quick", "--model", "tiny", "--out", str(out_dir), "--json"])
    d = json.loads(capsys.readouterr().out)
    assert (
        rc == 130
        and d["interrupted_in"] == "the report"
        and d["tune_train"] == {"micro_batch": 4}
        and "plan" in d
    )
    assert (out_dir / "plan.json").is_file() and "report" not in d and "not_this_run" not in d

    monkeypatch.undo()
    old = out_dir / "pipeline.json"  # an earlier demo's, or the user's own pipeline result
    old.write_text(json.dumps({"command": "pipeline", "version": "0.1.0"}))
    os.utime(old, (time.time() + 600, time.time() + 600))  # a clock ahead: no matter, nothing goes by mtime
    monkeypatch.setattr(demo, "_tune_both", stopped)  # this run stops in its first phase
    rc = main(["demo", "--quick", "--model", "tiny", "--out", str(out_dir), "--json"])
    d = json.loads(capsys.readouterr().out)
    assert rc == 130 and {"pipeline.json", "plan.json"} <= set(d["not_this_run"]) and old.exists()


def test_simulate_stopped_while_it_draws_keeps_its_numbers(capsys, monkeypatch, tmp_path):
    """Ctrl-C after the simulation, while its chart was written: only {"error": "interrupted"} came out."""
    import json

    from microbatch.cli import main

    def stopped(*args: object, **kw: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr("microbatch.show.text.save_timeline_svg", stopped)
    rc = main(["simulate", "-p", "4", "-m", "8", "-s", "1f1b", "--forward-time", "1", "--backward-time", "2",
               "--svg", str(tmp_path / "t.svg"), "--json"])  # fmt: skip
    d = json.loads(capsys.readouterr().out)
    assert rc == 130 and d["kind"] == "interrupted" and d["bubble_fraction"] == pytest.approx(3 / 11)
    assert "interrupted while the charts were written" in d["error"]


def test_memory_that_does_not_fit_offers_only_fixes_not_taken(capsys):
    """A user who gave --recompute full was told to recompute (--recompute full) (a walk-through)."""
    from microbatch.cli import main

    base = ["memory", "--model", "gpt2", "-b", "512", "--gpu", "h100-sxm"]
    assert main([*base, "--recompute", "full"]) == 2
    err = capsys.readouterr().err
    assert "does not fit" in err and "--recompute full" not in err.split("does not fit", 1)[1]
    assert main([*base, "--recompute", "none"]) == 2
    assert "recompute (--recompute full)" in capsys.readouterr().err


def test_memory_without_a_pipeline_shows_no_schedule(capsys):
    """`p=1 v=1 m=4 1f1b` on a single-GPU run named a pipeline schedule and a default m the plan does not use."""
    from microbatch.cli import main

    assert main(["memory", "--model", "gpt2", "-b", "4"]) == 0
    head = capsys.readouterr().out.splitlines()[0]
    assert "p=1 (no pipeline)" in head and "1f1b" not in head
    assert main(["memory", "--model", "gpt2", "-b", "4", "-p", "2"]) == 0
    assert "p=2 v=1 m=8 1f1b" in capsys.readouterr().out.splitlines()[0]


def test_an_hf_config_asked_past_its_positions_says_so(capsys, tmp_path):
    import json

    from microbatch.cli import main

    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 2,
                                "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 1000,
                                "max_position_embeddings": 512}))  # fmt: skip
    assert main(["memory", "--hf-config", str(path), "-b", "1", "--seq", "4096", "--json"]) == 0
    notes = json.loads(capsys.readouterr().out)["notes"]
    assert any("s = 4,096 is past the config's max_position_embeddings 512" in n for n in notes)
    assert main(["memory", "--hf-config", str(path), "-b", "1", "--seq", "256", "--json"]) == 0
    assert not any("past the config" in n for n in json.loads(capsys.readouterr().out).get("notes", []))
