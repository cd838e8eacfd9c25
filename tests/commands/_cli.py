"""The command line run in-process, for the command tests: exit code, stdout and stderr, or the
``--json`` object with its envelope checked."""

from __future__ import annotations

import json
from typing import Any

import microbatch
from microbatch.cli import main


def run(args: list[str], capsys: Any) -> tuple[int, str, str]:
    """Exit code, stdout and stderr of ``microbatch ARGS``."""
    code = main(args)
    out = capsys.readouterr()
    return code, out.out, out.err


def run_json(args: list[str], capsys: Any, command: str | None = None) -> dict[str, Any]:
    """``microbatch ARGS --json``: exit 0, one object whose envelope names the command and the
    version first; the object."""
    code, out, err = run([*args, "--json"], capsys)
    assert code == 0, err
    d = json.loads(out)
    assert list(d)[:2] == ["command", "version"]
    assert d["command"] == (command or args[0]) and d["version"] == microbatch.__version__
    return d
