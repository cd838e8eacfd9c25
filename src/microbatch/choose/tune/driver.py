"""The one measuring driver that every entry point shares: :func:`~microbatch.choose.tune.entry.tune`,
:func:`~microbatch.choose.tune.entry.tune_model` and the integrations (Lightning and the Hugging Face
Trainer through ``tune``; Accelerate's :func:`~microbatch.integrations.accelerate.knee_batch_size`
with a prober over the decorated function). :func:`run_search` searches the throughput curve with a
prober (caching each point where the run can be keyed), confirms a flat curve's knee, chooses, and
puts the :class:`TuneResult` together. The callers resolve the settings and open the prober; this
module only runs it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from microbatch.choose.config import ChoiceConfig
from microbatch.choose.knee import recommend_measured
from microbatch.choose.result import CacheUse, TuneResult
from microbatch.choose.tune.cache import (
    cache_dir,
    cache_key,
    host_identity,
    load_points,
    save_points,
    versions,
)
from microbatch.choose.tune.config import ProbeConfig, SearchConfig
from microbatch.choose.tune.confirm import confirm_knee
from microbatch.choose.tune.probing import Prober, device_name
from microbatch.choose.tune.search import OnPoint, SearchLog, curve_point, search
from microbatch.errors import NoChoiceError
from microbatch.measure.probes import Measurement

__all__ = ["NOTHING_MEASURED", "Setup", "TuneInterrupted", "run_search"]

NOTHING_MEASURED = "interrupted before any point was measured: nothing to choose from"
"""The KeyboardInterrupt's message when Ctrl-C came before the first point."""


class TuneInterrupted(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM) during :func:`~microbatch.choose.tune.tune`, after some points were measured: a
    ``KeyboardInterrupt``, so a script stops as it would without the tune, with what was measured in :attr:`result`
    (``interrupted`` set; the points also kept in the cache, where it is on). Lightning's fit catches it and exits
    (its own Ctrl-C handling), where the partial result is not reached. Returning that result instead let a user's loop train on at a knee chosen from half a curve (a review,
    2026-12-07)."""

    def __init__(self, result: Any) -> None:
        measured = ", ".join(str(p.micro_batch) for p in result.points)
        super().__init__(
            f"interrupted: {len(result.points)} point(s) measured (b_m {measured}); the partial result is this "
            "exception's .result"
        )
        self.result = result


@dataclass(frozen=True, kw_only=True)
class Setup:
    """What a run is besides its settings: how it is named and keyed, where its budget came from."""

    model_label: str
    """The model's name in the result."""
    fingerprint_fields: dict[str, Any] | None
    """What identifies the model (and how it is probed) in the cache key. None: the run cannot be
    keyed (a decorated function's step): no cache, no fingerprint."""
    budget_source: str
    """Where the memory budget came from (``given``, ``device total``, ...)."""
    t_start: float
    """``time.perf_counter()`` when the tune began (setup included in its wall time)."""
    device_name: str | None = None
    """The device's name in the result. None: read from the device (the GPU's or the CPU's model name)."""
    precision: str | None = None
    """The precision in the result. None: the probe config's (a decorated function runs its own)."""


def run_search(
    prober: Prober,
    probe: ProbeConfig,
    search_config: SearchConfig,
    choice: ChoiceConfig,
    setup: Setup,
    on_point: OnPoint | None,
) -> TuneResult:
    """Search with ``prober`` (caching each point), choose, and put the result together.

    The configs are resolved: ``probe.device`` set, ``search_config.use_cache`` a bool,
    ``choice.reference`` and ``choice.data_parallel`` set, the budget filled in.
    """
    device = probe.device or "cpu"
    name = setup.device_name or device_name(device)
    vers = versions()
    fields = (
        None
        if setup.fingerprint_fields is None
        else dict(
            setup.fingerprint_fields,
            seq=probe.seq,
            precision=probe.precision,
            device=name,
            device_type=device,
            mode=probe.mode,
            checkpointing=search_config.checkpointing,
            global_batch=choice.global_batch,
            data_parallel=choice.data_parallel,
            versions=vers,
            host=host_identity() if device == "cpu" else None,
        )
    )
    cache = _PointCache(fields, bool(search_config.use_cache), choice.memory_budget_bytes)
    log = SearchLog()
    points = _search_and_confirm(cache.measuring(prober), prober, search_config, choice, log, on_point, cache)
    try:
        rec = recommend_measured([curve_point(p) for p in points], choice)
    except NoChoiceError as e:  # measured, but none meets a limit: the points go with the error, not lost
        raise NoChoiceError(str(e), points=[p.to_dict() for p in points], params=e.params) from None
    methods = {p.memory_method for p in points if p.memory_method}
    return TuneResult(
        points=points,
        recommendation=rec,
        model=setup.model_label,
        seq=probe.seq,
        mode=probe.mode,
        device=device,
        device_name=name,
        precision=setup.precision or probe.precision,
        checkpointing=search_config.checkpointing,
        torch_version=vers["torch"],
        memory_budget_bytes=choice.memory_budget_bytes,
        memory_method=", ".join(sorted(methods)),
        stop_reason=log.stop_reason,
        skipped=log.skipped,
        interrupted=log.interrupted,
        oom_events=log.oom_events,
        probes=log.probes,
        cached=log.cached,
        wall_time_s=time.perf_counter() - setup.t_start,
        memory_budget_source=setup.budget_source,
        static_bytes=getattr(prober, "static_bytes", None),
        fingerprint=cache.key,
        cache=cache.use(points),
        notes=cache.notes(),
    )


