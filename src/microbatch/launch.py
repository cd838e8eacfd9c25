"""Start pipeline ranks, watch them, and turn their measurements into a report.

:func:`run_pipeline` starts p worker processes on this machine (gloo on the CPU, a free port
found by binding port 0, ``torch.set_num_threads(1)`` per worker), waits for them under a
deadline and raises :class:`~microbatch.errors.PipelineError` naming the rank and the last
lines of its error output as soon as any rank fails, killing the others: never a hang.
:func:`run_external` is the same rank code under an outside launcher (``torchrun`` on one or
several machines; it reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
``MASTER_PORT``).

:func:`summarize` reduces the raw per-rank intervals to the measured bubble, busy and idle time,
in-flight counts and saved-activation bytes, and runs the simulator on the same action order
(torch's own, see :func:`microbatch.pipeline.torch_order`) fed with the measured per-stage
forward and backward times, so that measured and predicted compare like with like.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import fields
from typing import Any

from .errors import ConfigError, PipelineError
from .pipeline import PipelineConfig, stage_to_rank, torch_order

__all__ = [
    "chrome_trace",
    "free_port",
    "run_external",
    "run_pipeline",
    "simulate_order",
    "summarize",
    "under_torchrun",
]

STARTUP_S = 60.0
"""Allowance for starting Python and importing torch in every worker, added to the deadline."""

GRAD_TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 5e-3}
"""Largest relative gradient error accepted as a match, by parameter dtype (fp32: the issue's 1e-5)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the kernel's choice for port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def under_torchrun(env: dict | None = None) -> bool:
    """True when an outside launcher (torchrun) set the rendezvous variables of this process."""
    env = os.environ if env is None else env
    return all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")) and (
        "MICROBATCH_WORKER" not in env
    )


# -- the worker -------------------------------------------------------------------------


def _init_group(cfg: PipelineConfig):
    import datetime

    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if cfg.backend == "nccl":
        if not torch.cuda.is_available():
            raise ConfigError(
                "backend nccl needs CUDA GPUs and none is visible; use --backend gloo on the CPU"
            )
        device = torch.device("cuda", local % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
    dist.init_process_group(
        cfg.backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=cfg.timeout_s)
    )
    return rank, world, device


def _worker_main() -> None:
    """Entry point of a worker started by :func:`run_pipeline`: ``CONFIG_JSON RESULT_JSON``."""
    import traceback

    cfg_path, result_path = sys.argv[1], sys.argv[2]
    rank = os.environ.get("RANK", "?")
    try:
        with open(cfg_path) as f:
            cfg = PipelineConfig(**json.load(f))
        from .pipeline import run_rank

        r, world, device = _init_group(cfg)
        out = run_rank(cfg, rank=r, world_size=world, device=device)
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
    sys.stdout.flush()
    os._exit(0)


def _reason(e: BaseException) -> str:
    try:
        import torch

        if isinstance(e, torch.OutOfMemoryError):
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


def _kill_all(procs: list[subprocess.Popen]) -> None:
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


