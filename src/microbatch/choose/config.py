"""The settings of a choice: :class:`ChoiceConfig`, how a curve becomes a choice (knee rule,
tolerance, reference, the memory budget and headroom, the latency limit, B_global and d). Read by
:func:`microbatch.choose.knee.recommend` and by the search's stop rules. The settings of the
measuring (:class:`~microbatch.choose.tune.config.SearchConfig`,
:class:`~microbatch.choose.tune.config.ProbeConfig`) live with the driver.

The command line builds it from flags of the same names (``--tolerance`` → ``tolerance``);
Python callers build it or pass the same names as keywords to ``tune``/``recommend``, which
build it once (:func:`apply_options`). Every field is checked when
the object is made: a bad value raises :class:`~microbatch.errors.ConfigError` naming the field,
the value, the rule and the fix.
"""

from __future__ import annotations

import math
from collections.abc import MutableMapping
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any, TypeVar

from microbatch.batch import DEFAULT_KNEE_TOLERANCE, check_batch_quantity
from microbatch.errors import ConfigError, plain_numbers
from microbatch.hardware import DEFAULT_HEADROOM
from microbatch.units import parse_bytes

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = [
    "RULES",
    "REFERENCES",
    "DEFAULT_RULE",
    "DEFAULT_TOLERANCE",
    "ChoiceConfig",
    "check_choice",
    "apply_options",
    "check_options_used",
]

RULES = ("fraction", "gain")
"""The knee rules (``docs/knee.md``)."""
REFERENCES = ("measured", "bound")
"""What rule ``fraction`` measures against: the best measured point, or also the bound on larger b_m."""
DEFAULT_RULE = "fraction"
"""Default knee rule (see ``docs/knee.md`` for why)."""
DEFAULT_TOLERANCE = DEFAULT_KNEE_TOLERANCE
"""Default tolerance τ: 15% of the best throughput, the one knee tolerance
(:data:`microbatch.batch.DEFAULT_KNEE_TOLERANCE`; see ``docs/knee.md`` for why)."""


def _number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{name} {value!r} must be a finite number")
    return float(value)


def _fraction(name: str, value: object, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 <= value < 1):
        raise ConfigError(f"{name} {value!r} must be a number in [0, 1), e.g. {fix}")


def check_choice(name: str, value: object, allowed: tuple[str, ...]) -> None:
    """ConfigError unless ``value`` is one of ``allowed`` (a setting named ``name``)."""
    if value not in allowed:
        raise ConfigError(f"{name} {value!r} is not known; use one of {', '.join(allowed)}")


@dataclass(frozen=True, kw_only=True)
class ChoiceConfig:
    """How a measured curve becomes a choice of b_m (``docs/knee.md``)."""

    rule: str = DEFAULT_RULE
    """Knee rule: ``fraction`` (smallest b_m within τ of the best) or ``gain`` (stop when a
    doubling gains < τ)."""
    tolerance: float = DEFAULT_TOLERANCE
    """τ, in [0, 1): the share of the best throughput the knee may give up (rule ``fraction``),
    or the gain per doubling that still counts (rule ``gain``)."""
    reference: str | None = None
    """What "the best" is for rule ``fraction``: ``measured`` (the best measured) or ``bound``
    (also the bound on any larger b_m). None: the caller's default — ``bound`` for the search
    and ``tune`` (they stop early, so they must answer for what they did not measure),
    ``measured`` for ``recommend`` (a curve given whole is taken as the truth)."""
    memory_budget_bytes: int | None = None
    """Memory per device the choice must fit, in bytes (a float such as 1.2e10, or a size's text such as
    ``"12GiB"``, is read as :func:`microbatch.units.parse_bytes` reads it); None: no limit (``tune`` then uses the
    device's total memory on CUDA, 80% of the available memory on the CPU)."""
    memory_headroom: float = DEFAULT_HEADROOM
    """ε, in [0, 1): share of the budget kept free when predicting the largest fitting b_m."""
    max_latency_ms: float | None = None
    """Drop points whose step (decode: per-token) time exceeds this many milliseconds."""
    global_batch: int | None = None
    """B_global: only b_m with b_m·d dividing it are chosen, and g = B / (b_m·d) is reported."""
    data_parallel: int | None = None
    """d: data-parallel replicas. None: 1, or the world size under ``torch.distributed`` in
    ``tune``."""

    def __post_init__(self) -> None:
        plain_numbers(self)
        check_choice("knee rule", self.rule, RULES)
        _fraction(
            "tolerance", self.tolerance, f"{DEFAULT_TOLERANCE} for {100 * DEFAULT_TOLERANCE:g}% of the best"
        )
        if self.reference is not None:
            check_choice("reference", self.reference, REFERENCES)
        if self.memory_budget_bytes is not None:  # bytes, a whole float (1.2e10) or a size's text ("12GiB")
            object.__setattr__(
                self, "memory_budget_bytes", parse_bytes(self.memory_budget_bytes, name="memory_budget_bytes")
            )
        _fraction("memory_headroom", self.memory_headroom, "0.1 to keep 10% of the budget free")
        if self.max_latency_ms is not None and _number("max_latency_ms", self.max_latency_ms) <= 0:
            raise ConfigError(f"max_latency_ms {self.max_latency_ms!r} must be > 0, e.g. 50")
        if self.global_batch is not None:
            check_batch_quantity("global_batch", self.global_batch, fix="e.g. global_batch 512")
        if self.data_parallel is not None:
            check_batch_quantity("data_parallel", self.data_parallel, fix="e.g. data_parallel 8")

    def resolve(self, *, reference: str, data_parallel: int = 1) -> ChoiceConfig:
        """This config with the caller's defaults in the fields left None."""
        return replace(
            self,
            reference=self.reference or reference,
            data_parallel=self.data_parallel or data_parallel,
        )


C = TypeVar("C", bound="DataclassInstance")
"""A config object (a dataclass): ChoiceConfig, SearchConfig or ProbeConfig."""


def apply_options(config: C, options: MutableMapping[str, Any]) -> C:
    """``config`` with the ``options`` named like its fields put in (and taken out of ``options``).

    This is how ``tune(..., tolerance=0.05)`` becomes a :class:`ChoiceConfig`: each keyword
    goes to the config with a field of its name, checked as the config is made.
    """
    names = {f.name for f in fields(config)}
    mine = {k: options.pop(k) for k in list(options) if k in names}
    return replace(config, **mine) if mine else config


def check_options_used(options: MutableMapping[str, Any], what: str, *configs: type) -> None:
    """TypeError naming the options no config took (a misspelt keyword), with the known ones."""
    if options:
        known = sorted(f.name for c in configs for f in fields(c))
        raise TypeError(
            f"{what}() got unexpected option(s) {', '.join(map(repr, sorted(options)))}; "
            f"options: {', '.join(known)}"
        )
