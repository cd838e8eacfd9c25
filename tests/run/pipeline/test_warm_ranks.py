"""Ranks forked from the fork server (:mod:`microbatch.run.pipeline.warm`) are the ranks a new
interpreter made: the same losses and gradients, the launcher's environment and working folder, their
own process; the launcher's script is not run again in them; a killed one reads as killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from microbatch.run.pipeline.config import PipelineConfig
from microbatch.run.pipeline.launch import run_pipeline
from microbatch.run.pipeline.warm import COLD_ENV, start_warm, warm_ranks

FACTORY = '''
import os
import sys


def build():
    """A small stack that says, in a file per process, who started it and what it was given."""
    import torch.nn as nn

    with open(os.path.join(os.environ["MB_WARM_OUT"], f"{os.getpid()}.txt"), "w") as f:
        f.write(f"{os.getppid()} {os.environ.get('MB_WARM_MARK', '-')} {sys.path[0]!r}")
    return nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 50))
'''


def _run(tmp_path, monkeypatch, mark: str):
    out = tmp_path / mark
    out.mkdir()
    monkeypatch.setenv("MB_WARM_OUT", str(out))
    monkeypatch.setenv("MB_WARM_MARK", mark)  # set after the fork server may have started: still seen
    rep = run_pipeline(
        PipelineConfig(
            model="mb_warm_factory:build", schedule="1f1b", stages=2, microbatches=2, steps=2, seed=7,
            check_gradients=True, timeout_s=60,
        ),
        deadline_s=150,
    )  # fmt: skip
    seen = {}
    for f in out.iterdir():
        ppid, got_mark, first = f.read_text().split(" ", 2)
        seen[int(f.stem)] = (int(ppid), got_mark, first)
    return rep, seen


@pytest.mark.timeout(300)
def test_forked_ranks_match_new_interpreters_and_see_the_launchers_environment(tmp_path, monkeypatch):
    (tmp_path / "mb_warm_factory.py").write_text(FACTORY)
    monkeypatch.chdir(tmp_path)  # the factory is found in the working folder, as `python -c` finds it
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delenv(COLD_ENV, raising=False)
    monkeypatch.setenv("MB_WARM_OUT", str(tmp_path))
    start_warm(sleep_for, ["0"], dict(os.environ), str(tmp_path / "first.err")).wait(timeout=120)  # server up
    assert warm_ranks("gloo") and not warm_ranks("nccl") and not warm_ranks("gloo", {COLD_ENV: "1"})
    warm, warm_seen = _run(tmp_path, monkeypatch, "warm")  # its mark set after the server started
    monkeypatch.setenv(COLD_ENV, "1")
    cold, cold_seen = _run(tmp_path, monkeypatch, "cold")

    me = os.getpid()
    ranks = lambda seen: {p: v for p, v in seen.items() if p != me}  # noqa: E731 (the launcher's check builds it too)
    warm_ranks_seen, cold_ranks_seen = ranks(warm_seen), ranks(cold_seen)
    assert len(warm_ranks_seen) == 2 and len(cold_ranks_seen) == 2
    assert {v[0] for v in cold_ranks_seen.values()} == {me}  # new interpreters: the launcher's children
    forked_from = {v[0] for v in warm_ranks_seen.values()}
    assert len(forked_from) == 1 and me not in forked_from  # forked by one other process: the fork server
    assert {v[1] for v in warm_ranks_seen.values()} == {
        "warm"
    }  # the environment at the launch, not the server's
    assert {v[2] for v in warm_ranks_seen.values()} == {"''"}  # the working folder first, as `python -c`
    assert warm.gradients_match and cold.gradients_match
    for rep in (
        warm,
        cold,
    ):  # each start's own resident bytes a process (host_terms.process_bytes): -35% / -20% at 400 MiB
        assert rep.host_memory is not None and -25 <= rep.host_memory.error_pct <= 10, rep.host_memory
    assert warm.losses == cold.losses  # the same numbers, to the bit


@pytest.mark.timeout(200)
def test_a_script_that_runs_the_pipeline_at_its_top_level_runs_it_once(tmp_path):
    """multiprocessing's fork server runs the parent's main module again in each child: a script without
    ``if __name__ == "__main__"`` would start the ranks again inside every rank (and there fail)."""
    script = tmp_path / "train_pp.py"
    script.write_text(
        textwrap.dedent(
            """
            from microbatch.run.pipeline.config import PipelineConfig
            from microbatch.run.pipeline.launch import run_pipeline

            print("SCRIPT RAN", flush=True)
            rep = run_pipeline(PipelineConfig(stages=2, microbatches=2, steps=1, timeout_s=60))
            print("STEPS", rep.steps, flush=True)
            """
        )
    )
    env = {k: v for k, v in os.environ.items() if k != COLD_ENV}
    r = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count("SCRIPT RAN") == 1 and "STEPS 1" in r.stdout, r.stdout


def sleep_for(args: list[str]) -> None:
    """A rank's main that sleeps ``args[0]`` seconds."""
    time.sleep(float(args[0]))


