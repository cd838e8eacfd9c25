"""Start pipeline ranks, watch them, and return their report.

:func:`run_pipeline` starts p worker processes on this machine (gloo on the CPU, forked from a warm fork server:
:mod:`microbatch.run.pipeline.warm`; a free port found by binding port 0, ``torch.set_num_threads(1)`` per worker),
waits for them under a deadline and raises :class:`~microbatch.errors.PipelineError` naming the rank and the last
lines of its error output as soon as any rank fails, killing the others: never a hang. Ctrl-C and SIGTERM kill every
rank too, then raise :class:`~microbatch.run.pipeline.progress.PipelineInterrupted` with the report of the steps
every rank finished (each rank logs its finished steps to a file of its own as it goes). Each phase (ranks started,
steps finished, summary) is announced to a progress function, if the caller installed one
(:mod:`microbatch.run.pipeline.progress`). :func:`run_external` is the same rank code under an outside launcher
(``torchrun`` on one or several machines; it reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
``MASTER_PORT``). What one rank does is :func:`microbatch.run.pipeline.rank.run_rank`; rank 0's gathered
measurements become the report in :func:`microbatch.run.pipeline.summary.summarize`; drawing it is
:mod:`microbatch.show.pipeline_report`'s job.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from typing import Any

from microbatch.child_env import with_package_on_path
from microbatch.errors import ConfigError, PipelineError
from microbatch.measure.deaths import death_text, explains_crash
from microbatch.run.pipeline import warm
from microbatch.run.pipeline.chain_check import check_splittable
from microbatch.run.pipeline.config import STARTUP_S, PipelineConfig, check_run_args
from microbatch.run.pipeline.kept import kept_steps, second_interrupt_ignored, with_host
from microbatch.run.pipeline.progress import (
    PipelineDeadline,
    StepCounter,
    StepLog,
    announce,
    step_log_path,
)
from microbatch.run.pipeline.report import PipelineReport
from microbatch.run.pipeline.resolved import ResolvedRun, resolve
from microbatch.run.pipeline.signals import LAUNCHER_PID_ENV, Terminated, exit_with_parent, raise_on_sigterm
from microbatch.run.pipeline.summary import summarize
from microbatch.run.pipeline.warm import RankHandle

__all__ = [
    "STARTUP_S",
    "Terminated",
    "raise_on_sigterm",
    "check_splittable",
    "free_port",
    "run_external",
    "run_pipeline",
    "run_resolved",
    "under_torchrun",
]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the kernel's choice for port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def under_torchrun(env: Mapping[str, str] | None = None) -> bool:
    """True when an outside launcher (torchrun) set the rendezvous variables of this process."""
    seen: Mapping[str, str] = os.environ if env is None else env
    return all(k in seen for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")) and (
        "MICROBATCH_WORKER" not in seen
    )


# -- the worker -------------------------------------------------------------------------


def _init_group(cfg: PipelineConfig, interruptible: bool = False) -> tuple[int, int, Any]:
    """Join the process group the environment describes; (rank, world size, device). ``interruptible`` (an outside
    launch, a user at the terminal): the wait runs beside this thread, which Ctrl-C and SIGTERM reach
    (:func:`~microbatch.measure.device.init_group_interruptibly`; in torch's store they were ignored)."""
    import datetime

    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if cfg.backend == "nccl":
        if not torch.cuda.is_available():
            raise ConfigError(
                "backend nccl needs CUDA GPUs and none is visible; use backend gloo on the CPU",
                params=("backend",),
            )
        device = torch.device("cuda", local % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
    if interruptible:
        from microbatch.measure.device import init_group_interruptibly

        init_group_interruptibly(cfg.backend, cfg.timeout_s)
    else:
        dist.init_process_group(
            cfg.backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=cfg.timeout_s)
        )
    return rank, world, device


def _worker_main(argv: list[str] | None = None) -> None:
    """Entry point of a worker started by :func:`run_pipeline`: ``CONFIG_JSON RESULT_JSON`` (``argv``, or
    the command line's)."""
    import traceback

    cfg_path, result_path = (sys.argv[1:] if argv is None else argv)[:2]
    rank = os.environ.get("RANK", "?")
    exit_with_parent(int(os.environ.get(LAUNCHER_PID_ENV) or 0))  # a killed launcher takes its ranks along
    try:
        with open(cfg_path) as f:
            cfg = PipelineConfig(**json.load(f))
        from microbatch.run.pipeline.rank import run_rank

        r, world, device = _init_group(cfg)
        log = StepLog(step_log_path(os.path.dirname(result_path), r))  # what a Ctrl-C keeps
        out = run_rank(resolve(cfg), rank=r, world_size=world, device=device, on_step=log.write)
        if out is not None:
            tmp = result_path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(out, f)
            os.replace(tmp, result_path)
        import torch.distributed as dist

        dist.destroy_process_group()
    except BaseException as e:  # report the reason on one last line, then exit non-zero
        traceback.print_exc()
        print(f"\nRANK {rank} ERROR: {_reason(e)}", file=sys.stderr, flush=True)
        os._exit(1)
    if sys.stdout is not None:  # closed by the caller (>&-): a rank has nothing to flush (it crashed here)
        sys.stdout.flush()
    os._exit(0)


def _reason(e: BaseException) -> str:
    try:
        from microbatch.measure.device import torch_oom_types

        ooms = torch_oom_types()
        if ooms and isinstance(e, ooms):
            return f"out of memory ({str(e).splitlines()[0] if str(e) else 'no detail'})"
    except ImportError:  # pragma: no cover
        pass
    msg = " ".join(str(e).split())
    cause = e.__cause__
    if cause is not None:
        msg += f" <- {type(cause).__name__}: {' '.join(str(cause).split())}"
    return f"{type(e).__name__}: {msg[:400]}"


# -- the launcher -----------------------------------------------------------------------


def _tail(path: str, lines: int = 6) -> str:
    try:
        with open(path, errors="replace") as f:
            text = f.read().strip().splitlines()
    except OSError:
        return ""
    for line in reversed(text):
        if " ERROR: " in line and line.startswith("RANK "):
            return line.split(" ERROR: ", 1)[1]
    return " | ".join(text[-lines:])


def _is_victim(reason: str) -> bool:
    """True when a rank's error only says that a peer went away (the cause is elsewhere)."""
    peer_gone = ("connection closed by peer", "connection reset by peer", "broken pipe", "timed out waiting")
    return any(x in reason.lower() for x in peer_gone)  # a gloo timeout: it waited on a peer that stopped


def _kill_all(procs: list[RankHandle]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                p.kill()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover
            pass


def run_pipeline(cfg: PipelineConfig, *, deadline_s: float | None = None) -> PipelineReport:
    """Run ``cfg`` in ``cfg.stages`` local processes and return its typed report (:func:`summarize`).

    Raises :class:`PipelineError` (which rank, why, the end of its error output) when a rank
    exits non-zero or is killed, or when the run passes ``deadline_s`` (default: the config's
    timeout plus a start-up allowance); every worker is killed before it returns. The config is
    resolved here, once (:func:`~microbatch.run.pipeline.resolved.resolve`), and the
    :class:`ResolvedRun` handed down (:func:`run_resolved`).
    """
    check_run_args(cfg, deadline_s)
    run = resolve(cfg)
    return run_resolved(run, deadline_s=deadline_s)


def run_resolved(run: ResolvedRun, *, deadline_s: float | None = None) -> PipelineReport:
    """:func:`run_pipeline` of a run resolved already."""
    cfg = run.cfg
    if cfg.backend == "nccl":
        import torch

        if torch.cuda.device_count() < cfg.stages:
            raise ConfigError(
                f"backend nccl on {cfg.stages} ranks needs {cfg.stages} GPUs, found "
                f"{torch.cuda.device_count()}; use backend gloo or fewer stages",
                params=("backend", "stages"),
            )
    check_splittable(run)
    from microbatch.run.pipeline.fit import check_fits

    host = check_fits(run, deadline_s=deadline_s)  # host memory of the p local ranks, and the deadline
    deadline, why = cfg.deadline(deadline_s)
    tmp = tempfile.mkdtemp(prefix="microbatch-pipeline-")
    cfg_path, result_path = os.path.join(tmp, "config.json"), os.path.join(tmp, "result.json")
    with open(cfg_path, "w") as f:
        json.dump(cfg.to_dict(), f)
    for attempt in range(3):
        try:
            raw = _launch_once(run, tmp, cfg_path, result_path, free_port(), deadline, why)
            break
        except _PortTaken:
            if attempt == 2:
                shutil.rmtree(
                    tmp, ignore_errors=True
                )  # no rank ran: its logs say nothing (the error names none)
                raise PipelineError(
                    "three free ports were taken before the ranks could bind them; retry, or run under torchrun "
                    "with --master-port"
                ) from None
        except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM: every rank is dead; keep the steps they finished
            raise kept_steps(run, tmp, host) from e
        except _DeadlinePassed as e:  # every rank killed: the steps they finished are kept, as after Ctrl-C
            kept = kept_steps(run, tmp, host, keep_logs=True)  # the error names them
            if kept.report is None:
                raise PipelineError(str(e), params=e.params) from None
            raise PipelineDeadline(str(e), kept.report, kept.steps, kept.asked, e.params) from None
    shutil.rmtree(tmp, ignore_errors=True)
    announce("summarise")
    with (
        second_interrupt_ignored()
    ):  # every step is measured: a Ctrl-C now would lose them all for seconds' work
        return with_host(summarize(raw, run), host)


class _DeadlinePassed(PipelineError):
    """The ranks ran past the deadline and were killed (:func:`run_resolved` keeps the steps they finished)."""


class _PortTaken(Exception):
    """The rendezvous port was taken between finding it and binding it."""


def _launch_once(
    run: ResolvedRun,
    tmp: str,
    cfg_path: str,
    result_path: str,
    port: int,
    deadline_s: float,
    deadline_why: str,
) -> dict[str, Any]:
    """Start the ranks on ``port``, wait for them, return rank 0's raw result.

    SIGTERM (``timeout``, a job scheduler) stops the ranks as Ctrl-C does: it raises
    :class:`Terminated` (a ``KeyboardInterrupt``) here, and every rank is killed before it propagates.
    """
    cfg = run.cfg
    procs: list[RankHandle] = []
    errs: list[str] = []
    restore = raise_on_sigterm()
    try:
        _start_ranks(cfg, tmp, cfg_path, result_path, port, procs, errs)
        announce("start", total=cfg.steps, ranks=cfg.stages)
        _wait_for_ranks(run, tmp, port, procs, errs, deadline_s, deadline_why)
        with open(result_path) as f:
            raw: dict[str, Any] = json.load(f)
    finally:
        try:
            _kill_all(procs)
        finally:
            restore()
    return raw


def _start_ranks(
    cfg: PipelineConfig,
    tmp: str,
    cfg_path: str,
    result_path: str,
    port: int,
    procs: list[RankHandle],
    errs: list[str],
) -> None:
    """Start one process per rank (in ``procs``, as each starts), its stderr in ``tmp`` (``errs``): forked
    from the warm fork server on the CPU (:mod:`microbatch.run.pipeline.warm`), else a new interpreter."""
    forked = warm.warm_ranks(cfg.backend)
    if forked and not warm.server_alive():
        announce("server")  # seconds of torch's import before the first rank (once per launcher process)
    code = "from microbatch.run.pipeline.launch import _worker_main; _worker_main()"
    for r in range(cfg.stages):
        env = with_package_on_path(os.environ)
        env.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(r),
            LOCAL_RANK=str(r),
            WORLD_SIZE=str(cfg.stages),
            LOCAL_WORLD_SIZE=str(cfg.stages),
            MICROBATCH_WORKER="1",
            **{LAUNCHER_PID_ENV: str(os.getpid())},
        )
        if cfg.backend == "gloo":
            env.setdefault("OMP_NUM_THREADS", "1")
        err = os.path.join(tmp, f"rank{r}.err")
        errs.append(err)
        with open(err, "w") as ef:
            if forked:
                try:
                    procs.append(warm.start_warm(_worker_main, [cfg_path, result_path], env, err))
                    continue
                except (
                    warm.WarmStartError
                ) as e:  # every rank as a new interpreter (the forked ones die with it)
                    print(
                        f"pipeline: {e}; starting the ranks as new interpreters", file=sys.stderr, flush=True
                    )
                    _kill_all(procs)
                    procs.clear()
                    errs.clear()
                    return _start_ranks(cfg, tmp, cfg_path, result_path, port, procs, errs)
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", code, cfg_path, result_path],
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=ef,
                    start_new_session=True,
                )
            )


