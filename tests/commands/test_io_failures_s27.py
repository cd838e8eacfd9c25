"""The file system says no: a stderr on a full disk costs its lines, not the answer; an answer stdout cannot take is
kept in a file and said where; a result file is replaced whole or not at all; a folder where a result file goes, an
input file hundreds of MiB long and a path the system refuses are bad input, refused before any work."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from _cli import run

from microbatch.cli import main
from microbatch.commands import _outputs
from microbatch.errors import ConfigError


class Full:
    """A text stream on a full disk: every write fails with ENOSPC."""

    encoding = "utf-8"
    errors = "strict"

    def write(self, text):
        raise OSError(errno.ENOSPC, "No space left on device")

    def flush(self):
        raise OSError(errno.ENOSPC, "No space left on device")

    def isatty(self):
        return False


def test_a_full_stderr_costs_its_lines_not_the_answer_nor_the_exit_code(capsys, monkeypatch):
    monkeypatch.setattr(sys, "stderr", Full())
    # bad input: exit 2 and the envelope on stdout (was exit 1 and nothing: the error line itself failed)
    code = main(["batch", "--global-batch", "500", "--micro-batch", "8", "--data-parallel", "4", "--json"])
    out = capsys.readouterr().out
    assert code == 2 and json.loads(out)["kind"] == "bad_input"
    # a command that writes progress and notes on stderr still answers on stdout
    code = main(["simulate", "-p", "2", "-m", "4", "-s", "1f1b", "--json"])
    assert code == 0 and json.loads(capsys.readouterr().out)["command"] == "simulate"


def test_an_answer_stdout_cannot_take_is_kept_in_a_file_and_said_where(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # read TMPDIR again
    monkeypatch.setattr(sys, "stdout", Full())
    code = main(["batch", "--global-batch", "512", "--micro-batch", "8", "--data-parallel", "4", "--json"])
    err = capsys.readouterr().err
    assert code == 1 and "could not write to stdout: No space left on device; the answer was kept in" in err
    kept = Path(err.split("the answer was kept in ")[1].split()[0])
    assert kept.parent == tmp_path and json.loads(kept.read_text())["grad_accum"] == 16


def test_a_result_file_cut_short_leaves_the_earlier_one_whole(tmp_path):
    # under a file-size limit (ulimit -f) the write fails: the earlier result stays, no piece of the new one is left
    target = tmp_path / "result.json"
    target.write_text('{"command": "tune", "version": "0", "old": "' + "x" * 4000 + '"}')
    script = textwrap.dedent(f"""
        import resource, sys
        from microbatch.commands._outputs import write_text
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))
        try:
            write_text({str(target)!r}, "y" * 8192)
        except OSError as e:
            print("failed", e.errno)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["failed", str(errno.EFBIG)], out.stderr
    assert target.stat().st_size > 4000 and json.loads(target.read_text())["old"].startswith(
        "xxx"
    )  # was 1,024 bytes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["result.json"]
    _outputs.write_text(target, '{"new": 1}')  # and a write that succeeds replaces it, with no piece left
    assert json.loads(target.read_text()) == {"new": 1} and len(list(tmp_path.iterdir())) == 1


def test_a_result_neither_written_nor_kept_says_so(monkeypatch, capsys, tmp_path):
    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_outputs, "write_result", full)
    monkeypatch.setattr(_outputs, "keep_beside", full)  # the temporary folder on the same full disk
    d: dict = {"micro_batch": 4}
    _outputs.write_out(tmp_path / "result.json", d)
    assert d["kept_in"] is None  # it said kept_in: the path it could not write
    assert d["kind"] == "failure" and d["error"] == d["notes"][-1]  # the exit 1, in the envelope (2026-12-07)
    interrupted: dict = {"micro_batch": 4, "interrupted": True}
    _outputs.write_out(tmp_path / "result.json", interrupted)
    assert "kind" not in interrupted  # exit 130: the envelope says interrupted, not failure
    assert (
        "nor keep it in the temporary folder" in d["notes"][-1] and "only what is printed" in d["notes"][-1]
    )


