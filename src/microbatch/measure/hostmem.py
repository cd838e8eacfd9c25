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
import os
import resource
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = [
    "STEADY_MMAP_THRESHOLD",
    "tracking_heap",
    "steady_heap",
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
    try:
        import ctypes

        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False


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


def tracking_heap() -> tuple[int, int] | None:
    """(mmap threshold, trim threshold) this process fixed through glibc's environment
    (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``: the probe child's), or None where it fixed none."""
    mmap, trim = os.environ.get("MALLOC_MMAP_THRESHOLD_"), os.environ.get("MALLOC_TRIM_THRESHOLD_")
    if not (mmap and mmap.isdigit()):
        return None
    return int(mmap), int(trim) if trim and trim.isdigit() else 2 * int(mmap)


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


def _mapped_bytes(libc: Any) -> int:
    """Bytes glibc holds in mmapped chunks now (``mallinfo2().hblkhd``)."""
    return int(libc.mallinfo2().hblkhd)


def _plug_heap(libc: Any, threshold: int) -> None:
    """Hold every free heap chunk of at least ``threshold`` bytes the steady heap left: glibc serves a request
    from a free chunk that fits before it maps one, so without this the tensors of a later probe would land
    in the heap's freed middle, whose pages stay resident after they are freed: a peak inflated by the
    fragmentation of the timed repeats (+3% on gpt2 at b_m 2). Each request is halved once it is mapped
    (no free chunk that large remains); the held chunks are not touched, so not resident."""
    size = STEADY_MMAP_THRESHOLD
    while size >= threshold:
        before = _mapped_bytes(libc)
        ptr = libc.malloc(ctypes.c_size_t(size))
        if not ptr:
            return
        if _mapped_bytes(libc) > before:  # mapped: no free chunk of this size is left in the heap
            libc.free(ctypes.c_void_p(ptr))
            size //= 2
        else:
            _PLUGS.append(ptr)


def _unplug_heap(libc: Any) -> None:
    """Give the held chunks back to glibc (the steady heap reuses them)."""
    while _PLUGS:
        libc.free(ctypes.c_void_p(_PLUGS.pop()))


@contextmanager
def steady_heap() -> Iterator[bool]:
    """Inside: glibc's mmap and trim thresholds as a training process reaches them
    (:data:`STEADY_MMAP_THRESHOLD`), where this process fixed them (:func:`tracking_heap`); yields whether
    it switched. After: the fixed thresholds again, the freed heap returned (``malloc_trim``) and its large
    free chunks held (:func:`_plug_heap`), and the soft ``RLIMIT_AS`` moved by the address space the heap
    keeps mapped without holding it resident, so the limit keeps binding on real memory (see
    :mod:`microbatch.measure.childprobe`)."""
    fixed = tracking_heap()
    libc = _libc()
    if fixed is None or libc is None:
        yield False
        return
    _unplug_heap(libc)
    size_before, rss_before = virtual_bytes(), current_rss_bytes()
    libc.mallopt(M_MMAP_THRESHOLD, STEADY_MMAP_THRESHOLD)
    libc.mallopt(M_TRIM_THRESHOLD, 2 * STEADY_MMAP_THRESHOLD)
    try:
        yield True
    finally:
        libc.mallopt(M_MMAP_THRESHOLD, fixed[0])
        libc.mallopt(M_TRIM_THRESHOLD, fixed[1])
        libc.malloc_trim(0)
        _plug_heap(libc, fixed[0])
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        kept = (virtual_bytes() - size_before) - (current_rss_bytes() - rss_before)
        if soft != resource.RLIM_INFINITY and kept > 0:
            soft = soft + kept if hard == resource.RLIM_INFINITY else min(hard, soft + kept)
            resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _libc() -> Any:
    """glibc through ctypes with the calls :func:`steady_heap` needs (``mallopt``, ``mallinfo2``: glibc >= 2.33),
    or None where they are not there."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    if not all(hasattr(libc, f) for f in ("mallopt", "mallinfo2", "malloc_trim")):
        return None
    libc.mallinfo2.restype = _MallInfo2
    libc.malloc.restype = ctypes.c_void_p
    return libc
