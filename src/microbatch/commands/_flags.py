"""Parameter names → command-line flags: the one place where a library message becomes a CLI one.

The library names a setting by its parameter (``micro_batch``, ``hf_config``) and lists those names in
:attr:`microbatch.errors.ConfigError.params`; :func:`cli_message` writes each as the flag of the
running command (``--micro-batch``, ``--hf-config``), so the user reads the flag they typed. The flag
comes from the command's own click options (the option whose destination is the parameter), then
from :data:`PARAM_DESTS` where a command stores a parameter under another name, then from the
parameter's name with dashes (``cpu_peak_gflops`` → ``--cpu-peak-gflops``).
"""

from __future__ import annotations

import functools
import importlib
import re
from collections.abc import Sequence

from microbatch.errors import MicrobatchError

__all__ = ["PARAM_DESTS", "PARAM_VALUES", "flag_for", "cli_message", "cli_text", "command_flags"]

PARAM_DESTS: dict[str, str] = {
    "memory_budget_bytes": "memory_budget",
    "flash_attention": "flash",
    "schedule": "schedule_name",
    "shape": "model",
    "memory_key": "memory",
    "micro_batches": "micro_batch",
    "virtuals": "virtual",
    "schedules": "schedule",
}
"""Library parameter → the click destination of the flag that sets it, where the names differ
(``ChoiceConfig.memory_budget_bytes`` is set by ``--memory-budget 12GiB``)."""

PARAM_VALUES: dict[str, dict[str, str]] = {
    "memory_key": {"peak_memory_bytes": "peak", "peak_allocated_bytes": "allocated"},
}
"""Library parameter → its values → the flag's words for them, where the two differ: a message's
``memory_key 'peak_memory_bytes'`` is ``--memory peak`` on the command line."""


@functools.cache
def command_flags(command: str | None) -> dict[str, str]:
    """Click destination → first long flag of every option of ``command`` (empty for None or an
    unknown command). Imports the command's module (already imported when it ran)."""
    if command is None or not command.isidentifier() or command.startswith("_"):
        return {}
    try:  # each command lives in the module of its name (microbatch.cli.COMMANDS)
        cmd = importlib.import_module(f"microbatch.commands.{command}").cmd
    except (ImportError, AttributeError):
        return {}
    out: dict[str, str] = {}
    for p in cmd.params:
        longs = [o for o in getattr(p, "opts", ()) if o.startswith("--")]
        if p.name and longs:
            out[p.name] = longs[0]
    return out


def flag_for(param: str, command: str | None = None) -> str:
    """The flag of ``command`` that sets the library parameter ``param`` (``--`` and the name
    with dashes when the command has no such option)."""
    flags, dest = command_flags(command), PARAM_DESTS.get(param, param)
    return flags.get(dest) or flags.get(param) or "--" + dest.replace("_", "-")


def cli_message(error: MicrobatchError, command: str | None = None) -> str:
    """``error``'s message with each of its :attr:`~microbatch.errors.ConfigError.params` written as
    ``command``'s flag (:func:`cli_text`)."""
    return cli_text(str(error), getattr(error, "params", ()), command)


def cli_text(text: str, params: Sequence[str], command: str | None = None) -> str:
    """``text`` with each of ``params`` written as ``command``'s flag: every whole-word occurrence, not
    one that is part of a longer name, an attribute (``shape.seq``), a path (``/data/seq/``), a quoted
    value (``'seq'``), a possessive (``model's``) or a keyword (``use_cache=False``); a value of
    :data:`PARAM_VALUES` after it (``memory_key 'peak_memory_bytes'``) becomes the flag's word."""
    before, after = r"(?<![\w.\-/\\'\"])", r"(?![\w\-/\\'\"=])"
    for param in sorted(params, key=len, reverse=True):
        flag = flag_for(param, command)
        for value, word in PARAM_VALUES.get(param, {}).items():
            text = re.sub(rf"{before}{re.escape(param)} '{re.escape(value)}'", f"{flag} {word}", text)
        text = re.sub(rf"{before}{re.escape(param)}{after}", flag, text)
    return text
