"""Each micro-batch's own gradient norm, read as autograd hands it to the parameters: :class:`MicroBatchNorms`.

The gradient noise scale (McCandlish et al. 2018, App. A) needs |g|² at a small batch and at a big one. After the
first micro-batch ``.grad`` holds that micro-batch's gradient alone, but after the second it holds their sum, so
the later micro-batches' own gradients are gone unless copied (one gradient's memory). A hook on each parameter
(``Tensor.register_hook``: autograd calls it with the gradient this backward computed for the leaf, before adding
it to ``.grad``) reads each micro-batch's gradient as it passes: Σ over parameters of |∂loss/∂p|², no copy, in the
same backward. Under DDP the hook runs before the reducer's (DDP reduces after the gradient is accumulated), so it
sees this rank's local gradient, the last micro-batch's and a step of one micro-batch's included.

A leaf's hook runs once per backward with its whole gradient, the contributions of every use summed, except where
a backward runs inside another (reentrant activation checkpointing) and a parameter used both inside and outside
it (tied weights) gets its gradient in pieces: Σ|piece|² is not |Σ pieces|², so a micro-batch in which any
parameter's hook ran twice gives no reading (:meth:`MicroBatchNorms.take` returns None). The hooks count only
while :meth:`MicroBatchNorms.arming` is open, around the micro-batch's own backward: a gradient the loss function
takes itself (``torch.autograd.grad`` for a penalty) passes the same hooks and is not the micro-batch's.

Each reading stays on its device until the step ends (:func:`settled`): a float per micro-batch would make the host
wait for the device after every backward. The squared norm is taken in the gradient's own precision, at least
float32 (``vector_norm``'s ``dtype`` casts first: float64 copied every gradient at the backward's peak, 4× a bf16
one), and summed in float64.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["MicroBatchNorms", "Reading", "settled"]

Reading = list[torch.Tensor] | float
"""One micro-batch's Σ |g|²: float64 scalars still on their devices (one per device), or a float read already."""


def settled(reading: Reading) -> float:
    """A :data:`Reading` as a float (reads the device scalars back: once per step, after its last backward)."""
    return reading if isinstance(reading, float) else sum((float(t) for t in reading), 0.0)


class MicroBatchNorms:
    """Σ |g|² of the gradients each backward hands the parameters, summed on their devices until :meth:`take`.

    Use as a context manager (the hooks are removed on exit), one :meth:`take` after each micro-batch's backward.
    """

    def __init__(self, params: Sequence[Any]) -> None:
        self._sums: dict[torch.device, torch.Tensor] = {}
        self._seen: set[int] = set()
        self._repeated = False
        self._armed = False
        self._handles = [p.register_hook(self._hook(i)) for i, p in enumerate(params)]

    def _hook(self, index: int) -> Any:
        def add(grad: torch.Tensor) -> None:
            if not self._armed:  # not the micro-batch's own backward (a gradient its loss function took)
                return
            if index in self._seen:
                self._repeated = True
            self._seen.add(index)
            values = (grad.coalesce().values() if grad.is_sparse else grad).detach()
            half = values.dtype in (torch.float16, torch.bfloat16)
            sq = torch.linalg.vector_norm(values, dtype=torch.float32 if half else None).double() ** 2
            held = self._sums.get(sq.device)
            self._sums[sq.device] = sq if held is None else held + sq

        return add

    @contextmanager
    def arming(self) -> Iterator[None]:
        """Count what the hooks see inside this block (the micro-batch's own backward) and nothing outside it."""
        self._armed = True
        try:
            yield
        finally:
            self._armed = False

    def take(self) -> Reading | None:
        """Σ |g|² of the backwards armed since the last call, on their devices (``[]`` when no gradient came), or
        None when some parameter's gradient came in pieces; then start again."""
        total: Reading | None = None if self._repeated else list(self._sums.values())
        self._sums.clear()
        self._seen.clear()
        self._repeated = False
        return total

    def close(self) -> None:
        """Remove the hooks."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def __enter__(self) -> MicroBatchNorms:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
