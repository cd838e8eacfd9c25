"""One option given twice with two values (``-p 4 --pipeline-parallel 2``, ``--stages 3 -p 2``): click keeps the last
silently; the command line is refused before any work, naming both. Read from the command's own click options, so
every alias of every option is known."""

from __future__ import annotations

from collections.abc import Sequence

import click

from microbatch.errors import ConfigError

__all__ = ["check_repeated_options"]


def _value_options(command: click.Command) -> dict[str, click.Option]:
    """Each spelling (``-p``, ``--stages``) of the command's options that take one value, not a flag's or a
    repeatable's."""
    out: dict[str, click.Option] = {}
    for p in command.params:
        if isinstance(p, click.Option) and not (p.is_flag or p.multiple or p.count):
            out.update({o: p for o in p.opts})
    return out


def check_repeated_options(command: click.Command, args: Sequence[str]) -> None:
    """ConfigError when ``args`` (the words after the command's name) give one option two different values."""
    opts = _value_options(command)
    seen: dict[str, tuple[str, str]] = {}
    i = 0
    while i < len(args) and args[i] != "--":
        word, value = args[i], None
        key, eq, rest = word.partition("=")
        if key.startswith("--") and eq:
            word, value = key, rest
        elif not word.startswith("--") and word[:2] in opts and len(word) > 2:  # -p4
            word, value = word[:2], word[2:]
        if word in opts:
            if value is None:
                i += 1
                value = args[i] if i < len(args) else ""
            name = opts[word].name or word
            first = seen.setdefault(name, (word, value))
            if first[1] != value:
                raise ConfigError(
                    f"{first[0]} {first[1]} and {word} {value} both set {name} (one option, two spellings or given "
                    "twice); the last would win silently: give it once"
                )
        i += 1
