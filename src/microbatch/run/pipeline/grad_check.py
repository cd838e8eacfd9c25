"""The pipeline's gradient check (``--check-gradients``): each rank's gradients after one step against the unsplit
model's from the same weights and batch. Split from :mod:`microbatch.run.pipeline.rank`, which calls
:func:`grad_error` on its first step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from microbatch.errors import PipelineError
from microbatch.run.pipeline.split import model_units

__all__ = ["grad_error"]


def grad_error(
    build: Callable[[], Any],
    dtype: str,
    mine: list[int],
    modules: list[Any],
    batch: tuple[Any, Any, int],
    device: Any,
) -> tuple[float, float]:
    """(the pipeline's error, the unsplit step's own): the largest ‖g − g_ref‖ / ‖g_ref‖ over this rank's parameters
    of the pipeline's gradients and of the unsplit model's in the run's dtype, ``g_ref`` the unsplit model's in
    float32 from the same weights (a bf16 or fp16 reference has rounding errors of its own, as large as the
    pipeline's: a helper measured 0.029 for the unsplit bf16 step where the pipeline's was 0.017). In float32 both
    are the one reference: (error, 0)."""
    import torch

    ref32 = _unsplit_grads(build, batch, device, torch.float32)
    same = None if dtype == "float32" else _unsplit_grads(build, batch, device, None)
    sizes = [len(m) for m in modules]
    starts = [sum(sizes[:k]) for k in range(len(sizes))]
    worst = own = 0.0
    for s in mine:
        for j in range(sizes[s]):
            unit = starts[s] + j
            for k, (n, p) in enumerate(modules[s][j].named_parameters()):
                q = ref32[unit][k]
                if q is None:
                    continue
                if p.grad is None:
                    raise PipelineError(f"parameter {n} of stage {s} got no gradient from the pipeline")
                worst = max(worst, _rel(p.grad, q))
                if same is not None and same[unit][k] is not None:
                    own = max(own, _rel(same[unit][k], q))
    return worst, own


def _rel(g: Any, ref: Any) -> float:
    """‖g − ref‖ / ‖ref‖ in float64 (‖g − ref‖ where ref is 0)."""
    norm = ref.double().norm().item()
    diff = (g.double() - ref.double()).norm().item()
    return float(diff / norm if norm > 0 else diff)


def _unsplit_grads(
    build: Callable[[], Any], batch: tuple[Any, Any, int], device: Any, dtype: Any
) -> list[list[Any]]:
    """Each unit's parameters' gradients (None where unused) from one unsplit step of the model, cast to ``dtype``
    (None: the run's own), under one fixed seed: the two references draw the same dropout masks, so their difference
    is the dtype's alone (with masks of their own, the bf16 reference's "error" was 0.5–0.9 on a model with dropout
    and widened the tolerance past a mismatch: a helper's review, 2026-12-07); the pipeline's masks differ from both,
    and its check fails there as it should, naming the dropout."""
    import torch
    import torch.nn.functional as F

    inputs, targets, total_tokens = batch
    cuda = [torch.device(device).index or 0] if torch.device(device).type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(REFERENCE_SEED)
        ref = build()
        ref.to(device=device, dtype=dtype) if dtype is not None else ref.to(device)
        logits = ref(inputs)
        loss: Any = (
            F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(), reduction="sum") / total_tokens
        )
        loss.backward()
    return [[q.grad for q in u.parameters()] for u in model_units(ref)]


REFERENCE_SEED = 0
"""The seed both unsplit references draw their dropout masks from (any fixed value: the same for both)."""
