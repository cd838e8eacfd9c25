"""The settings of a choice and of a tune, as three frozen config objects.

- :class:`ChoiceConfig`: how a curve becomes a choice (knee rule, tolerance, reference, the
  memory budget and headroom, the latency limit, B_global and d). Read by
  :func:`microbatch.choose.knee.recommend` and by the search's stop rules.
- :class:`SearchConfig`: how the doubling search walks b_m (start, cap, patience, refine,
  activation checkpointing, the cache).
- :class:`ProbeConfig`: how each point is measured (mode, sequence, device, precision, backend,
  timing, threads, in this process or a child).

The command line builds them from flags of the same names (``--tolerance`` → ``tolerance``);
Python callers build them or pass the same names as keywords to ``tune``/``recommend``, which
build them once (:func:`apply_options`). Every field is checked when the object is made: a
bad value raises :class:`~microbatch.errors.ConfigError` naming the field, the value, the rule
and the fix.
"""

from __future__ import annotations

import math
from collections.abc import MutableMapping
from dataclasses import dataclass, fields, replace
from typing import Any, TypeVar

from microbatch.batch import DEFAULT_KNEE_TOLERANCE
from microbatch.errors import ConfigError, check_positive_int
from microbatch.hardware import DEFAULT_HEADROOM, usable_cores
from microbatch.measure.spec import BACKENDS, MODES
from microbatch.measure.timing import TimingConfig
from microbatch.precision import get_precision

