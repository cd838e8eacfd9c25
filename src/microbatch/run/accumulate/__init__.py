"""Exact gradient accumulation: the gradient of the whole batch, one micro-batch at a time.

The rooms, bottom up:

- :mod:`~microbatch.run.accumulate.microbatches`: splitting a batch (rows, or tokens per micro-batch);
- :mod:`~microbatch.run.accumulate.scaling`: counting valid items and the one loss scale, for
  hand-written loops and for :func:`accumulate`;
- :mod:`~microbatch.run.accumulate.oom`: what counts as out of memory, and freeing after it;
- :mod:`~microbatch.run.accumulate.agree`: what the data-parallel ranks agree on in the step's one
  ``all_reduce``;
- :mod:`~microbatch.run.accumulate.controller`: :class:`MicroBatchController`, the size across steps;
- :mod:`~microbatch.run.accumulate.exact`: :func:`accumulate` and :func:`accumulate_micro_batches`.

The public names are importable from here (``from microbatch.run.accumulate import accumulate,
split``) as they were when this was one module. Why the arithmetic is what it is:
``docs/accumulate.md``.
"""

from __future__ import annotations

from microbatch.run.accumulate.exact import (
    MicroBatchController,
    accumulate,
    accumulate_micro_batches,
    batch_rows,
    count_items,
    grad_sq_norm,
    is_ddp,
    loss_scale,
    split,
    split_by_tokens,
    sync_unless_last,
)

__all__ = [
    "accumulate",
    "accumulate_micro_batches",
    "MicroBatchController",
    "split",
    "split_by_tokens",
    "count_items",
    "loss_scale",
    "sync_unless_last",
    "is_ddp",
    "batch_rows",
    "grad_sq_norm",
]
