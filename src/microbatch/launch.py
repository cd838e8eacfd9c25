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
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import fields
from typing import Any

from .errors import ConfigError, PipelineError, ScheduleError
from .pipeline import PipelineConfig, stage_to_rank, torch_order

__all__ = [
    "chrome_trace",
    "free_port",
    "measured_comm_s",
    "run_external",
    "run_pipeline",
    "predict",
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

        ooms = tuple(
            t
            for t in (getattr(torch, "OutOfMemoryError", None), getattr(torch.cuda, "OutOfMemoryError", None))
            if t
        )
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
    r = reason.lower()
    return any(x in r for x in ("connection closed by peer", "connection reset by peer", "broken pipe"))


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
    check_splittable(cfg)
    deadline_s = cfg.timeout_s + STARTUP_S if deadline_s is None else deadline_s
    tmp = tempfile.mkdtemp(prefix="microbatch-pipeline-")
    cfg_path, result_path = os.path.join(tmp, "config.json"), os.path.join(tmp, "result.json")
    with open(cfg_path, "w") as f:
        json.dump(cfg.to_dict(), f)
    for attempt in range(3):
        try:
            raw = _launch_once(cfg, tmp, cfg_path, result_path, free_port(), deadline_s)
            break
        except _PortTaken:
            if attempt == 2:
                raise PipelineError(
                    "three free ports were taken before the ranks could bind them; retry, or run under torchrun "
                    "with --master-port"
                ) from None
    shutil.rmtree(tmp, ignore_errors=True)
    return summarize(raw)


class _PortTaken(Exception):
    """The rendezvous port was taken between finding it and binding it."""


def _launch_once(
    cfg: PipelineConfig, tmp: str, cfg_path: str, result_path: str, port: int, deadline_s: float
) -> dict:
    """Start the ranks on ``port``, wait for them, return rank 0's raw result."""
    src = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
                time.sleep(0.3)  # let a crash's neighbours report, then name the cause, not a victim
                later = [x for x, rc in enumerate(p.poll() for p in procs) if rc not in (None, 0)]
                causes = [x for x in bad + later if not _is_victim(_tail(errs[x]))]
                r = causes[0] if causes else bad[0]
                rc = procs[r].poll()
                if rc < 0:
                    why = f"killed by signal {signal.Signals(-rc).name}"
                    if -rc == signal.SIGKILL:
                        why += " (out of host memory? the kernel's OOM killer sends SIGKILL)"
                else:
                    why = f"exit status {rc}"
                tail = _tail(errs[r])
                why += f": {tail}" if tail else ""
                _kill_all(procs)
                if "address already in use" in tail.lower() or "eaddrinuse" in tail.lower():
                    raise _PortTaken(port)
                raise PipelineError(
                    f"rank {r} (stages {_stages_of(cfg, r)}) failed ({why}); every rank was stopped; "
                    f"full logs: {os.path.join(tmp, 'rank*.err')}"
                )
            if all(rc == 0 for rc in rcs):
                break
            if time.monotonic() > t_end:
                alive = [r for r, rc in enumerate(rcs) if rc is None]
                _kill_all(procs)
                raise PipelineError(
                    f"pipeline run passed its deadline of {deadline_s:.0f} s; ranks {alive} were still running "
                    f"and were killed; raise --timeout or lower --steps; logs: {os.path.join(tmp, 'rank*.err')}"
                )
            time.sleep(0.05)
        with open(result_path) as f:
            raw = json.load(f)
    finally:
        _kill_all(procs)
    return raw


def check_splittable(cfg: PipelineConfig) -> None:
    """Refuse, before any process starts, a built-in model with fewer layers than p·v stages
    (units: the embedding, every block, the head)."""
    if ":" in cfg.model:
        return
    from .model import get_model

    shape = get_model(cfg.model, seq=cfg.seq)
    units = shape.layers + 2
    if cfg.total_stages > units:
        raise ConfigError(
            f"{cfg.total_stages} stages (p·v = {cfg.stages}·{cfg.virtual}) but model {cfg.model} has only {units} "
            f"layers to split (embedding, {shape.layers} blocks, head); each stage needs at least one; use "
            f"p·v <= {units} or a deeper model"
        )


def _stages_of(cfg: PipelineConfig, rank: int) -> list[int]:
    return [s for s, r in enumerate(stage_to_rank(cfg.schedule, cfg.stages, cfg.virtual)) if r == rank]


def run_external(cfg: PipelineConfig) -> dict | None:
    """Run this process as one rank under ``torchrun``; return the report on rank 0, else None."""
    from .pipeline import run_rank

    rank, world, device = _init_group(cfg)
    import torch.distributed as dist

    try:
        raw = run_rank(cfg, rank=rank, world_size=world, device=device)
    except ConfigError:
        raise
    except Exception as e:  # one line naming this rank; torchrun stops the others
        raise PipelineError(f"rank {rank} (stages {_stages_of(cfg, rank)}) failed: {_reason(e)}") from e
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return summarize(raw) if raw is not None else None


def config_from_dict(d: dict) -> PipelineConfig:
    names = {f.name for f in fields(PipelineConfig)}
    return PipelineConfig(**{k: v for k, v in d.items() if k in names})


# -- the report -------------------------------------------------------------------------


def summarize(raw: dict) -> dict:
    """Measured and predicted bubble, busy/idle time, in-flight counts and memory per rank.

    Steps after the first are averaged (the first warms up); with one step, it is used. Keys:

    - ``measured.bubble_fraction``: Σ_ranks idle / (p × step wall time); the step's wall time runs
      from the barrier before ``step()`` to the last rank's return.
    - ``measured.stage_stats[r]`` (``stage`` is the rank; ``virtual_stages`` the stages it holds):
      ``busy_s`` (time inside forward/backward calls, the loss counted with the forward),
      ``idle_s`` = wall − busy, ``peak_in_flight`` (in a rank's layers: chunks / v, as
      :mod:`microbatch.simulate`; ``peak_in_flight_chunks`` the raw count),
      ``activation_bytes_per_microbatch`` (mean bytes autograd saved for one (stage,
      micro-batch)), ``peak_activation_bytes`` (most saved bytes resident at once) and
      ``cuda_peak_bytes`` (``max_memory_allocated``, GPU only).
    - ``measured.op_time_s``: mean seconds of each stage's F/B/I/W (``"1F"``) — the simulator's input.
    - ``predicted``: :func:`predict` on torch's order with those times (no communication time);
      ``predicted.with_comm``: the same plus the measured hand-off latency (:func:`measured_comm_s`).
    - ``gradients_match`` / ``max_grad_rel_error``: largest ‖g_pipe − g_ref‖/‖g_ref‖ over the
      parameters after step 1 against the unsplit model (None unless checked); tolerance
      :data:`GRAD_TOLERANCE` by dtype.
    - ``order_matches_torch``: every rank ran exactly torch's planned compute order.
    - ``timeline`` / ``predicted_timeline``: the last step's intervals, seconds from its start.
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
    executed = {str(r["rank"]): r["steps"][-1]["order"] for r in ranks}
    pred = predict(cfg, mean_times, executed)
    comm = measured_comm_s(cfg, [[r["steps"][k]["intervals"] for r in ranks] for k in use])
    pred_comm = predict(cfg, mean_times, executed, comm_s=comm)
    v = cfg.virtual
    for st in stats:
        st["peak_in_flight_chunks"] = st["peak_in_flight"]
        st["peak_in_flight"] = st["peak_in_flight"] if v == 1 else st["peak_in_flight"] / v
    t0 = min(r["steps"][-1]["start_wall_s"] for r in ranks)
    timeline = [
        {"rank": r["rank"], "stage": s, "kind": kind, "microbatch": i, "start_s": a - t0, "end_s": e - t0}
        for r in ranks
        for (kind, s, i, a, e) in r["steps"][-1]["intervals"]
    ]
    predicted_rows = pred.timeline_rows()
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
            "bubble_fraction": pred.bubble_fraction,
            "peak_in_flight": list(pred.peak_in_flight),
            "peak_in_flight_chunks": list(pred.peak_in_flight_chunks),
            "step_time_s": pred.makespan,
            "source": "microbatch.simulate on torch's action order, fed the measured mean F/B/I/W time of each stage",
            "with_comm": {
                "comm_time_s": comm,
                "bubble_fraction": pred_comm.bubble_fraction,
                "step_time_s": pred_comm.makespan,
            },
        },
        "gradients_match": None if max_err is None else bool(max_err <= tol),
        "max_grad_rel_error": max_err,
        "grad_tolerance": tol,
        "losses": losses,
        "order_matches_torch": all(
            executed[str(r)] == [str(a) for a in acts] for r, acts in enumerate(pred.schedule.actions)
        ),
        "executed_order": executed,
        "timeline": timeline,
        "predicted_timeline": [
            {"rank": r, "label": lab, "microbatch": i, "start_s": a, "end_s": e}
            for r, rows in enumerate(predicted_rows)
            for (a, e, lab, i) in rows
        ],
    }


def measured_comm_s(cfg: PipelineConfig, steps: list[list[list]]) -> float:
    """Median measured hand-off latency between ranks: for each op whose input comes from another
    rank (F from stage s−1, B/I from stage s+1) and whose rank sat idle waiting for it, the gap
    from the input's end to the op's start. ``steps``: per step, per rank, the raw intervals
    ``(kind, stage, microbatch, start, end)``. 0 when no op waited on another rank."""
    placement = stage_to_rank(cfg.schedule, cfg.stages, cfg.virtual)
    last = cfg.total_stages - 1
    gaps = []
    for per_rank in steps:
        span: dict[tuple[str, int, int], tuple[float, float, float | None]] = {}
        for intervals in per_rank:
            before = None  # end of the rank's previous op: the rank is idle from then on
            for kind, s, i, a, e in sorted(intervals, key=lambda x: x[3]):
                span[(kind, s, i)] = (a, e, before)
                before = e
        for (kind, s, i), (start, _, idle_from) in span.items():
            if kind == "F" and s > 0:
                deps = [("F", s - 1, i)]
            elif kind in ("B", "I") and s < last:
                deps = [("B", s + 1, i), ("I", s + 1, i)]
            else:
                continue
            dep = next((d for d in deps if d in span), None)
            if dep is None or placement[dep[1]] == placement[s]:
                continue
            dep_end = span[dep][1]
            if idle_from is None or idle_from <= dep_end:  # the op waited for its input
                gaps.append(max(0.0, start - dep_end))
    if not gaps:
        return 0.0
    gaps.sort()
    return gaps[len(gaps) // 2]


def predict(
    cfg: PipelineConfig,
    op_time_s: dict[tuple[int, str], float],
    executed: dict | None = None,
    *,
    comm_s: float = 0.0,
):
    """:func:`microbatch.simulate.simulate` on torch's action order for ``cfg`` (as a
    :class:`~microbatch.schedule.Schedule`), with ``op_time_s[(stage, kind)]`` seconds per op.

    Where torch's order cannot be derived (an older torch whose internals differ), the order the
    ranks ``executed`` (rank -> action strings) is simulated instead. ``comm_s`` is paid on every
    dependency between ranks (see :func:`measured_comm_s`)."""
    from .schedule import Schedule
    from .simulate import simulate

    try:
        order = torch_order(cfg.schedule, cfg.stages, cfg.microbatches, cfg.virtual)
    except ScheduleError:
        if executed is None:
            raise
        order = {int(r): acts for r, acts in executed.items()}  # what this torch really ran
    sched = Schedule.from_strings(
        cfg.schedule,
        [order[r] for r in range(cfg.stages)],
        microbatches=cfg.microbatches,
        virtual=cfg.virtual,
        placement="v" if cfg.schedule == "zbv" else "loop",
    )
    n = cfg.total_stages
    times = {k: [float(op_time_s.get((s, k), 0.0)) for s in range(n)] for k in "FBIW"}
    split = sched.split_backward
    return simulate(
        sched,
        forward_time=times["F"],
        backward_time=None if split else times["B"],
        input_time=times["I"] if split else None,
        weight_time=times["W"] if split else None,
        comm_time=comm_s,
    )


def timeline_rows(report: dict) -> list[list[tuple[float, float, str, int]]]:
    """The measured last step as per-rank ``(start, end, label, microbatch)`` rows, labelled as
    :meth:`microbatch.simulate.SimResult.timeline_rows` labels them (chunk prefix when v > 1)."""
    p, v = report["stages"], report["virtual"]
    rows: list[list[tuple[float, float, str, int]]] = [[] for _ in range(p)]
    for it in sorted(report["timeline"], key=lambda x: x["start_s"]):
        label = it["kind"] if v == 1 else f"{it['stage'] // p}{it['kind']}"
        rows[it["rank"]].append((it["start_s"], it["end_s"], label, it["microbatch"]))
    return rows


def chrome_trace(report: dict) -> dict:
    """The measured timeline of the last step as a Chrome trace (``chrome://tracing``, Perfetto):
    one process per rank, one thread per stage, one complete event per F/B/I/W, and a counter of
    the micro-batches in flight on each rank."""
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
    # in-flight micro-batches per rank as a counter track: +1 at a forward's end, -1 at the end of
    # the last part of its backward (B, or W when the backward is split)
    split = any(it["kind"] == "W" for it in report["timeline"])
    last = "W" if split else "B"
    for r in range(report["stages"]):
        steps = sorted(
            (it["end_s"], 1 if it["kind"] == "F" else -1)
            for it in report["timeline"]
            if it["rank"] == r and it["kind"] in ("F", last)
        )
        held = 0
        for t, d in steps:
            held += d
            events.append(
                {"name": "in flight", "ph": "C", "pid": r, "ts": t * 1e6, "args": {"micro-batches": held}}
            )
    return {"traceEvents": events, "displayTimeUnit": "ms"}
