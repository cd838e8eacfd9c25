"""Host memory of this process: resident set size, its peak, and resetting that peak (Linux).

The peak resident set size is ``VmHWM`` in ``/proc/self/status``, reset by writing ``5`` to
``/proc/self/clear_refs`` (Linux ≥ 4.0), so one process can measure several probes in any
order. Where ``/proc`` is missing the peak falls back to ``getrusage(RUSAGE_SELF).ru_maxrss``, a
high-water mark that only rises. The figure includes the Python interpreter and torch's
libraries (about 0.2–0.4 GB); the per-sample slope does not.

**The heap a training process holds.** The probe child fixes glibc's mmap threshold
(:data:`~microbatch.measure.childprobe.WORKER_ENV`) so that each large tensor is its own mapping and the
address space tracks the resident memory under ``RLIMIT_AS``; but then every such tensor is mapped, faulted
in page by page and unmapped again each step, which a user's process does not do (glibc raises its
threshold to each freed mapping's size, up to 32 MiB, and reuses the heap). :func:`steady_heap` gives the
timed repeats glibc's steady state and puts the tracking settings back after.
"""

from __future__ import annotations

import ctypes
import functools
import os
import resource
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = [
    "STEADY_MMAP_THRESHOLD",
    "mark_probe_child",
    "tracking_heap",
    "steady_heap",
    "replug",
    "rebind_limit",
    "available_host_bytes",
    "reset_peak_rss",
    "peak_rss_bytes",
    "current_rss_bytes",
    "virtual_bytes",
    "malloc_trim",
]


def _status_kib(key: str) -> int | None:
    """The ``key`` line of ``/proc/self/status`` in KiB; None where it cannot be read."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def reset_peak_rss() -> bool:
    """Reset the process's peak RSS (``echo 5 > /proc/self/clear_refs``); False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """Peak resident set size of this process since start or the last :func:`reset_peak_rss`."""
    kib = _status_kib("VmHWM")
    if kib is None:
        import resource

        kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return kib * 1024


def current_rss_bytes() -> int:
    """Resident set size of this process now (``VmRSS``); 0 where ``/proc`` is missing."""
    return (_status_kib("VmRSS") or 0) * 1024


def virtual_bytes() -> int:
    """Address space of this process now (``VmSize``, what ``RLIMIT_AS`` limits); 0 without ``/proc``."""
    return (_status_kib("VmSize") or 0) * 1024


def malloc_trim() -> bool:
    """Return freed heap memory to the system (glibc ``malloc_trim(0)``), so that the resident set
    after a probe is not inflated by what an earlier, larger probe freed. False where unavailable."""
    libc = _glibc()
    return bool(libc.malloc_trim(0)) if libc is not None and hasattr(libc, "malloc_trim") else False


def available_host_bytes() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes (what can be allocated without swapping); None
    where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


M_TRIM_THRESHOLD = -1
"""``mallopt`` parameter numbers of glibc's ``<malloc.h>``."""
M_MMAP_THRESHOLD = -3

STEADY_MMAP_THRESHOLD = 32 * 1024 * 1024
"""Where glibc's dynamic mmap threshold ends on a 64-bit system (``DEFAULT_MMAP_THRESHOLD_MAX``,
4·1024·1024·sizeof(long) bytes, malloc(3) ``M_MMAP_THRESHOLD``): a process that frees and allocates the same
tensors each step serves those up to this size from its heap, whose trim threshold glibc keeps at twice it."""


_PROBE_CHILD: list[tuple[int, int]] = []
"""The tracking thresholds of the probe child, once :func:`mark_probe_child` has run there (empty elsewhere)."""


def mark_probe_child() -> None:
    """Say that this process is the probe child, which fixed glibc's heap to track memory through its environment
    (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``: :data:`~microbatch.measure.childprobe.WORKER_ENV`).
    Called by the child's worker alone: a user's process that exports the same variables keeps its own heap."""
    mmap, trim = os.environ.get("MALLOC_MMAP_THRESHOLD_"), os.environ.get("MALLOC_TRIM_THRESHOLD_")
    if mmap and mmap.isdigit():
        _PROBE_CHILD[:] = [(int(mmap), int(trim) if trim and trim.isdigit() else 2 * int(mmap))]


def tracking_heap() -> tuple[int, int] | None:
    """(mmap threshold, trim threshold) of the probe child's tracking heap (:func:`mark_probe_child`), where
    glibc's calls :func:`steady_heap` needs are there (glibc >= 2.33); None elsewhere."""
    return _PROBE_CHILD[0] if _PROBE_CHILD and _libc() is not None else None


class _MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (glibc >= 2.33, ``<malloc.h>``)."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


_PLUGS: list[int] = []
"""Free heap chunks held (never touched) while the tracking heap is on, so that large tensors are mapped
afresh as in a new process (:func:`_plug_heap`)."""