def _wait_for_ranks(
    run: ResolvedRun,
    tmp: str,
    port: int,
    procs: list[RankHandle],
    errs: list[str],
    deadline_s: float,
    deadline_why: str,
) -> None:
    """Wait until every rank exits 0, announcing the steps they finish; on a failed rank or past the
    deadline, kill every rank and raise."""
    cfg = run.cfg
    finished = StepCounter([step_log_path(tmp, r) for r in range(cfg.stages)])
    done, next_count = 0, 0.0
    t_end = time.monotonic() + deadline_s
    while True:
        if time.monotonic() >= next_count:  # the steps every rank finished, four times a second
            next_count = time.monotonic() + 0.25
            n = finished()
            if n > done:
                done = n
                announce("step", done=done, total=cfg.steps)
        rcs = [p.poll() for p in procs]
        bad = [r for r, rc in enumerate(rcs) if rc not in (None, 0)]
        if bad:
            raise _rank_failure(run, tmp, port, procs, errs, bad)
        if all(rc == 0 for rc in rcs):
            if finished() > done:  # the last steps, finished since the last look
                announce("step", done=finished.last, total=cfg.steps)
            return
        if time.monotonic() > t_end:
            alive = [r for r, rc in enumerate(rcs) if rc is None]
            _kill_all(procs)
            said = f" ({deadline_why})" if deadline_why else ""
            raise _DeadlinePassed(
                f"pipeline run passed its deadline of {deadline_s:.0f} s{said}; ranks {alive} were still running "
                f"and were killed; raise timeout_s or lower steps; logs: {os.path.join(tmp, 'rank*.err')}",
                params=("timeout_s", "steps"),
            )
        time.sleep(0.05)


