"""Splitting a model into pipeline stages: its layers, a balanced contiguous split, the stage modules.

:func:`model_units` lists the layers pipelining may cut between; :func:`balanced_split` cuts a
list of weights (parameter counts from :func:`unit_param_counts`, or measured seconds from
:func:`unit_times_s`) into contiguous groups minimising the heaviest; :func:`split_units` builds the
stage modules. torch is imported inside the functions that need it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from microbatch.errors import ConfigError

__all__ = ["balanced_split", "model_units", "split_units", "unit_param_counts", "unit_times_s"]


def model_units(model: Any) -> list[Any]:
    """The ordered layers of a model that pipelining may cut between.

    A GPT-like module (``embed``, ``layers``, ``head``) gives ``[embed, *layers, head]``; an
    ``nn.Sequential`` (or any list of modules) gives its children. Each unit maps the previous
    unit's output to its own, the first takes token ids and the last returns logits.
    """
    from torch import nn

    if all(hasattr(model, a) for a in ("embed", "layers", "head")):
        return [model.embed, *model.layers, model.head]
    if isinstance(model, (nn.Sequential, nn.ModuleList, list, tuple)):
        units = list(model)
        if units:
            return units
    raise ConfigError(
        f"cannot split a {type(model).__name__} into stages; pipelining needs a stack of layers: an "
        "nn.Sequential, or a module with .embed, .layers (nn.ModuleList) and .head"
    )


def balanced_split(weights: Sequence[float], parts: int) -> list[int]:
    """Contiguous split of ``weights`` into ``parts`` non-empty groups minimising the heaviest.

    Returns the group sizes. Exact dynamic programme (linear partition, O(parts·n²)); among
    equally good splits the earliest cut wins (lighter leading stages).
    """
    n = len(weights)
    if parts > n:
        raise ConfigError(
            f"{parts} stages but the model has only {n} layers to split (embedding, blocks, head); each "
            f"stage needs at least one; use fewer stages (p·v <= {n}) or a deeper model"
        )
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))
    inf = float("inf")
    # best[k][i]: minimal heaviest group splitting the first i units into k groups
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i] - 1e-12:
                    best[k][i], cut[k][i] = cost, j
    sizes: list[int] = []
    i = n
    for k in range(parts, 0, -1):
        j = cut[k][i]
        sizes.append(i - j)
        i = j
    return sizes[::-1]


def split_units(units: Sequence[Any], sizes: Sequence[int]) -> list[Any]:
    """``nn.Sequential`` stage modules holding ``sizes[k]`` consecutive units each."""
    from torch import nn

    out: list[Any] = []
    i = 0
    for k in sizes:
        out.append(nn.Sequential(*units[i : i + k]))
        i += k
    return out


def unit_param_counts(units: Sequence[Any]) -> list[int]:
    """Parameters of every unit (a weight shared by two units counts in both: both compute with it)."""
    return [sum(p.numel() for p in u.parameters()) for u in units]


def unit_times_s(units: Sequence[Any], tokens: Any, repeats: int = 3) -> list[float]:
    """Measured forward + backward seconds of every unit on ``tokens`` (best of ``repeats``)."""
    import torch

    times: list[float] = []
    x = tokens
    for u in units:
        best = float("inf")
        for _ in range(repeats):
            inp = x.detach().requires_grad_(x.is_floating_point())
            t0 = time.perf_counter()
            y = u(inp)
            y.float().square().mean().backward()
            best = min(best, time.perf_counter() - t0)
        u.zero_grad(set_to_none=True)
        with torch.no_grad():
            x = u(x)
        times.append(best)
    return times