def run_pipeline(cfg: PipelineConfig, *, deadline_s: float | None = None) -> dict:
    """Run ``cfg`` in ``cfg.stages`` local processes and return :func:`summarize`'s report.

    Raises :class:`PipelineError` (which rank, why, the end of its error output) when a rank
    exits non-zero or is killed, or when the run passes ``deadline_s`` (default: the config's
    timeout plus a start-up allowance); every worker is killed before it returns.
    """
    if cfg.backend == "nccl":
        import torch

        if torch.cuda.device_count() < cfg.stages:
            raise ConfigError(
                f"backend nccl with {cfg.stages} stages needs {cfg.stages} GPUs, found "
                f"{torch.cuda.device_count()}; use --backend gloo or fewer --stages"
            )
    deadline_s = cfg.timeout_s + STARTUP_S if deadline_s is None else deadline_s
    tmp = tempfile.mkdtemp(prefix="microbatch-pipeline-")
    cfg_path, result_path = os.path.join(tmp, "config.json"), os.path.join(tmp, "result.json")
    with open(cfg_path, "w") as f:
        json.dump(cfg.to_dict(), f)
    src = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    port = free_port()
    procs: list[subprocess.Popen] = []
    errs: list[str] = []
    code = "from microbatch.launch import _worker_main; _worker_main()"
    try:
        for r in range(cfg.stages):
            env = dict(os.environ)
            env.update(
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                RANK=str(r),
                LOCAL_RANK=str(r),
                WORLD_SIZE=str(cfg.stages),
                LOCAL_WORLD_SIZE=str(cfg.stages),
                MICROBATCH_WORKER="1",
                PYTHONPATH=os.pathsep.join(x for x in (src, env.get("PYTHONPATH", "")) if x),
            )
            if cfg.backend == "gloo":
                env.setdefault("OMP_NUM_THREADS", "1")
            err = os.path.join(tmp, f"rank{r}.err")
            errs.append(err)
            with open(err, "w") as ef:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-c", code, cfg_path, result_path],
                        env=env,
                        stdout=subprocess.DEVNULL,
                        stderr=ef,
                        start_new_session=True,
                    )
                )
        t_end = time.monotonic() + deadline_s
        while True:
            rcs = [p.poll() for p in procs]
            bad = [r for r, rc in enumerate(rcs) if rc not in (None, 0)]
            if bad:
                time.sleep(0.2)  # let a crash's neighbours report, then name the first one seen
                r = bad[0]
                rc = rcs[r]
                why = (f"killed by signal {signal.Signals(-rc).name}" if rc < 0 else f"exit status {rc}") + (
                    f": {_tail(errs[r])}" if _tail(errs[r]) else ""
                )
                _kill_all(procs)
                raise PipelineError(
                    f"rank {r} (stages {_stages_of(cfg, r)}) failed ({why}); every rank was stopped"
                )
            if all(rc == 0 for rc in rcs):
                break
            if time.monotonic() > t_end:
                alive = [r for r, rc in enumerate(rcs) if rc is None]
                _kill_all(procs)
                raise PipelineError(
                    f"pipeline run passed its deadline of {deadline_s:.0f} s; ranks {alive} were still running "
                    "and were killed; raise --timeout or lower --steps"
                )
            time.sleep(0.05)
        with open(result_path) as f:
            raw = json.load(f)
    finally:
        _kill_all(procs)
    return summarize(raw)


def _stages_of(cfg: PipelineConfig, rank: int) -> list[int]:
    return [s for s, r in enumerate(stage_to_rank(cfg.schedule, cfg.stages, cfg.virtual)) if r == rank]


def run_external(cfg: PipelineConfig) -> dict | None:
    """Run this process as one rank under ``torchrun``; return the report on rank 0, else None."""
    from .pipeline import run_rank

    rank, world, device = _init_group(cfg)
    import torch.distributed as dist

    try:
        raw = run_rank(cfg, rank=rank, world_size=world, device=device)
    finally:
        dist.destroy_process_group()
    return summarize(raw) if raw is not None else None


def config_from_dict(d: dict) -> PipelineConfig:
    names = {f.name for f in fields(PipelineConfig)}
    return PipelineConfig(**{k: v for k, v in d.items() if k in names})


# -- simulation of an action order ----------------------------------------------------


