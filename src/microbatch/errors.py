"""The error hierarchy.

Every error a user can cause is a :class:`ConfigError` whose message gives the value, the rule
and the fix, in one line ("global batch 500 is not divisible by micro-batch 8 × data-parallel
4 = 32; nearest valid global batches: 480, 512"). The CLI turns a ``ConfigError`` into exit
status 2 and any other :class:`MicrobatchError` into exit status 1, without a traceback.

The library speaks the caller's vocabulary: a message names a setting by its parameter (the
config field or function argument, ``micro_batch``, ``hf_config``), never by a command-line flag,
and the error carries those names in :attr:`ConfigError.params`. ``microbatch.commands._flags``
rewrites each such name into the flag of the running command (``--micro-batch``), so the CLI user
reads the flag they typed and a Python caller the argument they passed (``docs/errors.md``).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

__all__ = [
    "MicrobatchError",
    "ConfigError",
    "ScheduleError",
    "NoChoiceError",
    "MeasurementError",
    "OutOfMemoryError",
    "ProbeTimeoutError",
    "PipelineError",
    "check_positive_int",
    "whole_number",
    "plain_numbers",
    "plain_number",
    "as_tuple",
    "check_instance",
    "check_non_negative",
    "check_positive",
]


class MicrobatchError(Exception):
    """Base class of every error microbatch raises on purpose.

    ``params`` are the parameter names the message speaks of (see :class:`ConfigError`): the command
    line writes each as its flag, whatever the error's kind.
    """

    params: tuple[str, ...]

    def __init__(self, *args: object, params: Sequence[str] = ()) -> None:
        super().__init__(*args)
        self.params = tuple(params)


class ConfigError(MicrobatchError, ValueError):
    """Bad input: a value that breaks a rule. The message names the value, the rule and the fix.

    ``params`` are the parameter names the message speaks of, each written in it as a whole word
    (``ConfigError("seq 4096 is over 1024 positions; use seq 1024 or less", params=("seq",))``):
    the command line replaces each by its flag. Name only words that mean the parameter wherever
    they occur in the message.
    """


class NoChoiceError(ConfigError):
    """Points were measured, but none meets the choice's limits (a latency or memory budget): the measured points
    ride along (``points``, as each ``to_dict`` writes it) so that the caller keeps them, not loses them with the
    choice."""

    def __init__(
        self, *args: object, points: Sequence[dict[str, Any]] = (), params: Sequence[str] = ()
    ) -> None:
        super().__init__(*args, params=params)
        self.points = list(points)


class ScheduleError(ConfigError):
    """A pipeline schedule that is malformed or that cannot serve the given (p, m, v)."""


class MeasurementError(MicrobatchError):
    """A measurement that could not be made (a crashed probe, a device that vanished)."""


class ProbeTimeoutError(MeasurementError):
    """A probe ran past its time limit and was stopped (its process ended): ``micro_batch`` (None during the
    set-up) and ``timeout_s``. The search ends there with the points below it; a larger b_m takes longer."""

    PARAMS = ("probe_timeout_s", "seq")
    """The parameters its message names (the limit, and the sequence length that makes a probe long)."""

    def __init__(self, message: str, *, micro_batch: int | None, timeout_s: float) -> None:
        super().__init__(message, params=self.PARAMS)
        self.micro_batch, self.timeout_s = micro_batch, timeout_s


class OutOfMemoryError(MeasurementError):
    """A probe ran out of memory. Raised only where the caller asked for it; the tuner records it."""


class PipelineError(MicrobatchError):
    """A pipeline run failed on some rank; the message says which rank and why."""


def whole_number(value: object) -> int | None:
    """``value`` as an int when it is an integer of any kind (``int``, NumPy's, a 0-d integer tensor: whatever
    has ``__index__``), else None; a bool is not a number here, nor a one-element array (torch indexes with
    ``tensor([8])``: a count it is not)."""
    if isinstance(value, bool) or "bool" in str(getattr(value, "dtype", "")):  # a bool is not a count
        return None
    if getattr(value, "shape", ()) != ():
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]  # anything with __index__
    except TypeError:
        return None


_PLAIN = frozenset((int, float, str, bool, type(None)))


def plain_number(value: object) -> object:
    """``value`` as Python's own number when it is a number of another kind (NumPy's, a 0-d tensor); tuples
    element by element and dicts value by value; anything else unchanged."""
    kind = type(value)
    if kind in _PLAIN:
        return value
    if kind is tuple or kind is dict:
        old = list(value.values() if kind is dict else value)  # type: ignore[attr-defined, arg-type]
        new = [plain_number(v) for v in old]
        if all(a is b for a, b in zip(new, old, strict=True)):
            return value
        return dict(zip(value, new, strict=True)) if kind is dict else tuple(new)  # type: ignore[call-overload]
    dtype = str(getattr(value, "dtype", ""))
    if getattr(value, "shape", None) != () or not dtype:
        return (
            value  # not a scalar of NumPy's or torch's (a model, an array, a tensor of more than one number)
        )
    if "bool" in dtype:
        return bool(value)
    index = whole_number(value)
    if index is not None:
        return index
    if "float" in dtype:
        return float(value)  # type: ignore[arg-type]
    return value


def plain_numbers(obj: object, skip: tuple[str, ...] = ()) -> None:
    """Replace, in the frozen dataclass ``obj``, every field holding a NumPy or torch scalar (or a tuple of them)
    with Python's own ``int``, ``float`` or ``bool``: the checks that follow then see plain numbers (size caps
    test ``int``), and the object's ``to_dict`` writes JSON. Called first in each config's ``__post_init__``;
    ``skip``: fields it need not walk (a schedule's thousands of actions, checked on their own)."""
    for name, value in vars(obj).items():
        if type(value) in _PLAIN or name in skip:
            continue
        plain = plain_number(value)
        if plain is not value:
            object.__setattr__(obj, name, plain)
    _check_flags(obj)


_FLAG_TYPES = {"bool": False, "bool | None": True, "Optional[bool]": True, bool: False}
"""A dataclass field's annotation that makes it a switch, and whether None is allowed (the default's choice)."""


def _check_flags(obj: object) -> None:
    """ConfigError for a switch (a field annotated ``bool``) holding anything but True or False (or None where the
    annotation allows it): a string such as "no" or "false" read as true (flash_attention="no" priced flash
    attention, a review, 2026-12-07)."""
    import dataclasses

    if not dataclasses.is_dataclass(obj):
        return
    for f in dataclasses.fields(obj):
        optional = _FLAG_TYPES.get(f.type)  # str or type annotations
        if optional is None:
            continue
        v = getattr(obj, f.name, None)
        if isinstance(v, bool) or (v is None and optional):
            continue
        at = getattr(obj, "micro_batch", None)  # a point of a curve: which one
        raise ConfigError(
            f"{type(obj).__name__} {f.name} must be True or False{' (or None: the default)' if optional else ''}, "
            f"got {v!r}"
            + (f" at micro_batch {at}" if isinstance(at, int) else "")
            + (" (a string such as 'no' would read as true)" if isinstance(v, str) else ""),
            params=(f.name,),
        )


def as_tuple(name: str, value: object) -> tuple[Any, ...] | None:
    """A config's field of choices as a tuple: None stays None (every choice), one value (a name, a number)
    becomes a tuple of it — ``schedules="1f1b"`` is ``("1f1b",)``, not five one-letter names — and a list or
    another iterable its tuple; anything else a :class:`ConfigError`."""
    if value is None or isinstance(value, tuple):
        return value
    if isinstance(value, str | bytes) or whole_number(value) is not None or isinstance(value, float):
        return (value,)
    if isinstance(value, list | range):
        return tuple(value)
    if getattr(value, "ndim", None) == 1 and callable(getattr(value, "tolist", None)):
        return tuple(value.tolist())  # type: ignore[attr-defined]  # a NumPy array or a tensor of choices
    if isinstance(value, set | frozenset):
        return tuple(
            sorted(value, key=repr)
        )  # one order whatever the hash seed: ties between choices stay put
    raise ConfigError(
        f"{name} must be a tuple of choices (or one choice), got {value!r}; give e.g. {name}=(a, b) or {name}=a",
        params=_param(name),
    )


def check_instance(name: str, value: object, kind: type, fix: str) -> None:
    """ConfigError unless ``value`` is a ``kind`` (a name or a dict where a config object belongs failed deep inside,
    naming an attribute the caller never wrote): the message names the parameter, the value and ``fix``."""
    if not isinstance(value, kind):
        article = "an" if kind.__name__[:1] in "AEIOU" else "a"
        raise ConfigError(
            f"{name} must be {article} {kind.__name__}, got {value!r}; {fix}", params=_param(name)
        )


def check_positive_int(name: str, value: object, *, fix: str = "") -> int:
    """Return ``value`` as an int if it is a whole number >= 1 (:func:`whole_number`), else raise
    :class:`ConfigError`."""
    v = whole_number(value)
    if v is None or v < 1:
        tail = f"; {fix}" if fix else f"; give {name} a whole number of 1 or more"
        raise ConfigError(f"{name} must be a whole number >= 1, got {value!r}{tail}", params=_param(name))
    return v


def check_non_negative(name: str, value: float, *, fix: str = "") -> float:
    """Return ``value`` as a float if it is finite and >= 0, else raise :class:`ConfigError`."""
    return _check_number(name, value, strict=False, fix=fix)


def check_positive(name: str, value: float, *, fix: str = "") -> float:
    """Return ``value`` as a float if it is finite and > 0, else raise :class:`ConfigError`."""
    return _check_number(name, value, strict=True, fix=fix)


def _check_number(name: str, value: float, *, strict: bool, fix: str) -> float:
    import math

    try:
        if isinstance(value, bool | str | bytes) or "bool" in str(getattr(value, "dtype", "")):
            raise TypeError  # True is not 1 byte (nor NumPy's True), "80e9" not a figure: say so here
        v = float(value)
    except (TypeError, ValueError):
        tail = f"; {fix}" if fix else "; give it as a number"
        raise ConfigError(f"{name} must be a number, got {value!r}{tail}", params=_param(name)) from None
    if not math.isfinite(v) or v < 0 or (strict and v == 0):
        tail = f"; {fix}" if fix else ""
        raise ConfigError(
            f"{name} must be a finite number {'>' if strict else '>='} 0, got {value!r}{tail}",
            params=_param(name),
        )
    return v


def _param(name: str) -> tuple[str, ...]:
    """``(name,)`` when ``name`` is a parameter's name (an identifier), else ``()`` (a phrase)."""
    return (name,) if name.isidentifier() else ()
