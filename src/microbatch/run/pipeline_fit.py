"""Will a local pipeline run fit in this machine's memory? Predicted before any process starts.

Every rank of :mod:`microbatch.run.pipeline_rank` builds the whole model (same weights on every rank,
then keeps its stages), so on one host the model's parameters are resident p times, plus each rank's
gradients and Adam's two moments for its own stages (together 3 copies of the model over all ranks),
plus, with ``check_gradients``, an unsplit reference model and its gradients on every rank. Each
worker process also holds the Python interpreter and torch's libraries, about 0.2–0.4 GB
(:mod:`microbatch.measure.hostmem`; :data:`PROCESS_BYTES` takes the upper end). Activations are left
out: for the models this refuses they are small beside the model state.
"""

from __future__ import annotations

from microbatch.errors import ConfigError
from microbatch.run.pipeline_config import PipelineConfig
from microbatch.units import format_bytes, format_count

__all__ = ["PROCESS_BYTES", "available_host_bytes", "check_fits", "predicted_host_bytes"]

PROCESS_BYTES = 400 * 1024**2
"""Resident bytes of one worker before the model: Python and torch's libraries (measured 0.2–0.4 GB,
see :mod:`microbatch.measure.hostmem`)."""

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def predicted_host_bytes(cfg: PipelineConfig, params: int) -> dict[str, float]:
    """Bytes the p local ranks hold together for a model of ``params`` parameters: the whole model on
    every rank, gradients and Adam's two moments once over all ranks, the reference model with its
    gradients on every rank when checking gradients, and the processes themselves."""
    e = _DTYPE_BYTES[cfg.dtype]
    p = cfg.stages
    out = {
        "model_copies": p * params * e,
        "gradients_and_adam": 3 * params * e,
        "reference_model": (2 * p * params * e) if cfg.check_gradients else 0.0,
        "processes": p * PROCESS_BYTES,
    }
    out["total"] = sum(out.values())
    return out


def available_host_bytes() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes (what can be allocated without swapping); None
    where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_fits(cfg: PipelineConfig, *, available: int | None = None) -> dict[str, float] | None:
    """Refuse, before any process starts, a built-in model whose predicted host memory
    (:func:`predicted_host_bytes`) exceeds the host's available memory; returns the prediction
    (None for a ``module:function`` model, whose size is unknown before it is built)."""
    if ":" in cfg.model or cfg.backend != "gloo":
        return None
    from microbatch.model import get_model

    shape = get_model(cfg.model, seq=cfg.seq)
    pred = predicted_host_bytes(cfg, shape.param_count())
    avail = available_host_bytes() if available is None else available
    if avail is not None and pred["total"] > avail:
        one = _DTYPE_BYTES[cfg.dtype] * shape.param_count()
        raise ConfigError(
            f"model {cfg.model} ({format_count(shape.param_count())} parameters, {format_bytes(one)} in "
            f"{cfg.dtype}) on {cfg.stages} local ranks needs about {format_bytes(pred['total'])} of host memory "
            f"(the model built on every rank {format_bytes(pred['model_copies'])}, gradients and Adam "
            f"{format_bytes(pred['gradients_and_adam'])}"
            + (
                f", reference model {format_bytes(pred['reference_model'])}"
                if pred["reference_model"]
                else ""
            )
            + f") but {format_bytes(avail)} is available; use a smaller model (--model tiny or small) or "
            "run one rank per machine under torchrun"
        )
    return pred