def _rank_failure(
    run: ResolvedRun,
    tmp: str,
    port: int,
    procs: list[RankHandle],
    errs: list[str],
    bad: list[int],
) -> Exception:
    """Every rank killed, and the error naming the rank that caused the failure (not a victim)."""
    time.sleep(0.3)  # let a crash's neighbours report, then name the cause, not a victim
    later = [x for x, rc in enumerate(p.poll() for p in procs) if rc not in (None, 0)]
    causes = [x for x in bad + later if not _is_victim(_tail(errs[x]))]
    stalled = [x for x, p in enumerate(procs) if p.poll() is None]
    if not causes and stalled:  # the ranks that failed only waited on a peer; those still running stopped
        _kill_all(procs)
        return PipelineError(
            f"rank {', '.join(map(str, stalled))} (stages {[s for x in stalled for s in run.stages_of(x)]}) stopped "
            f"making progress: rank {', '.join(map(str, sorted(set(bad + later))))} timed out waiting for it and "
            f"every rank was stopped; look at what it runs (full logs: {os.path.join(tmp, 'rank*.err')})"
        )
    r = causes[0] if causes else bad[0]
    rc = procs[r].poll() or 0  # bad ranks have exited: poll() is their status
    why = death_text(rc)
    if -rc == signal.SIGKILL:
        why += " (out of host memory? the kernel's OOM killer sends SIGKILL)"
    if rc == 255 and isinstance(procs[r], warm.RankProcess) and not warm.server_alive():
        why += " (the fork server that started the ranks died: killed with the launcher's process group?)"
    tail = _tail(errs[r])
    if rc < 0 and not explains_crash(tail):
        tail = "no error on its stderr before it"  # not the last warning it printed, which is not why
    why += f": {tail}" if tail else ""
    _kill_all(procs)
    if "address already in use" in tail.lower() or "eaddrinuse" in tail.lower():
        return _PortTaken(port)
    return PipelineError(
        f"rank {r} (stages {run.stages_of(r)}) failed ({why}); every rank was stopped; "
        f"full logs: {os.path.join(tmp, 'rank*.err')}"
    )