@pytest.mark.timeout(120)
def test_a_forked_rank_reads_as_a_process_does(tmp_path):
    err = tmp_path / "rank.err"
    err.write_text("")
    rank = start_warm(sleep_for, ["60"], dict(os.environ), str(err))
    assert rank.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        rank.wait(timeout=0.2)
    from microbatch.run.pipeline.launch import _kill_all

    _kill_all([rank])  # as the launcher kills it: its group (its own session), or itself before setsid
    assert rank.wait(timeout=30) == -signal.SIGKILL and rank.poll() == -signal.SIGKILL
    done = start_warm(sleep_for, ["0"], dict(os.environ), str(err))
    assert done.wait(timeout=60) == 0


@pytest.mark.timeout(120)
def test_the_launchers_own_multiprocessing_is_left_as_it_was(tmp_path, monkeypatch):
    """A forked rank must not fix the launcher's start method (``set_start_method("spawn")`` failed after a
    run), nor be joined at its exit (a rank left alive held the launcher's exit until it ended)."""
    import multiprocessing

    from _helpers import alive  # here: the ranks import this module for sleep_for

    code = textwrap.dedent(
        f"""
        import multiprocessing, os, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from microbatch.run.pipeline.warm import start_warm
        from test_warm_ranks import sleep_for

        assert multiprocessing.get_start_method(allow_none=True) is None
        rank = start_warm(sleep_for, ["0"], dict(os.environ), {str(tmp_path / "a.err")!r})
        assert rank.wait(timeout=60) == 0
        assert multiprocessing.get_start_method(allow_none=True) is None
        multiprocessing.set_start_method("spawn")  # raised "context has already been set"
        left = start_warm(sleep_for, ["30"], dict(os.environ), {str(tmp_path / "b.err")!r})
        assert multiprocessing.active_children() == []
        print("PID", left.pid, flush=True)
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()  # its last line: from here the process only exits
    t_line = time.monotonic()
    rc = proc.wait(timeout=90)
    took = (
        time.monotonic() - t_line
    )  # the clock starts after its imports, so a loaded machine moves it little
    assert rc == 0 and line.startswith("PID "), (line, proc.stderr.read()[-2000:] if proc.stderr else "")
    left = int(line.split("PID ")[1])
    assert took < 20, took  # not held by the 30 s rank still running at exit
    deadline = time.monotonic() + 15  # the server exits with its launcher, and the rank with the server
    while alive(left) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(left)
    assert multiprocessing.get_start_method(allow_none=True) in (None, "fork", "forkserver", "spawn")


def _warm_in_daemon(q) -> None:
    q.put(warm_ranks("gloo"))


def test_the_cold_path_where_a_fork_cannot_serve(monkeypatch, tmp_path):
    import multiprocessing

    from microbatch.run.pipeline import warm

    monkeypatch.delenv(COLD_ENV, raising=False)
    start_warm(sleep_for, ["0"], dict(os.environ), str(tmp_path / "a.err")).wait(timeout=120)  # a server up
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_warm_in_daemon, args=(q,), daemon=True)
    p.start()
    assert q.get(timeout=30) is False  # a daemonic worker may not start children
    p.join(timeout=30)
    # the fork dropped the server it inherited without touching the launcher's (it removed its socket once)
    assert start_warm(sleep_for, ["0"], dict(os.environ), str(tmp_path / "b.err")).wait(timeout=60) == 0
    monkeypatch.setattr(warm, "_owner", os.getpid())
    monkeypatch.setattr(warm, "_server_env", warm._start_up_env(os.environ))
    assert warm_ranks("gloo")
    assert not warm_ranks("gloo", {**os.environ, "OMP_NUM_THREADS": "7"})  # read once by the server's torch
    monkeypatch.setattr(warm, "_owner", os.getpid() + 1)  # a fork of the process that started the server
    assert not warm_ranks("gloo")


def record_start_method(args: list[str]) -> None:
    """A rank's main that writes its multiprocessing start method (None: not chosen) to ``args[0]``."""
    import multiprocessing

    Path(args[0]).write_text(str(multiprocessing.get_start_method(allow_none=True)))


def test_a_rank_keeps_the_platforms_start_method(tmp_path):
    """multiprocessing forced 'forkserver' on a child of a fork server: a rank's own workers would have
    started through CPython's process-wide server, not as a new interpreter's rank forks them."""
    out = tmp_path / "method.txt"
    rank = start_warm(record_start_method, [str(out)], dict(os.environ), str(tmp_path / "m.err"))
    assert rank.wait(timeout=60) == 0
    assert out.read_text() == "None"


@pytest.mark.timeout(300)
def test_a_fork_server_that_cannot_serve_leaves_the_run_to_new_interpreters(tmp_path, monkeypatch, capfd):
    from microbatch.run.pipeline import warm

    (tmp_path / "mb_dies_on_import.py").write_text("import os\nos._exit(3)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.delenv(COLD_ENV, raising=False)
    monkeypatch.setattr(warm, "PRELOAD", ("mb_dies_on_import", *warm.PRELOAD))  # the server dies importing
    for name in ("_server", "_owner", "_server_env"):
        monkeypatch.setattr(warm, name, None)  # a server of this test's own; the worker's is put back after
    monkeypatch.setattr(warm, "_broken", "")
    rep = run_pipeline(PipelineConfig(stages=2, microbatches=2, steps=2, timeout_s=60), deadline_s=150)
    assert rep.measured_steps >= 1 and len(rep.losses) == 2  # the run ran, on new interpreters
    assert warm._broken and not warm_ranks("gloo")  # and the next launches go there too
    assert "the fork server could not start a rank" in capfd.readouterr().err


@pytest.mark.timeout(300)
def test_a_start_failing_after_the_first_rank_starts_every_rank_again_cold(monkeypatch, capfd):
    """The ranks forked before the failure die with the server the launcher kills: they were left waiting
    beside new interpreters for a rank 0 that was gone (exit 255)."""
    from microbatch.run.pipeline import warm

    real, calls = warm.start_warm, []

    def second_fails(*a, **k):
        calls.append(a)
        if len(calls) == 2:
            warm._kill_server()  # as start_warm does on a failure: rank 0 dies with it
            monkeypatch.setattr(warm, "_broken", "the test's second start")
            raise warm.WarmStartError("the fork server could not start a rank (the test's)")
        return real(*a, **k)

    monkeypatch.delenv(COLD_ENV, raising=False)
    monkeypatch.setattr(warm, "start_warm", second_fails)
    rep = run_pipeline(PipelineConfig(stages=2, microbatches=2, steps=2, timeout_s=60), deadline_s=150)
    assert len(calls) == 2 and len(rep.losses) == 2
    assert "starting the ranks as new interpreters" in capfd.readouterr().err


@pytest.mark.timeout(120)
def test_a_dead_server_is_not_restarted_behind_the_launchers_back(monkeypatch, tmp_path):
    from microbatch.run.pipeline import warm

    monkeypatch.setattr(warm, "_broken", "")
    assert start_warm(sleep_for, ["0"], dict(os.environ), str(tmp_path / "a.err")).wait(timeout=120) == 0
    pid = warm._server._forkserver_pid
    os.kill(pid, signal.SIGKILL)
    time.sleep(0.5)
    monkeypatch.setattr(
        warm, "server_alive", lambda: True
    )  # the race: alive at the check, dead at the connect
    with pytest.raises(warm.WarmStartError, match="the fork server died"):
        start_warm(sleep_for, ["0"], dict(os.environ), str(tmp_path / "b.err"))
    assert warm._broken and not warm_ranks("gloo")


@pytest.mark.timeout(300)
def test_the_first_launch_says_it_starts_the_fork_server(monkeypatch):
    """Seconds of torch's import before the first rank: said as a phase of its own (the progress was silent)."""
    from microbatch.run.pipeline import warm
    from microbatch.run.pipeline.progress import progress_to

    monkeypatch.delenv(COLD_ENV, raising=False)
    for name in ("_server", "_owner", "_server_env"):
        monkeypatch.setattr(warm, name, None)  # a server of this test's own
    monkeypatch.setattr(warm, "_broken", "")
    phases: list[str] = []
    try:
        with progress_to(lambda e: phases.append(e.phase)):
            run_pipeline(PipelineConfig(stages=2, microbatches=2, steps=1, timeout_s=60), deadline_s=150)
            first = list(phases)
            phases.clear()
            run_pipeline(PipelineConfig(stages=2, microbatches=2, steps=1, timeout_s=60), deadline_s=150)
    finally:
        warm._kill_server()  # before the worker's own server is put back
    assert first.index("server") < first.index("start") and "server" not in phases and "start" in phases


def test_a_cold_switch_that_is_not_one_is_refused_before_any_process(monkeypatch, capsys):
    """MICROBATCH_COLD_RANKS reads 1/true/yes/on (any case) as new interpreters and 0/false/no/off or unset as forked;
    any other value is refused with its name, at the check before the run (with nccl too), not taken as 'forked'."""
    from _helpers import refuse_processes

    from microbatch.cli import main
    from microbatch.errors import ConfigError

    for value, cold in (
        ("1", True),
        ("TRUE", True),
        (" yes ", True),
        ("on", True),
        ("0", False),
        ("off", False),
    ):
        assert warm_ranks("gloo", {COLD_ENV: value}) is (not cold and warm_ranks("gloo", {}))
    with pytest.raises(ConfigError, match=r"MICROBATCH_COLD_RANKS='maybe' is not a switch; set it to 1"):
        warm_ranks("gloo", {COLD_ENV: "maybe"})
    started = refuse_processes(monkeypatch)
    monkeypatch.setenv(COLD_ENV, "maybe")
    assert main(["pipeline", "-p", "2", "-m", "2", "--steps", "1", "--no-predict"]) == 2
    assert "MICROBATCH_COLD_RANKS='maybe' is not a switch" in capsys.readouterr().err and not started
    from microbatch.run.pipeline import host_terms

    with pytest.raises(
        ConfigError, match="is not a switch"
    ):  # nccl's check reads it too (its ranks start cold)
        host_terms.process_bytes("nccl")
