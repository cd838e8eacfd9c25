"""The result of a kernel microbenchmark (``microbatch bench-gpu``) as a typed value and its JSON.

Written by :mod:`microbatch.measure.microbench` (which times the kernels) and read by
:mod:`microbatch.predict.kernel_calibration` (which turns them into the planner's kernel terms): the two
are peers that do not import each other, so the record they share lives here, below both. Pure Python.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from microbatch._json import loads
from microbatch.errors import ConfigError
from microbatch.fields import is_finite_number

__all__ = [
    "ADAMW_RECORDED_BYTES",
    "KIND",
    "is_microbench",
    "GemmTiming",
    "AttentionTiming",
    "StreamTiming",
    "CollectiveTiming",
    "MicrobenchResult",
]

ADAMW_RECORDED_BYTES = 28
"""Bytes per parameter the ``adamw`` stream row counts (its ``nbytes``): the parameter, gradient and two moments read
(16 B, fp32) and the parameter and moments written (12 B) — what the step must move, not what its unfused kernels
move (:data:`microbatch.predict.state.EAGER_PASSES`: 80 B in fp32)."""

KIND = "microbench"
"""The ``record`` field that tells a microbenchmark file from a tune result or a saved calibration."""


def is_microbench(d: Any) -> bool:
    """Whether ``d`` is a bench-gpu record: ``"record": "microbench"``, or ``"kind"`` as files before 2026-12-07
    named it."""
    return isinstance(d, dict) and d.get("record", d.get("kind")) == KIND


@dataclass(frozen=True, kw_only=True)
class GemmTiming:
    """One GEMM ``[rows, k] × [k, n]``: median seconds and what they achieve."""

    label: str
    """``qkv``, ``proj``, ``fc1``, ``fc2``, ``logits`` (a layer GEMM of the model) or ``grid``."""
    rows: int
    """M: rows of the input (b_m·s for a layer GEMM)."""
    k: int
    """K: the inner dimension."""
    n: int
    """N: output columns."""
    seconds: float
    """Median seconds of one GEMM."""
    flops_per_s: float
    """2·rows·k·n / seconds."""
    fraction_of_peak: float | None = None
    """flops_per_s over the accelerator table's peak in this dtype (None: the device is not in the table)."""


@dataclass(frozen=True, kw_only=True)
class AttentionTiming:
    """Causal scaled-dot-product attention (forward) at one sequence length."""

    seq: int
    """s: query and key length."""
    heads: int
    """Heads."""
    head_dim: int
    """d: head dimension."""
    batch: int
    """Sequences."""
    seconds: float
    """Median seconds of one forward."""
    flops_per_s: float
    """Causal FLOPs (half of 4·b·a·s²·d) / seconds."""
    fraction_of_peak: float | None = None
    """flops_per_s over the table's peak (None: not in the table)."""


@dataclass(frozen=True, kw_only=True)
class StreamTiming:
    """One memory-bound kernel over a large tensor."""

    kernel: str
    """``copy``, ``add``, ``gelu`` or ``layernorm``."""
    nbytes: int
    """Bytes read plus written."""
    seconds: float
    """Median seconds."""
    bytes_per_s: float
    """nbytes / seconds."""
    fraction_of_bandwidth: float | None = None
    """bytes_per_s over the table's memory bandwidth (None: not in the table)."""


@dataclass(frozen=True, kw_only=True)
class CollectiveTiming:
    """One ring collective over the initialised process group."""

    op: str
    """``all_reduce`` or ``all_gather``."""
    nbytes: int
    """Bytes of the (output) tensor."""
    world_size: int
    """Ranks in the group."""
    seconds: float
    """Median seconds."""
    bus_bytes_per_s: float
    """Bus bandwidth (nccl-tests' convention): all-reduce 2(n−1)/n · bytes / s, all-gather (n−1)/n · bytes / s."""
    fraction_of_link: float | None = None
    """bus_bytes_per_s over the table's intra-node link bandwidth (None: not in the table)."""


