"""The settings of the measuring: how the search walks b_m and how each point is measured.

- :class:`SearchConfig`: how the doubling search walks b_m (start, cap, patience, refine,
  activation checkpointing, the cache).
- :class:`ProbeConfig`: how each point is measured (mode, sequence, device, precision, backend,
  timing, threads, in this process or a child).

With :class:`~microbatch.choose.config.ChoiceConfig` (how the curve becomes a choice) they are the
three settings of a tune. The command line builds them from flags of the same names; Python callers
build them or pass the same names as keywords to ``tune``, which build them once
(:func:`microbatch.choose.config.apply_options`). Every field is checked when the object is made: a bad value raises
:class:`~microbatch.errors.ConfigError` naming the field, the value, the rule and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass

from microbatch.choose.config import check_choice
from microbatch.errors import ConfigError, check_positive, check_positive_int, plain_numbers
from microbatch.hardware import usable_cores
from microbatch.measure.spec import BACKENDS, MODES
from microbatch.measure.timing import TimingConfig
from microbatch.precision import get_precision

__all__ = [
    "CHECKPOINTING",
    "DEVICE_TYPES",
    "SearchConfig",
    "ProbeConfig",
]

DEVICE_TYPES = ("cpu", "cuda", "mps", "xpu")
"""torch device types a probe may run on (the registry models' probes: cpu and cuda only)."""
CHECKPOINTING = ("off", "on", "auto")
"""Activation checkpointing settings of the search."""


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
        plain_numbers(self)
        check_positive_int("start", self.start, fix="the first micro-batch probed, e.g. start 1")
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


PROBE_TIMEOUT_S = 600.0
"""Default limit of one child probe, seconds: a probe measures a few warm-up and timed steps, so ten minutes
is far past any probe of a model a CPU can train at a usable rate."""

MAX_PROBE_TIMEOUT_S = 86_400.0
"""The largest limit accepted (a day)."""


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
    """Decoding: tokens decoded after the prefill, at least the timing's warm-up and most repeats (the probe decodes
    that many: 2 with the CPU's timing decodes 11); the prompt is ``seq`` less them."""
    in_process: bool | None = None
    """Probe in this process (True) or in a child process under a hard memory limit (False).
    None: in this process on CUDA (OOM is caught by type), in a child on the CPU (an
    over-committed host kills the process outright)."""
    probe_timeout_s: float = PROBE_TIMEOUT_S
    """Longest a child process's probe (or its set-up) may take, seconds: one past it is stopped and the
    search ends with the points below it (a larger b_m takes longer). In-process probes run the user's own
    step, which cannot be stopped safely: not bounded."""

    def __post_init__(self) -> None:
        plain_numbers(self)
        check_choice("mode", self.mode, MODES)
        if self.seq is not None:
            check_positive_int("seq", self.seq, fix="give the longest sequence the data holds, e.g. seq 1024")
        if self.device is not None and (
            not isinstance(self.device, str) or self.device.split(":")[0] not in DEVICE_TYPES
        ):
            raise ConfigError(f"device {self.device!r} is not known; use cpu or cuda (cuda:N)")
        get_precision(self.precision, measurable=True)
        check_choice("backend", self.backend, BACKENDS)
        if self.timing is not None and not isinstance(self.timing, TimingConfig):
            raise ConfigError(f"timing {self.timing!r} must be a TimingConfig or None")
        if self.threads is not None:
            check_positive_int("threads", self.threads, fix="e.g. threads 1")
            cores = usable_cores()
            if self.threads > cores and (self.device is None or self.device == "cpu"):  # CPU probes only
                raise ConfigError(
                    f"threads {self.threads} is more than the {cores} core(s) this process may use: oversubscribed "
                    f"cores only contend and the timing measures that; use threads {cores} or fewer",
                    params=("threads",),
                )
        check_positive_int("new_tokens", self.new_tokens, fix="tokens decoded after the prefill, e.g. 32")
        if isinstance(self.probe_timeout_s, bool) or not isinstance(self.probe_timeout_s, (int, float)):
            raise ConfigError(
                f"probe_timeout_s must be a number of seconds, got {self.probe_timeout_s!r}; e.g. probe_timeout_s 600",
                params=("probe_timeout_s",),
            )
        check_positive("probe_timeout_s", self.probe_timeout_s, fix="seconds, e.g. probe_timeout_s 600")
        if not 1 <= self.probe_timeout_s <= MAX_PROBE_TIMEOUT_S:
            raise ConfigError(
                f"probe_timeout_s {self.probe_timeout_s:g} is outside 1 to {MAX_PROBE_TIMEOUT_S:g} s; a probe "
                f"measures a few steps: give seconds in that range, e.g. probe_timeout_s {PROBE_TIMEOUT_S:g}",
                params=("probe_timeout_s",),
            )
        if self.in_process is not None and not isinstance(self.in_process, bool):
            raise ConfigError(f"in_process {self.in_process!r} must be True, False or None")
