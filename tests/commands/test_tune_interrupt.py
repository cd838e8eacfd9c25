"""Ctrl-C anywhere in ``tune`` exits 130 and keeps what was measured (issue 30 item 4, issue 32 item 7)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from microbatch.choose.config import ChoiceConfig
from microbatch.choose.tune.config import ProbeConfig, SearchConfig
from microbatch.measure.probes import Measurement


def _children(pid: int) -> list[str]:
    """Command lines of the processes whose parent is ``pid``."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append((d / "cmdline").read_text().replace("\0", " "))
        except (OSError, ValueError, IndexError):
            continue
    return out


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc to see the probe process start")
def test_ctrl_c_during_the_first_probe_exits_130_saying_nothing_was_measured(tmp_path):
    env = dict(os.environ, MICROBATCH_CACHE_DIR=str(tmp_path / "cache"))
    cmd = [
        sys.executable,
        "-m",
        "microbatch",
        "tune",
        "--model",
        "small",
        "-B",
        "64",
        "--out",
        str(tmp_path / "o"),
    ]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not any("childprobe" in c for c in _children(p.pid)):  # the probe process has started
            assert p.poll() is None and time.monotonic() < deadline, "the probe process never started"
            time.sleep(0.05)
        time.sleep(0.3)
        os.killpg(p.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the whole group
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    # exit 130 (was 2: the probe process died of the SIGINT and read as an out-of-memory kill, or 'no
    # measured point to choose from'), one line saying so, and no probe process left behind
    assert p.returncode == 130, err
    assert "interrupted before any point was measured" in err and "Traceback" not in err
    assert out == "" and not (tmp_path / "o" / "result.json").exists()
    assert not any("childprobe" in c for c in _children(p.pid))


class _Prober:
    """A prober whose measurements follow a curve, and whose ``interrupt_at``-th call is a Ctrl-C."""

    def __init__(self, interrupt_at: int, close_interrupts: bool = False) -> None:
        self.calls, self.interrupt_at, self.close_interrupts = 0, interrupt_at, close_interrupts

    def start(self) -> None:
        pass

    def measure(self, b: int, *, checkpointing: bool = False) -> Measurement:
        self.calls += 1
        if self.calls == self.interrupt_at:
            raise KeyboardInterrupt
        time.sleep(0.2 if b == 1 else 0.01)  # a slow first probe (a child's start): the confirmation's budget
        t = {1: 100.0, 2: 150.0, 4: 190.0, 8: 200.0, 16: 201.0}[b]
        return Measurement(micro_batch=b, throughput=t, step_time_s=b / t, peak_memory_bytes=1000 * b, repeats=3,
                           spread=0.01)  # fmt: skip

    def close(self) -> None:
        if self.close_interrupts:
            raise KeyboardInterrupt  # a second Ctrl-C while the probe process is being ended


@pytest.mark.parametrize("close_interrupts", [False, True])
def test_ctrl_c_while_confirming_keeps_every_point(tmp_path, monkeypatch, close_interrupts):
    from microbatch.choose.tune.driver import Setup, run_search

    monkeypatch.setenv("MICROBATCH_CACHE_DIR", str(tmp_path))
    prober = _Prober(interrupt_at=5, close_interrupts=close_interrupts)  # 4 search probes, then confirming
    setup = Setup(
        model_label="m", fingerprint_fields={"t": 1}, budget_source="given", t_start=time.perf_counter()
    )
    result = run_search(
        prober,  # type: ignore[arg-type]
        ProbeConfig(device="cpu", seq=8),
        SearchConfig(max_micro_batch=16, use_cache=True),
        ChoiceConfig(reference="measured", global_batch=16, data_parallel=1),
        setup,
        None,
    )
    searched = [p.micro_batch for p in result.points]
    assert result.interrupted and prober.calls == len(searched) + 1  # the first re-measurement was the Ctrl-C
    assert searched[:4] == [1, 2, 4, 8] and result.recommendation.knee.micro_batch == 4
    assert "interrupted" in result.stop_reason
    saved = json.loads(next(tmp_path.glob("tune-*.json")).read_text())
    assert sorted(p["micro_batch"] for p in saved["points"]) == sorted(searched)  # kept on disk too


def test_a_rerun_after_an_interrupted_confirmation_says_the_knee_was_not_re_measured(tmp_path, monkeypatch):
    """A Ctrl-C while the knee was being re-measured left its single measurements in the cache, and a rerun served all
    of them from there with 0 probes and said nothing (a review: the noisy answer stuck in 2 of 6). The cache now says
    whether its knee was re-measured, and such a rerun says it was not; after a whole run it says nothing."""
    from microbatch.choose.tune.driver import Setup, run_search

    monkeypatch.setenv("MICROBATCH_CACHE_DIR", str(tmp_path))
    setup = Setup(
        model_label="m", fingerprint_fields={"t": 1}, budget_source="given", t_start=time.perf_counter()
    )

    def run(prober):
        return run_search(prober, ProbeConfig(device="cpu", seq=8), SearchConfig(max_micro_batch=16, use_cache=True),
                          ChoiceConfig(reference="measured", global_batch=16, data_parallel=1), setup, None)  # fmt: skip

    def saved():
        return json.loads(next(tmp_path.glob("tune-*.json")).read_text())

    first = run(_Prober(interrupt_at=6))  # 1, 2, 4, 8, 16 searched; the first re-measurement is the Ctrl-C
    assert first.interrupted and "while confirming the knee" in first.stop_reason
    assert all(p["confirmed"] is False for p in saved()["points"])
    again = run(_Prober(interrupt_at=0))
    assert again.probes == 0 and again.cached == 5
    assert (
        "the knee was not re-measured: the run that measured these points ended before it did"
        in again.stop_reason
    )
    for path in tmp_path.glob("tune-*.json"):
        path.unlink()
    whole = run(_Prober(interrupt_at=0))
    assert not whole.interrupted and whole.probes > 5 and all(p["confirmed"] for p in saved()["points"])
    cached = run(_Prober(interrupt_at=0))
    assert cached.probes == 0 and "not re-measured: the run" not in cached.stop_reason
