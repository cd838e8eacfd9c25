"""Units: the one byte formatter, the one size parser and the one short-number formatter.

Binary prefixes (KiB, MiB, GiB = 2**30 bytes) for memory, as allocators and ``nvidia-smi``
report it; decimal ones (kB, MB, GB) are accepted on input.
"""

from __future__ import annotations

import math

from microbatch.errors import ConfigError

__all__ = ["GIB", "MIB", "parse_bytes", "format_bytes", "format_count", "format_number"]

KIB = 2**10
MIB = 2**20
GIB = 2**30

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": KIB,
    "mib": MIB,
    "gib": GIB,
    "tib": 2**40,
    "k": KIB,
    "m": MIB,
    "g": GIB,
    "t": 2**40,
}


MAX_BYTES = 2**60
"""The largest size :func:`parse_bytes` takes: 1 EiB, ~7,000× the 141 GB of the largest GPU in the table (H200) and
past any host's memory; a larger one is a typo, and its arithmetic runs past float's range (1e308 bytes)."""


def parse_bytes(text: str | int | float, *, name: str = "memory budget") -> int:
    """Bytes in ``"12GiB"``, ``"500MB"``, ``"1.5g"`` (binary for the one-letter forms) or a plain number.

    Raises :class:`ConfigError` naming ``name``, the value and the accepted forms.
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value, unit = float(text), ""
    else:
        s = str(text).strip().lower().replace(" ", "")
        i = len(s)
        while i > 0 and s[i - 1].isalpha():
            i -= 1
        num, unit = s[:i], s[i:]
        try:
            value = float(num)
        except ValueError:
            value = float("nan")
    if unit in _UNITS and math.isfinite(value) and value <= 0:
        raise ConfigError(
            f"{name} {text!r} is not above zero; give a positive size, e.g. 12GiB, 500MB or 2e9"
        )
    if unit not in _UNITS or not math.isfinite(value):
        raise ConfigError(
            f"{name} {text!r} is not a size; give a positive number with a unit, e.g. 12GiB, 500MB or 2e9"
        )
    if value * _UNITS[unit] < 1:
        raise ConfigError(f"{name} {text!r} is less than one byte; give a size, e.g. 12GiB, 500MB or 2e9")
    if not math.isfinite(value * _UNITS[unit]) or value * _UNITS[unit] > MAX_BYTES:
        raise ConfigError(
            f"{name} {text!r} is past any device's memory (more than 1 EiB); give a size, e.g. 12GiB, 500MB or 2e9"
        )
    return int(value * _UNITS[unit])


def format_bytes(n: float | None, *, digits: int = 2, unit: str | None = None) -> str:
    """``n`` bytes as text: ``"1.50 GiB"``, ``"12.0 MiB"``; ``"—"`` for None.

    ``unit`` fixes the unit (``"GiB"``, ``"MiB"``, ``"KiB"``, ``"B"``); by default the largest
    binary unit that keeps the number at or above 1.
    """
    if n is None:
        return "—"
    scales = {"GiB": GIB, "MiB": MIB, "KiB": KIB, "B": 1}
    if unit is None:
        unit = next((u for u, s in scales.items() if abs(n) >= s), "B")
    if unit not in scales:
        raise ValueError(f"unit {unit!r} is not one of {', '.join(scales)}")
    if unit == "B":
        return f"{n:.0f} B"
    return f"{n / scales[unit]:.{digits}f} {unit}"


def format_number(x: float) -> str:
    """Short number: integers without decimals (below 10**15), else 4 significant digits;
    ``"inf"``, ``"-inf"`` and ``"nan"`` for the non-finite."""
    if not math.isfinite(x):
        return str(float(x))  # "inf", "-inf", "nan"
    if abs(x) < 1e15 and abs(x - round(x)) < 1e-9:
        return str(int(round(x)))
    return f"{x:.4g}"


def format_signed_pct(pct: float) -> str:
    """A signed percentage (``pct`` in percent): ``"+3.4%"``; from ±100,000% on in powers of ten (``"+2.96e+299%"``,
    not 300 digits), as is the non-finite (``"+inf%"``, ``"+nan%"``)."""
    if math.isfinite(pct) and abs(pct) < 1e5:
        return f"{pct:+.1f}%"
    return f"{pct:+.3g}%"


def format_count(n: int) -> str:
    """A parameter count as text: ``"6.74 B"``, ``"124.4 M"``, ``"136,960"``."""
    if n >= 1e9:
        return f"{n / 1e9:.2f} B"
    if n >= 1e6:
        return f"{n / 1e6:.1f} M"
    return f"{n:,}"