@dataclass(frozen=True, kw_only=True)
class MicrobenchResult:
    """What one microbenchmark measured on one device, with where and how."""

    device: str
    """``cpu`` or ``cuda``."""
    device_name: str
    """The device's own name (``torch.cuda.get_device_name``; ``cpu``)."""
    accelerator: str | None
    """The accelerator table's key for it (None: not in the table)."""
    torch_version: str
    """torch.__version__ that ran it."""
    dtype: str
    """``bf16``, ``fp16`` or ``fp32``."""
    timer: str
    """How seconds were taken (CUDA events, or the thread's CPU clock)."""
    model: str = ""
    """The model whose layer GEMMs were measured."""
    seq: int = 0
    """Its sequence length."""
    micro_batches: tuple[int, ...] = ()
    """The b_m whose rows b_m·s were measured."""
    gemms: tuple[GemmTiming, ...] = ()
    """Layer GEMMs of the model, then the M, N, K grid."""
    attention: tuple[AttentionTiming, ...] = ()
    """Causal SDPA at a few sequence lengths."""
    stream: tuple[StreamTiming, ...] = ()
    """Copy, add, GeLU, LayerNorm."""
    collectives: tuple[CollectiveTiming, ...] = ()
    """All-reduce and all-gather when a process group was initialised."""
    launch_s_per_kernel: float | None = None
    """Wall seconds per tiny eager kernel (the host's launch floor)."""
    layer_host_s_per_kernel: float | None = None
    """Seconds per kernel the planner counts of a small eager layer of the model's kind run forward and backward
    (:func:`microbatch.measure.microbench._layer_host_s`): the host's time per kernel as a real layer pays it;
    None when not measured (files written before the field)."""
    overlap_slowdown: float | None = None
    """How much longer a GEMM took while an all-reduce ran beside it than alone (0.2 = 20% longer), when a
    process group of 2+ ranks was initialised; None when not measured."""
    power_limit_w: float | None = None
    """The board's enforced power limit as the driver reported it (``nvidia-smi``); None when not read."""
    sm_clock_mhz: float | None = None
    """The SM clock the board held while a long square GEMM ran (the driver's, median of its samples)."""
    max_sm_clock_mhz: float | None = None
    """The board's highest SM clock (the driver's), to read ``sm_clock_mhz`` against."""
    soak_s: float = 0.0
    """Seconds of back-to-back calls each GEMM and attention item ran before it was timed: > 0, they carry the
    clock a sustained load holds; 0 (and every file written before the field), bursts."""
    burst_square_flops_per_s: float | None = None
    """A square 8,192 GEMM's rate in a burst (warm-up and repeats, no soak); None when not measured."""
    sustained_square_flops_per_s: float | None = None
    """The same GEMM's rate over the second half of min(2 s, 5% of the budget) of back-to-back calls (1 s at
    bench-gpu's default 20 s budget); over :attr:`burst_square_flops_per_s`,
    the ratio :data:`microbatch.hardware_clocks.HOPPER_BURST_TO_SUSTAINED` cites for the Hopper rows."""

    @property
    def sustained_over_burst(self) -> float | None:
        """Sustained over burst rate of the square GEMM, when both were measured."""
        b, s = self.burst_square_flops_per_s, self.sustained_square_flops_per_s
        return s / b if b and s else None

    seconds_total: float = 0.0
    """Wall seconds the whole benchmark took."""
    complete: bool = True
    """False when it was interrupted: what is here was measured, the rest was not."""
    notes: tuple[str, ...] = field(default_factory=tuple)
    """What was skipped and why."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, with ``"record": "microbench"`` (``kind``, as files before 2026-12-07 wrote it, is the envelope's
        key for a failure: a script reading ``kind`` took every result for an error)."""
        return {"record": KIND, **asdict(self)}

    def to_json(self) -> str:
        """:meth:`to_dict` as JSON text."""
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, label: str = "microbenchmark result") -> MicrobenchResult:
        """The result :meth:`to_dict` wrote (an envelope's ``result`` or the bare object), every number checked
        (:func:`_check_numbers`); ``label`` (the file) names the place in the error."""
        d = d.get("result", d) if isinstance(d.get("result"), dict) else d
        for key, value in d.items():  # each timing's numbers, before anything divides by them
            if key in ("gemms", "attention", "stream", "collectives") and isinstance(value, list):
                for i, item in enumerate(value):
                    if isinstance(item, dict):
                        _check_numbers(item, _ITEM_TYPES[key], f"{label}: {key}[{i}]")
        _check_numbers(d, MicrobenchResult, label)
        mbs = d.get("micro_batches", [])
        if not isinstance(mbs, (list, tuple)) or not all(
            is_finite_number(b) and float(b).is_integer() and b >= 1 for b in mbs
        ):
            raise ConfigError(
                f"{label}: micro_batches is {mbs!r}; it must be a list of whole numbers >= 1; give the file bench-gpu "
                "wrote, or fix it"
            )
        try:
            if not is_microbench(d):
                raise ValueError(f"record is {d.get('record', d.get('kind'))!r}, not {KIND!r}")
            rows = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}  # the envelope's keys aside
            return cls(
                **{
                    **rows,
                    "micro_batches": tuple(rows.get("micro_batches", ())),
                    "gemms": tuple(GemmTiming(**g) for g in rows.get("gemms", ())),
                    "attention": tuple(AttentionTiming(**a) for a in rows.get("attention", ())),
                    "stream": tuple(StreamTiming(**s) for s in rows.get("stream", ())),
                    "collectives": tuple(CollectiveTiming(**c) for c in rows.get("collectives", ())),
                    "notes": tuple(rows.get("notes", ())),
                }
            )
        except (TypeError, ValueError, AttributeError) as e:
            raise ConfigError(
                f"{label} is not a microbenchmark result ({type(e).__name__}: {e}); give the file bench-gpu wrote"
            ) from None

    @classmethod
    def from_json(cls, text: str) -> MicrobenchResult:
        """:meth:`from_dict` of JSON text."""
        try:
            return cls.from_dict(loads(text))
        except json.JSONDecodeError as e:
            raise ConfigError(
                f"microbenchmark result is not JSON ({e.msg.removesuffix(' at')} at line {e.lineno})"
            ) from None


