"""CPU probes in a child process under a hard memory limit, so that running out of memory ends
only the child.

On the CPU an allocation failure is a plain ``RuntimeError`` and an over-committed host kills the
process outright, so the CLI's CPU probes run in a child process (``python -m
microbatch.measure.childprobe --worker``, JSON lines over stdin/stdout) under a hard address-space limit
(``RLIMIT_AS``). The child builds the probe of a :class:`~microbatch.measure.spec.ProbeSpec`, measures
each micro-batch size with :mod:`microbatch.measure.probes` (peak memory: ``VmHWM``, reset before each
probe) and answers with a :class:`~microbatch.measure.probes.Measurement`; after an out-of-memory the
parent records the point as out of memory and starts a fresh child for the next probe.
"""

from __future__ import annotations

import gc
import json
import os
import select
import subprocess
import sys
import tempfile
import time
from typing import IO, Any

from microbatch.child_env import with_package_on_path
from microbatch.errors import ConfigError, MeasurementError, ProbeTimeoutError
from microbatch.measure.deaths import death_is_oom, death_text, memory_stall_s, oom_kills, pressure_note
from microbatch.measure.device import oom_types, short_error
from microbatch.measure.hostmem import (
    current_rss_bytes,
    mark_probe_child,
    peak_rss_bytes,
    rebind_limit,
    reset_peak_rss,
    virtual_bytes,
)
from microbatch.measure.inprocess import Probe, static_bytes
from microbatch.measure.probes import Measurement
from microbatch.measure.spec import ProbeSpec, build_probe
from microbatch.units import format_bytes

__all__ = ["ChildProber", "WORKER_ENV"]


WORKER_ENV = {"MALLOC_ARENA_MAX": "2", "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536"}
"""glibc settings in the child: few malloc arenas (each reserves 64 MiB of address space) and a
fixed mmap threshold, so large tensors are mapped and unmapped one by one and the address space
tracks the resident memory (RLIMIT_AS then acts as a limit on real memory). The peak is read there; the timed
repeats run on glibc's steady heap (:func:`microbatch.measure.device.steady_timing`), as a training process
holds it: mapping each tensor afresh every step is not the user's cost."""


