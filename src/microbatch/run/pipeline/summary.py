"""A pipeline run's report as data: measured bubble and memory per rank, the simulator's
prediction on the same action order, the timeline as plain rows.

:func:`summarize` reduces the raw per-rank intervals that :func:`microbatch.run.pipeline.rank.run_rank`
gathers on rank 0 to the measured bubble, busy and idle time, in-flight counts and
saved-activation bytes, and runs the simulator on torch's own order (see
:func:`microbatch.schedules.torch_order.torch_order`) fed with the measured per-stage forward and
backward times, so that measured and predicted compare like with like. Plain data in, plain data
out: no torch needed here beyond what :func:`~microbatch.schedules.torch_order.torch_order` imports.
Drawing and prose live in :mod:`microbatch.show.pipeline_report`.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from dataclasses import replace
from typing import Any

from microbatch.errors import ConfigError
from microbatch.run.pipeline.memory import memory_rows
from microbatch.run.pipeline.report import (
    MEASURED_BUBBLE_IS,
    REPLAY_WITH_HANDOFF_IS,
    REPLAY_WITHOUT_HANDOFF_IS,
    Measured,
    PipelineReport,
    Predicted,
    PredictedOp,
    RankStats,
    StepIntervals,
    TimelineOp,
    WithComm,
)
from microbatch.run.pipeline.resolved import ResolvedRun
from microbatch.schedules.action import Action, Schedule
from microbatch.schedules.simulate import SimResult, simulate

__all__ = [
    "GRAD_TOLERANCE",
    "UNSPLIT_TIMES",
    "grad_tolerance",
    "figure_notes",
    "measured_comm_s",
    "predict",
    "summarize",
    "timeline_rows",
]

GRAD_TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 5e-3}
"""Largest relative gradient error accepted as a match, by parameter dtype (fp32: the issue's 1e-5), against the
unsplit model's float32 gradients; in bf16 and fp16 at least :data:`UNSPLIT_TIMES` × the unsplit step's own error in
that dtype (:func:`grad_tolerance`)."""

UNSPLIT_TIMES = 2.0
"""The pipeline adds m micro-batches' gradients in the parameters' dtype, a rounding each, where the unsplit step
rounds its sum once; twice that step's own error against float32 bounds what the dtype alone explains (a helper's
runs, 2026-12-07: bf16 at m = 4 the pipeline 0.017, the unsplit step 0.029; m = 8 and B = 16 grew both)."""


def grad_tolerance(dtype: str, unsplit_error: float | None) -> float:
    """The relative gradient error accepted in ``dtype``: :data:`GRAD_TOLERANCE`, or :data:`UNSPLIT_TIMES` × the
    unsplit step's own error in that dtype where larger."""
    return max(GRAD_TOLERANCE[dtype], UNSPLIT_TIMES * (unsplit_error or 0.0))