_ITEM_TYPES: dict[str, type] = {
    "gemms": GemmTiming, "attention": AttentionTiming, "stream": StreamTiming, "collectives": CollectiveTiming,
}  # fmt: skip
_MAY_BE_ZERO = {
    "seq",
    "soak_s",
    "seconds_total",
    "fraction_of_peak",
    "fraction_of_bandwidth",
    "fraction_of_link",
}
"""Numeric fields that may be 0 (a file with no layer GEMMs has seq 0; bursts have soak 0); the others measure a
size, a time, a rate, a clock or a power, and are > 0."""
_SIGNED = {"overlap_slowdown"}
"""A measured slowdown: a GEMM beside an all-reduce may time a little faster than alone (noise), not -100% or less."""
_BOUNDS = {
    "launch_s_per_kernel": (1e-9, 1e-3, "> 0 and at most 1 ms (a kernel's launch takes microseconds)"),
    "overlap_slowdown": (
        -0.999,
        10.0,
        "> -1 and at most 10 (a GEMM 11x as slow beside a collective; measured on "
        "GPUs 0.05-0.3, on an oversubscribed CPU up to 2)",
    ),  # fmt: skip
    "bytes_per_s": (1e6, math.inf, "at least 1 MB/s (a memory or a link of any accelerator moves GB/s)"),
    "bus_bytes_per_s": (1e6, math.inf, "at least 1 MB/s (a link of any accelerator moves GB/s)"),
    "flops_per_s": (1e6, math.inf, "at least 1 MFLOP/s"),
    "world_size": (2, math.inf, "at least 2 (a collective over one rank moves nothing)"),
}
"""(low, high, rule) of the fields whose range is narrower than their sign: a file with a launch of a second or a
stream at kB/s planned steps of days without a word (a review, 2026-12-08)."""


def _check_numbers(d: dict[str, Any], cls: type, where: str) -> None:
    """ConfigError for a numeric field of ``cls`` in ``d`` that is not a finite JSON number of its kind (a string,
    a boolean, NaN or Infinity, a fraction for a count) or out of its range (> 0; >= 0 for :data:`_MAY_BE_ZERO`;
    > -1 for :data:`_SIGNED`), naming the field: kernel terms divide by these."""
    for f in fields(cls):
        kind = str(f.type)
        if f.name not in d or d[f.name] is None or not kind.startswith(("int", "float")):
            continue
        v, whole = d[f.name], kind.startswith("int")
        ok = is_finite_number(v)
        if ok and whole and not float(v).is_integer():
            ok = False
        if not ok:
            what = "a whole number" if whole else "a finite number"
            raise ConfigError(
                f"{where}: {f.name} is {v!r}, not {what}; give the file bench-gpu wrote, or fix the field"
            )
        zero = (
            _MAY_BE_ZERO if cls is MicrobenchResult else _MAY_BE_ZERO - {"seq"}
        )  # a timing's seq is a length
        low, rule = (-1.0, "> -1") if f.name in _SIGNED else (0.0, ">= 0") if f.name in zero else (0.0, "> 0")
        if f.name in _BOUNDS:
            low, high, rule = _BOUNDS[f.name]
            if not low <= v <= high:
                raise ConfigError(
                    f"{where}: {f.name} is {v!r}; it must be {rule}; give the file bench-gpu wrote, or fix it"
                )
        elif v < low or (v == low and rule != ">= 0"):
            raise ConfigError(
                f"{where}: {f.name} is {v!r}; it must be {rule}; "
                "give the file bench-gpu wrote, or fix the field"
            )
