"""A prediction of a pipeline run made before its ranks start.

Inputs, all measured on this machine before the run:

1. **A per-stage profile** on one process (:func:`microbatch.run.pipeline.stage_profile.profile_stages`): the model split as the ranks
   split it (by parameter count), each stage's forward (the last stage with its loss), full
   backward, input-gradient and weight-gradient time of one micro-batch — median of a few repeats,
   one thread, as each worker runs.
2. **The pipeline runtime's own costs between ops** (:mod:`microbatch.run.pipeline.calibrate`): a
   short calibration run of torch's runtime with the real boundary's bytes, and on the CPU a second
   one whose stages load the cores as the real ones do.
3. **The schedule**: torch's own action order (:func:`microbatch.schedules.torch_order.torch_order`).
4. **The machine** (:func:`microbatch.run.pipeline.calibrate.machine_load`): its cores, the other
   programs' runnable threads, and the scheduler's time slice.

:func:`predict_before` replays the order (:func:`microbatch.run.pipeline.replay.replay`) with the
profiled op times and those terms, the ranks' work queued for the machine's cores in time slices
(more ranks than cores wait for a core; an op longer than a slice is shared): the bubble and step
time predicted before the run. Terms from a loaded calibration already hold their waits for a
core and are taken as latency. :func:`predict_run` does all of it; :func:`run_predicted` then runs.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from microbatch.run.pipeline.calibrate import SLICE_S
from microbatch.run.pipeline.config import PipelineConfig
from microbatch.run.pipeline.report import BeforeRun, PipelineReport
from microbatch.run.pipeline.resolved import ResolvedRun, resolve
from microbatch.run.pipeline.stage_profile import profile_stages

__all__ = ["predict_before", "predict_resolved", "predict_run", "run_predicted"]


def predict_before(
    run: ResolvedRun, profile: dict[int, dict[str, float]], runtime: dict[str, Any]
) -> BeforeRun:
    """Bubble and step time of ``run`` predicted before it: torch's order replayed with the
    profiled per-stage times and the runtime's measured costs between ops
    (:func:`microbatch.run.pipeline.replay.replay`)."""
    from microbatch.run.pipeline.replay import parse_action, replay

    order = run.torch_order()
    extra = runtime.get("in_op_s", {})
    split = run.splits_backward

    machine = runtime.get("machine")
    kinds = "FBIW" if split else "FB"

    def op_time(s: int, row: dict[str, float], k: str) -> float:
        # under processor sharing an op's work is its CPU time alone; without a machine reading
        # its wall time alone; plus the runtime's own work inside the stage call
        alone = row[f"cpu{k}"] if machine and f"cpu{k}" in row else row[k]
        return alone + float(extra.get(f"{s}{k}", 0.0))

    op_s = {(s, k): op_time(s, row, k) for s, row in profile.items() for k in kinds if k in row}
    # the ranks share the machine's cores with each other and with the other programs' runnable
    # threads measured before the calibration run, in time slices (the replay's scheduler)
    rep = replay(
        run,
        order,
        op_s,
        runtime,
        cores=int(machine["cores"]) if machine else None,
        slice_s=float(machine.get("slice_s") or SLICE_S) if machine else SLICE_S,
        others=round(float(machine["others"])) if machine else 0,
        after_as_latency=bool(runtime.get("loaded")),
    )
    work = sum(op_s.get((s, k), 0.0) for acts in order.values() for s, k, _i in map(parse_action, acts))
    busy = sum(rep["busy_s"])
    share = work / busy if busy > 0 else 1.0  # the share of a core the ops got in the replay
    after = runtime["after_send_s"]
    hop = runtime["hop_s"]
    return BeforeRun(
        bubble_fraction=rep["bubble_fraction"],
        step_time_s=rep["step_time_s"],
        overhead_s=(after["fwd"] + after["bwd"] + runtime["after_local_s"]) / 3,
        comm_time_s=(hop["fwd"] + hop["bwd"]) / 2,
        cpu_share=share,
        runtime={k: v for k, v in runtime.items() if k != "cases"},
        profile_s={f"{s}{k}": t for s, row in sorted(profile.items()) for k, t in row.items() if k in "FBIW"},
        source="made before the run: one-process per-stage profile + the runtime's measured costs between "
        "ops (after a send, after a local op, hand-off, step start and end) from a calibration run with the "
        "real boundary's bytes"
        + (" and the real stages' CPU load (terms taken as latency)" if runtime.get("loaded") else "")
        + ", replayed on torch's order",
    )


def predict_run(cfg: PipelineConfig) -> BeforeRun:
    """The prediction of ``cfg``'s run made before its ranks start (:func:`predict_before`'s
    result): the checks first (layers, host memory), then the runtime calibration, the per-stage
    profile and, for gloo ranks on the CPU, the loaded calibration. It does not depend on
    ``cfg.steps`` (the calibrations run their own steps), so a caller may choose the run's steps
    from its predicted step time. The config is resolved here, once."""
    return predict_resolved(resolve(cfg))


def predict_resolved(run: ResolvedRun) -> BeforeRun:
    """:func:`predict_run` of a run resolved already."""
    from microbatch.run.pipeline.calibrate import (
        calibrate_loaded,
        calibrate_runtime,
        loaded_steps,
        needs_loaded_calibration,
    )
    from microbatch.run.pipeline.chain_check import check_splittable
    from microbatch.run.pipeline.fit import check_fits
    from microbatch.run.pipeline.progress import announce

    cfg = run.cfg
    announce("check")
    check_splittable(run)
    check_fits(run)
    announce("calibrate")
    runtime = calibrate_runtime(run)
    announce("profile")
    profile = profile_stages(run, idle_s=runtime["mean_gap_s"])
    if needs_loaded_calibration(cfg, runtime):
        # as many loaded steps as the bound on the wait allows, from the step the bare terms predict
        steps = loaded_steps(predict_before(run, profile, runtime).step_time_s, cfg.timeout_s)
        if steps is not None:
            announce("calibrate_loaded")
            runtime = calibrate_loaded(run, profile, runtime, steps)
    return predict_before(run, profile, runtime)


def run_predicted(cfg: PipelineConfig, *, deadline_s: float | None = None) -> PipelineReport:
    """:func:`microbatch.run.pipeline.launch.run_pipeline` with the prediction made before the ranks start
    (:func:`predict_run`) as its ``before_run``."""
    from microbatch.run.pipeline.launch import run_pipeline

    before = predict_run(cfg)
    report = run_pipeline(cfg, deadline_s=deadline_s)
    return replace(report, before_run=before)
