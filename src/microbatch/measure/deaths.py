"""How a child process died, in words (:func:`death_text`), and whether that death says it ran out of memory
(:func:`death_is_oom`): a ``tune`` probe's child and a pipeline rank read the same way."""

from __future__ import annotations

import signal

__all__ = [
    "ALLOCATION_FAILURE_MARKERS", "CRASH_MARKERS", "death_text", "death_is_oom", "explains_crash", "memory_stall_s",
    "oom_kills", "pressure_note",
]  # fmt: skip

ALLOCATION_FAILURE_MARKERS = (
    "bad_alloc", "cannot allocate memory", "can't allocate", "out of memory", "allocation failed",
    "failed to allocate", "memoryerror",
)  # fmt: skip
"""Words on a dead child's stderr that say an allocation failed (C++'s ``std::bad_alloc`` through ``terminate``, the
C library's ``ENOMEM`` text, torch's and OpenBLAS's allocators, Python's ``MemoryError``)."""

CRASH_MARKERS = (
    "error",
    "traceback",
    "terminate called",
    "what():",
    "fatal",
    "exception",
    "enforce",
    "abort",
)
"""Words that make the end of a dead child's stderr the account of its death (a Python traceback, C++'s
``terminate called after throwing ... what():``, gloo's ``EnforceNotMet``, ``Fatal Python error``), not the last
warning it happened to print."""


def death_text(returncode: int | None) -> str:
    """``killed by signal SIGSEGV``, ``exit status 1``: a child's end as ``Popen.returncode`` gives it."""
    if returncode is None:
        return "no exit status"
    if returncode >= 0:
        return f"exit status {returncode}"
    try:
        return f"killed by signal {signal.Signals(-returncode).name}"
    except ValueError:
        return f"killed by signal {-returncode}"


VMSTAT = "/proc/vmstat"
"""The kernel's event counters; its ``oom_kill`` line counts every process the OOM killer has killed (Linux 4.13 on,
``mm/oom_kill.c``: a cgroup's kills included), on the whole machine."""


def oom_kills(path: str = VMSTAT) -> int | None:
    """The kernel's count of OOM kills (:data:`VMSTAT`'s ``oom_kill``), None where it cannot be read."""
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


PSI_MEMORY = "/proc/pressure/memory"
"""Linux's pressure-stall information for memory (4.20 on, ``Documentation/accounting/psi.rst``): its ``some`` line's
``total`` is the microseconds during which some task stalled waiting for memory, on the whole machine."""

STALL_NOTE_S = 0.1
"""Memory stalls (PSI ``some`` total) during a probe that make a SIGKILL's note name a user-space OOM killer: 100 ms,
a tenth of a second in which tasks waited on reclaim — none on an idle machine (0 µs on this VM at rest), and far
past the noise of a probe that fits."""


def memory_stall_s(path: str = PSI_MEMORY) -> float | None:
    """Seconds some task has stalled on memory since boot (:data:`PSI_MEMORY`), None where it cannot be read."""
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                if line.startswith("some "):
                    return int(line.rsplit("total=", 1)[1]) / 1e6
    except (OSError, ValueError, IndexError):
        return None
    return None


def pressure_note(returncode: int | None, stall_before: float | None, stall_after: float | None) -> str:
    """For a SIGKILL that is not counted as out of memory (:func:`death_is_oom`): a sentence saying the machine was
    short of memory while the child ran, where PSI stalls grew by :data:`STALL_NOTE_S` or more — systemd-oomd (on by
    default in Ubuntu 22.04 and Fedora 34 on) and earlyoom kill with SIGKILL from user space, which the kernel's
    OOM-kill count does not see. Empty otherwise: the death is still not taken as out of memory (a guess cached
    would stop every later run below that size), but the user learns where to look."""
    if returncode != -signal.SIGKILL or stall_before is None or stall_after is None:
        return ""
    stalled = stall_after - stall_before
    if stalled < STALL_NOTE_S:
        return ""
    return (
        f"; tasks stalled {stalled:.1f} s waiting for memory while it ran (/proc/pressure/memory): a user-space "
        "out-of-memory killer (systemd-oomd, earlyoom) may have ended it — if so, give a memory budget below this "
        "size"
    )


def death_is_oom(
    returncode: int | None,
    stderr_tail: str,
    oom_kills_before: int | None = None,
    oom_kills_after: int | None = None,
) -> bool:
    """Whether a child's death counts as running out of memory: SIGKILL (what the kernel's OOM killer sends), or
    another signal with an allocation failure on its stderr (under ``RLIMIT_AS`` a native allocation that fails may
    abort the process rather than raise). A segfault or an abort with nothing of the kind is a crash, not a size
    that does not fit: counted as out of memory it was cached and the search stopped below it. A SIGKILL while the
    kernel's OOM-kill count (:func:`oom_kills`, read before the child's work and after its death) did not move came
    from someone else (``kill -9``, a job scheduler): not out of memory. Counted as one, it was cached, and every
    later tune stopped below that size (a review: b_m 4 kept out for good, where an unkilled run chose it)."""
    if returncode is None or returncode >= 0:
        return False
    if -returncode == signal.SIGKILL:
        return oom_kills_before is None or oom_kills_after is None or oom_kills_after > oom_kills_before
    low = stderr_tail.lower()
    return any(m in low for m in ALLOCATION_FAILURE_MARKERS)


def explains_crash(stderr_tail: str) -> bool:
    """Whether the end of a dead child's stderr accounts for its death (:data:`CRASH_MARKERS`)."""
    low = stderr_tail.lower()
    return any(m in low for m in CRASH_MARKERS)
