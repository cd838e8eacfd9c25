"""One option given twice with two values (``-p 4 --pipeline-parallel 2``, ``--stages 3 -p 2``,
``--flash-attention --no-flash-attention``): click keeps the last silently; the command line is refused before any
work, naming both. Read from the command's own click options, so every alias of every option is known; values are
compared as the option converts them (``-p 4 -p 04`` is one value)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import click

from microbatch.errors import ConfigError

__all__ = ["check_repeated_options"]


def _spellings(
    command: click.Command,
) -> tuple[dict[str, click.Option], dict[str, tuple[click.Option, bool]]]:
    """(each spelling of an option that takes one value, each spelling of an on/off pair with the value it sets); not
    a repeatable's, a count's, nor a lone flag's (given twice, it says the same)."""
    values: dict[str, click.Option] = {}
    pairs: dict[str, tuple[click.Option, bool]] = {}
    for p in command.params:
        if not isinstance(p, click.Option) or p.multiple or p.count:
            continue
        if not p.is_flag:
            values.update({o: p for o in p.opts})
        elif p.secondary_opts:
            pairs.update({o: (p, True) for o in p.opts} | {o: (p, False) for o in p.secondary_opts})
    return values, pairs


def _same(option: click.Option, a: str, b: str) -> bool:
    """Whether two words give ``option`` one value: equal as written, as its type converts them, or, for a schedule,
    as one schedule by its name or an alias (``interleaved``, ``interleaved-1f1b``, ``GPipe``)."""
    if a == b:
        return True
    if "schedule" in (option.name or ""):
        from microbatch.schedules.registry import get_spec

        try:
            if get_spec(a) is get_spec(b):
                return True
        except ConfigError:  # an unknown name: the command itself says so
            pass
    try:
        return bool(option.type.convert(a, option, None) == option.type.convert(b, option, None))
    except (click.BadParameter, ValueError, TypeError):
        return False


def check_repeated_options(command: click.Command, args: Sequence[str]) -> None:
    """ConfigError when ``args`` (the words after the command's name) give one option two different values."""
    if "--help" in args or "-h" in args:
        return  # the help is asked for: it answers whatever else the line says
    values, pairs = _spellings(command)
    seen: dict[str, tuple[str, Any]] = {}
    i = 0
    while i < len(args) and args[i] != "--":
        word, value = args[i], None  # type: str, str | bool | None
        key, eq, rest = word.partition("=")
        if key.startswith("--") and eq:
            word, value = key, rest
        elif not word.startswith("--") and word[:2] in values and len(word) > 2:  # -p4
            word, value = word[:2], word[2:]
        option: click.Option | None = None
        if word in values:
            option = values[word]
            if value is None:
                i += 1
                value = args[i] if i < len(args) else ""
        elif word in pairs:
            option, value = pairs[word]
        if option is not None:
            name = option.name or word
            first = seen.setdefault(name, (word, value))
            alike = first[1] == value if isinstance(value, bool) else _same(option, str(first[1]), str(value))
            if not alike:
                said = [w if isinstance(v, bool) else f"{w} {v}" for w, v in (first, (word, value))]
                raise ConfigError(
                    f"{said[0]} and {said[1]} both set one option (two spellings of it, or given twice); the last "
                    "would win silently: give it once"
                )
        i += 1
