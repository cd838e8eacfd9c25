"""A prediction of a pipeline run made before its ranks start.

Three inputs, all measured on this machine before the run:

1. **A per-stage profile** on one process (:func:`profile_stages`): the model split as the ranks
   split it (by parameter count), each stage's forward (the last stage with its loss), full
   backward, input-gradient and weight-gradient time of one micro-batch — median of a few repeats,
   one thread, as each worker runs.
2. **The pipeline runtime's own cost** (:func:`calibrate_runtime`): a tiny run of the same
   schedule, p, m and v through ``torch.distributed.pipelining`` on a model whose ops take
   microseconds, so its step time is almost all runtime overhead and hand-off. From it: the
   hand-off latency (median wait for another rank's output,
   :func:`microbatch.run.pipeline_summary.measured_comm_s`) and the per-action overhead, the
   remainder of its measured step time over the simulated one, spread over each rank's actions.
3. **The schedule**: torch's own action order (:func:`microbatch.run.pipeline_order.torch_order`).

:func:`predict_before` simulates the order with (profiled time + overhead) per action and the
hand-off on every cross-rank dependency: the bubble and step time predicted before the run.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from microbatch.run.pipeline_config import PipelineConfig

__all__ = ["calibrate_runtime", "calibration_model", "predict_before", "profile_stages", "run_predicted"]


def calibration_model() -> Any:
    """A stack of 18 units whose ops take microseconds (vocabulary 32, width 8): embedding, 16
    residual linear layers (x + W·x, so that no stage output is a view, which torch's split
    backward refuses), head — the model of :func:`calibrate_runtime` (p·v up to 18 stages)."""
    from torch import nn

    class Residual(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x: Any) -> Any:
            return x + self.lin(x)

    return nn.Sequential(nn.Embedding(32, 8), *[Residual() for _ in range(16)], nn.Linear(8, 32))


def _median_time(fn: Any, repeats: int) -> float:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def profile_stages(cfg: PipelineConfig, repeats: int = 5) -> dict[int, dict[str, float]]:
    """Per virtual stage: ``F``, ``B``, ``I`` and ``W`` seconds of one micro-batch (median of
    ``repeats``), measured in this process with one thread on the split the ranks use."""
    import torch
    import torch.nn.functional as F

    from microbatch.run.pipeline_rank import build_full_model, make_batch
    from microbatch.run.pipeline_split import balanced_split, model_units, split_units, unit_param_counts

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        full, vocab, seq = build_full_model(cfg)
        units = model_units(full)
        modules = split_units(units, balanced_split(unit_param_counts(units), cfg.total_stages))
        tok, tgt = make_batch(cfg, vocab, seq, -1)
        x: Any = tok[: cfg.micro_batch]
        target = tgt[: cfg.micro_batch]
        total = cfg.batch * seq
        out: dict[int, dict[str, float]] = {}
        last = len(modules) - 1
        for s, mod in enumerate(modules):
            params = [p for p in mod.parameters() if p.requires_grad]
            inp = x.detach().requires_grad_(x.is_floating_point())

            def fwd(mod: Any = mod, inp: Any = inp, s: int = s) -> Any:
                y = mod(inp)
                if s == last:
                    y = F.cross_entropy(y.flatten(0, -2).float(), target.flatten(), reduction="sum") / total
                return y

            y = fwd()
            grad = None if s == last else torch.ones_like(y)
            f_s = _median_time(fwd, repeats)

            def full_b(fwd: Any = fwd, grad: Any = grad) -> float:
                y = fwd()
                t0 = time.perf_counter()
                torch.autograd.backward(y, grad)
                return time.perf_counter() - t0

            b_s = statistics.median(full_b() for _ in range(repeats))
            wants = [t for t in ([inp] if inp.requires_grad else []) + params]

            def split(
                fwd: Any = fwd, grad: Any = grad, inp: Any = inp, params: Any = params
            ) -> tuple[float, float]:
                y = fwd()
                t0 = time.perf_counter()
                if inp.requires_grad:
                    torch.autograd.grad(y, [inp], grad, retain_graph=True)
                t1 = time.perf_counter()
                if params:
                    torch.autograd.grad(y, params, grad, allow_unused=True)
                return t1 - t0, time.perf_counter() - t1

            parts = [split() for _ in range(repeats)] if wants else [(0.0, 0.0)]
            out[s] = {
                "F": f_s,
                "B": b_s,
                "I": statistics.median(a for a, _ in parts),
                "W": statistics.median(b for _, b in parts),
            }
            mod.zero_grad(set_to_none=True)
            with torch.no_grad():
                x = mod(x)
        return out
    finally:
        torch.set_num_threads(threads)


def calibrate_runtime(cfg: PipelineConfig) -> dict[str, float]:
    """Hand-off latency and per-action overhead of torch's pipeline runtime for ``cfg``'s schedule,
    p, m and v on this machine, from a run of :func:`calibration_model` (a few seconds)."""
    from dataclasses import replace

    from microbatch.run.launch import run_pipeline

    tiny = replace(
        cfg,
        model="microbatch.run.pipeline_profile:calibration_model",
        seq=8,
        global_batch=None,
        check_gradients=False,
        balance="params",
        steps=3,
        dtype="float32",
    )
    rep = run_pipeline(tiny)
    comm = float(rep["predicted"]["with_comm"]["comm_time_s"])
    measured = float(rep["measured"]["step_time_s"])
    simulated = float(rep["predicted"]["with_comm"]["step_time_s"])
    per_rank = max(len(v) for v in rep["executed_order"].values())
    overhead = max(0.0, (measured - simulated) / per_rank) if per_rank else 0.0
    return {"comm_s": comm, "overhead_s": overhead, "calibration_step_s": measured}


def predict_before(
    cfg: PipelineConfig, profile: dict[int, dict[str, float]], runtime: dict[str, float]
) -> dict[str, Any]:
    """Bubble and step time of ``cfg`` simulated before the run: torch's order, the profiled
    per-stage times plus the runtime's per-action overhead, the hand-off on cross-rank inputs."""
    from microbatch.run.pipeline_summary import predict

    o = runtime["overhead_s"]
    times = {(s, k): t + o for s, row in profile.items() for k, t in row.items()}
    sim = predict(cfg, times, comm_s=runtime["comm_s"])
    # the overhead runs outside the forward/backward calls, where a run measures its busy time:
    # it counts as idle here too, so that the bubble compares like with like
    n_actions = sim.schedule.num_actions()
    busy = sum(sim.busy) - o * n_actions
    span = cfg.stages * sim.makespan
    return {
        "bubble_fraction": 1.0 - busy / span if span > 0 else 0.0,
        "step_time_s": sim.makespan,
        "overhead_s": o,
        "comm_time_s": runtime["comm_s"],
        "profile_s": {f"{s}{k}": t for s, row in sorted(profile.items()) for k, t in row.items()},
        "source": "made before the run: one-process per-stage profile + the runtime's overhead and hand-off "
        "from a tiny calibration run, simulated on torch's order",
    }


def run_predicted(cfg: PipelineConfig, *, deadline_s: float | None = None) -> dict[str, Any]:
    """:func:`microbatch.run.launch.run_pipeline` with the prediction made before the ranks start
    as ``report["before_run"]``: the checks first (layers, host memory), then the profile and the
    runtime calibration, then the run."""
    from microbatch.run.launch import check_splittable, run_pipeline
    from microbatch.run.pipeline_fit import check_fits

    check_splittable(cfg)
    check_fits(cfg)
    before = predict_before(cfg, profile_stages(cfg), calibrate_runtime(cfg))
    report = run_pipeline(cfg, deadline_s=deadline_s)
    report["before_run"] = before
    return report
