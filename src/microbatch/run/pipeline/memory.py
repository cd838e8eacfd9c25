"""Per-rank activation memory of a pipeline run: measured against predicted, with the error.

- **measured**: the peak of the saved-activation storages actually alive on the rank during a step
  (:class:`microbatch.run.pipeline.instrument.LiveBytes`: counted once per storage, released through weak
  references when the last saved tensor on it is freed) — memory held, not the schedule's count.
- **predicted, calibrated**: the saved bytes the rank holds along torch's order of its actions
  (:func:`_calibrated`), from each stage's bytes of one micro-batch measured on one process apart
  from the run (the calibration: :func:`microbatch.run.pipeline.stage_profile.stage_saved_bytes`,
  one number per stage and b_m, storages shared by micro-batches held once — not the run's own
  hooks, so that a stage that saves more or less in the run than its forward does alone shows as
  error, as well as a late free), the part
  torch's split backward keeps between I and W (measured on one micro-batch before the steps), and
  the received stage inputs torch's runtime keeps. On GPipe and 1F1B with equal stages this is the
  registry's in-flight rule (:func:`microbatch.schedules.in_flight.in_flight_chunks`, the rule
  :mod:`microbatch.predict.memory` reads) × bytes per micro-batch.
- **predicted, uncalibrated**: :func:`microbatch.predict.memory.estimate_memory`'s activation bytes
  for the rank's transformer blocks (Korthikanti et al. 2022's per-layer formula, fp32), the same
  in-flight rule, and the embedding and output terms on the ranks that hold them; None where the
  memory model cannot describe the split (:func:`uncalibrated_gap` says why: a rank without a block, a
  ``module:function`` model, more than one stage per rank).

A leak or a late free makes measured exceed the calibrated prediction; the schedule's in-flight
count cannot show either. Measured and calibrated bytes are both counted by saved-tensor hooks (the
run's, and one process's apart from it), so on a model that saves the same in the run their error is
0 by construction: it checks the walk of torch's order (what is in flight when), not the bytes.

- **host memory** (:func:`host_memory`): the ranks' peak resident sets (``VmHWM``) against the host
  memory the check before the run predicted (:func:`microbatch.run.pipeline.fit.predicted_host_bytes`):
  the comparison whose two sides come from different sources.
"""

from __future__ import annotations

from typing import Any

from microbatch.errors import ConfigError, PipelineError
from microbatch.run.pipeline.report import HostMemory, PipelineReport, RankMemory
from microbatch.run.pipeline.resolved import ResolvedRun

__all__ = ["boundary_bytes", "host_memory", "memory_rows", "uncalibrated_gap"]


def boundary_bytes(run: ResolvedRun) -> float | None:
    """Bytes of one micro-batch's activation between stages of a built-in model: b_m·s·h·dtype."""
    if run.shape is None:
        return None
    return float(run.cfg.micro_batch * run.shape.seq * run.shape.hidden * run.dtype_bytes)


def _rank_order(run: ResolvedRun, rank: int, executed: list[str]) -> list[str]:
    """torch's compute order of ``rank`` (what the ranks ran where it cannot be derived)."""
    order = run.order
    return executed if order is None else list(order[rank])


def _calibrated(
    run: ResolvedRun,
    rank: int,
    own: dict[int, float],
    shared: dict[int, float],
    kept: dict[int, float],
    executed: list[str],
    inputs: dict[int, float] | None = None,
) -> float | None:
    """Peak of the saved bytes the rank holds along torch's order of its actions, per stage:

    - a forward F adds the stage's own bytes of one micro-batch (``own``, measured on one process:
      saved storages less those an earlier micro-batch saved, which are held once: ``shared``);
    - a full backward B frees them; torch's input-gradient pass I frees all but the fraction
      ``kept`` that its weight-gradient pass W needs (measured by
      :func:`microbatch.run.pipeline.instrument.split_backward_kept`), W frees the rest;
    - torch.distributed.pipelining keeps every micro-batch's received stage input (its receive
      buffer, allocated per micro-batch and reused across steps) and the stage's first operation
      saves it: m inputs per stage fed by another rank, held throughout (``inputs``: each stage's received
      bytes as measured, where its first operation saves the received tensor itself; saved only through a
      view it leaves the measured count at the backward: 0. A ``module:function`` model has no shape to
      compute them from: leaving them out under-predicted its fed ranks by (m − 1) inputs) (measured: on tiny, p = 4,
      1F1B, the last three ranks held exactly 5, 6 and 7 inputs of 16 KiB beyond their in-flight
      count).

    On GPipe and 1F1B with equal stages this is the registry's in-flight rule × bytes per micro-batch
    (:func:`microbatch.schedules.in_flight.in_flight_chunks`); it differs where a rank's stages differ
    in size (interleaved, DualPipeV: the embedding-only stage) and where I frees part of a stage
    (zero-bubble schedules: the last stage's loss and output softmax go at I, not at W)."""
    mine = run.stages_of(rank)
    if any(s not in own for s in mine):
        return None
    fed = run.fed(rank)
    formula = boundary_bytes(run) or 0.0  # a built-in model's b·s·h·dtype, where no measured input is given
    inp = {s: inputs.get(s, formula) if inputs is not None else formula for s in fed}
    held = sum(run.cfg.microbatches * inp[s] for s in fed) + sum(shared.get(s, 0.0) for s in mine)
    peak = held
    for action in _rank_order(run, rank, executed):
        kind = next(c for c in action if c.isalpha())
        s = int(action[: action.index(kind)])
        x = max(0.0, own[s] - inp.get(s, 0.0))
        k = kept.get(s, 1.0)
        held += {"F": x, "B": -x, "I": -x * (1.0 - k), "W": -x * k}.get(kind, 0.0)
        peak = max(peak, held)
    return peak


