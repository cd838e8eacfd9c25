"""A dead child's end in words, and which deaths count as out of memory (microbatch.measure.deaths)."""

from __future__ import annotations

import os
import signal
import sys
import threading

import pytest

from microbatch.errors import MeasurementError
from microbatch.measure.childprobe import ChildProber
from microbatch.measure.deaths import death_is_oom, death_text, explains_crash
from microbatch.measure.spec import ProbeSpec
from microbatch.measure.timing import TimingConfig

GLOO_ABORT = (
    "terminate called after throwing an instance of 'gloo::EnforceNotMet'\n  what():  [enforce fail at "
    "gloo/transport/tcp/pair.cc:446] op.preamble.length <= op.nbytes. Received data size doesn't match expected size."
)


def test_death_text_names_the_signal_or_the_status():
    assert death_text(-int(signal.SIGSEGV)) == "killed by signal SIGSEGV"
    assert death_text(-int(signal.SIGKILL)) == "killed by signal SIGKILL"
    assert death_text(3) == "exit status 3" and death_text(None) == "no exit status"
    assert death_text(-200) == "killed by signal 200"


def test_only_sigkill_or_an_allocation_failure_counts_as_out_of_memory():
    assert death_is_oom(-int(signal.SIGKILL), "")
    assert not death_is_oom(-int(signal.SIGSEGV), "")  # a crash: it was cached as a size that does not fit
    assert not death_is_oom(-int(signal.SIGABRT), GLOO_ABORT)
    assert not death_is_oom(-int(signal.SIGTERM), "")  # stopped from outside
    assert death_is_oom(
        -int(signal.SIGABRT), "terminate called after throwing an instance of 'std::bad_alloc'"
    )
    assert not death_is_oom(1, "MemoryError")  # a status, not a signal: the child answers its own errors
    assert explains_crash(GLOO_ABORT) and not explains_crash("UserWarning: TypedStorage is deprecated")


def _killed_mid_probe(sig: signal.Signals, micro_batch: int = 4):
    """The probe's child killed by ``sig`` half a second into timing ``micro_batch`` (seconds at s = 4,096 on a
    small CPU); what ``measure`` then returned or raised."""
    timing = TimingConfig(warmup=1, min_repeats=2, max_repeats=3, max_time_s=1.0, rel_tol=0.5)
    prober = ChildProber(ProbeSpec(model="tiny", seq=4096, threads=1, timing=timing), timeout_s=120)
    try:
        prober.start()
        assert prober.proc is not None
        timer = threading.Timer(0.5, os.kill, (prober.proc.pid, sig))
        timer.start()
        try:
            return prober.measure(micro_batch)
        except MeasurementError as e:
            return e
        finally:
            timer.join()
    finally:
        prober.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the probe's child is Linux's")
@pytest.mark.timeout(240)
def test_a_probe_child_that_crashes_is_an_error_and_one_killed_is_out_of_memory(monkeypatch):
    """``tune`` took any death of its probe's child by a signal for out of memory: a segfault at b_m 4 stopped the
    search there, 'out of memory' cached, beside a peak of 312 MiB under a 17.75 GiB budget (a helper's run). A
    SIGKILL is out of memory where the kernel's OOM-kill count moved meanwhile (faked here: the count read before
    the probe, then one more), and an error where it stood still (this test's own ``kill``)."""
    from microbatch.measure import childprobe

    crashed = _killed_mid_probe(signal.SIGSEGV)
    assert isinstance(crashed, MeasurementError)
    assert "micro-batch 4 died (killed by signal SIGSEGV)" in str(crashed) and "not counted" in str(crashed)
    if childprobe.oom_kills() is not None:  # a kernel that counts: our own kill is not the OOM killer's
        killed_by_us = _killed_mid_probe(signal.SIGKILL)
        assert isinstance(killed_by_us, MeasurementError)
        assert "micro-batch 4 died (killed by signal SIGKILL)" in str(killed_by_us)
    counts = iter(range(100, 200))
    monkeypatch.setattr(childprobe, "oom_kills", lambda: next(counts))  # each read one more: the killer ran
    killed = _killed_mid_probe(signal.SIGKILL)
    assert killed.oom and killed.error == "probe process killed by signal SIGKILL"


def test_a_sigkill_the_oom_killer_did_not_send_is_not_out_of_memory(tmp_path):
    """``kill -9`` of a probe child was cached as an out-of-memory point and every later tune stopped below it (a
    review: b_m 4 kept out for good). The kernel counts its OOM kills (/proc/vmstat ``oom_kill``): a SIGKILL while
    that count stood still came from someone else."""
    from microbatch.measure.deaths import oom_kills

    vmstat = tmp_path / "vmstat"
    vmstat.write_text("nr_free_pages 123\noom_kill 7\nworkingset_refault 0\n")
    assert oom_kills(str(vmstat)) == 7
    assert oom_kills(str(tmp_path / "missing")) is None
    (tmp_path / "old").write_text("nr_free_pages 123\n")  # a kernel before 4.13: no count
    assert oom_kills(str(tmp_path / "old")) is None
    kill = -signal.SIGKILL
    assert not death_is_oom(kill, "", 7, 7)  # nobody was OOM-killed meanwhile
    assert death_is_oom(kill, "", 7, 8)  # the OOM killer ran
    assert death_is_oom(kill, "", None, 8) and death_is_oom(kill, "")  # no count to read: as before
    assert death_is_oom(-signal.SIGABRT, "std::bad_alloc", 7, 7)  # a failed allocation says so itself


def test_a_sigkill_under_memory_pressure_names_a_user_space_killer(tmp_path, monkeypatch):
    """systemd-oomd and earlyoom kill with SIGKILL from user space, which the kernel's OOM-kill count never sees: the
    death stays an error (not cached as out of memory), but where tasks stalled on memory while the probe ran
    (/proc/pressure/memory) the message says so and what to do."""
    from microbatch.measure import childprobe
    from microbatch.measure.deaths import memory_stall_s, pressure_note

    psi = tmp_path / "memory"
    psi.write_text(
        "some avg10=41.00 avg60=12.00 avg300=3.00 total=2500000\nfull avg10=0.00 avg60=0.00 total=10\n"
    )
    assert memory_stall_s(str(psi)) == pytest.approx(2.5)
    assert memory_stall_s(str(tmp_path / "missing")) is None
    kill = -signal.SIGKILL
    assert "systemd-oomd, earlyoom" in pressure_note(kill, 1.0, 2.5) and "1.5 s" in pressure_note(
        kill, 1.0, 2.5
    )
    assert pressure_note(kill, 1.0, 1.05) == ""  # a stall of 50 ms: no pressure to speak of
    assert pressure_note(-signal.SIGSEGV, 1.0, 9.0) == "" and pressure_note(kill, None, 9.0) == ""
    if childprobe.oom_kills() is None:
        pytest.skip("this kernel does not count OOM kills: a SIGKILL reads as out of memory here")
    stalls = iter([10.0, 12.0] * 10)
    monkeypatch.setattr(childprobe, "memory_stall_s", lambda: next(stalls))  # 2 s of stalls during the probe
    killed = _killed_mid_probe(signal.SIGKILL)
    assert isinstance(killed, MeasurementError) and "stalled 2.0 s waiting for memory" in str(killed)
