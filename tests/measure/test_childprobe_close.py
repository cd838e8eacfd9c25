"""ChildProber.close ends and reaps the child even when Popen's wait lock was left held.

A Ctrl-C landing between ``Popen._waitpid_lock.acquire()`` and its ``try`` leaves the lock held;
``Popen.wait()`` then blocks forever on a zombie (``microbatch tune`` interrupted: 1 hang in 8)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from microbatch.measure.childprobe import ChildProber, _reap
from microbatch.measure.spec import ProbeSpec

# reads stdin to its end, then exits 3
CHILD = "import sys; sys.stdin.read(); sys.exit(3)"
# ignores stdin's end: only a kill ends it
STUBBORN = "import time\nwhile True: time.sleep(0.05)"


def _child(code: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, text=True)


def _close_with_the_lock_held(proc: subprocess.Popen[str]) -> float:
    prober = ChildProber(ProbeSpec(model="tiny", seq=32))
    prober.proc = proc
    assert proc._waitpid_lock.acquire(False)  # the lock a KeyboardInterrupt leaked
    done = threading.Event()
    t0 = time.monotonic()
    worker = threading.Thread(target=lambda: (prober.close(), done.set()), daemon=True)
    worker.start()
    assert done.wait(30), "close() blocked on Popen's lock"
    assert prober.proc is None
    return time.monotonic() - t0


def test_close_reaps_a_child_that_exits_on_stdin_end_despite_the_lock() -> None:
    proc = _child(CHILD)
    elapsed = _close_with_the_lock_held(proc)
    assert proc.returncode == 3  # its own exit status, read by os.waitpid
    assert elapsed < 5


def test_close_kills_a_child_that_does_not_exit_after_ten_seconds() -> None:
    proc = _child(STUBBORN)
    elapsed = _close_with_the_lock_held(proc)
    assert proc.returncode == -9  # SIGKILL
    assert 9 < elapsed < 25


def test_reap_times_out_on_a_live_child_and_reads_a_dead_one() -> None:
    proc = _child(STUBBORN)
    try:
        assert _reap(proc, timeout_s=0.2) is False and proc.returncode is None
    finally:
        proc.kill()
    assert _reap(proc, timeout_s=None) is True and proc.returncode == -9


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.timeout(90)
def test_a_busy_worker_ends_when_its_parent_is_killed(tmp_path):
    """A parent killed outright (SIGTERM's default, SIGKILL) runs no clean-up; its probe worker, inside a long
    probe (it reads the closed stdin only after), must not outlive it: one was left at parent 1, burning a
    core, 2026-12-04. Here the worker times a tiny model at s = 16,384 (many seconds on 2 cores) when its
    parent dies 2 s in."""
    spec = ProbeSpec(model="tiny", seq=16384).to_dict()
    pid_file = tmp_path / "child.pid"
    parent = (
        "import json, os, signal, subprocess, sys, time\n"
        "p = subprocess.Popen([sys.executable, '-m', 'microbatch.measure.childprobe', '--worker'],"
        " stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)\n"
        f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
        f"p.stdin.write(json.dumps({{'op': 'setup', 'spec': {spec!r}, 'limit_bytes': None}}) + '\\n')\n"
        "p.stdout.readline()\n"
        "p.stdin.write(json.dumps({'op': 'probe', 'micro_batch': 4, 'checkpointing': False}) + '\\n')\n"
        "time.sleep(2)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src"),
        "OMP_NUM_THREADS": "1",
    }
    subprocess.run([sys.executable, "-c", parent], env=env, timeout=60, check=False)
    child = int(pid_file.read_text())
    alive = True
    for _ in range(50):  # the kernel kills the worker at its parent's death
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            alive = False
            break
        time.sleep(0.1)
    if alive:
        os.kill(child, 9)  # do not leave it running
    assert not alive, f"probe worker {child} outlived its killed parent by 5 s"
