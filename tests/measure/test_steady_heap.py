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
hostmem.mark_probe_child()  # as the probe child's worker does (a no-op without its environment)
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


def test_a_process_that_only_exports_the_same_glibc_settings_keeps_its_heap() -> None:
    """The probe child says it is one (``mark_probe_child``); the environment alone (a user's export) is not it."""
    got = _run("""
        hostmem._PROBE_CHILD.clear()  # the prelude marked it: undo, as in a user's process
        with hostmem.steady_heap() as switched:
            churn()
            inside = mapped_by()
        print(json.dumps({"fixed": hostmem.tracking_heap(), "switched": switched, "inside": inside}))
    """)
    assert got == {"fixed": None, "switched": False, "inside": True}


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


def test_the_memory_limit_stays_the_real_budget_plus_what_is_mapped_but_not_resident() -> None:
    """A function of the state, not of history: after each steady phase the soft limit is the budget it stood for at
    the first (limit less the unresident address space then) plus the unresident address space now, so it rises
    by what the heap keeps mapped, and falls again when that is returned."""
    got = _run("""
        def unresident():
            return hostmem.virtual_bytes() - hostmem.current_rss_bytes()
        soft0 = hostmem.virtual_bytes() + (2 << 30)
        resource.setrlimit(resource.RLIMIT_AS, (soft0, resource.RLIM_INFINITY))
        budget = soft0 - unresident()
        rounds = []
        for _ in range(2):
            with hostmem.steady_heap():
                chunks = [libc.malloc(ctypes.c_size_t(1 << 20)) for _ in range(64)]
                for p in chunks:
                    ctypes.memset(p, 1, 1 << 20)
                for p in chunks[::2]:  # every other one freed, between live ones: the heap cannot shrink
                    libc.free(ctypes.c_void_p(p))
            rounds.append((resource.getrlimit(resource.RLIMIT_AS)[0], unresident()))
            for p in chunks[1::2]:
                libc.free(ctypes.c_void_p(p))
        print(json.dumps({"budget": budget, "soft0": soft0, "rounds": rounds}))
    """)
    (soft1, unres1), (soft2, unres2) = got["rounds"]
    assert unres1 > got["soft0"] - got["budget"] + (
        24 << 20
    )  # the heap kept its freed middle mapped, trimmed
    for soft, unres in got["rounds"]:  # to within the pages the reading itself touches
        assert soft == pytest.approx(got["budget"] + unres, abs=256 << 10)
    assert soft2 - soft1 == pytest.approx(unres2 - unres1, abs=256 << 10)  # no creep from counting twice


def test_probe_child_peak_is_read_on_the_tracking_heap_and_the_repeats_timed_on_the_steady_heap() -> None:
    got = _run("""
        import torch
        torch.set_num_threads(1)
        from microbatch.measure.device import Device, steady_timing
        from microbatch.measure.hostmem import current_rss_bytes
        dev = Device("cpu", "process")
        dev.free()
        dev.reset_peak()
        base = current_rss_bytes()
        seen = []
        def memory_phase():  # 64 MiB touched, then freed
            seen.append(("memory", mapped_by()))
            t = torch.ones(16 << 20)
            del t
        def timed():  # 128 MiB: after the peak was read, so not in it
            seen.append(("timed", mapped_by()))
            t = torch.ones(32 << 20)
            del t
            return 7
        value, peak, heap = steady_timing(dev, memory_phase, timed)
        print(json.dumps({"tracks": dev.tracks_heap, "seen": seen, "value": value, "rise": peak[0] - base,
                          "heap": heap}))
    """)
    assert got["tracks"] is True
    assert got["seen"] == [["memory", True], ["timed", False]]
    assert got["value"] == 7 and got["heap"] == "steady"
    assert 64 << 20 <= got["rise"] < 128 << 20  # the memory phase's 64 MiB, not the timing's 128