class ChildProber:
    """CPU probes in a child process under a hard memory limit; a misprediction ends only the child.

    The child (``python -m microbatch.measure.childprobe --worker``, JSON lines over stdin/stdout) builds the
    model, runs the setup step, measures its static memory (RSS after setup), then sets
    ``RLIMIT_AS`` to its current address space plus ``limit_bytes − RSS``: the limit binds on real
    memory to within the address space mapped but not resident (torch's import maps ~0.4 GB more
    than it touches; that is already in the baseline). One child serves the probes in turn (the
    peak RSS is reset before each); after an out-of-memory (a ``RuntimeError`` from the allocator
    under the limit, or the child's death by a signal) the child is restarted.
    """

    def __init__(self, spec: ProbeSpec, *, limit_bytes: int | None = None, timeout_s: float = 600.0) -> None:
        self.spec, self.limit_bytes, self.timeout_s = spec, limit_bytes, timeout_s
        self.proc: subprocess.Popen[str] | None = None
        self.static_bytes: int | None = None
        """Bytes the child holds before any activation (process, weights, gradients, optimizer state)."""
        self.setup_reply: dict[str, Any] | None = None
        """The child's answer to the setup request (None when it died)."""
        self._stderr: IO[bytes] | None = None

    def start(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            return
        env = with_package_on_path(dict(os.environ, **WORKER_ENV))
        self._stderr = tempfile.TemporaryFile()
        kills = oom_kills()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "microbatch.measure.childprobe", "--worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env=env,
            text=True,
            bufsize=1,
        )
        try:
            reply = self._ask({"op": "setup", "spec": self.spec.to_dict(), "limit_bytes": self.limit_bytes})
        except KeyboardInterrupt:
            self.kill()
            raise
        self.setup_reply = reply
        if reply is None:
            rc = self.proc.returncode if self.proc else None
            self.close()
            tail = self._stderr_tail()
            if self.limit_bytes is not None and death_is_oom(rc, tail, kills, oom_kills()):
                reply = {"oom": True}
            else:
                raise MeasurementError(f"the probe process died during setup ({death_text(rc)}): {tail}")
        if reply.get("config_error"):
            self.close()
            raise ConfigError(reply["config_error"], params=tuple(reply.get("params", ())))
        if reply.get("oom"):
            self.close()
            raise ConfigError(
                f"micro-batch 1 is already out of memory under the limit of {self.limit_bytes} bytes "
                f"({format_bytes(self.limit_bytes or 0, unit='GiB')}) "
                f"(the setup step needs more); turn activation checkpointing on, use a shorter seq, "
                "or raise memory_budget_bytes",
                params=("seq", "memory_budget_bytes"),
            )
        if reply.get("error"):
            self.close()
            raise MeasurementError(f"the probe process failed during setup: {reply['error']}")
        self.static_bytes = reply.get("static_bytes")

    def ask(self, msg: dict[str, Any]) -> dict[str, Any] | None:
        """Send one request to the running child; its reply, or None if it died."""
        self.start()
        return self._ask(msg)

    def _ask(self, msg: dict[str, Any]) -> dict[str, Any] | None:
        assert self.proc is not None and self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(json.dumps(msg) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            return None
        ready, _, _ = select.select([self.proc.stdout], [], [], self.timeout_s)
        if not ready:
            self.kill()  # a probe past its limit is stopped now, not given the time a finishing one gets
            b = msg.get("micro_batch")
            what = (
                "the set-up (starting the probe process, importing torch, building the model, its first step)"
                if b is None
                else f"micro-batch {b}"
            )
            raise ProbeTimeoutError(
                f"{what} took longer than probe_timeout_s {self.timeout_s:g} s and was stopped; give a larger "
                "probe_timeout_s, or a shorter seq",
                micro_batch=b,
                timeout_s=self.timeout_s,
            )
        line = self.proc.stdout.readline()
        if not line:  # the child died: its exit status tells how
            _end(self.proc, kill_after_s=30.0)
            return None
        answer: dict[str, Any] = json.loads(line)
        return answer

    def _stderr_tail(self) -> str:
        if self._stderr is None:
            return ""
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace").strip()[-500:]

    def measure(self, micro_batch: int, *, checkpointing: bool = False) -> Measurement:
        self.start()
        kills, stalled = oom_kills(), memory_stall_s()
        try:
            reply = self._ask({"op": "probe", "micro_batch": micro_batch, "checkpointing": checkpointing})
        except KeyboardInterrupt:
            self.kill()  # not the 10 s a finishing probe may take: the user is waiting
            raise
        if reply is None:  # the child died: killed for memory (SIGKILL) or aborted by a failed allocation
            rc = self.proc.returncode if self.proc else None
            self.close()
            tail = self._stderr_tail()
            if death_is_oom(rc, tail, kills, oom_kills()):
                return Measurement(
                    micro_batch=micro_batch,
                    oom=True,
                    checkpointing=checkpointing,
                    error=f"probe process {death_text(rc)}",
                    memory_method="vmhwm",
                )
            raise MeasurementError(
                f"the probe process at micro-batch {micro_batch} died ({death_text(rc)}), with no sign of running "
                f"out of memory, so it is not counted as one: {tail or 'nothing on its stderr'}"
                + pressure_note(rc, stalled, memory_stall_s())
            )
        if reply.get("error"):
            raise MeasurementError(f"probe at micro-batch {micro_batch} failed: {reply['error']}")
        m = Measurement.from_dict(reply["measurement"])
        if m.oom:
            self.close()  # a fresh child: the failed allocation may have left the heap fragmented
        return m

    def kill(self) -> None:
        """End the child now (SIGKILL) and reap it."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.returncode is None:
            proc.kill()
            _reap(proc, timeout_s=None)

    def close(self) -> None:
        """End the child: close its stdin (it exits after the probe it is running), kill it after
        10 s, and reap it.

        Reaped with ``os.waitpid`` rather than ``Popen.wait``/``poll``: a Ctrl-C (KeyboardInterrupt)
        that lands between ``Popen``'s ``_waitpid_lock.acquire()`` and its ``try`` leaves that lock
        held for good, and a later ``Popen.wait()`` then blocks forever on a child that is already
        a zombie (seen: ``microbatch tune`` interrupted after two probes hung in 1 of 8 runs)."""
        proc, self.proc = self.proc, None
        if proc is None or proc.returncode is not None:
            return
        try:
            if proc.stdin is not None:
                proc.stdin.close()
        except OSError:
            pass
        _end(proc, kill_after_s=10.0)


def _end(proc: subprocess.Popen[str], kill_after_s: float) -> None:
    """Reap ``proc``, killing it if it has not exited within ``kill_after_s``."""
    if not _reap(proc, timeout_s=kill_after_s):
        proc.kill()
        _reap(proc, timeout_s=None)


def _reap(proc: subprocess.Popen[str], timeout_s: float | None) -> bool:
    """Wait for ``proc`` to exit (at most ``timeout_s``; None: for good) without ``Popen``'s lock;
    sets ``proc.returncode``. True once it has exited."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    delay = 0.001
    while True:
        try:
            pid, status = os.waitpid(proc.pid, os.WNOHANG)
        except ChildProcessError:  # reaped already (by Popen itself)
            if proc.returncode is None:
                proc.returncode = 0
            return True
        if pid == proc.pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return True
        if deadline is not None and time.monotonic() >= deadline:
            return False
        time.sleep(delay)
        delay = min(2 * delay, 0.05)


def _end_with_parent() -> None:
    """Linux: ask the kernel to end this child when its parent dies (``prctl(PR_SET_PDEATHSIG, SIGKILL)``):
    a parent killed by SIGTERM or SIGKILL runs no clean-up, and a child inside a long probe would not read
    the end of its stdin until the probe ends (it was left running, parent 1). Elsewhere nothing."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return


def _worker() -> int:
    """The child's loop: one JSON request per line on stdin, one JSON reply per line on stdout."""
    out = sys.stdout
    sys.stdout = sys.stderr  # nothing else may write to the protocol stream
    mark_probe_child()  # its heap tracks memory (WORKER_ENV); the timed repeats run on the steady heap
    probe: Probe | None = None
    limited = False

    def reply(d: dict[str, Any]) -> None:
        out.write(json.dumps(d) + "\n")
        out.flush()

    for line in sys.stdin:
        msg = json.loads(line)
        try:
            if msg["op"] == "setup":
                probe, limited, answer = _setup(msg)
                reply(answer)
            elif msg["op"] == "alloc":  # a known allocation, to check the peak-memory method
                reply(_alloc(int(msg["bytes"])))
            elif msg["op"] == "probe":
                if probe is None:
                    raise MeasurementError("a probe request came before the setup request")
                reply({"measurement": _measure(probe, msg, limited).to_dict()})
        except ConfigError as e:
            reply({"config_error": str(e), "params": list(e.params)})
        except Exception as e:  # noqa: BLE001 - reported to the parent, which raises
            import traceback

            traceback.print_exc(file=sys.stderr)
            reply({"error": short_error(e)})
    return 0


def _setup(msg: dict[str, Any]) -> tuple[Probe, bool, dict[str, Any]]:
    """Build the probe of ``msg["spec"]``, put the process under the memory limit, set up at b_m = 1:
    the probe, whether the limit is on, and the reply (static bytes, or why not)."""
    import resource

    import torch

    torch.manual_seed(0)
    spec = ProbeSpec.from_dict(msg["spec"])
    if spec.threads:
        torch.set_num_threads(spec.threads)
    probe = build_probe(spec)
    limit = msg.get("limit_bytes")
    need = (
        current_rss_bytes()
        + static_bytes(probe)
        - sum(p.numel() * p.element_size() for p in probe.model.parameters())
    )
    if limit is not None and need > limit:
        why = (
            f"memory budget {limit} bytes ({format_bytes(limit, unit='GiB')}) is below the model's static "
            f"memory: it needs at least {need} bytes ({format_bytes(need, unit='GiB')}: process, weights"
            + (", gradients and optimizer state" if spec.mode == "train" else "")
            + "); raise memory_budget_bytes or choose a smaller model"
        )
        return probe, False, {"config_error": why, "params": ["memory_budget_bytes"]}
    ooms = oom_types()  # resolved before the limit: nothing lazy may allocate in an except clause
    limited = False
    if limit is not None:
        room = limit - current_rss_bytes()
        # the hard limit stays as it was: raising it is refused (``ulimit -v`` set one, even 100 GB, and every tune
        # ended in "not allowed to raise maximum limit", a review); one below the budget binds first, as it would
        hard = resource.getrlimit(resource.RLIMIT_AS)[1]
        want = virtual_bytes() + room
        resource.setrlimit(
            resource.RLIMIT_AS, (want if hard == resource.RLIM_INFINITY else min(want, hard), hard)
        )
        rebind_limit()  # reads the real-memory budget the limit stands for: ``limit``
        limited = True
    caught: tuple[type[BaseException], ...] = (RuntimeError, *ooms)
    try:
        probe.setup(1)
    except caught as e:
        if not (limited and isinstance(e, RuntimeError)) and not isinstance(e, ooms):
            raise
        return probe, limited, {"oom": True, "error": short_error(e)}
    if (
        limited
    ):  # the first step mapped what it does not touch (thread stacks, arenas): the limit counts from here
        rebind_limit()
    return probe, limited, {"static_bytes": need, "rss_after_setup": current_rss_bytes()}


def _alloc(n_bytes: int) -> dict[str, Any]:
    """Allocate and touch ``n_bytes``: the peak-memory method's reading of a known allocation."""
    import torch

    reset_peak_rss()
    before = peak_rss_bytes()
    t = torch.ones(n_bytes // 4, dtype=torch.float32)
    t += 1  # touch every page
    answer = {"peak_delta_bytes": peak_rss_bytes() - before, "allocated_bytes": t.numel() * 4}
    del t
    return answer


def _measure(probe: Probe, msg: dict[str, Any], limited: bool) -> Measurement:
    """One probe at ``msg["micro_batch"]``; under the memory limit a RuntimeError is out of memory."""
    probe.set_checkpointing(bool(msg.get("checkpointing")))
    try:
        return probe.measure(int(msg["micro_batch"]))
    except RuntimeError as e:
        if not limited:
            raise
        # Under RLIMIT_AS the CPU allocator's failure is a plain RuntimeError: the only
        # change from a working probe is b_m, so it is recorded as out of memory.
        gc.collect()
        return Measurement(
            micro_batch=int(msg["micro_batch"]),
            oom=True,
            memory_method="vmhwm",
            checkpointing=probe.checkpointing,
            error=short_error(e),
        )


if __name__ == "__main__":
    if sys.argv[1:] == ["--worker"]:
        import signal

        # Ctrl-C reaches the whole process group: the parent handles it (keeps the points, ends this
        # child at once); a child dying of it mid-probe would read as an out-of-memory kill
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        _end_with_parent()
        sys.exit(_worker())
    print(
        "usage: python -m microbatch.measure.childprobe --worker   (started by microbatch tune)",
        file=sys.stderr,
    )
    sys.exit(2)
