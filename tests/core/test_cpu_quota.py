"""A container's CPU quota in whole cores, read from a cgroup tree (v2's cpu.max, v1's cfs files) laid out in a
temporary root: a pod limited to 2 CPUs on a 64-core host saw 64 cores (affinity), and sized threads and ranks so."""

from __future__ import annotations

from pathlib import Path

import pytest

from microbatch import cpu_quota
from microbatch.cpu_quota import quota_cores


def _tree(root: Path, cgroup: str, files: dict[str, str]) -> Path:
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/self/cgroup").write_text(cgroup)
    for name, text in files.items():
        path = root / "sys/fs/cgroup" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


@pytest.mark.parametrize(
    "cgroup, files, cores",
    [
        ("0::/\n", {"cpu.max": "200000 100000\n"}, 2),  # v2, inside the container's namespace
        ("0::/\n", {"cpu.max": "150000 100000\n"}, 2),  # 1.5 CPUs: two threads may run
        ("0::/\n", {"cpu.max": "50000 100000\n"}, 1),
        ("0::/\n", {"cpu.max": "max 100000\n"}, None),  # no limit
        (
            "0::/pod/c1\n",
            {"pod/c1/cpu.max": "max 100000\n", "pod/cpu.max": "300000 100000\n"},
            3,
        ),  # the parent binds
        (
            "0::/pod/c1\n",
            {"pod/c1/cpu.max": "100000 100000\n", "pod/cpu.max": "300000 100000\n"},
            1,
        ),  # the tightest
        (
            "4:cpu,cpuacct:/docker/abc\n3:memory:/docker/abc\n",
            {"cpu,cpuacct/cpu.cfs_quota_us": "400000\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"},
            4,
        ),  # v1 without a cgroup namespace: the mount is the container's own
        (
            "4:cpu,cpuacct:/\n",
            {"cpu,cpuacct/cpu.cfs_quota_us": "-1\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"},
            None,
        ),
        ("0::/\n", {}, None),  # no cpu controller file
        ("garbage\n", {"cpu.max": "200000 100000\n"}, None),
    ],
)
def test_the_quota_in_whole_cores(tmp_path, cgroup, files, cores):
    assert quota_cores(_tree(tmp_path, cgroup, files)) == cores


def test_no_cgroup_file_system_is_no_quota(tmp_path):
    assert quota_cores(tmp_path) is None


def test_usable_cores_is_the_affinity_at_most_the_quota(monkeypatch):
    import os

    seen = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    monkeypatch.setattr(cpu_quota, "quota_cores", lambda: 1)
    assert cpu_quota.usable_cores() == 1
    monkeypatch.setattr(cpu_quota, "quota_cores", lambda: 10_000)
    assert cpu_quota.usable_cores() == seen
    monkeypatch.setattr(cpu_quota, "quota_cores", lambda: None)
    assert cpu_quota.usable_cores() == seen