def test_a_real_allocation_refused_on_the_steady_heap_times_again_on_the_tracking_heap() -> None:
    """Under the child's address-space limit a refused CPU allocation is torch's error (a RuntimeError by its
    words, or its OutOfMemoryError): the repeats run again where the memory phase fitted."""
    got = _run("""
        import torch
        torch.set_num_threads(1)
        from microbatch.measure.device import Device, steady_timing
        resource.setrlimit(resource.RLIMIT_AS, (hostmem.virtual_bytes() + (512 << 20), resource.RLIM_INFINITY))
        dev = Device("cpu", "process")
        calls = []
        def timed():
            calls.append(mapped_by())
            if len(calls) == 1:
                torch.ones(1 << 30)  # 4 GiB past a 512 MiB limit
            return 8
        value, _, heap = steady_timing(dev, lambda: None, timed)
        other = []
        try:
            steady_timing(dev, lambda: None, lambda: other.append(1) or int("x"))
        except ValueError as e:
            other.append(str(e)[:20])
        print(json.dumps({"value": value, "calls": calls, "other": other, "heap": heap}))
    """)
    assert got["value"] == 8 and got["calls"] == [False, True]  # steady heap, then the tracking heap
    assert got["heap"] == "tracking"  # and the point says so (tune notes it)
    assert got["other"] == [1, "invalid literal for "]  # anything else is raised, not retried


def test_in_process_probe_reads_its_peak_over_the_timing_as_before() -> None:
    got = _run(
        """
        from microbatch.measure.device import Device
        from microbatch.measure.device import steady_timing
        seen = []
        value, peak, heap = steady_timing(Device("cpu"), lambda: seen.append("memory"), lambda: 3)
        print(json.dumps({"seen": seen, "value": value, "peak": peak, "heap": heap}))
        """,
        env={},
    )
    assert got == {"seen": [], "value": 3, "peak": None, "heap": None}


def test_tune_notes_the_points_timed_on_the_tracking_heap_and_only_those() -> None:
    from dataclasses import replace

    from microbatch.choose.config import ChoiceConfig
    from microbatch.choose.knee import recommend
    from microbatch.choose.result import TuneResult
    from microbatch.choose.tune.entry import _with_heap_note
    from microbatch.choose.tune.search import curve_point
    from microbatch.measure.probes import Measurement

    heaps = {1: "steady", 2: "steady", 4: "tracking", 8: "tracking"}
    pts = [Measurement(micro_batch=b, throughput=100.0 * b, step_time_s=0.01, peak_memory_bytes=10**8 + b,
                       timed_heap=h) for b, h in heaps.items()]  # fmt: skip
    rec = recommend([curve_point(p) for p in pts], ChoiceConfig(reference="measured"))
    result = TuneResult(points=pts, recommendation=rec, model="tiny", seq=64, mode="train", device="cpu",
                        device_name="cpu", precision="fp32", checkpointing="off", torch_version="x",
                        memory_budget_bytes=None, memory_method="vmhwm", stop_reason="flat", skipped=[],
                        interrupted=False, oom_events=0, probes=4, cached=0, wall_time_s=1.0)  # fmt: skip
    noted = _with_heap_note(result)
    assert len(noted.notes) == 1 and noted.notes[0].startswith(
        "b_m 4, 8 timed with each tensor mapped afresh"
    )
    steady = replace(result, points=[replace(p, timed_heap="steady") for p in pts])
    assert _with_heap_note(steady).notes == ()
    assert noted.to_dict()["points"][2]["timed_heap"] == "tracking"  # in the file, point by point


def test_a_decode_probe_reads_its_peak_over_every_step_and_times_the_steps_on_the_steady_heap() -> None:
    """Decoding timed on the tracking heap (every tensor mapped and faulted in afresh each step) read a Hugging Face
    Llama's tokens/s 1.5-1.7x low and the built-in GPT's about 1.1x: the probe decodes every step it may time
    untimed on the tracking heap first (the cache at its largest: the peak), then times the steps on the steady
    heap, as a user's process decodes."""
    got = _run("""
        import torch
        torch.set_num_threads(1)
        from microbatch.measure.gpt import build_model
        from microbatch.measure.probes import DecodeProbe
        from microbatch.model import get_model
        shape = get_model("tiny", seq=128)
        probe = DecodeProbe(build_model(shape), vocab=shape.vocab, seq=128, device="cpu")
        calls = []
        real = probe._decode
        def spy(b, steps):
            calls.append((steps, mapped_by()))
            return real(b, steps)
        probe._decode = spy
        m = probe.measure(4)
        print(json.dumps({"calls": calls, "heap": m.timed_heap, "new": probe.new_tokens, "oom": m.oom,
                          "tps": m.tokens_per_s, "lat": m.step_time_s, "peak": m.peak_memory_bytes}))
    """)
    assert not got["oom"] and got["heap"] == "steady"
    # the memory phase decodes all new_tokens steps on the tracking heap, then the timing runs on the steady heap
    assert got["calls"] == [[got["new"], True], [None, False]]
    assert got["tps"] == pytest.approx(4 / got["lat"]) and got["peak"] > 0