def test_a_folder_where_a_result_file_goes_is_refused_before_any_work(tmp_path):
    (tmp_path / "run" / "result.json").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"result\.json is a folder there"):
        _outputs.check_out_dir(tmp_path / "run")


def test_an_input_file_hundreds_of_mib_long_is_refused_unread(capsys, tmp_path):
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(300 * 1024**2)  # sparse: no disk used; read whole, it took the process's memory
    code, _, err = run(["recommend", "--measurements", str(big)], capsys)
    assert code == 2 and "is 300 MiB, past the 256 MiB" in err
    code, _, err = run(["validate", "--calibration", str(big)], capsys)
    assert code == 2 and "is 300 MiB" in err


def test_a_path_the_system_refuses_is_bad_input_with_a_fix(capsys, tmp_path):
    long = tmp_path / ("a" * 300 + ".svg")
    code, _, err = run(["simulate", "-p", "4", "-m", "8", "-s", "1f1b", "--svg", str(long)], capsys)
    assert code == 2 and "File name too long; give a shorter path" in err
    if os.geteuid() == 0:
        pytest.skip("root reads and writes any folder")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0)
    try:
        code, _, err = run(["recommend", "--measurements", str(locked / "s.json")], capsys)
        assert code == 2 and "Permission denied; give a shorter path, or one this user may read" in err
    finally:
        locked.chmod(0o755)


def test_a_utf16_input_is_told_to_be_utf8_and_a_fifo_in_the_cache_is_passed_by(capsys, tmp_path, monkeypatch):
    f = tmp_path / "points.json"
    f.write_text('[{"micro_batch": 1, "throughput": 10}]', encoding="utf-16")
    for args in (["recommend", "--measurements", str(f)], ["validate", "--calibration", str(f)]):
        code, _, err = run(args, capsys)
        assert code == 2 and "is not UTF-8 text" in err and "save it as UTF-8" in err, err
    from microbatch.choose.tune import cache

    monkeypatch.setenv("MICROBATCH_CACHE_DIR", str(tmp_path))
    os.mkfifo(tmp_path / "tune-abc.json")  # read, it waited for a writer forever
    assert cache.load_points("abc") == {}


def test_a_full_stderr_in_ascii_is_silent_too():
    # click writes through the stream's bytes where its encoding is ASCII: those writes were not guarded
    import io

    import click

    from microbatch.cli import _SilentOnFailure

    class FullRaw(io.RawIOBase):
        def writable(self):
            return True

        def write(self, b):
            raise OSError(errno.ENOSPC, "No space left on device")

    for encoding in ("utf-8", "ascii"):
        bare = io.TextIOWrapper(io.BufferedWriter(FullRaw()), encoding=encoding)
        old = sys.stderr
        sys.stderr = bare
        try:
            with pytest.raises(OSError):  # the stream itself: the failure the wrapper must absorb
                click.echo("note: a line × ≥", err=True)
                sys.stderr.flush()
            stream = _SilentOnFailure(io.TextIOWrapper(io.BufferedWriter(FullRaw()), encoding=encoding))
            sys.stderr = stream
            click.echo("note: a line × ≥", err=True)  # raised ENOSPC under ascii
            sys.stderr.flush()
        finally:
            sys.stderr = old
        assert stream._failed, encoding  # the failure was met, and dropped


def test_what_is_not_the_users_own_file_is_written_in_place(tmp_path):
    # /dev/stdout appended to a log keeps the log's lines; a hard-linked file stays one file under both names
    log = tmp_path / "log.txt"
    log.write_text("earlier line\n")
    script = "from microbatch.commands._outputs import write_text; write_text('/dev/stdout', 'the answer\\n')"
    with open(log, "a") as f:
        subprocess.run([sys.executable, "-c", script], stdout=f, check=True, timeout=60)
    assert log.read_text() == "earlier line\nthe answer\n"  # was: the answer alone (or nothing)
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text("old")
    os.link(a, b)
    _outputs.write_text(a, "new")
    assert b.read_text() == "new" and a.stat().st_ino == b.stat().st_ino
