"""A user's ``make_batch(b)`` checked to grow with b: a batch that does not grow measures a wrong curve.

``tune(model, make_batch)`` times ``make_batch(b)`` for each micro-batch b it probes and credits the step with b
sequences. A ``make_batch`` that returns the same rows whatever b (``X[:4]``, or ``X[:b]`` past the end of a
256-row tensor) gave a throughput curve rising as b / step time with nothing measured behind it: the knee at the
largest b, without a word (the Python-API sweep of 2026-12-06). :class:`GrowingBatches` wraps ``make_batch`` and
counts the elements of every tensor in each batch it returns (through tuples, lists and mappings, as collate
functions nest them); a larger b whose batch holds no more elements than a smaller b's is refused, naming both.
Elements, not dim 0: a batch laid out sequence-first ((s, b, e), ``nn.Transformer``'s default) grows in dim 1, and
a padded text batch may pad to another length, but more rows never hold fewer elements in practice.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from microbatch.errors import ConfigError

__all__ = ["BatchDidNotGrow", "GrowingBatches", "batch_elements"]


class BatchDidNotGrow(ConfigError):
    """``make_batch(b)`` returned no more than a smaller b's batch. ``grown``: the batches of the smaller b's grew
    (two or more sizes seen, each larger than the last): the data ran out past them and the points measured so far
    stand (the search ends there); False: no batch was seen to grow, and no point can be trusted."""

    def __init__(self, message: str, *, grown: bool) -> None:
        super().__init__(message, params=("make_batch",))
        self.grown = grown


def batch_elements(batch: Any) -> int:
    """Elements of every tensor in ``batch`` (nested tuples, lists and mappings; anything else counts 0)."""
    if hasattr(batch, "numel") and hasattr(batch, "shape"):
        return int(batch.numel())
    if isinstance(batch, Mapping):
        return sum(batch_elements(v) for v in batch.values())
    if isinstance(batch, tuple | list):
        return sum(batch_elements(v) for v in batch)
    return 0


class GrowingBatches:
    """``make_batch`` itself, with each batch's size checked against those of the other b it was called with."""

    def __init__(self, make_batch: Callable[[int], Any]) -> None:
        self.make_batch = make_batch
        self.sizes: dict[int, int] = {}
        """Elements of the batch made for each micro-batch b (tensors only; 0 where the batch holds none)."""

    def __call__(self, micro_batch: int) -> Any:
        batch = self.make_batch(micro_batch)
        n = batch_elements(batch)
        if n:
            self._check(micro_batch, n)
            self.sizes[micro_batch] = n
        return batch

    def _check(self, b: int, n: int) -> None:
        for other, m in self.sizes.items():
            small, big = sorted(((b, n), (other, m)))
            if small[0] < big[0] and big[1] <= small[1]:
                raise BatchDidNotGrow(
                    f"make_batch({big[0]}) returned {big[1]:,} elements, no more than make_batch({small[0]})'s "
                    f"{small[1]:,}: tune credits each step with b sequences, so a batch that does not grow with b "
                    "measures a curve that is not there; make_batch(b) must return b rows (a slice past the end "
                    "of the data, X[:b] with fewer rows than b, returns fewer: repeat or draw rows instead)",
                    grown=self._grown(below=big[0]),
                )

    def _grown(self, below: int) -> bool:
        """Whether the batches made for two or more b under ``below`` grew with b."""
        seen = [self.sizes[b] for b in sorted(self.sizes) if b < below]
        return len(seen) >= 2 and all(x < y for x, y in zip(seen, seen[1:], strict=False))
