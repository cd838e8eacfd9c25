"""ChildProber.close ends and reaps the child even when Popen's wait lock was left held.

A Ctrl-C landing between ``Popen._waitpid_lock.acquire()`` and its ``try`` leaves the lock held;
``Popen.wait()`` then blocks forever on a zombie (``microbatch tune`` interrupted: 1 hang in 8)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

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
