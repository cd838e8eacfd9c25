"""Helpers several test modules share: an out-of-memory injected at the allocation point, and two
gloo ranks run as real processes with a timeout (so a hang fails instead of blocking CI), and a plan read
back from ``plan --json``."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class AllocationLimit(TorchDispatchMode):
    """Every kernel output over ``max_bytes`` fails with torch.OutOfMemoryError; counts the failures."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__()
        self.max_bytes, self.failures = max_bytes, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.numel() * t.element_size() > self.max_bytes:
                self.failures += 1
                raise torch.OutOfMemoryError(
                    f"Tried to allocate {t.numel() * t.element_size()} bytes ({func}); the test device holds "
                    f"{self.max_bytes} bytes per tensor"
                )
        return out


def free_port() -> int:
    """A TCP port on the loopback that is free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


WORKER_START = r"""
import os, sys, torch, torch.distributed as dist
sys.path[:0] = [{tests!r}, os.path.dirname(os.path.dirname({tests!r}))]
rank, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{{port}}", rank=rank, world_size=2)
"""
"""The start of a two-rank worker script (:func:`run_two_ranks`; ``.format(tests=...)`` fills the tests folder):
torch, the tests and the package on the path, this rank's arguments, the gloo group of two."""

WORKER_END = """torch.save(results, out)
dist.barrier()  # both ranks at the end before either tears gloo down (an early teardown aborted a rank)
dist.destroy_process_group()
# skip the interpreter's teardown, where gloo's background threads can abort an exiting process
# ("terminate called without an active exception") after its work, as microbatch's own ranks do
import os
sys.stdout.flush()
os._exit(0)
"""
"""The end of a two-rank worker script (:func:`run_two_ranks`): save ``results`` to ``out``, meet, leave."""

LAUNCHED_END = """
# both ranks at the end, then the process group ended before the interpreter's teardown is skipped: left to
# exit, gloo's threads aborted a rank ('terminate called without an active exception') after its work was
# written, in 1 of 6 runs and once in a clean-clone CI run (2026-12-04), as microbatch's own ranks avoid
import sys as _sys, os as _os
import torch.distributed as _dist
if _dist.is_initialized():
    _dist.barrier()
    _dist.destroy_process_group()
_sys.stdout.flush()
_os._exit(0)
"""
"""The end of a script :func:`run_launched` starts, after it has written its ``rank{RANK}.json``."""


def run_two_ranks(script: Path, tmp_path: Path, *, timeout_s: float = 150) -> None:
    """Run ``script RANK PORT OUT`` as two processes (OUT = tmp_path/r{rank}.pt); assert both exit 0."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(r), str(port), str(tmp_path / f"r{r}.pt")],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for r in range(2)
    ]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout_s)[0].decode(errors="replace"))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)[-3000:]


def two_rank_results(
    script_text: str, tmp_path: Path, *, timeout_s: float = 150, weights_only: bool = True
) -> list:
    """Write ``script_text`` as tmp_path/worker.py, run it on two ranks (:func:`run_two_ranks`) and load what each
    rank saved (``torch.load`` of tmp_path/r{rank}.pt)."""
    script = tmp_path / "worker.py"
    script.write_text(script_text)
    run_two_ranks(script, tmp_path, timeout_s=timeout_s)
    return [torch.load(tmp_path / f"r{r}.pt", weights_only=weights_only) for r in range(2)]


def run_launched(
    script: str, tmp_path: Path, *, ranks: int = 2, timeout_s: float = 120, **env: str
) -> list[dict]:
    """Run the Python source ``script`` as ``ranks`` processes the way torchrun / ``accelerate
    launch`` start them (``MASTER_ADDR``/``MASTER_PORT``, ``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``;
    ``OUT_DIR`` = tmp_path, plus ``env``; each ends with :data:`LAUNCHED_END`); assert every one exits 0 within ``timeout_s`` (a hang
    fails) and return what each wrote to ``OUT_DIR/rank{RANK}.json``."""
    import json

    path = tmp_path / "child.py"
    path.write_text(script + LAUNCHED_END)  # every rank ends past gloo's teardown
    port = free_port()
    procs = []
    for rank in range(ranks):
        e = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(ranks),
                 RANK=str(rank), LOCAL_RANK=str(rank), NODE_RANK="0", OUT_DIR=str(tmp_path),
                 OMP_NUM_THREADS="1", **env)  # fmt: skip
        procs.append(subprocess.Popen([sys.executable, str(path)], env=e, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT))  # fmt: skip
    try:
        outs = [p.communicate(timeout=timeout_s)[0].decode(errors="replace") for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outs)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(ranks)]


def plan_json(args: list[str], capsys) -> dict:
    """Run ``microbatch`` with ``args`` (a ``plan … --json`` line), check it exits 0, return the plan."""
    from microbatch.cli import main

    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    return out["result"] if "result" in out else out


def _stat(pid: int) -> list[str]:
    """The fields of ``/proc/PID/stat`` after the command's name (state, parent, group, session, ...)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def children_of(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if int(_stat(int(d))[1]) == pid:
                    out.append(int(d))
            except (OSError, IndexError, ValueError):
                continue
    return out


def rank_pids(launcher: int) -> list[int]:
    """The pipeline ranks a launcher started: its descendants that lead a session of their own (a rank
    calls ``setsid``, as a new interpreter or forked from the fork server; the fork server and
    multiprocessing's resource tracker do not)."""
    parents: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                parents[int(d)] = int(_stat(int(d))[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = [], [launcher]
    while frontier:
        kids = [p for p, pp in parents.items() if pp in frontier]
        found += kids
        frontier = kids
    out = []
    for p in found:
        try:
            if int(_stat(p)[3]) == p:
                out.append(p)
        except (OSError, IndexError, ValueError):
            continue
    return sorted(out)


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        return _stat(pid)[0] != "Z"
    except OSError:
        return False


def refuse_processes(monkeypatch) -> list:
    """Make any process start fail the test (returned: what tried): a new interpreter
    (``subprocess.Popen``: the profile, the calibrations, ranks on the cold path) or a rank forked from
    the fork server (:func:`microbatch.run.pipeline.warm.start_warm`)."""
    from microbatch.run.pipeline import warm

    started: list = []

    def refuse(*args, **kwargs):
        started.append(args)
        raise AssertionError(f"a process was started: {args[:1]}")

    monkeypatch.setattr(subprocess, "Popen", refuse)
    monkeypatch.setattr(warm, "start_warm", refuse)
    return started
