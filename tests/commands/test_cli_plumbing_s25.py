"""The command line's plumbing as scripts and odd terminals meet it (a review of 2026-12-07): a stdout that is full
or gone while the error envelope is written, an encoding without −/×/τ, --json before the command, stderr closed
under tune, and a result file that could not be written said in the result and in the exit status."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from microbatch.cli import main

CLI = [sys.executable, "-m", "microbatch"]
ENV = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}


def run(args, *, stdout=subprocess.PIPE, env=None, shell_tail="", timeout=120, encoding="utf-8"):
    if shell_tail:  # a redirection only a shell makes (a closed stream)
        cmd = " ".join([*map(str, CLI), *args]) + " " + shell_tail
        return subprocess.run(
            ["bash", "-c", cmd], capture_output=True, text=True, env=env or ENV, timeout=timeout
        )
    return subprocess.run(
        [*CLI, *args],
        stdout=stdout,
        stderr=subprocess.PIPE,
        encoding=encoding,
        env=env or ENV,
        timeout=timeout,
    )


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_full_stdout_is_said_in_one_line_with_the_commands_own_status():
    with open("/dev/full", "w") as full:
        bad = run(["batch", "-B", "500", "-b", "8", "-d", "4", "--json"], stdout=full)
        good = run(["bubble", "-p", "4", "-m", "8", "--json"], stdout=full)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr  # bad input stays bad input
    assert "could not write the JSON error envelope to stdout: No space left on device" in bad.stderr
    assert (
        good.returncode == 1 and "Traceback" not in good.stderr and "No space left on device" in good.stderr
    )


def test_a_reader_that_left_gets_no_traceback():
    r = run(
        ["batch", "-B", "500", "-b", "8", "-d", "4", "--json"], shell_tail="| true; exit ${PIPESTATUS[0]}"
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr and "BrokenPipe" not in r.stderr


@pytest.mark.parametrize("encoding", ["latin-1", "cp1252"])
def test_an_encoding_without_the_symbols_replaces_them(encoding):
    r = run(["bubble", "-p", "4", "-m", "8"], env={**ENV, "PYTHONIOENCODING": encoding}, encoding=encoding)
    assert r.returncode == 0 and "Traceback" not in r.stderr and "rank 3" in r.stdout
    assert (
        "(p-1)" in r.stdout
    )  # what the encoding cannot hold (−, ×) is written in plain letters, the rest printed
    helped = run(["bubble", "--help"], env={**ENV, "PYTHONIOENCODING": encoding}, encoding=encoding)
    assert helped.returncode == 0 and "Traceback" not in helped.stderr


def test_json_before_the_command_says_where_it_goes(capsys):
    assert main(["--json", "bubble", "-p", "4", "-m", "8"]) == 2
    out, err = capsys.readouterr()
    assert "error: --json goes after the command: microbatch bubble ... --json" in err
    assert json.loads(out)["kind"] == "bad_input"


def test_tune_runs_with_stderr_closed(tmp_path):
    r = run(
        ["tune", "--model", "tiny", "--max-micro-batch", "1", "--repeats", "1", "--no-cache", "--json"],
        shell_tail="2>&-",
        env={**ENV, "MICROBATCH_CACHE_DIR": str(tmp_path)},
        timeout=300,
    )
    assert r.returncode == 0 and json.loads(r.stdout)["micro_batch"] == 1


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_result_file_not_written_is_a_failure_naming_where_it_was_kept():
    r = run(["bench-gpu", "--quick", "--out", "/dev/full", "--force", "--json"], timeout=300)
    d = json.loads(r.stdout)
    assert r.returncode == 1 and "interrupted" not in r.stderr and "interrupted" not in d
    kept = Path(d["kept_in"])
    try:
        assert kept.is_file() and any("could not write /dev/full" in n for n in d["notes"])
    finally:
        kept.unlink(missing_ok=True)


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_an_answer_that_stdout_cannot_take_is_said_once_as_stdout():
    with open("/dev/full", "w") as full:
        r = run(["bubble", "-p", "4", "-m", "8", "--json"], stdout=full)
    said = r.stderr.strip()
    assert r.returncode == 1 and said.count("\n") == 0  # once, one line
    assert said.startswith(
        "error: could not write to stdout: No space left on device; the answer was kept in "
    )
    kept = Path(said.rsplit(" ", 1)[1])
    try:
        assert json.loads(kept.read_text())["command"] == "bubble"  # the answer, not lost
    finally:
        kept.unlink(missing_ok=True)


def test_the_json_hint_only_replaces_a_complaint_about_json(capsys):
    assert main(["--foo", "--json", "bubble", "-p", "4", "-m", "8"]) == 2
    assert "No such option '--foo'" in capsys.readouterr().err


def test_a_closed_stdout_is_a_failure_not_a_silent_success():
    r = run(["bubble", "-p", "4", "-m", "8"], shell_tail=">&-")
    assert r.returncode == 1 and "could not write to stdout: stdout is closed" in r.stderr


def test_exports_notes_and_refusals_name_the_plans_flags(tmp_path, capsys):
    plan = tmp_path / "p.json"
    base = ["plan", "--model", "llama-2-7b", "--gpu", "h100-sxm", "-B", "64", "-d", "8"]
    assert main([*base, "--json"]) == 0
    plan.write_text(capsys.readouterr().out)
    assert main(["export", "--plan", str(plan), "--format", "hf"]) == 0
    assert "plan with --loss-kernel eager to price them" in capsys.readouterr().err
    assert main([*base, "--moments-dtype", "bf16", "--json"]) == 0
    plan.write_text(capsys.readouterr().out)
    assert main(["export", "--plan", str(plan), "--format", "hf"]) == 2
    assert "--moments-dtype and --master-weights fp32 export" in capsys.readouterr().err