def _plug_heap(libc: Any, threshold: int) -> None:
    """Hold every free heap chunk of at least ``threshold`` bytes: glibc serves a request from a free chunk that
    fits before it maps one, so without this a later probe's tensors would land in the heap's freed middle, whose
    pages stay resident after they are freed: a peak inflated by the timed repeats' fragmentation (+88 MiB on
    gpt2 at b_m 2). A request is halved once glibc maps it, grows its heap for it, or refuses it (no free chunk
    that large is left); the held chunks are not touched, so not resident."""
    size = STEADY_MMAP_THRESHOLD
    while size >= threshold:
        before = libc.mallinfo2()
        ptr = libc.malloc(ctypes.c_size_t(size))
        if not ptr:
            size //= 2
            continue
        after = libc.mallinfo2()
        if after.hblkhd > before.hblkhd or after.arena > before.arena:  # not a free chunk of the heap
            libc.free(ctypes.c_void_p(ptr))
            size //= 2
        else:
            _PLUGS.append(ptr)


def _unplug_heap(libc: Any) -> None:
    """Give the held chunks back to glibc (the steady heap reuses them)."""
    while _PLUGS:
        libc.free(ctypes.c_void_p(_PLUGS.pop()))


def replug() -> None:
    """In the probe child, after freeing what a probe held and returning it (:func:`malloc_trim`): the heap's
    large free chunks held (:func:`_plug_heap`), so the next tensors are mapped afresh; nothing elsewhere."""
    fixed = tracking_heap()
    if fixed is not None and not _DEPTH[0]:
        _plug_heap(_libc(), fixed[0])
        rebind_limit()  # the held chunks are mapped, not resident: the limit keeps binding on real memory


_DEPTH = [0]
"""How many :func:`steady_heap` blocks this process is inside (an inner one changes nothing)."""

_REAL_LIMIT: list[int] = []
"""The real-memory budget the soft ``RLIMIT_AS`` stands for: the limit less the address space mapped but not
resident, read at the first :func:`steady_heap` (the child set the limit so)."""


def rebind_limit() -> None:
    """Set the soft ``RLIMIT_AS`` to the real-memory budget plus what is mapped now but not resident, so the limit
    keeps binding on real memory whatever the heap keeps mapped: a function of the state, not of history. The
    first call after the child sets the limit reads the budget it stands for."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return
    unresident = max(0, virtual_bytes() - current_rss_bytes())
    if not _REAL_LIMIT:
        _REAL_LIMIT.append(soft - unresident)
        return
    want = _REAL_LIMIT[0] + unresident
    resource.setrlimit(
        resource.RLIMIT_AS, (want if hard == resource.RLIM_INFINITY else min(hard, want), hard)
    )


@contextmanager
def steady_heap() -> Iterator[bool]:
    """Inside: glibc's mmap and trim thresholds as a training process reaches them
    (:data:`STEADY_MMAP_THRESHOLD`), in the probe child (:func:`tracking_heap`); yields whether it runs on them.
    After: the tracking thresholds again, the freed heap returned and its large free chunks held
    (:func:`replug`), and the soft ``RLIMIT_AS`` at the real-memory budget plus what the heap keeps mapped without
    holding it resident (:func:`rebind_limit`). Entered again inside, it changes nothing."""
    fixed = tracking_heap()
    if fixed is None:
        yield False
        return
    if _DEPTH[0]:
        yield True
        return
    libc = _libc()
    rebind_limit()  # the first time: reads the budget the limit stands for
    _DEPTH[0] += 1
    libc.mallopt(M_MMAP_THRESHOLD, STEADY_MMAP_THRESHOLD)
    libc.mallopt(M_TRIM_THRESHOLD, 2 * STEADY_MMAP_THRESHOLD)
    _unplug_heap(libc)  # at the steady trim threshold: freeing them trims nothing
    try:
        yield True
    finally:
        _DEPTH[0] -= 1
        libc.mallopt(M_MMAP_THRESHOLD, fixed[0])
        libc.mallopt(M_TRIM_THRESHOLD, fixed[1])
        try:
            malloc_trim()
            replug()
            rebind_limit()
        except MemoryError:  # at the limit: the next probe's free() does the bookkeeping
            pass


@functools.cache
def _glibc() -> Any:
    """glibc through ctypes (loaded once), or None where there is none."""
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


@functools.cache
def _libc() -> Any:
    """glibc with the calls :func:`steady_heap` needs (``mallopt``, ``mallinfo2``: glibc >= 2.33), or None where
    they are not there."""
    libc = _glibc()
    if libc is None:
        return None
    if not all(hasattr(libc, f) for f in ("mallopt", "mallinfo2", "malloc_trim")):
        return None
    libc.mallinfo2.restype = _MallInfo2
    libc.malloc.restype = ctypes.c_void_p
    return libc