__all__ = [
    "RULES",
    "REFERENCES",
    "DEFAULT_RULE",
    "DEFAULT_TOLERANCE",
    "CHECKPOINTING",
    "DEVICE_TYPES",
    "ChoiceConfig",
    "SearchConfig",
    "ProbeConfig",
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
DEVICE_TYPES = ("cpu", "cuda", "mps", "xpu")
"""torch device types a probe may run on (the registry models' probes: cpu and cuda only)."""
CHECKPOINTING = ("off", "on", "auto")
"""Activation checkpointing settings of the search."""


def _number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{name} {value!r} must be a finite number")
    return float(value)


def _fraction(name: str, value: object, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 <= value < 1):
        raise ConfigError(f"{name} {value!r} must be a number in [0, 1), e.g. {fix}")


def _choice(name: str, value: object, allowed: tuple[str, ...]) -> None:
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
    """Memory per device the choice must fit (None: no limit; ``tune`` then uses the device's
    total memory on CUDA, 80% of the available memory on the CPU)."""
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
        _choice("knee rule", self.rule, RULES)
        _fraction(
            "tolerance", self.tolerance, f"{DEFAULT_TOLERANCE} for {100 * DEFAULT_TOLERANCE:g}% of the best"
        )
        if self.reference is not None:
            _choice("reference", self.reference, REFERENCES)
        if self.memory_budget_bytes is not None and (
            isinstance(self.memory_budget_bytes, bool)
            or not isinstance(self.memory_budget_bytes, int)
            or self.memory_budget_bytes <= 0
        ):
            raise ConfigError(
                f"memory budget {self.memory_budget_bytes!r} must be a whole number of bytes > 0, e.g. 12GiB"
            )
        _fraction("memory_headroom", self.memory_headroom, "0.1 to keep 10% of the budget free")
        if self.max_latency_ms is not None and _number("max_latency_ms", self.max_latency_ms) <= 0:
            raise ConfigError(f"max_latency_ms {self.max_latency_ms!r} must be > 0, e.g. 50")
        if self.global_batch is not None:
            check_positive_int("global_batch", self.global_batch, fix="e.g. --global-batch 512")
        if self.data_parallel is not None:
            check_positive_int("data_parallel", self.data_parallel, fix="e.g. --data-parallel 8")

    def resolve(self, *, reference: str, data_parallel: int = 1) -> ChoiceConfig:
        """This config with the caller's defaults in the fields left None."""
        return replace(
            self,
            reference=self.reference or reference,
            data_parallel=self.data_parallel or data_parallel,
        )


@dataclass(frozen=True, kw_only=True)
class SearchConfig:
    """How the doubling search walks b_m (:mod:`microbatch.choose.tune.search`)."""

    start: int = 1
    """First b_m probed (then doubled; where B_global is given, stepped along the divisors of
    B_global / d: :func:`microbatch.batch.next_micro_batch`)."""
    max_micro_batch: int | None = 1024
    """Largest b_m probed (None: no cap but memory)."""
    patience: int = 2
    """Stop after this many doublings in a row gain less than τ (or fall)."""
    refine: bool = False
    """Probe once more halfway between the knee and the point below it."""
    checkpointing: str = "off"
    """Activation checkpointing: ``off``, ``on``, or ``auto`` (on only where a b_m does not fit
    without it). Decoding has no backward pass: ``tune`` uses ``off`` there."""
    use_cache: bool | None = None
    """Reuse and save points in the cache (``$MICROBATCH_CACHE_DIR``). None: yes, except for
    ``tune`` under ``torch.distributed``."""

    def __post_init__(self) -> None:
        check_positive_int("start", self.start, fix="the first micro-batch probed, e.g. --start 1")
        if self.max_micro_batch is not None:
            check_positive_int(
                "max_micro_batch", self.max_micro_batch, fix="the largest micro-batch probed, e.g. 1024"
            )
        check_positive_int("patience", self.patience, fix="flat doublings in a row that stop, e.g. 2")
        if not isinstance(self.refine, bool):
            raise ConfigError(f"refine {self.refine!r} must be True or False")
        if self.checkpointing not in CHECKPOINTING:
            raise ConfigError(f"checkpointing {self.checkpointing!r} is not known; use on, off or auto")
        if self.use_cache is not None and not isinstance(self.use_cache, bool):
            raise ConfigError(f"use_cache {self.use_cache!r} must be True, False or None")


@dataclass(frozen=True, kw_only=True)
class ProbeConfig:
    """How each point of the curve is measured (:mod:`microbatch.measure.probes`)."""

    mode: str = "train"
    """``train`` (forward + backward micro-steps) or ``decode`` (KV-cache decoding after a prefill)."""
    seq: int | None = None
    """The longest sequence the data holds (memory is set by the longest sequence). None: the
    registry shape's; required with a Hugging Face config."""
    device: str | None = None
    """``cpu`` or ``cuda`` (``cuda:N``). None: ``cpu`` for a registry model; for ``tune`` on the
    user's model, the device of its parameters."""
    precision: str = "fp32"
    """A measurable precision of :data:`microbatch.precision.PRECISIONS` (``fp32``, ``bf16-mixed``)."""
    backend: str = "builtin"
    """For a registry model: the built-in PyTorch GPT (``builtin``) or a transformers model of
    the same shape with random weights (``hf``)."""
    timing: TimingConfig | None = None
    """Warm-up, repeats and clock of each probe. None: short on the CPU, longer on CUDA."""
    threads: int | None = None
    """torch threads in the probe's child process (None: torch's; 1 is steadier on a shared CPU)."""
    new_tokens: int = 32
    """Decoding: tokens decoded after the prefill."""
    in_process: bool | None = None
    """Probe in this process (True) or in a child process under a hard memory limit (False).
    None: in this process on CUDA (OOM is caught by type), in a child on the CPU (an
    over-committed host kills the process outright)."""

    def __post_init__(self) -> None:
        _choice("mode", self.mode, MODES)
        if self.seq is not None:
            check_positive_int(
                "seq", self.seq, fix="give the longest sequence the data holds, e.g. --seq 1024"
            )
        if self.device is not None and (
            not isinstance(self.device, str) or self.device.split(":")[0] not in DEVICE_TYPES
        ):
            raise ConfigError(f"device {self.device!r} is not known; use cpu or cuda (cuda:N)")
        get_precision(self.precision, measurable=True)
        _choice("backend", self.backend, BACKENDS)
        if self.timing is not None and not isinstance(self.timing, TimingConfig):
            raise ConfigError(f"timing {self.timing!r} must be a TimingConfig or None")
        if self.threads is not None:
            check_positive_int("threads", self.threads, fix="e.g. --threads 1")
            cores = usable_cores()
            if self.threads > cores and (self.device is None or self.device == "cpu"):  # CPU probes only
                raise ConfigError(
                    f"threads {self.threads} is more than the {cores} core(s) this process may use: more "
                    f"threads than cores only contend and the timing measures that; use --threads {cores} or fewer"
                )
        check_positive_int("new_tokens", self.new_tokens, fix="tokens decoded after the prefill, e.g. 32")
        if self.in_process is not None and not isinstance(self.in_process, bool):
            raise ConfigError(f"in_process {self.in_process!r} must be True, False or None")


C = TypeVar("C", ChoiceConfig, SearchConfig, ProbeConfig)


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
