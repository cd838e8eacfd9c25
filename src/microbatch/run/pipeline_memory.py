"""Per-rank activation memory of a pipeline run: measured against predicted, with the error.

- **measured**: the peak of the saved-activation storages actually alive on the rank during a step
  (:class:`microbatch.run.instrument.LiveBytes`: counted once per storage, released through weak
  references when the last saved tensor on it is freed) — memory held, not the schedule's count.
- **predicted, calibrated**: the schedule's in-flight rule (:func:`microbatch.schedules.registry.in_flight_chunks`,
  the rule :mod:`microbatch.predict.memory` reads) times the saved bytes of one micro-batch of each
  of the rank's stages, as measured by the hooks (the calibration: one number per stage and b_m),
  plus the received stage inputs torch's runtime keeps until the step ends (see :func:`_calibrated`).
- **predicted, uncalibrated**: :func:`microbatch.predict.memory.estimate_memory`'s activation bytes
  for the rank's transformer blocks (Korthikanti et al. 2022's per-layer formula, fp32), the same
  in-flight rule, and the embedding and output terms on the ranks that hold them; None where the
  memory model cannot describe the split (a rank without a block, a ``module:function`` model).

A leak or a late free makes measured exceed the calibrated prediction; the schedule's in-flight
count cannot show either.
"""

from __future__ import annotations

from typing import Any

from microbatch.errors import ConfigError
from microbatch.run.pipeline_config import PipelineConfig
from microbatch.schedules.registry import get_spec, in_flight_chunks, stage_ranks

__all__ = ["memory_rows"]


def _rule_name(cfg: PipelineConfig) -> str:
    """The schedule whose in-flight rule describes the run: zb-h1 runs as zb-interleaved with v = 1."""
    return "zb-h1" if cfg.schedule == "zb-interleaved" and cfg.virtual == 1 else cfg.schedule


def _input_bytes(cfg: PipelineConfig) -> float | None:
    """Bytes of one micro-batch's activation between stages of a built-in model: b_m·s·h·dtype."""
    if ":" in cfg.model:
        return None
    from microbatch.model import get_model

    shape = get_model(cfg.model, seq=cfg.seq)
    dtype_bytes = 4 if cfg.dtype == "float32" else 2
    return float(cfg.micro_batch * shape.seq * shape.hidden * dtype_bytes)


def _calibrated(cfg: PipelineConfig, rank: int, per_stage_bytes: dict[int, float]) -> float | None:
    """In-flight chunks × saved bytes per chunk, plus the received inputs torch's runtime keeps.

    torch.distributed.pipelining keeps every micro-batch's received stage input (its receive
    buffer) until the step ends, and the stage's first operation saves that input for its
    backward; so a stage fed by another rank holds m inputs, of which the in-flight count covers
    chunks / v (measured: on tiny, p = 4, 1F1B, the last three ranks held exactly 5, 6 and 7
    inputs of 16 KiB beyond their in-flight count)."""
    name = _rule_name(cfg)
    if get_spec(name).in_flight is None:
        return None
    placement = stage_ranks(cfg.schedule, cfg.stages, cfg.virtual)
    mine = [s for s, r in enumerate(placement) if r == rank]
    known = [per_stage_bytes[s] for s in mine if s in per_stage_bytes]
    if not known:
        return None
    chunks = in_flight_chunks(name, rank, cfg.stages, cfg.microbatches, cfg.virtual)
    held = chunks * sum(known) / len(known)
    inp = _input_bytes(cfg)
    if inp:
        fed = [s for s in mine if s > 0 and placement[s - 1] != rank]
        held += sum(max(0.0, cfg.microbatches - chunks / cfg.virtual) for _ in fed) * inp
    return held


def _uncalibrated(cfg: PipelineConfig, layers_per_stage: list[int]) -> list[float | None]:
    """predict/memory's activation bytes per rank, for v = 1 and a built-in model."""
    p = cfg.stages
    none: list[float | None] = [None] * p
    if ":" in cfg.model or cfg.virtual != 1 or get_spec(_rule_name(cfg)).in_flight is None:
        return none
    from microbatch.model import get_model
    from microbatch.predict.memory import MemoryConfig, estimate_memory

    shape = get_model(cfg.model, seq=cfg.seq)
    blocks = list(layers_per_stage)
    blocks[0] -= 1  # the embedding unit
    blocks[-1] -= 1  # the head unit
    if min(blocks) < 1 or sum(blocks) != shape.layers:
        return none
    try:
        est = estimate_memory(
            shape,
            MemoryConfig(
                micro_batch=cfg.micro_batch,
                seq=cfg.seq,
                pipeline_parallel=p,
                microbatches=cfg.microbatches,
                schedule=_rule_name(cfg),
                layers_per_stage=tuple(blocks),
                precision="fp32",
                optimizer="adamw",
            ),
        )
    except ConfigError:
        return none
    return [float(st.activations_bytes) for st in est.stages]


def memory_rows(cfg: PipelineConfig, ranks: list[dict[str, Any]], use: list[int]) -> list[dict[str, Any]]:
    """Per rank: measured peak of live saved bytes, the two predictions and their errors (%), the
    schedule's counted bytes, the host high-water mark and the bytes still alive after the step."""
    per_stage: dict[int, list[int]] = {}
    for r in ranks:
        for k in use:
            st = r["steps"][k]
            for (_kind, stage, _i, _a, _e), nbytes in zip(
                [it for it in st["intervals"] if it[0] == "F"], st["per_microbatch_bytes"], strict=False
            ):
                per_stage.setdefault(stage, []).append(nbytes)
    mean = {s: sum(v) / len(v) for s, v in per_stage.items() if v}
    uncal = _uncalibrated(cfg, ranks[0]["layers_per_stage"])
    out = []
    for r in ranks:
        steps = [r["steps"][k] for k in use]
        measured = max(st["peak_activation_bytes"] for st in steps)
        cal = _calibrated(cfg, r["rank"], mean)
        un = uncal[r["rank"]]
        hosts = [st["host_peak_bytes"] for st in steps if st.get("host_peak_bytes") is not None]
        out.append(
            {
                "rank": r["rank"],
                "measured_peak_bytes": measured,
                "predicted_bytes": cal,
                "error_pct": None if not cal else 100 * (measured - cal) / cal,
                "uncalibrated_bytes": un,
                "uncalibrated_error_pct": None if not un else 100 * (measured - un) / un,
                "counted_bytes": max(st["counted_activation_bytes"] for st in steps),
                "live_bytes_after_step": max(st["live_bytes_after_step"] for st in steps),
                "host_peak_bytes": max(hosts) if hosts else None,
            }
        )
    return out