class _PointCache:
    """The points known for one cache key: read before the search, written after each probe (none,
    and no key, for a run that cannot be keyed: ``fields`` None)."""

    def __init__(
        self, fields: dict[str, Any] | None, enabled: bool, budget_bytes: float | None = None
    ) -> None:
        self.key = "" if fields is None else cache_key(fields)
        self.fields, self.enabled = fields or {}, enabled and fields is not None
        self.budget = budget_bytes  # the limit this run's points meet (cache.holds_under)
        self.stamps: dict[tuple[int, bool], float] = {}
        self.budgets: dict[tuple[int, bool], float | None] = {}  # the budget each met: saved again as it was
        meta: dict[str, Any] = {}
        self.known = (
            load_points(self.key, self.stamps, budget_bytes, self.budgets, meta) if self.enabled else {}
        )
        self.unconfirmed: set[tuple[int, bool]] = set(
            meta.get("unconfirmed", ())
        )  # saved before a knee's check
        self.from_cache = set(self.known)  # what was measured before this run
        self.unsaved: str | None = None  # why the cache could not be written, the first time

    def save(self) -> None:
        why = save_points(self.key, self.fields, self.known, self.stamps, self.budgets, self.unconfirmed)
        self.unsaved = self.unsaved or why

    def notes(self) -> tuple[str, ...]:
        """A note when the points could not be cached (a repeated tune measures them again)."""
        if self.unsaved is None:
            return ()
        return (
            f"the points were not cached ({self.unsaved}): a repeated tune measures them again; set "
            "MICROBATCH_CACHE_DIR to a folder you can write",
        )

    def measuring(self, prober: Prober) -> Callable[[int, bool], Measurement]:
        """``measure(b, checkpointing)`` with ``prober``, each point saved as it comes."""

        def measure(b: int, ckpt: bool) -> Measurement:
            prober.start()
            m = prober.measure(b, checkpointing=ckpt)
            self.from_cache.discard((b, ckpt))
            if self.enabled:
                self.unconfirmed.add((b, ckpt))  # a new point: the knee is not re-measured on it yet
                self.known[(b, ckpt)] = m
                self.stamps[(b, ckpt)] = time.time()
                self.budgets[(b, ckpt)] = self.budget
                self.save()
            return m

        return measure

    def keep(self, points: list[Measurement], confirmed: bool = True) -> None:
        """Save ``points`` over those known (a repeated tune reads the confirmed, median, points); ``confirmed``:
        whether the knee's re-measurement ran to its end (an interrupt inside it keeps the points, not the flag)."""
        if self.enabled:
            for p in points:
                k = (p.micro_batch, p.checkpointing)
                if k not in self.from_cache:  # a point read back keeps the budget it met
                    self.budgets[k] = self.budget
            self.known.update({(p.micro_batch, p.checkpointing): p for p in points})
            if confirmed:  # the curve the knee was re-measured on
                self.unconfirmed -= {(p.micro_batch, p.checkpointing) for p in points}
            self.save()

    def use(self, points: list[Measurement]) -> CacheUse | None:
        """How many of ``points`` came from the cache (None when none did)."""
        cached = [
            (p.micro_batch, p.checkpointing)
            for p in points
            if (p.micro_batch, p.checkpointing) in self.from_cache
        ]
        if not cached:
            return None
        return CacheUse(
            points=len(cached),
            measured=len(points) - len(cached),
            oldest_s=min((self.stamps[k] for k in cached if k in self.stamps), default=None),
            key=self.key,
            file=str(cache_dir() / f"tune-{self.key}.json"),
        )


def _agree() -> Callable[[bool], bool] | None:
    """Under torch.distributed (``tune`` on every rank of a DDP/FSDP model): a decision made the same on
    every rank; None in one process (``tune_model``'s child probes never are)."""
    from microbatch.measure.device import agree_any, distributed

    return agree_any if distributed() is not None else None


def _search_and_confirm(
    measure: Callable[[int, bool], Measurement],
    prober: Prober,
    search_config: SearchConfig,
    choice: ChoiceConfig,
    log: SearchLog,
    on_point: OnPoint | None,
    cache: _PointCache,
) -> list[Measurement]:
    """The searched points, a flat curve's knee measured again; the prober closed. A Ctrl-C keeps the
    points measured (``log.interrupted``), unless there is none."""
    points: list[Measurement] = []
    try:
        try:
            points = search(measure, search_config, choice, known=cache.known, on_point=on_point, log=log)
            if log.probes and not log.interrupted:  # a flat curve's knee, measured again (cached: kept)
                points = confirm_knee(measure, points, choice, log, on_point=on_point, agree=_agree())
                cache.keep(points, confirmed=not log.interrupted)
            elif not log.interrupted and cache.unconfirmed & {
                (p.micro_batch, p.checkpointing) for p in points
            }:
                log.stop_reason += (
                    "; the knee was not re-measured: the run that measured these points ended before it did "
                    f"(interrupted, or stopped by an error) and they all came from the cache; remove "
                    f"{cache_dir() / f'tune-{cache.key}.json'} to measure them again"
                )
        finally:
            prober.close()
    except KeyboardInterrupt:  # one that landed outside the search's and the confirmation's own handling
        log.interrupted = True
        log.stop_reason += (
            "; " if log.stop_reason else ""
        ) + "interrupted (Ctrl-C or SIGTERM): the points measured are kept"
    if log.interrupted and not any(not p.oom for p in points):
        raise KeyboardInterrupt(NOTHING_MEASURED)
    return points
