"""The probe child's timed repeats run on glibc's steady heap; its memory is read on the tracking heap.

Each check runs in a fresh Python started with the child's glibc settings (``WORKER_ENV``: they are read at
process start), and reads glibc's own counters (``mallinfo2``) or the kernel's (``/proc/self/status``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from microbatch.measure.childprobe import WORKER_ENV
from microbatch.measure.hostmem import steady_heap, tracking_heap

SRC = str(Path(__file__).resolve().parents[2] / "src")

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc and /proc")

_PRELUDE = """
import ctypes, json, resource
from microbatch.measure import hostmem
libc = hostmem._libc()
def mapped():
    return int(libc.mallinfo2().hblkhd)
def churn(n=64, size=1 << 20):
    # allocate and free n chunks of size bytes, touched, the way a step's activations come and go
    ptrs = [libc.malloc(ctypes.c_size_t(size)) for _ in range(n)]
    for p in ptrs:
        ctypes.memset(p, 1, size)
    for p in ptrs:
        libc.free(ctypes.c_void_p(p))
def mapped_by(size=1 << 20):
    # whether glibc maps a fresh chunk of size bytes (True) or serves it from the heap (False)
    before = mapped()
    p = libc.malloc(ctypes.c_size_t(size))
    out = mapped() > before
    libc.free(ctypes.c_void_p(p))
    return out
"""


def _run(body: str, *, env: dict[str, str] | None = None) -> dict:
    code = _PRELUDE + textwrap.dedent(body)
    full = {**os.environ, "PYTHONPATH": SRC, **(env if env is not None else WORKER_ENV)}
    if env is not None:
        for k in WORKER_ENV:
            full.pop(k, None)
        full.update(env)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=full)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_steady_heap_switches_only_where_the_process_fixed_the_tracking_heap() -> None:
    # in this test process (no MALLOC_ settings) nothing is switched
    assert tracking_heap() is None
    with steady_heap() as switched:
        assert switched is False
    got = _run("""
        before = mapped_by()
        with hostmem.steady_heap() as switched:
            churn()
            inside = mapped_by()
        after = mapped_by()
        print(json.dumps({"fixed": hostmem.tracking_heap(), "switched": switched,
                          "before": before, "inside": inside, "after": after}))
    """)
    assert got["fixed"] == [65536, 65536]
    assert got["switched"] is True
    # tracking heap: a 1 MiB tensor is its own mapping; steady heap: served from the freed heap, as in a
    # training process; after: mapped again
    assert (got["before"], got["inside"], got["after"]) == (True, False, True)


def test_after_the_steady_heap_large_chunks_are_mapped_afresh_not_served_from_its_freed_middle() -> None:
    """Without holding the freed chunks, glibc serves a tracked tensor from them (resident after it is
    freed): the later probe's peak would carry the timed repeats' fragmentation."""
    got = _run("""
        with hostmem.steady_heap():
            churn()
            keep = libc.malloc(ctypes.c_size_t(256))  # a small live chunk above the freed ones pins the heap
            churn()
        held = len(hostmem._PLUGS)
        plugged = [mapped_by(s) for s in (1 << 16, 1 << 20, 1 << 24)]
        hostmem._unplug_heap(libc)
        unplugged = [mapped_by(s) for s in (1 << 16, 1 << 20, 1 << 24)]
        print(json.dumps({"held": held, "plugged": plugged, "unplugged": unplugged}))
    """)
    assert got["held"] >= 1
    assert got["plugged"] == [True, True, True]
    assert (
        got["unplugged"].count(False) >= 1
    )  # what the plugs prevent: a heap chunk served to a large request


def test_the_memory_limit_moves_by_the_address_space_the_heap_keeps_without_holding_it() -> None:
    got = _run("""
        soft = hostmem.virtual_bytes() + (2 << 30)
        resource.setrlimit(resource.RLIMIT_AS, (soft, resource.RLIM_INFINITY))
        size0, rss0 = hostmem.virtual_bytes(), hostmem.current_rss_bytes()
        with hostmem.steady_heap():
            chunks = [libc.malloc(ctypes.c_size_t(1 << 20)) for _ in range(64)]
            for p in chunks:
                ctypes.memset(p, 1, 1 << 20)
            for p in chunks[::2]:  # every other one freed, between live ones: the heap cannot shrink
                libc.free(ctypes.c_void_p(p))
        size1, rss1 = hostmem.virtual_bytes(), hostmem.current_rss_bytes()
        print(json.dumps({"soft0": soft, "soft1": resource.getrlimit(resource.RLIMIT_AS)[0],
                          "kept": (size1 - size0) - (rss1 - rss0)}))
    """)
    # the heap keeps the 32 freed MiB mapped, not resident (trimmed); the limit binds on real memory:
    # that much is added to it (to within the pages the reading itself touches)
    assert got["kept"] > 24 << 20
    assert got["soft1"] - got["soft0"] == pytest.approx(got["kept"], abs=64 << 10)


def test_probe_child_peak_is_read_on_the_tracking_heap_and_the_repeats_timed_on_the_steady_heap() -> None:
    got = _run("""
        import torch
        torch.set_num_threads(1)
        from microbatch.measure.device import Device
        from microbatch.measure.device import steady_timing
        dev = Device("cpu", "process")
        seen = []
        def memory_phase():
            seen.append(("memory", mapped_by()))
        def timed():
            seen.append(("timed", mapped_by()))
            return 7
        value, peak = steady_timing(dev, memory_phase, timed)
        calls = []
        def failing_once():
            calls.append(mapped_by())
            if len(calls) == 1:
                raise MemoryError("the steady heap's slack")
            return 8
        again, _ = steady_timing(dev, lambda: None, failing_once)
        print(json.dumps({"tracks": dev.tracks_heap, "seen": seen, "value": value, "peak": peak[0],
                          "again": again, "calls": calls}))
    """)
    assert got["tracks"] is True
    assert got["seen"] == [["memory", True], ["timed", False]]
    assert got["value"] == 7 and got["peak"] > 0
    # an out-of-memory on the steady heap times again on the tracking heap
    assert got["again"] == 8 and got["calls"] == [False, True]


def test_in_process_probe_reads_its_peak_over_the_timing_as_before() -> None:
    got = _run(
        """
        from microbatch.measure.device import Device
        from microbatch.measure.device import steady_timing
        seen = []
        value, peak = steady_timing(Device("cpu"), lambda: seen.append("memory"), lambda: 3)
        print(json.dumps({"seen": seen, "value": value, "peak": peak}))
        """,
        env={},
    )
    assert got == {"seen": [], "value": 3, "peak": None}