def simulate_order(
    order: dict[int, list[str]], times_s: dict[tuple[int, str], float], *, comm_s: float = 0.0
) -> dict:
    """Start every action of ``order`` as early as its rank and its inputs allow.

    ``order``: rank -> actions like ``"1F0"``; ``times_s``: (stage, kind) -> seconds. F of stage s
    needs F of s−1 (plus ``comm_s`` across ranks); B or I of s needs B/I of s+1 (the last stage's
    needs its own F); W needs I of the same stage. Returns ``makespan_s``, ``bubble_fraction``
    (idle share of p × makespan), ``peak_in_flight`` per rank (F done, B or W not) and the
    intervals as (rank, stage, kind, microbatch, start_s, end_s).
    """
    import re

    pat = re.compile(r"^(\d+)([FBIW])(\d+)$")
    acts = {r: [pat.match(a).groups() for a in ops] for r, ops in order.items()}
    acts = {r: [(int(s), k, int(i)) for s, k, i in ops] for r, ops in acts.items()}
    n_stages = 1 + max(s for ops in acts.values() for s, _, _ in ops)
    rank_of = {s: r for r, ops in acts.items() for s, _, _ in ops}
    done: dict[tuple[int, str, int], float] = {}
    pos = {r: 0 for r in acts}
    free = {r: 0.0 for r in acts}
    intervals = []
    while any(pos[r] < len(acts[r]) for r in acts):
        progressed = False
        for r in acts:
            while pos[r] < len(acts[r]):
                s, k, i = acts[r][pos[r]]
                if k == "F":
                    dep = (s - 1, "F", i) if s > 0 else None
                elif k in ("B", "I"):
                    dep = (s, "F", i) if s == n_stages - 1 else (s + 1, "BI", i)
                else:
                    dep = (s, "I", i)
                if dep is None:
                    ready = 0.0
                else:
                    ds, dk, di = dep
                    keys = [(ds, c, di) for c in dk] if dk == "BI" else [dep]
                    got = [done[x] for x in keys if x in done]
                    if not got:
                        break
                    ready = got[0] + (comm_s if rank_of[ds] != r else 0.0)
                start = max(free[r], ready)
                end = start + float(times_s.get((s, k), 0.0))
                done[(s, k, i)] = end
                free[r] = end
                intervals.append((r, s, k, i, start, end))
                pos[r] += 1
                progressed = True
        if not progressed:
            stuck = {r: "".join(map(str, acts[r][pos[r]])) for r in acts if pos[r] < len(acts[r])}
            raise PipelineError(f"schedule order deadlocks: ranks wait on {stuck}")
    makespan = max(free.values()) if free else 0.0
    busy = sum(e - s for _, _, _, _, s, e in intervals)
    p = len(acts)
    peaks = {}
    for r in acts:
        events = []
        split = any(k == "W" for _, k, _ in acts[r])
        for rr, _s, k, _i, _st, en in intervals:
            if rr != r:
                continue
            if k == "F":
                events.append((en, 1))
            elif k == "W" or (k == "B" and not split):
                events.append((en, -1))
        cur = peak = 0
        for _, d in sorted(events, key=lambda e: (e[0], e[1])):
            cur += d
            peak = max(peak, cur)
        peaks[r] = peak
    return {
        "makespan_s": makespan,
        "bubble_fraction": 1.0 - busy / (p * makespan) if makespan > 0 else 0.0,
        "peak_in_flight": [peaks[r] for r in sorted(acts)],
        "intervals": intervals,
    }


# -- the report -------------------------------------------------------------------------


