"""The field checks every reader of a result file applies to a value: a number, a whole number, a
number > 0, a flag, a yes/no (:mod:`microbatch.records` hands them on with the readers).

Each raises :class:`~microbatch.errors.ConfigError` naming the value. Core: no torch, no layer above.
"""

from __future__ import annotations

import math
from typing import Any

from microbatch.errors import ConfigError

__all__ = [
    "MAX_EXACT_WHOLE",
    "is_finite_number",
    "number",
    "short_repr",
    "positive",
    "flag",
    "true_or_false",
    "whole_key",
]


def is_finite_number(v: Any) -> bool:
    """Whether ``v`` is a JSON number as read: an int or float, not a bool, finite (Python's json reads the
    non-standard NaN and Infinity literals). No strings: a file's number is checked as written."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def number(v: Any, *, what: str = "value", whole: bool = False) -> float | None:
    """``v`` as a finite float (a whole one with ``whole``); None for None or ``""``.

    Numeric strings are accepted (CSV cells). Raises :class:`ConfigError` naming the value.
    """
    if v is None or v == "":
        return None
    named = "" if what == "value" else f"{what} "
    if isinstance(v, bool):
        raise ConfigError(f"{named}{v!r} is not a number; write the number itself")
    try:
        f = float(v)
    except OverflowError:  # an int past the largest float (~1.8e308)
        raise ConfigError(
            f"{what} {short_repr(v)} is past the largest float (~1.8e308); check the file"
        ) from None
    except (TypeError, ValueError):
        hint = "; write numbers without thousands separators" if isinstance(v, str) and "," in v else ""
        raise ConfigError(f"{named}{short_repr(v)} is not a number{hint}") from None
    if whole and math.isfinite(f) and max(abs(f), abs(v) if isinstance(v, int) else 0) > MAX_EXACT_WHOLE:
        raise ConfigError(
            f"{what} {short_repr(v)} is over 2^53 = {MAX_EXACT_WHOLE:,}, past which a number is not held exactly (it "
            f"would be read as {f:.17g}); no real {what} is that large: check the file"
        )
    if whole and (not math.isfinite(f) or f != int(f)):
        raise ConfigError(f"{what} {short_repr(v)} must be a whole number >= 1")
    if not math.isfinite(f):
        raise ConfigError(f"{what} {v!r} must be finite" if what != "value" else f"{v!r} must be finite")
    return f


MAX_EXACT_WHOLE = 2**53
"""The largest whole number every larger one of which a float (IEEE 754 double, 53-bit significand)
cannot hold exactly: a count read past it would be silently rounded."""


def short_repr(v: Any) -> str:
    """``v`` for a message: its repr, or for a number of more than 20 digits its magnitude (a value of
    10^300 is not spelt out in 301 digits)."""
    text = repr(v)
    if isinstance(v, int) and not isinstance(v, bool) and len(text) > 20:
        return f"{float(v):.3g}" if abs(v) < 10**308 else f"a {len(text.lstrip('-'))}-digit number"
    return text if len(text) <= 60 else text[:57] + "..."


def whole_key(source: str, key: str, v: Any, *, minimum: int = 1, params: tuple[str, ...] = ()) -> int:
    """A config file's count ``key`` as written: a JSON whole number from ``minimum`` to :data:`MAX_EXACT_WHOLE`.

    Raises :class:`ConfigError` "``source``: ``key`` is ``v``, not a whole number in minimum..2^53" and the fix (a
    quoted number: write it as a JSON number)."""
    if isinstance(v, int) and not isinstance(v, bool) and minimum <= v <= MAX_EXACT_WHOLE:
        return v
    if isinstance(v, str) and v.strip().isdigit():
        fix = f'write it as a JSON number: "{key}": {int(v)}'
    elif isinstance(v, int) and not isinstance(v, bool) and v > MAX_EXACT_WHOLE:
        fix = "no real model is that large: check the file"
    else:
        fix = f"give {key} as a whole number >= {minimum}, or take the key out for the family's default"
    raise ConfigError(
        f"{source}: {key} is {short_repr(v)}, not a whole number in {minimum}..2^53; {fix}", params=params
    )


def positive(v: Any, *, where: str) -> float | None:
    """``v`` as a float > 0 (a JSON number, not a string); None for None.

    Raises :class:`ConfigError` "``where`` ``v`` must be a number > 0".
    """
    if v is None:
        return None
    try:
        f = float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan
    except OverflowError:  # an int past the largest float (~1.8e308)
        f = math.inf
    if not math.isfinite(f) or f <= 0:
        raise ConfigError(f"{where} {short_repr(v)} must be a number > 0, and finite")
    return f


def flag(v: Any) -> bool | None:
    """A setting written as a flag: ``True``/``"on"``/``"full"`` → True, ``False``/``"off"``/``"none"`` →
    False, anything else (``"auto"``, missing) → None."""
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.strip().lower() in ("on", "true", "yes", "1", "full"):
        return True
    if isinstance(v, str) and v.strip().lower() in ("off", "false", "no", "0", "none"):
        return False
    return None


def true_or_false(v: Any, *, where: str) -> bool:
    """A yes/no field (``oom``): a bool, 0/1, or ``"true"``/``"false"``/``"yes"``/``"no"``/``""``.

    Raises :class:`ConfigError` "``where`` ``v`` must be true or false" for anything else.
    """
    if isinstance(v, bool):
        return v
    if v is None or (isinstance(v, str) and v.strip().lower() in ("", "0", "false", "no")) or v == 0:
        return False
    if (isinstance(v, str) and v.strip().lower() in ("1", "true", "yes")) or v == 1:
        return True
    raise ConfigError(f"{where} {v!r} must be true or false")