def uncalibrated_gap(run: ResolvedRun, layers_per_stage: list[int]) -> str | None:
    """Why predict/memory's formula gives no uncalibrated prediction for ``run`` (None: it gives one)."""
    shape = run.shape
    if shape is None:
        return "a module:function model has no shape for predict/memory's formula"
    if run.cfg.virtual != 1 or run.rule is None:
        return (
            f"predict/memory's in-flight rule describes one stage per rank (GPipe, 1F1B, ZB-H1), not "
            f"{run.cfg.schedule} with v = {run.cfg.virtual}"
        )
    blocks = _block_counts(layers_per_stage)
    if min(blocks) < 1 or sum(blocks) != shape.layers:
        return "a rank holds no transformer block (the embedding or the head alone)"
    return None


def _block_counts(layers_per_stage: list[int]) -> list[int]:
    """Transformer blocks per stage: the first stage's embedding unit and the last's head unit taken off."""
    blocks = list(layers_per_stage)
    blocks[0] -= 1
    blocks[-1] -= 1
    return blocks


def _uncalibrated(run: ResolvedRun, layers_per_stage: list[int]) -> list[float | None]:
    """predict/memory's activation bytes per rank, where :func:`uncalibrated_gap` finds none missing."""
    cfg, shape = run.cfg, run.shape
    p = cfg.stages
    none: list[float | None] = [None] * p
    if shape is None or run.rule is None or uncalibrated_gap(run, layers_per_stage) is not None:
        return none
    from microbatch.predict.memory import MemoryConfig, estimate_memory

    blocks = _block_counts(layers_per_stage)
    try:
        est = estimate_memory(
            shape,
            MemoryConfig(
                micro_batch=cfg.micro_batch,
                seq=cfg.seq,
                pipeline_parallel=p,
                microbatches=cfg.microbatches,
                schedule=run.rule.name,
                layers_per_stage=tuple(blocks),
                precision="fp32",
                optimizer="adamw",
            ),
        )
    except ConfigError:
        return none
    return [float(st.activations_bytes) for st in est.stages]


def memory_rows(
    run: ResolvedRun,
    ranks: list[dict[str, Any]],
    use: list[int],
    stage_bytes: dict[int, dict[str, float]] | None = None,
    device: str = "cpu",
    notes: list[str] | None = None,
) -> list[RankMemory]:
    """Per rank: measured peak of live saved bytes, the two predictions and their errors (%), the
    schedule's counted bytes, the host high-water mark and the bytes still alive after the step.

    ``stage_bytes``: each stage's ``own`` and ``shared`` saved bytes of one micro-batch
    (:func:`microbatch.run.pipeline.stage_profile.stage_saved_bytes`); None measures them here, on
    one process, on the split the ranks used, on ``device`` (where the ranks ran); where that fails (the model's
    error, after the run), ``notes`` given gets the error and the rows have no calibrated prediction."""
    from microbatch.run.pipeline.stage_profile import stage_saved_bytes

    kept: dict[int, float] = {}
    for r in ranks:
        for s, f in (r.get("kept_after_input_grad") or {}).items():
            if f is not None:
                kept[int(s)] = float(f)
    if stage_bytes is None:
        try:
            stage_bytes = stage_saved_bytes(run, list(ranks[0]["layers_per_stage"]), device)
        except PipelineError as e:  # after the run: a late error loses no measurement, only this prediction
            if notes is None:
                raise
            notes.append(str(e))
            stage_bytes = {}
    own = {s: row["own"] for s, row in stage_bytes.items()}
    shared_of = {s: row["shared"] for s, row in stage_bytes.items()}
    inputs = {s: row["input"] for s, row in stage_bytes.items() if "input" in row}
    uncal = _uncalibrated(run, ranks[0]["layers_per_stage"])
    out = []
    for r in ranks:
        steps = [r["steps"][k] for k in use]
        measured = max(st["peak_activation_bytes"] for st in steps)
        cal = _calibrated(run, r["rank"], own, shared_of, kept, r["steps"][-1]["order"], inputs)
        un = uncal[r["rank"]]
        hosts = [st["host_peak_bytes"] for st in steps if st.get("host_peak_bytes") is not None]
        out.append(
            RankMemory(
                rank=r["rank"],
                measured_peak_bytes=measured,
                predicted_bytes=cal,
                error_pct=None if not cal else 100 * (measured - cal) / cal,
                uncalibrated_bytes=un,
                uncalibrated_error_pct=None if not un else 100 * (measured - un) / un,
                counted_bytes=max(st["counted_activation_bytes"] for st in steps),
                live_bytes_after_step=max(st["live_bytes_after_step"] for st in steps),
                host_peak_bytes=max(hosts) if hosts else None,
            )
        )
    return out


def host_memory(report: PipelineReport, predicted: dict[str, float] | None) -> HostMemory | None:
    """The ranks' host peak against ``predicted`` (:func:`microbatch.run.pipeline.fit.predicted_host_bytes`,
    by term and ``total``): None without a prediction, or where a rank read no peak (not Linux)."""
    peaks = [row.host_peak_bytes for row in report.memory]
    if not predicted or not predicted.get("total") or not peaks or any(p is None for p in peaks):
        return None
    measured = sum(int(p or 0) for p in peaks)
    total = float(predicted["total"])
    return HostMemory(
        measured_bytes=measured,
        predicted_bytes=total,
        error_pct=100.0 * (measured - total) / total,
        predicted_terms={k: float(v) for k, v in predicted.items() if k != "total"},
    )