def _join_external(cfg: PipelineConfig) -> tuple[int, int, Any]:
    """:func:`_init_group` under an outside launcher, said on stderr first (RANK and WORLD_SIZE left in a shell by
    torchrun or SLURM put the command in this mode, and it then waited the whole ``--timeout`` in silence), its
    failure a :class:`PipelineError` naming the address, the port and the fix (it was a raw traceback)."""
    from microbatch.measure.device import launch_env

    env = os.environ
    launch_env()  # variables that describe no launch (RANK past WORLD_SIZE, a bad port): refused before any wait
    where = f"{env.get('MASTER_ADDR', '?')}:{env.get('MASTER_PORT', '?')}"
    if env.get("RANK") == "0" or "TORCHELASTIC_RUN_ID" not in env:  # under torchrun, rank 0 says it for all
        print(
            f"pipeline: RANK={env.get('RANK')} and WORLD_SIZE={env.get('WORLD_SIZE')} are set: this process joins the "
            f"process group at {where} as one rank of an outside launch (torchrun), waiting up to {cfg.timeout_s:g} s "
            "for the others",
            file=sys.stderr,
            flush=True,
        )
    try:
        return _init_group(cfg, interruptible=True)
    except ConfigError:
        raise
    except Exception as e:  # the store's timeout, a refused connection, a bad address
        raise PipelineError(
            f"rank {env.get('RANK')} of {env.get('WORLD_SIZE')} could not join the process group at {where} "
            f"({_reason(e)}); RANK, WORLD_SIZE and MASTER_ADDR/MASTER_PORT in the environment make this run one "
            "rank of an outside launch: start the other ranks (with torchrun), or unset RANK and "
            "WORLD_SIZE to run every rank here"
        ) from e


def run_external(run: ResolvedRun) -> PipelineReport | None:
    """Run this process as one rank under ``torchrun``; return the report on rank 0, else None."""
    from microbatch.run.pipeline.rank import run_rank

    rank, world, device = _join_external(run.cfg)
    import torch.distributed as dist

    try:
        # a factory that cannot be imported or built: ConfigError on every rank; checked once the
        # group is made, so that a factory that builds on the GPU builds on this rank's device
        check_splittable(run)
        raw = run_rank(run, rank=rank, world_size=world, device=device)
    except ConfigError:
        raise
    except Exception as e:  # one line naming this rank; torchrun stops the others
        raise PipelineError(f"rank {rank} (stages {run.stages_of(rank)}) failed: {_reason(e)}") from e
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if raw is None:
        return None
    with second_interrupt_ignored():  # the steps are measured: kept whole
        return summarize(raw, run)
