"""Host memory of this process: resident set size, its peak, and resetting that peak (Linux).

The peak resident set size is ``VmHWM`` in ``/proc/self/status``, reset by writing ``5`` to
``/proc/self/clear_refs`` (Linux ≥ 4.0), so one process can measure several probes in any
order. Where ``/proc`` is missing the peak falls back to ``getrusage(RUSAGE_SELF).ru_maxrss``, a
high-water mark that only rises. The figure includes the Python interpreter and torch's
libraries (about 0.2–0.4 GB); the per-sample slope does not.
"""

from __future__ import annotations

__all__ = [
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
