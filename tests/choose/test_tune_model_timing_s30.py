"""``tune_model`` on a CPU follows the command line's timing rule (one thread and the process clock on a CPU of four
cores or fewer): it timed with torch's threads on the wall clock, and on two shared cores sub-millisecond decode
steps read 100-700x slow and picked the wrong knee in 2 of 4 runs (a read-only review, 2026-12-07)."""

from __future__ import annotations

import pytest

from microbatch.choose.tune.config import ProbeConfig
from microbatch.choose.tune.entry import _resolved_probe, tune_model
from microbatch.measure.timing import TimingConfig
from microbatch.model import get_model


@pytest.mark.parametrize(("cores", "threads", "clock"), [(2, 1, "process"), (64, None, "wall")])
def test_the_cpu_rule_sets_threads_and_clock(monkeypatch, cores, threads, clock):
    monkeypatch.setattr("microbatch.hardware.usable_cores", lambda: cores)
    probe, why = _resolved_probe(ProbeConfig(mode="decode"), get_model("tiny"))
    assert (probe.threads, probe.timing.clock, probe.device) == (threads, clock, "cpu")
    assert f"{cores} cores detected" in why


def test_what_the_user_gave_is_kept(monkeypatch):
    monkeypatch.setattr("microbatch.hardware.usable_cores", lambda: 2)
    given = ProbeConfig(threads=2, timing=TimingConfig(clock="wall"))
    probe, why = _resolved_probe(given, get_model("tiny"))
    assert (probe.threads, probe.timing.clock) == (2, "wall") and "as given" in why


def test_tune_model_says_how_it_timed(monkeypatch, tmp_path):
    monkeypatch.setenv("MICROBATCH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr("microbatch.hardware.usable_cores", lambda: 2)
    r = tune_model("tiny", mode="decode", seq=64, use_cache=False, max_micro_batch=2)
    assert r.timing_choice.startswith("timing: 1 thread, process clock (2 cores detected")
    assert "1 thread, process clock" in r.to_dict()["timing_choice"]


def test_two_stalled_repeats_of_three_are_not_a_stable_median():
    from microbatch.choose.tune.probing import CPU_TIMING
    from microbatch.measure.timing import enough_repeats

    stalled = [0.102, 0.1, 0.00016]  # two repeats 600x slow (another process held the core), one as it runs
    assert not enough_repeats(stalled, CPU_TIMING, 0.2)
    assert not enough_repeats([*stalled, 0.00016], CPU_TIMING, 0.2)  # the median moved: not stable either
    settled = [*stalled, 0.00016, 0.000161, 0.00016]
    assert enough_repeats(settled, CPU_TIMING, 0.2)  # a median of the step as it runs
    assert enough_repeats([0.0101, 0.01, 0.0099], CPU_TIMING, 0.03)  # jitter of a few percent stops at three
    assert enough_repeats(stalled, CPU_TIMING, CPU_TIMING.max_time_s)  # the time limit still ends it
