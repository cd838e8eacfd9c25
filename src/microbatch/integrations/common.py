"""What every integration shares: B_global checks, the choice as (b_m, g), the curve as log lines.

Every integration holds ``B_global = b_m × g × world`` exactly: it refuses, before any probe, a
global batch that the world size does not divide (with the nearest valid ones), caps the search
at ``B_global / world``, and checks the identity again on the answer.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from microbatch.batch import grad_accum_for, nearest_multiples, per_replica
from microbatch.choose.result import TuneResult
from microbatch.errors import ConfigError, MicrobatchError, whole_number

__all__ = [
    "check_global_batch",
    "nearest_global_batches",
    "choice_of",
    "choice_lines",
    "curve_lines",
    "emit_lines",
    "quiet_cache",
    "options_with_cap",
    "log",
    "muted",
]

log = logging.getLogger("microbatch.integrations")
"""The integrations' logger: the curve and the choice, one line each (INFO)."""


def nearest_global_batches(global_batch: int, world: int) -> tuple[int, int]:
    """The multiples of ``world`` just below and above ``global_batch`` (the valid B_global)."""
    near = nearest_multiples(global_batch, world) or [world]  # none under the limit: the world size itself
    return near[0], near[-1]


def check_global_batch(global_batch: object, world: int, *, name: str = "global_batch") -> int:
    """``global_batch`` as an int, or a ConfigError: it must be a whole number divisible by the world size."""
    whole = whole_number(global_batch)  # NumPy's and torch's integers too
    if whole is None or whole < 1:
        raise ConfigError(f"{name} {global_batch!r} must be a whole number >= 1, e.g. {name}=256")
    global_batch = whole
    if per_replica(global_batch, world) is None:
        below, above = nearest_global_batches(global_batch, world)
        raise ConfigError(
            f"{name} {global_batch} is not divisible by the world size {world}: B_global = b_m × g × {world} "
            f"must hold exactly, and B_global is never changed silently; nearest valid global batches: "
            f"{below}, {above}"
        )
    return global_batch


def choice_of(result: TuneResult, global_batch: int, world: int) -> tuple[int, int]:
    """(b_m, g) of the knee, with b_m × g × world == global_batch checked."""
    rec = result.recommendation
    b = rec.knee.micro_batch
    g = grad_accum_for(global_batch, b, world)
    if b * g * world != global_batch:
        below, above = nearest_global_batches(global_batch, b * world)
        raise MicrobatchError(
            f"the knee b_m = {b} gives no exact global batch {global_batch} on {world} processes "
            f"({b} × g × {world}); nearest valid global batches: {below}, {above}"
        )
    return b, g


def curve_lines(result: TuneResult, micro_batch: int, grad_accum: int, world: int) -> list[str]:
    """The measured curve and the choice, one line each (what the integrations log)."""
    lines: list[str] = []
    for p in result.points:
        if p.oom:
            lines.append(f"microbatch: b_m {p.micro_batch}: out of memory")
            continue
        mem = "" if p.peak_memory_bytes is None else f", peak {p.peak_memory_bytes / 2**20:.0f} MiB"
        lines.append(f"microbatch: b_m {p.micro_batch}: {p.throughput:.4g} /s{mem}")
    lines.append(
        f"microbatch: knee b_m = {micro_batch}, g = {grad_accum}, world {world}: "
        f"B_global = {micro_batch} × {grad_accum} × {world} = {micro_batch * grad_accum * world} "
        f"({result.stop_reason or 'search done'})"
    )
    return lines


def choice_lines(result: TuneResult, micro_batch: int, grad_accum: int, world: int) -> list[str]:
    """What every integration shows its user once, in the framework's own way: the choice in one plain
    line (with the b_m the measurements could not tell from it, where there are any), and where
    points came from the cache, that line too."""
    rec = result.recommendation
    line = (
        f"microbatch: use b_m = {micro_batch}, g = {grad_accum} (b_m x g x world = {micro_batch} x "
        f"{grad_accum} x {world} = {micro_batch * grad_accum * world}); the knee of {len(result.points)} "
        f"measured points, {100 * rec.knee_fraction_of_reference:.0f}% of the reference throughput"
    )
    others = [b for b in rec.indistinguishable if b != micro_batch]
    if others:
        line += f"; indistinguishable at the measured noise: b_m {', '.join(map(str, others))}"
    lines = [line]
    if result.cache is not None:
        lines.append(f"microbatch: {result.cache.message()}")
    return lines


@contextmanager
def quiet_cache() -> Iterator[None]:
    """No :class:`~microbatch.choose.tune.cache.CachedAnswer` warning inside: the integration says it itself
    (:func:`choice_lines`)."""
    from microbatch.choose.tune.cache import CachedAnswer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CachedAnswer)
        yield


def emit_lines(lines: list[str], rank: int = 0, say: Callable[[str], None] | None = None) -> None:
    """Log ``lines`` at INFO on rank 0 (the curve), and hand them to ``say`` there too (the choice:
    the framework's own visible channel)."""
    if rank == 0:
        for line in lines:
            (say or log.info)(line)


def options_with_cap(
    options: dict[str, Any], global_batch: int, world: int, *, data: Any = None, data_shards: int = 1
) -> dict[str, Any]:
    """The tune options with ``max_micro_batch`` capped at B_global / world (no larger b_m can be
    exact) and, given ``data`` with a length, at what one process's share of it holds (its length
    over ``data_shards``, rounded up as ``DistributedSampler`` pads): a probe's first batch of a
    larger b_m would hold only that share, and its throughput would be counted for samples it never
    ran (Lightning's ``BatchSizeFinder`` caps at the data the same way)."""
    out = dict(options)
    cap = per_replica(global_batch, world) or max(1, global_batch // world)  # world | B: check_global_batch
    try:
        cap = min(cap, max(1, -(-len(data) // data_shards)))
    except TypeError:  # no data, or no length: the probes take what the loader gives
        pass
    given = out.get("max_micro_batch", 1024)
    out["max_micro_batch"] = cap if given is None else min(int(given), cap)
    return out


@contextmanager
def muted(obj: Any, *names: str) -> Iterator[None]:
    """``obj``'s methods ``names`` do nothing in the block, then are its own again (an instance attribute it had is
    put back; the class's methods otherwise): a LightningModule's ``log`` and ``log_dict`` while KneeBatchSize probes
    and for a weightless piece, a Trainer's ``log`` while tune_trainer probes (its callbacks' on_log, its log_history
    and the loggers behind them saw every probe: a review, 2026-12-08)."""
    saved = {name: obj.__dict__.get(name) for name in names}
    for name in names:
        setattr(obj, name, lambda *a, **k: None)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                obj.__dict__.pop(name, None)
            else:
                setattr(obj, name, value)
