"""What a Lightning step logs and counts, kept right when :class:`~microbatch.integrations.lightning.SplitOnOOM` runs
``training_step`` on pieces of the batch and redoes an attempt that ran out of memory.

Two things Lightning keeps outside the gradient see every call of ``training_step``:

- ``self.log(..., on_epoch=True)``: the trainer's result collection (``lightning.pytorch.trainer.connectors.
  logger_connector.result._ResultCollection``, Lightning 2.x) adds ``value · batch_size`` and ``batch_size`` per call,
  the size read from the batch the loop set (``results.batch``, the whole batch) unless ``batch_size=`` is given.
  :func:`piece_logging` sets each piece as that batch while it runs, so a piece's mean counts for its rows (three
  rows' mean and three rows' mean weigh as the six rows' mean did), and puts the loop's back after.
- torchmetrics ``Metric`` modules of the LightningModule, updated in ``training_step``.

An attempt that fails in its backward has already logged and updated both for its pieces: :class:`LoggedState` takes
them before the step and puts them back before each redo (before: the failed attempt's rows counted again, 18 of 12
in a review's loop, and its epoch loss 1.2194 for 1.1923). Plain attributes the step changes (a counter of rows) are
the module's own: no redo can know them. Lightning's private attributes are read where they exist; without them
(another Lightning) nothing is taken and nothing changes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

__all__ = ["LoggedState", "muted_logs", "piece_logging"]


def _results(trainer: Any) -> Any:
    """The trainer's result collection of the running loop, or None where this Lightning has none."""
    try:
        return trainer._results
    except Exception:  # noqa: BLE001 - another Lightning, or no loop running: nothing to keep
        return None


def _states(metric: Any) -> dict[str, Any]:
    """A torchmetrics ``Metric``'s (or Lightning's ``_ResultMetric``'s) states: tensors cloned (a metric's states are
    scalars or small), a list state as the list and its length (updates append: put back by cutting it there, not
    by a copy per step, which grew with the epoch)."""
    out: dict[str, Any] = {}
    for name in getattr(metric, "_defaults", {}):
        value = getattr(metric, name)
        out[name] = (
            value.clone()
            if hasattr(value, "clone")
            else (value, len(value))
            if isinstance(value, list)
            else value
        )
    for name in ("_update_count", "_computed"):
        if hasattr(metric, name):
            out[name] = getattr(metric, name)
    return out


class LoggedState:
    """The logged results and the module's metrics as they were before a step (:meth:`take`), put back by
    :meth:`restore`: keys logged since are dropped, the others' sums and counts set back."""

    def __init__(
        self, results: Any, logged: dict[str, dict[str, Any]], metrics: list[tuple[Any, dict[str, Any]]]
    ):
        self.results, self.logged, self.metrics = results, logged, metrics

    @classmethod
    def take(cls, trainer: Any, module: Any) -> LoggedState:
        results = _results(trainer)
        logged = {} if not isinstance(results, dict) else {k: _states(v) for k, v in results.items()}
        metrics = [(m, _states(m)) for m in module.modules() if _is_metric(m)]
        return cls(results, logged, metrics)

    def restore(self) -> None:
        if isinstance(self.results, dict):
            for key in [k for k in self.results if k not in self.logged]:
                del self.results[key]
            for key, states in self.logged.items():
                _put(self.results[key], states)
        for metric, states in self.metrics:
            _put(metric, states)


def _put(metric: Any, states: dict[str, Any]) -> None:
    for name, value in states.items():
        if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], list):
            del value[0][value[1] :]
            value = value[0]
        setattr(metric, name, value.clone() if hasattr(value, "clone") else value)


def _is_metric(module: Any) -> bool:
    """A torchmetrics ``Metric`` (by its class's module and its states: torchmetrics is not imported here)."""
    return hasattr(module, "_defaults") and type(module).__module__.startswith("torchmetrics")


@contextlib.contextmanager
def piece_logging(
    trainer: Any, piece: Any, weight: float | None = None, module: Any = None
) -> Iterator[None]:
    """While a piece runs, the result collection reads its batch size from the piece, not from the whole batch; or,
    given ``weight``, takes that as its size: the whole batch's rows × the piece's share of the counted items
    (``count_fn``'s), so that an epoch mean of a per-token loss weighs each piece as the gradient does and equals the
    unsplit one (weighted by rows, a piece of 16 one-token rows beside 16 six-token rows logged 3.4581 for 3.3314, a
    review's loop, 2026-12-07). A piece of weight 0 (no items: its mean over none is nan) logs nothing: ``module``'s
    ``log`` and ``log_dict`` are muted while it runs."""
    results = _results(trainer)
    mute = muted_logs(module) if weight == 0.0 and module is not None else contextlib.nullcontext()
    with mute:
        if results is None or not hasattr(results, "batch"):
            yield
            return
        batch, size = results.batch, getattr(results, "batch_size", None)
        results.batch, results.batch_size = piece, weight
        try:
            yield
        finally:
            results.batch, results.batch_size = batch, size


def muted_logs(module: Any) -> contextlib.AbstractContextManager[None]:
    """``module.log`` and ``module.log_dict`` do nothing in the block, then are the module's own again
    (:func:`~microbatch.integrations.common.muted`)."""
    from microbatch.integrations.common import muted

    return muted(module, "log", "log_dict")
