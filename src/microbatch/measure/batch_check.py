"""A user's ``make_batch(b)`` checked to grow with b: a batch that does not measures a wrong curve.

``tune(model, make_batch)`` times ``make_batch(b)`` for each micro-batch b it probes and credits the step with b
sequences. A ``make_batch`` that returns the same rows whatever b (``X[:4]``), or stops growing once the data runs out
(``X[:b]`` past the last of 256 rows), gave a throughput curve rising as b / step time with nothing measured behind it:
the knee at the largest b, without a word (the Python-API sweep of 2026-12-06). :class:`GrowingBatches` wraps
``make_batch`` and reads the shapes of the tensors in each batch (through tuples, lists and mappings, as collate
functions nest them): a batch for a larger b must be larger than a smaller b's in some dimension — whichever holds
the rows in the user's layout (batch-first ``(b, s)``, sequence-first ``(s, b, e)``, one packed row ``(1, b·s)``),
and whatever the padding of rows drawn at random does to the others. Where it is not, it is refused; where batches
grew before (two b or more seen), the data ran out and the search ends there, keeping the points before (``grown``).

A batch that grows but holds fewer than b rows (``X[:8]`` of 6 rows after ``X[:4]``) is caught where the layout
shows its rows: every tensor of every smaller b's batch (one b >= 2 among them) led with b (batch-first), and this
one's do not all lead with b (:func:`_rows_first`); in another layout (sequence-first, packed) it is not caught, and that point's
throughput is overstated by b / rows. Under torch.distributed the check
is not made: a rank refusing alone would leave the others waiting in the probe's next collective.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from microbatch.errors import ConfigError

__all__ = ["BatchDidNotGrow", "GrowingBatches", "batch_shapes"]


class BatchDidNotGrow(ConfigError):
    """``make_batch(b)`` returned a batch no larger than a smaller b's. ``grown``: the batches of two or more smaller
    b grew (the data ran out past them; the points measured so far stand and the search ends there); False: no
    batch was seen to grow, and no point can be trusted."""

    def __init__(self, message: str, *, grown: bool) -> None:
        super().__init__(message, params=("make_batch",))
        self.grown = grown


def batch_shapes(batch: Any) -> list[tuple[int, ...]]:
    """The shape of every tensor in ``batch`` (nested tuples, lists and mappings; anything else has none)."""
    if hasattr(batch, "shape") and hasattr(batch, "numel"):
        return [tuple(int(n) for n in batch.shape)]
    if isinstance(batch, Mapping):
        return [s for v in batch.values() for s in batch_shapes(v)]
    if isinstance(batch, tuple | list):
        return [s for v in batch for s in batch_shapes(v)]
    return []


def _rows_first(shapes: list[tuple[int, ...]], micro_batch: int) -> bool:
    """Whether every tensor of a batch leads with ``micro_batch`` rows (the batch-first layout)."""
    return all(len(s) > 0 and s[0] == micro_batch for s in shapes)


def _grew(big: list[tuple[int, ...]], small: list[tuple[int, ...]]) -> bool:
    """Whether some tensor of ``big`` is larger than its counterpart in ``small`` in some dimension (True where the
    two are not laid out alike: nothing to compare)."""
    if len(big) != len(small) or any(len(a) != len(b) for a, b in zip(big, small, strict=True)):
        return True
    return any(x > y for a, b in zip(big, small, strict=True) for x, y in zip(a, b, strict=True))


class GrowingBatches:
    """``make_batch`` itself, each batch checked to be larger than a smaller b's (the module's rule)."""

    def __init__(self, make_batch: Callable[[int], Any]) -> None:
        self.make_batch = make_batch
        self.shapes: dict[int, list[tuple[int, ...]]] = {}
        """The tensor shapes of the batch made for each micro-batch b."""

    def __call__(self, micro_batch: int) -> Any:
        batch = self.make_batch(micro_batch)
        from microbatch.measure.device import distributed

        shapes = batch_shapes(batch)
        if shapes and distributed() is None:
            seen_rows_first = [b for b, s in self.shapes.items() if b < micro_batch and _rows_first(s, b)]
            # a b >= 2 among them: a packed (1, b·s) batch leads with 1 row at b = 1 too
            smaller = sum(b < micro_batch for b in self.shapes)
            if max(seen_rows_first, default=1) >= 2 and len(seen_rows_first) == smaller:
                if not _rows_first(shapes, micro_batch):
                    raise BatchDidNotGrow(
                        f"make_batch({micro_batch}) returned tensors of shapes {shapes}, not {micro_batch} rows, where "
                        f"each smaller b's led with b rows ({', '.join(map(str, sorted(seen_rows_first)))}): the data "
                        f"ran out (a slice past the end, X[:b] of fewer than b rows), and tune credits each step with "
                        f"b sequences; make_batch(b) must return b rows (repeat or draw rows instead)",
                        grown=True,
                    )
            for other, seen in sorted(self.shapes.items()):
                if other < micro_batch and not _grew(shapes, seen):
                    raise BatchDidNotGrow(
                        f"make_batch({micro_batch}) returned tensors of shapes {shapes}, no larger than "
                        f"make_batch({other})'s {seen}: tune credits each step with b sequences, so a batch that does "
                        "not grow with b measures a curve that is not there; make_batch(b) must return b rows (a "
                        "slice past the end of the data, X[:b] with fewer rows than b, returns fewer: repeat or draw "
                        "rows instead)",
                        grown=sum(c < micro_batch for c in self.shapes) >= 2,
                    )
            self.shapes.setdefault(micro_batch, shapes)
        return batch
