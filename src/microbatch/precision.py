"""The one table of training precisions: every layer reads its names and rules here.

A precision names the numerics of a training step: half-precision compute with fp32 master
weights (``bf16-mixed``, ``fp16-mixed``; Micikevicius et al. 2018, "Mixed Precision
Training") or fp32 throughout. Byte counts per parameter follow ZeRO §3.1 (Rajbhandari et al.
2020: 2 + 2 + 12 = 16 B with Adam under mixed precision).
"""

from __future__ import annotations

from dataclasses import dataclass

from microbatch.errors import ConfigError

__all__ = ["Precision", "PRECISIONS", "MEASURABLE", "get_precision", "check_precision"]


@dataclass(frozen=True, kw_only=True)
class Precision:
    """One training precision."""

    name: str
    """The name used by every command and config (``bf16-mixed``)."""
    compute_dtype: str
    """The dtype the GEMMs run in, as the roofline and the accelerator table name it."""
    weight_bytes: int
    """Bytes per parameter of the weights used in compute (2 for half, 4 for fp32)."""
    master_copy: bool
    """Whether an fp32 master copy of the weights is kept (mixed precision)."""
    measurable: bool
    """Whether the probes can run it on this code path (torch autocast on CPU and CUDA)."""
    description: str
    """One line for ``--help``."""


PRECISIONS: dict[str, Precision] = {
    p.name: p
    for p in (
        Precision(
            name="bf16-mixed",
            compute_dtype="bf16",
            weight_bytes=2,
            master_copy=True,
            measurable=True,
            description="bfloat16 compute, fp32 master weights",
        ),
        Precision(
            name="fp16-mixed",
            compute_dtype="fp16",
            weight_bytes=2,
            master_copy=True,
            measurable=False,
            description="float16 compute with loss scaling, fp32 master weights",
        ),
        Precision(
            name="fp32",
            compute_dtype="fp32",
            weight_bytes=4,
            master_copy=False,
            measurable=True,
            description="fp32 throughout",
        ),
    )
}
"""Every precision the planner knows, by name."""

MEASURABLE: tuple[str, ...] = tuple(n for n, p in PRECISIONS.items() if p.measurable)
"""The precisions a probe can measure (``tune``, ``validate``)."""


def get_precision(name: str, *, measurable: bool = False, what: str = "precision") -> Precision:
    """The precision called ``name``; ``measurable=True`` also requires that probes can run it.

    Raises :class:`ConfigError` naming the value and the choices.
    """
    allowed = MEASURABLE if measurable else tuple(PRECISIONS)
    if name not in allowed:
        extra = " (fp16-mixed is planned but not measured)" if measurable and name in PRECISIONS else ""
        raise ConfigError(f"{what} {name!r} is not known{extra}; use one of {', '.join(allowed)}")
    return PRECISIONS[name]


def check_precision(name: str, *, measurable: bool = False, what: str = "precision") -> str:
    """``name`` if it is a known (and, with ``measurable``, measurable) precision; else ConfigError."""
    return get_precision(name, measurable=measurable, what=what).name