def summarize(raw: dict) -> dict:
    """Measured and predicted bubble, busy/idle time, in-flight counts and memory per rank.

    Steps after the first are averaged (the first warms up); with one step, it is used.
    """
    cfg = config_from_dict(raw["config"])
    ranks = sorted(raw["ranks"], key=lambda x: x["rank"])
    n_steps = len(ranks[0]["steps"])
    use = list(range(1, n_steps)) if n_steps > 1 else [0]
    p = cfg.stages

    bubbles, walls = [], []
    busy = defaultdict(list)
    op_times: dict[tuple[int, str], list[float]] = defaultdict(list)
    for k in use:
        start = min(r["steps"][k]["start_wall_s"] for r in ranks)
        end = max(r["steps"][k]["end_wall_s"] for r in ranks)
        wall = end - start
        walls.append(wall)
        tot = 0.0
        for r in ranks:
            b = sum(e - s for _, _, _, s, e in r["steps"][k]["intervals"])
            busy[r["rank"]].append(b)
            tot += b
            for kind, stage, _i, s, e in r["steps"][k]["intervals"]:
                op_times[(stage, kind)].append(e - s)
        bubbles.append(1.0 - tot / (p * wall) if wall > 0 else 0.0)
    wall = sum(walls) / len(walls)
    stats = []
    for r in ranks:
        steps = [r["steps"][k] for k in use]
        per_mb = [x for st in steps for x in st["per_microbatch_bytes"]]
        b = sum(busy[r["rank"]]) / len(use)
        cuda = [st["cuda_peak_bytes"] for st in steps if st.get("cuda_peak_bytes") is not None]
        stats.append(
            {
                "stage": r["rank"],
                "virtual_stages": r["stages"],
                "busy_s": b,
                "idle_s": max(0.0, wall - b),
                "peak_in_flight": max(st["peak_in_flight"] for st in steps),
                "activation_bytes_per_microbatch": (sum(per_mb) / len(per_mb)) if per_mb else 0,
                "peak_activation_bytes": max(st["peak_activation_bytes"] for st in steps),
                "cuda_peak_bytes": max(cuda) if cuda else None,
            }
        )
    mean_times = {key: sum(v) / len(v) for key, v in op_times.items()}
    order = torch_order(cfg.schedule, cfg.stages, cfg.microbatches, cfg.virtual)
    pred = simulate_order(order, mean_times)
    executed = {str(r["rank"]): r["steps"][-1]["order"] for r in ranks}
    last = raw["ranks"][0]["steps"][-1]
    t0 = min(r["steps"][-1]["start_wall_s"] for r in ranks)
    timeline = [
        {"rank": r["rank"], "stage": s, "kind": kind, "microbatch": i, "start_s": a - t0, "end_s": e - t0}
        for r in ranks
        for (kind, s, i, a, e) in r["steps"][-1]["intervals"]
    ]
    del last
    err = [r["max_grad_rel_error"] for r in ranks if r["max_grad_rel_error"] is not None]
    max_err = max(err) if err else None
    tol = GRAD_TOLERANCE[cfg.dtype]
    losses = [st["loss"] for r in ranks for st in r["steps"] if st["loss"] is not None]
    return {
        "schedule": cfg.schedule,
        "stages": cfg.stages,
        "microbatches": cfg.microbatches,
        "virtual": cfg.virtual,
        "model": cfg.model,
        "global_batch": cfg.batch,
        "micro_batch": cfg.micro_batch,
        "steps": n_steps,
        "measured_steps": len(use),
        "layers_per_stage": ranks[0]["layers_per_stage"],
        "torch_version": raw.get("torch_version"),
        "device": raw.get("device"),
        "measured": {
            "bubble_fraction": sum(bubbles) / len(bubbles),
            "step_time_s": wall,
            "stage_stats": stats,
            "op_time_s": {f"{s}{k}": v for (s, k), v in sorted(mean_times.items())},
        },
        "predicted": {
            "bubble_fraction": pred["bubble_fraction"],
            "peak_in_flight": pred["peak_in_flight"],
            "step_time_s": pred["makespan_s"],
            "source": "simulate_order on torch's action order with the measured mean time of each stage's F/B/I/W",
        },
        "gradients_match": None if max_err is None else bool(max_err <= tol),
        "max_grad_rel_error": max_err,
        "grad_tolerance": tol,
        "losses": losses,
        "order_matches_torch": all(executed[str(r)] == order[r] for r in order),
        "executed_order": executed,
        "timeline": timeline,
    }


def chrome_trace(report: dict) -> dict:
    """The measured timeline of the last step as a Chrome trace (``chrome://tracing``, Perfetto):
    one process per rank, one thread per stage, one complete event per F/B/I/W."""
    events: list[dict[str, Any]] = []
    for r in range(report["stages"]):
        events.append({"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r}"}})
    for it in report["timeline"]:
        events.append(
            {
                "name": f"{it['kind']}{it['microbatch']}",
                "cat": it["kind"],
                "ph": "X",
                "pid": it["rank"],
                "tid": it["stage"],
                "ts": it["start_s"] * 1e6,
                "dur": (it["end_s"] - it["start_s"]) * 1e6,
                "args": {"stage": it["stage"], "microbatch": it["microbatch"]},
            }
        )
    return {"traceEvents": events, "displayTimeUnit": "ms"}
