"""The CPU time a container may use: its cgroup's quota, in whole cores.

A container started with ``docker run --cpus 2`` or a Kubernetes pod with a CPU limit of 2 sees every core of its
host in its affinity mask (``os.sched_getaffinity``) and in ``os.cpu_count()``, but the kernel's CFS bandwidth control
lets it run 2 cores' worth of time per period and throttles it past that. A tool that sized its threads or its local
ranks to the 64 cores it sees would be throttled, and a prediction that put 8 ranks on 8 cores would not hold.
:func:`quota_cores` reads the quota where the kernel keeps it (``Documentation/admin-guide/cgroup-v2.rst``, "cpu.max":
"$MAX $PERIOD ... indicates that the group may consume up to $MAX in each $PERIOD duration. 'max' for $MAX indicates
no limit"; cgroup v1's ``cpu.cfs_quota_us`` and ``cpu.cfs_period_us``, -1 for none,
``Documentation/scheduler/sched-bwc.rst``), along the process's cgroup path up to the root (a parent's limit binds
its children), and rounds it up to whole cores (1.5 CPUs: 2 threads may run, throttled for part of each period).
"""

from __future__ import annotations

import math
from pathlib import Path

__all__ = ["quota_cores", "usable_cores"]


def usable_cores() -> int:
    """The CPU cores this process may use: its affinity mask (Linux), else the machine's count, at most its
    container's CPU quota (:func:`quota_cores`: ``docker --cpus``, a pod's CPU limit). Re-exported by
    :mod:`microbatch.hardware`."""
    import os

    seen = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = quota_cores()
    return seen if quota is None else max(1, min(seen, quota))


def quota_cores(root: str | Path = "/") -> int | None:
    """The whole cores this process's cgroup quota allows (the tightest along its path), or None where none is set or
    none can be read (no cgroup file system, another OS). ``root``: where ``/proc`` and ``/sys`` are (tests)."""
    base = Path(root)
    try:
        lines = (base / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    limits: list[float] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and not controllers:  # cgroup v2: one tree
            limits += _along(base / "sys/fs/cgroup", path, _v2)
        elif "cpu" in controllers.split(","):  # cgroup v1: the cpu controller's own tree
            for mount in ("cpu,cpuacct", "cpuacct,cpu", "cpu"):
                limits += _along(base / "sys/fs/cgroup" / mount, path, _v1)
    return max(1, math.ceil(min(limits))) if limits else None


def _along(mount: Path, path: str, read: object) -> list[float]:
    """The limits ``read`` finds in ``mount`` at each folder from the cgroup ``path`` up to the mount's root (inside a
    container the mount is often its own cgroup already, so the root is read too)."""
    folder = mount / path.strip("/")
    found = []
    for d in (folder, *folder.parents):
        if not str(d).startswith(str(mount)):
            break
        value = read(d)  # type: ignore[operator]
        if value is not None:
            found.append(value)
    return found


def _v2(folder: Path) -> float | None:
    try:
        quota, period = (folder / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def _v1(folder: Path) -> float | None:
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
        return None if quota <= 0 or period <= 0 else quota / period
    except (OSError, ValueError):
        return None