def summarize(raw: dict[str, Any], run: ResolvedRun) -> PipelineReport:
    """Measured and predicted bubble, busy/idle time, in-flight counts and memory per rank.

    Steps after the first are averaged (the first warms up); with one step, it is used. Fields
    (:class:`~microbatch.run.pipeline.report.PipelineReport`):

    - ``measured.bubble_fraction``: the mean over steps of Σ_ranks idle / (p × step wall time), from
      the barrier before ``step()`` to the last rank's return; ``bubble_of_mean_times``: 1 − Σ mean busy
      / (p × mean wall), what the busy/idle seconds give; ``bubble_steps``: each step's; ``bubble_se``:
      their standard error (sample standard deviation / √steps; None with one step) — on a shared CPU
      one step's bubble moves by several points (tiny, p = 2: sd 6-8 points per step on the 2-core dev
      machine), so a measurement of few steps is itself uncertain.
    - ``measured.stage_stats[r]`` (``stage`` is the rank; ``virtual_stages`` the stages it holds):
      ``busy_s`` (time inside forward/backward calls, the loss counted with the forward),
      ``idle_s`` = wall − busy, ``counted_in_flight`` (the schedule's count of micro-batches
      between a forward and the end of its backward, in a rank's layers: chunks / v, as
      :mod:`microbatch.schedules.simulate`; ``counted_in_flight_chunks`` the raw count — arithmetic
      on the order, not memory), ``activation_bytes_per_microbatch`` (mean bytes autograd saved for
      one (stage, micro-batch)), ``peak_activation_bytes`` (measured: the peak of saved storages
      actually alive), ``counted_activation_bytes`` (the count times the bytes) and
      ``cuda_peak_bytes`` / ``cuda_reserved_bytes`` (GPU only).
    - ``memory``: per rank, measured against predicted activation memory with the error
      (:func:`microbatch.run.pipeline.memory.memory_rows`).
    - ``measured.op_time_s``: mean seconds of each stage's F/B/I/W (``"1F"``) — the simulator's input.
    - ``measured.cpu_share``: CPU seconds / wall seconds inside the ops, over all ranks (the share of
      a core the ops got; below 1 when the machine is shared); None on a GPU or without CPU times.
    - ``predicted``: :func:`predict` on torch's order with those times (no communication time);
      ``predicted.with_comm``: the same plus the measured hand-off latency (:func:`measured_comm_s`),
      which the text shows as its "replay (measured ops)" column (each says so in ``bubble_fraction_is``).
    - ``gradients_match`` / ``max_grad_rel_error``: largest ‖g_pipe − g_ref‖/‖g_ref‖ over the
      parameters after step 1 against the unsplit model (None unless checked); tolerance
      :data:`GRAD_TOLERANCE` by dtype.
    - ``order_matches_torch``: every rank ran exactly torch's planned compute order.
    - ``timeline`` / ``predicted_timeline``: the last step's intervals, seconds from its start.
    - ``step_intervals``: every measured step's start, end and raw per-rank intervals (wall-clock
      seconds), what :func:`microbatch.run.pipeline.replay.runtime_terms` reads.
    ``run``: the resolved run the ranks ran (``raw`` holds its config as they read it).
    """
    cfg = run.cfg
    ranks = sorted(raw["ranks"], key=lambda x: x["rank"])
    n_steps = len(ranks[0]["steps"])
    use = list(range(1, n_steps)) if n_steps > 1 else [0]
    bubbles, wall, busy, mean_times = _measured_steps(ranks, use, cfg.stages)
    stats = _stage_stats(ranks, use, wall, busy, cfg.virtual)
    executed = {str(r["rank"]): r["steps"][-1]["order"] for r in ranks}
    pred = predict(run, mean_times, executed)
    comm = measured_comm_s(run, [[r["steps"][k]["intervals"] for r in ranks] for k in use])
    pred_comm = predict(run, mean_times, executed, comm_s=comm)
    max_err = max((e for r in ranks if (e := r["max_grad_rel_error"]) is not None), default=None)
    own = max((e for r in ranks if (e := r.get("unsplit_grad_rel_error")) is not None), default=None)
    tol = grad_tolerance(cfg.dtype, own)
    return PipelineReport(
        notes=(late := list[str]()),  # a failed measurement after the run (memory_rows)
        schedule=cfg.schedule,
        stages=cfg.stages,
        microbatches=cfg.microbatches,
        virtual=cfg.virtual,
        model=cfg.model,
        global_batch=cfg.batch,
        micro_batch=cfg.micro_batch,
        steps=n_steps,
        measured_steps=len(use),
        layers_per_stage=list(ranks[0]["layers_per_stage"]),
        torch_version=raw.get("torch_version"),
        device=raw.get("device"),
        measured=_measured(ranks, use, bubbles, wall, stats, mean_times, str(raw.get("device", "cpu"))),
        memory=memory_rows(run, ranks, use, device=str(raw.get("device") or "cpu"), notes=late),
        predicted=_predicted(pred, pred_comm, comm),
        gradients_match=None if max_err is None else bool(max_err <= tol),
        max_grad_rel_error=max_err,
        grad_tolerance=tol,
        losses=[st["loss"] for r in ranks for st in r["steps"] if st["loss"] is not None],
        torch_class=run.torch_class,
        dropout_modules=[name for r in ranks for name in r.get("dropout_modules", [])],
        order_matches_torch=all(
            executed[str(r)] == [str(a) for a in acts] for r, acts in enumerate(pred.schedule.actions)
        ),
        executed_order=executed,
        **_timelines(ranks, use, pred),
    )


