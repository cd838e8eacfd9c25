"""Ctrl-C keeps what was measured: ``noise`` and ``pipeline`` exit 130 and print the partial result.

Each test starts the command in its own process group, waits for the progress line on stderr that
says a step was measured (never a fixed sleep), sends SIGINT to the whole group as a terminal does,
and checks the exit status and the values of what was kept. Every wait is bounded.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import pytest

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX process groups and SIGINT")


class Command:
    """``python -m microbatch ARGS`` in a new process group, its stderr read line by line."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "microbatch", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # its own group: SIGINT reaches it and its children, not pytest
            env={**os.environ, **(env or {})},
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.err: list[str] = []
        self.out: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._out_reader = threading.Thread(
            target=lambda: self.out.append(self.proc.stdout.read()), daemon=True
        )
        self._out_reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.put(line)
        self.lines.put(None)

    def wait_for(self, seen: Callable[[str], bool], timeout_s: float) -> str:
        """The first stderr line for which ``seen`` holds; fails when the command ends or time runs out."""
        end = time.monotonic() + timeout_s
        while True:
            try:
                line = self.lines.get(timeout=max(0.01, end - time.monotonic()))
            except queue.Empty:
                self.kill()
                pytest.fail(
                    f"no such progress line within {timeout_s} s; stderr so far:\n{''.join(self.err)}"
                )
            if line is None:
                pytest.fail(
                    f"the command ended before the line came (rc {self.proc.wait()}):\n{''.join(self.err)}"
                )
            self.err.append(line)
            if seen(line):
                return line

    def interrupt(self, timeout_s: float = 60.0) -> tuple[int, str, str]:
        """SIGINT to the whole group (a terminal's Ctrl-C); (exit status, stdout, the rest of stderr)."""
        os.killpg(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"the command did not end within {timeout_s} s of SIGINT")
        self._reader.join(timeout=10)
        self._out_reader.join(timeout=10)
        while not self.lines.empty():
            line = self.lines.get()
            if line is not None:
                self.err.append(line)
        return self.proc.returncode, "".join(self.out), "".join(self.err)

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)


def test_noise_interrupted_after_a_step_exits_130_with_the_steps_measured():
    cmd = Command(
        "noise", "--model", "tiny", "--seq", "16", "-B", "8", "-b", "2", "--steps", "100000", "--json"
    )
    cmd.wait_for(lambda line: line.startswith("noise: step 1/100000 measured"), timeout_s=60)
    rc, out, err = cmd.interrupt()
    assert rc == 130, err
    r = json.loads(out)
    assert r["command"] == "noise" and r["interrupted"] is True and r["steps_asked"] == 100000
    assert 1 <= r["steps"] < 100000 and len(r["per_step"]) == r["steps"]
    # the kept estimate is the plain mean of the steps kept (decay 1), as a finished run's is
    assert r["g_sq"] == pytest.approx(sum(p["g_sq"] for p in r["per_step"]) / r["steps"])
    assert r["trace_sigma"] == pytest.approx(sum(p["trace_sigma"] for p in r["per_step"]) / r["steps"])
    assert f"interrupted: kept the {r['steps']} step(s) measured of 100000" in err
    assert "Traceback" not in err


def test_noise_interrupted_prints_the_partial_estimate_as_text():
    cmd = Command("noise", "--model", "tiny", "--seq", "16", "-B", "8", "-b", "2", "--steps", "100000")
    cmd.wait_for(lambda line: line.startswith("noise: step 2/100000 measured"), timeout_s=60)
    rc, out, err = cmd.interrupt()
    assert rc == 130, err
    head = out.splitlines()[0]
    n = int(head.split(", ")[-1].split()[0])
    assert n >= 2 and f"(interrupted: {n} of 100000 measured)" in head
    assert "|G|²   (smoothed)  =" in out and "tr(Σ)  (smoothed)  =" in out


def test_pipeline_interrupted_in_the_run_exits_130_with_the_steps_every_rank_finished(tmp_path):
    """SIGINT after the run's first finished step: the launcher kills the ranks, summarises the steps
    every rank finished (their step logs) and prints that report; --trace is written from it."""
    trace = tmp_path / "t.json"
    args = ["pipeline", "--model", "tiny", "-p", "2", "-m", "4", "--steps", "2000", "--timeout", "600"]
    cmd = Command(*args, "--no-predict", "--json", "--trace", str(trace))
    cmd.wait_for(lambda line: line.startswith("pipeline:   step "), timeout_s=120)
    rc, out, err = cmd.interrupt()
    assert rc == 130, err
    r = json.loads(out)
    assert r["command"] == "pipeline" and r["interrupted"] is True and r["steps_asked"] == 2000
    n = r["steps"]  # the envelope says why it exits 130, the kept result beside it
    assert (
        r["kind"] == "interrupted"
        and r["error"] == f"interrupted: kept the {n} step(s) of 2000 every rank finished"
    )
    assert 1 <= n < 2000 and r["measured_steps"] == max(1, n - 1)
    m = r["measured"]
    assert len(m["bubble_steps"]) == r["measured_steps"] and 0.0 < m["bubble_fraction"] < 1.0
    assert m["step_time_s"] > 0 and len(r["losses"]) == n  # the last stage's loss of every kept step
    assert any("interrupted (Ctrl-C or SIGTERM) after" in note for note in r["notes"])
    assert r["trace"] == str(trace) and json.loads(trace.read_text())["traceEvents"]
    assert f"interrupted: kept the {n} step(s) of 2000 every rank finished" in err
    assert "Traceback" not in err


def test_pipeline_interrupted_in_a_calibration_says_where_and_exits_130():
    """SIGINT while the calibration's ranks run: nothing of the run itself was measured; it says so."""
    cmd = Command("pipeline", "--model", "tiny", "-p", "2", "-m", "4", "--steps", "3", "--json")
    cmd.wait_for(lambda line: line.startswith("pipeline: 2 ranks started for"), timeout_s=120)
    rc, out, err = cmd.interrupt()
    assert rc == 130, err
    # the calibration's ranks take seconds to start: the signal lands in the calibration run
    assert re.search(r"interrupted during the calibration run: no step of the run was measured", err), err
    assert json.loads(out) == {**json.loads(out), "kind": "interrupted"}
    assert "Traceback" not in err


def _fork_server_of(pid: int) -> int | None:
    """The fork server among ``pid``'s children (its command line names multiprocessing's forkserver)."""
    from _helpers import children_of

    for child in children_of(pid):
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                if b"multiprocessing.forkserver" in f.read():
                    return child
        except OSError:
            continue
    return None


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the fork server in /proc")
def test_pipeline_interrupted_while_its_fork_server_imports_torch_prints_no_traceback():
    """A Ctrl-C reaches the launcher's whole process group, the fork server too, which printed a
    KeyboardInterrupt traceback from inside torch's import (it ignores SIGINT only once its imports are made)."""
    cmd = Command("pipeline", "--model", "tiny", "-p", "2", "-m", "2", "--steps", "3", "--json")
    cmd.wait_for(lambda line: line.startswith("pipeline: calibration run of torch's runtime"), timeout_s=120)
    end = time.monotonic() + 60
    while _fork_server_of(cmd.proc.pid) is None and time.monotonic() < end:
        time.sleep(0.05)
    assert _fork_server_of(cmd.proc.pid) is not None, "no fork server started"
    time.sleep(0.5)  # inside its imports (about 5 s of torch on the dev VM)
    rc, out, err = cmd.interrupt()
    assert rc == 130, err
    assert json.loads(out)["kind"] == "interrupted"
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
