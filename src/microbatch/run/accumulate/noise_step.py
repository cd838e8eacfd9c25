"""One optimizer step's gradient-noise estimates fed to a :class:`~microbatch.run.noise.GradientNoiseScale`: each
micro-batch's gradient as a small batch, the whole step's as the big one (McCandlish et al. 2018, App. A), the
estimates of every micro-batch averaged. Split from :mod:`microbatch.run.accumulate.exact`, which measures the
norms (:mod:`~microbatch.run.accumulate.grad_hooks`).

Each pair (a micro-batch of n items, the step of N > n) gives unbiased |G|² and tr(Σ) estimates, whatever the
correlation between the two gradients; their mean over the g micro-batches is unbiased too and spreads less than
the first micro-batch's alone (the last audit: tr(Σ)'s spread 2.2% → 1.0% at b 4, B 16). Under DDP a micro-batch's
gradient is this rank's alone (read before the reduction): B_small is its items, so a step of one micro-batch per
rank gives d pairs (McCandlish et al.'s data-parallel form: each device's gradient against the reduced one). FSDP reduces
every backward's gradients, the first micro-batch's too, averaging them over the d ranks: that gradient is the mean
over the items of every rank's first micro-batch, so B_small is their sum; labelled with one rank's count, |G|² came
out 84 times too high and tr(Σ) 59% too low on two ranks (a read-only audit, 2026-12-06).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from microbatch.run.accumulate.grad_hooks import MicroBatchNorms, Reading, settled
from microbatch.run.accumulate.scaling import grad_sq_norm, to_float
from microbatch.run.noise import GradientNoiseScale, g_sq_estimate, trace_sigma_estimate

__all__ = ["NoiseStep", "noise_reading", "noise_smalls", "noise_update"]


@dataclass(frozen=True)
class NoiseStep:
    """What one step measured for the noise scale."""

    smalls: tuple[tuple[float, float], ...]
    """``(items, |g|²)`` of this rank's micro-batches' mean gradients (under FSDP its first micro-batch alone);
    empty when none is usable (zero items)."""
    n_big: float
    """The step's items over every rank."""
    g_big_sq: float
    """|g|² of the step's mean gradient (over every rank)."""
    group: Any
    """The process group the gradients are averaged over (None alone)."""
    world: int
    """Its size."""
    first_reduced: bool = False
    """The first micro-batch's gradient was already averaged over the ranks (FSDP)."""


def noise_update(noise: GradientNoiseScale, step: NoiseStep, device: torch.device) -> None:
    """Feed this step's unbiased |G|² and tr(Σ) estimates (averaged over ranks) to ``noise``; every rank of a group
    joins the same all_reduce calls."""
    if step.first_reduced and step.world > 1:
        pooled = _pooled(step, device)
        smalls: tuple[tuple[float, float], ...] = () if pooled is None else (pooled,)
    else:
        smalls = step.smalls
    est = [0.0, 0.0, 0.0]  # sums over the pairs, and their count
    # an inf or NaN norm (an fp16 overflow its GradScaler skips, a NaN loss) gives no estimate: the step is counted
    # as skipped on every rank (the big norm is the same on all; a small one leaves its rank's pairs out)
    finite = math.isfinite(step.g_big_sq) and all(math.isfinite(sq) for _, sq in smalls)
    for n_small, sq in smalls if finite else ():
        if step.n_big > n_small:
            kw = dict(b_small=n_small, g_small_sq=sq, b_big=step.n_big, g_big_sq=step.g_big_sq)
            est = [est[0] + g_sq_estimate(**kw), est[1] + trace_sigma_estimate(**kw), est[2] + 1.0]
    if est[2] > 0:
        est = [est[0] / est[2], est[1] / est[2], 1.0]  # this rank's mean: each rank weighs the same
    if step.world > 1:
        t = torch.tensor([*est, 0.0 if finite else 1.0], dtype=torch.float64, device=device)
        torch.distributed.all_reduce(t, group=step.group)
        est = [float(x) for x in t[:3]]
        finite = float(t[3]) == 0  # no rank saw an inf or NaN
        if est[2] > 0:
            est = [est[0] / est[2], est[1] / est[2], 1.0]
    if est[2] > 0 and finite:
        noise.add_estimates(g_sq=est[0], trace_sigma=est[1])
    else:  # every rank counts it; rank 0 says so
        noise.skip(warn=step.world <= 1 or torch.distributed.get_rank(step.group) == 0, nonfinite=not finite)


def _pooled(step: NoiseStep, device: torch.device) -> tuple[float, float] | None:
    """Under FSDP: (items of every rank's first micro-batch, |g_small|² of their mean). The reduced gradient is
    (1/d)·Σ_r S_r (S_r: rank r's sum of per-item gradients, scaled), which each rank divided by its own n_r: the mean
    over the N = Σ n_r items is that times d·n_r/N. None on every rank when one rank had no usable first micro-batch
    (its gradient then holds another micro-batch's items)."""
    n_r, sq = step.smalls[0] if step.smalls else (0.0, 0.0)
    t = torch.tensor([n_r, 1.0 if step.smalls else 0.0], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(t, group=step.group)
    total, ranks = float(t[0]), int(round(float(t[1])))
    if ranks < step.world or total <= 0:
        return None
    return total, sq * (step.world * n_r / total) ** 2


def noise_reading(hooks: MicroBatchNorms | None, params: list[Any], first: bool) -> Reading | None:
    """Σ |g|² of the micro-batch just run, still on its devices, or None.

    ``hooks`` (:class:`~microbatch.run.accumulate.grad_hooks.MicroBatchNorms`) read every micro-batch's own
    gradient as autograd passes it (this rank's under DDP, the last micro-batch's and a lone one's too). Where they
    are None (FSDP, whose every backward reduces over the ranks: :mod:`~microbatch.run.accumulate.noise_step`) or
    could not read this one (a parameter's gradient in pieces), ``.grad`` after the step's first micro-batch holds its
    gradient alone (the older gradients were set aside), unless it is also the last (synchronised under DDP):
    ``first`` says it is the first and not the last."""
    reading = hooks.take() if hooks is not None else None
    if reading is None and first:
        return grad_sq_norm(params)
    return reading


def noise_smalls(readings: list[tuple[Any, Reading | None]], scale: float) -> list[tuple[float, float]]:
    """``(items, |g|²)`` of each micro-batch's mean gradient (its Σ|g|² over (scale · items)²), read back once the
    step's backwards are all queued; those with no reading or no items left out."""
    out = []
    for n, reading in readings:
        items = to_float(n)
        if reading is not None and items > 0:
            out.append((items, settled(reading) / (scale * items) ** 2))
    return out
