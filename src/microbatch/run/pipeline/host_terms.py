"""What a pipeline rank holds on the host beyond its activations: the parameters it keeps (with their gradients and
Adam's moments), the optimizer step's temporaries on the CPU, and the process itself, by how it starts — the terms
:func:`microbatch.run.pipeline.fit.predicted_host_bytes` sums. Measured against the ranks' VmHWM in
``docs/pipeline-fit.md`` and BENCHMARKS.md (``bench/bench_rank_memory.py``).
"""

from __future__ import annotations

from typing import Any

from microbatch.run.pipeline import warm
from microbatch.run.pipeline.resolved import ResolvedRun

__all__ = [
    "ADAM_TEMPORARIES",
    "FORKED_PROCESS_BYTES",
    "GLOO_PROCESS_BYTES",
    "PROCESS_BYTES",
    "largest_param",
    "process_bytes",
    "rank_largest",
    "rank_params",
]

PROCESS_BYTES = 400 * 1024**2
"""Resident bytes of one worker before the model under nccl: Python, torch's libraries and the CUDA runtime's host
share (0.2–0.4 GB measured on CPU builds, :mod:`microbatch.measure.hostmem`; the upper end, not measured on a
GPU host here)."""

GLOO_PROCESS_BYTES = 392 * 1024**2
"""Resident bytes of one CPU (gloo) rank started as a new interpreter, before its model: its VmHWM less the model's
terms (``bench/bench_rank_memory.py``), 382.9–384.8 MiB on a fresh install, rounded up to 8 MiB. About 211 MiB of it
is the interpreter's and torch's own (anonymous) memory; the rest is the shared libraries' pages mapped in, which
the kernel maps more of when the files are in the page cache (fault-around): 79 MiB of torch's files for a venv
installed days before, 136 MiB for one just installed, so the same rank reads 310–314 MiB there. The upper end is
taken: a check that refuses a run must not count on the cache being cold."""

FORKED_PROCESS_BYTES = 328 * 1024**2
"""The same for a rank forked from the warm fork server (:mod:`microbatch.run.pipeline.warm`, its imports already
resident): 325.8–326.0 MiB on a fresh install, 256.7–261.1 with the older venv's libraries partly out of the cache
(same bench), rounded up to 8 MiB from the upper end."""


def rank_params(run: ResolvedRun, shape: Any) -> list[int] | None:
    """Distinct parameters each rank holds, where the split is known before the ranks build the model (a built-in
    model split by parameters, :attr:`ResolvedRun.split`): its stages' units
    (:func:`~microbatch.run.pipeline.split.shape_unit_params`), a weight tied between the embedding and the head
    counted on each rank that holds one of them (each keeps its own gradient and Adam moments of it, all-reduced
    between them) and once on a rank holding both. None otherwise."""
    ranks = _rank_units(run, shape)
    if ranks is None:
        return None
    from microbatch.run.pipeline.split import shape_unit_params

    units = shape_unit_params(shape)
    held = []
    for mine in ranks:
        n = sum(units[u] for u in mine)
        if shape.tied_embeddings and 0 in mine and len(units) - 1 in mine:
            n -= shape.vocab * shape.hidden  # the tied table once on the rank holding both ends
        held.append(n)
    return held


def rank_largest(run: ResolvedRun, shape: Any) -> list[int] | None:
    """Each rank's largest parameter tensor (:func:`largest_param` of the units it holds: the token table or head on
    the end ranks, a block's largest matrix on the others), where the split is known; None otherwise."""
    ranks = _rank_units(run, shape)
    if ranks is None:
        return None
    table = shape.vocab * shape.hidden
    block = largest_param(shape, 0, blocks_only=True)
    last = shape.layers + 1  # units: the embedding, the blocks, the head
    return [max(table if u in (0, last) else block for u in mine) for mine in ranks]


def _rank_units(run: ResolvedRun, shape: Any) -> list[list[int]] | None:
    """The units (embedding, blocks, head) each rank holds, where the split is known before the ranks build it."""
    if shape is None or run.split is None:
        return None
    starts = [sum(run.split[:s]) for s in range(len(run.split) + 1)]
    return [
        [u for s in run.stages_of(r) for u in range(starts[s], starts[s + 1])] for r in range(run.cfg.stages)
    ]


def largest_param(shape: Any, params: int, *, blocks_only: bool = False) -> int:
    """Elements of the model's largest parameter tensor: of the built-in GPT (:mod:`microbatch.measure.gpt`) the token
    table or head (V·h), the fused q/k/v, the output projection or the MLP's up (gated: both halves) or down matrix
    (``blocks_only``: a block's); of a factory, ``params``: its largest tensor as the launcher's inspection read it,
    or its whole count."""
    if shape is None:
        return params
    h, f, kvd = shape.hidden, shape.ffn, shape.kv * shape.head_dim
    up = (2 if shape.gated_mlp else 1) * f
    block = max(h * (shape.q_width + 2 * kvd), shape.q_width * h, h * up)
    return int(block if blocks_only else max(shape.vocab * h, block))


ADAM_TEMPORARIES = 2
"""Parameter-sized tensors torch's Adam allocates at once on the CPU: foreach kernels are CUDA's
(``torch.utils._foreach_utils._get_foreach_kernels_supported_devices``), so the CPU runs ``_single_tensor_adam``
(torch/optim/adam.py), one parameter at a time, whose ``(exp_avg_sq.sqrt() / bias_correction2_sqrt)`` holds the
square root and the quotient together: 2 × the largest parameter at the step's peak on each rank."""


def process_bytes(backend: str) -> int:
    """Resident bytes of one rank before its model: :data:`FORKED_PROCESS_BYTES` where its ranks will be forked
    from the warm server (:func:`microbatch.run.pipeline.warm.warm_ranks`), :data:`GLOO_PROCESS_BYTES` for new
    CPU interpreters, :data:`PROCESS_BYTES` under nccl."""
    forked = warm.warm_ranks(backend)  # refuses a bad MICROBATCH_COLD_RANKS before any process starts
    if backend != "gloo":
        return PROCESS_BYTES
    return FORKED_PROCESS_BYTES if forked else GLOO_PROCESS_BYTES