def _measured_steps(
    ranks: list[dict[str, Any]], use: list[int], p: int
) -> tuple[list[float], float, dict[int, list[float]], dict[tuple[int, str], float]]:
    """Over the measured steps: each step's bubble, the mean step wall time, each rank's busy seconds
    per step and the mean seconds of each (stage, kind) op."""
    bubbles: list[float] = []
    walls: list[float] = []
    busy: defaultdict[int, list[float]] = defaultdict(list)
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
    mean_times = {key: sum(v) / len(v) for key, v in op_times.items()}
    return bubbles, sum(walls) / len(walls), busy, mean_times


def _measured(
    ranks: list[dict[str, Any]],
    use: list[int],
    bubbles: list[float],
    wall: float,
    stats: list[RankStats],
    mean_times: dict[tuple[int, str], float],
    device: str,
) -> Measured:
    """The measured bubble (mean, per step, standard error), step time, per-rank stats, op times and
    the share of a core the ops got (None on a GPU or without CPU times)."""
    op_wall = sum(e - a for r in ranks for k in use for (_, _, _, a, e) in r["steps"][k]["intervals"])
    op_cpu = sum(c for r in ranks for k in use for c in r["steps"][k].get("cpu_s", []))
    return Measured(
        bubble_fraction=sum(bubbles) / len(bubbles),
        bubble_steps=bubbles,
        bubble_se=statistics.stdev(bubbles) / math.sqrt(len(bubbles)) if len(bubbles) > 1 else None,
        step_time_s=wall,
        stage_stats=stats,
        op_time_s={f"{s}{k}": v for (s, k), v in sorted(mean_times.items())},
        cpu_share=op_cpu / op_wall if op_wall > 0 and op_cpu > 0 and not device.startswith("cuda") else None,
        bubble_of_mean_times=1.0 - sum(s.busy_s for s in stats) / (len(stats) * wall) if wall > 0 else None,
        bubble_fraction_is=MEASURED_BUBBLE_IS,
    )


def _stage_stats(
    ranks: list[dict[str, Any]], use: list[int], wall: float, busy: dict[int, list[float]], v: int
) -> list[RankStats]:
    """Per rank: busy and idle seconds, in-flight counts, saved-activation and device bytes."""
    stats: list[RankStats] = []
    for r in ranks:
        steps = [r["steps"][k] for k in use]
        per_mb = [x for st in steps for x in st["per_microbatch_bytes"]]
        b = sum(busy[r["rank"]]) / len(use)
        cuda = [st["cuda_peak_bytes"] for st in steps if st.get("cuda_peak_bytes") is not None]
        counted = max(st["peak_in_flight"] for st in steps)
        stats.append(
            RankStats(
                stage=r["rank"],
                virtual_stages=r["stages"],
                busy_s=b,
                idle_s=max(0.0, wall - b),
                counted_in_flight=counted if v == 1 else counted / v,
                activation_bytes_per_microbatch=(sum(per_mb) / len(per_mb)) if per_mb else 0,
                peak_activation_bytes=max(st["peak_activation_bytes"] for st in steps),
                counted_activation_bytes=max(st["counted_activation_bytes"] for st in steps),
                cuda_peak_bytes=max(cuda) if cuda else None,
                cuda_reserved_bytes=max(
                    (st["cuda_reserved_bytes"] for st in steps if st.get("cuda_reserved_bytes") is not None),
                    default=None,
                ),
                counted_in_flight_chunks=counted,
            )
        )
    return stats


def _predicted(pred: SimResult, pred_comm: SimResult, comm: float) -> Predicted:
    """The simulator's bubble, in-flight counts and step time on torch's order, without and with comm."""
    return Predicted(
        bubble_fraction=pred.bubble_fraction,
        peak_in_flight=list(pred.peak_in_flight),
        peak_in_flight_chunks=list(pred.peak_in_flight_chunks),
        step_time_s=pred.makespan,
        source="microbatch.schedules.simulate on torch's action order, fed the measured mean F/B/I/W time of each stage",
        with_comm=WithComm(
            comm_time_s=comm,
            bubble_fraction=pred_comm.bubble_fraction,
            step_time_s=pred_comm.makespan,
            bubble_fraction_is=REPLAY_WITH_HANDOFF_IS,
        ),
        bubble_fraction_is=REPLAY_WITHOUT_HANDOFF_IS,
    )


def _timelines(ranks: list[dict[str, Any]], use: list[int], pred: SimResult) -> dict[str, Any]:
    """The last step's measured intervals (seconds from its start), every measured step's raw
    intervals, and the predicted timeline."""
    t0 = min(r["steps"][-1]["start_wall_s"] for r in ranks)
    return {
        "timeline": [
            TimelineOp(rank=r["rank"], stage=s, kind=kind, microbatch=i, start_s=a - t0, end_s=e - t0)
            for r in ranks
            for (kind, s, i, a, e) in r["steps"][-1]["intervals"]
        ],
        "step_intervals": [
            StepIntervals(
                start=min(r["steps"][k]["start_wall_s"] for r in ranks),
                end=max(r["steps"][k]["end_wall_s"] for r in ranks),
                ranks=[r["steps"][k]["intervals"] for r in ranks],
            )
            for k in use
        ],
        "predicted_timeline": [
            PredictedOp(rank=r, label=lab, microbatch=i, start_s=a, end_s=e)
            for r, rows in enumerate(pred.timeline_rows())
            for (a, e, lab, i) in rows
        ],
    }


def measured_comm_s(run: ResolvedRun, steps: list[list[list[Any]]]) -> float:
    """Median measured hand-off latency between ranks: for each op whose input comes from another
    rank (F from stage s−1, B/I from stage s+1) and whose rank sat idle waiting for it, the gap
    from the input's end to the op's start. ``steps``: per step, per rank, the raw intervals
    ``(kind, stage, microbatch, start, end)``. 0 when no op waited on another rank."""
    placement = run.placement
    last = run.cfg.total_stages - 1
    paired = _paired_ops(run)
    gaps: list[float] = []
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
            if dep in paired and paired[dep] in span:  # DualPipeV: sent once the paired op ends
                dep_end = max(dep_end, span[paired[dep]][1])
            if idle_from is None or idle_from <= dep_end:  # the op waited for its input
                gaps.append(max(0.0, start - dep_end))
    if not gaps:
        return 0.0
    gaps.sort()
    return gaps[len(gaps) // 2]


def _paired_ops(run: ResolvedRun) -> dict[tuple[str, int, int], tuple[str, int, int]]:
    """(kind, stage, micro-batch) of each overlapped forward (DualPipeV: a forward and the action after it run as one
    step, and the forward's output leaves when that action ends) to the action it is paired with; empty for other
    schedules or where torch's order cannot be derived. Measured from the forward's own end, dualpipev's hand-off
    read 15.6 ms against 1.2 ms on the plain ones (p 2, m 8, a review): the paired backward counted twice, once in the
    hand-off and once by the simulator's pairing."""
    spec = run.spec
    if spec.overlapped is None:
        return {}
    try:
        order = run.torch_order()
        acts = [[Action.parse(a) for a in order[r]] for r in range(run.cfg.stages)]
    except ConfigError:  # an order this torch gives that cannot be read: no pairing, the plain hand-offs
        return {}
    pairs = {}
    for rank, positions in enumerate(spec.overlapped(acts)):
        for k in positions:
            f, nxt = acts[rank][k], acts[rank][k + 1]
            pairs[(f.kind, f.stage, f.microbatch)] = (nxt.kind, nxt.stage, nxt.microbatch)
    return pairs


def predict(
    run: ResolvedRun,
    op_time_s: dict[tuple[int, str], float],
    executed: dict[str, list[str]] | None = None,
    *,
    comm_s: float = 0.0,
) -> SimResult:
    """:func:`microbatch.schedules.simulate.simulate` on torch's action order of ``run`` (as a
    :class:`~microbatch.schedules.action.Schedule`), with ``op_time_s[(stage, kind)]`` seconds per op.

    Where torch's order cannot be derived (an older torch whose internals differ), the order the
    ranks ``executed`` (rank -> action strings) is simulated instead. ``comm_s`` is paid on every
    dependency between ranks (see :func:`measured_comm_s`)."""
    cfg = run.cfg
    if run.order is not None or executed is None:
        order = run.torch_order()  # raises, where executed is None, why it cannot be derived here
    else:
        order = {int(r): acts for r, acts in executed.items()}  # what this torch really ran
    sched = Schedule.from_strings(
        cfg.schedule,
        [order[r] for r in range(cfg.stages)],
        microbatches=cfg.microbatches,
        virtual=cfg.virtual,
        placement=run.spec.placement,
    )
    spec = run.spec
    if spec.overlapped is not None:  # DualPipeV: a forward's output leaves after its paired backward
        sched = replace(sched, overlapped=spec.overlapped(sched.actions))
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


def timeline_rows(report: PipelineReport) -> list[list[tuple[float, float, str, int]]]:
    """The measured last step as per-rank ``(start, end, label, microbatch)`` rows, labelled as
    :meth:`microbatch.schedules.simulate.SimResult.timeline_rows` labels them (chunk prefix when v > 1)."""
    p, v = report.stages, report.virtual
    rows: list[list[tuple[float, float, str, int]]] = [[] for _ in range(p)]
    for it in sorted(report.timeline, key=lambda x: x.start_s):
        label = it.kind if v == 1 else f"{it.stage // p}{it.kind}"
        rows[it.rank].append((it.start_s, it.end_s, label, it.microbatch))
    return rows


def figure_notes(report: PipelineReport) -> list[str]:
    """Notes on what the report's figures are: a gradient mismatch's likely cause (dropout), a prediction
    made on a busy host (:func:`~microbatch.run.pipeline.before_run.host_load`), the measured bubble's
    definition, the activation memory's calibrated column, and the host memory measured against the
    prediction (:attr:`~microbatch.run.pipeline.report.PipelineReport.host_memory`)."""
    from microbatch.units import format_bytes

    notes: list[str] = []
    add = notes.append
    if report.steps == 1 and not report.interrupted:  # the rest are measured only past the first
        add(
            "one step: its figures are the first step's, which warms up (the first allocations and calls) and "
            "runs slower than the steps after it; run two steps or more"
        )
    if report.gradients_match is False and report.dropout_modules:
        shown = ", ".join(report.dropout_modules[:4]) + (" ..." if len(report.dropout_modules) > 4 else "")
        add(
            f"the model has dropout or batch-statistic norms in training mode ({shown}): dropout's masks differ "
            "between the pipelined run and the unsplit reference, and a BatchNorm normalises each micro-batch by its "
            "own rows, the likely cause of the mismatch; check gradients on a model without dropout (p = 0) and "
            "with its norms in eval mode"
        )
    m = report.measured
    b = report.before_run
    if b is not None:
        from microbatch.run.pipeline.report import BUSY_HOST_OTHERS, LOW_CPU_SHARE, host_load

        load = host_load(b)
        if load is not None:
            in_run = f"; in the run they got {m.cpu_share:.0%}" if m.cpu_share is not None else ""
            add(
                f"the host was busy when the prediction was made: other programs kept {load.others:.2f} threads "
                f"runnable on {load.cores} cores (busy from {BUSY_HOST_OTHERS:g}) and the replayed ops got "
                f"{load.cpu_share:.0%} of a core (contended under {LOW_CPU_SHARE:.0%}){in_run}; the prediction "
                "assumes that load holds through the run and models the sharing of cores roughly, so under "
                "contention it can be far off: predict on an idle host to compare"
            )
    if m.bubble_of_mean_times is not None:
        add(
            f"measured bubble {m.bubble_fraction:.1%}: the mean of each step's idle share; the busy and idle ms "
            f"per rank are means over the steps, whose share is {m.bubble_of_mean_times:.1%}"
        )
    if any(row.predicted_bytes is not None for row in report.memory):
        add(
            "activation memory: measured and predicted (calibrated) bytes both come from saved-tensor hooks, so "
            "its error checks the walk of torch's order (what is in flight when), not the bytes"
        )
    h = report.host_memory
    if h is not None:
        add(
            f"host memory: the ranks' peak resident memory (VmHWM) {format_bytes(h.measured_bytes, digits=1)} "
            f"against {format_bytes(h.predicted_bytes, digits=1)} predicted before the run, error {h.error_pct:+.1f}%"
        )
    return notes
