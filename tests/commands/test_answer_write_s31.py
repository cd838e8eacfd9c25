"""An interrupt while the answer is written (a helper's review, 2026-12-07): a Ctrl-C landing while a large JSON
answer filled a slow reader's pipe cut it short and the error envelope was written after the part, so stdout
parsed as nothing. The answer is now written whole under a held interrupt (a second one stops it), by ``os.write``:
Python's buffered stream drops the rest of a write a returning signal handler interrupts (measured: 81,920 of
1,000,000 bytes, no error)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

CHILD = r"""
import json, sys
from microbatch.commands._answer import emit
from microbatch.commands import _answer as _common
_common.command_name = lambda: "bubble"
sys.stderr.write("writing\n"); sys.stderr.flush()
emit({"rows": [[i, "x" * 40] for i in range(40000)]}, True, lambda: "")
sys.stderr.write("written\n")
"""


@pytest.mark.timeout(60)
def test_a_ctrl_c_while_the_answer_fills_a_pipe_leaves_it_whole():
    p = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stderr is not None and p.stdout is not None
    assert p.stderr.readline() == b"writing\n"
    time.sleep(1.0)  # the pipe is full: the write blocks
    p.send_signal(signal.SIGINT)
    out = p.stdout.read()
    p.wait(timeout=30)
    d = json.loads(out)  # one whole object
    assert len(d["rows"]) == 40000 and d["command"] == "bubble"
    assert p.returncode == 0 and b"written" in p.stderr.read()


def test_no_error_envelope_after_part_of_an_answer(monkeypatch, capsys):
    """A second Ctrl-C (or a failure) after the answer began: the error goes to stderr only; a later command in the
    same process writes its own error envelope again."""
    from microbatch.cli import main
    from microbatch.commands import _answer as _common

    def cut(text: str) -> None:
        sys.stdout.write(text[:100])
        raise KeyboardInterrupt

    monkeypatch.setattr(_common, "_write_answer", cut)
    assert main(["bubble", "-p", "4", "-m", "8", "--json"]) == 130
    out = capsys.readouterr().out
    assert out.count('"command"') == 1 and len(out) == 100  # the part, and no second object after it
    monkeypatch.undo()
    assert main(["bubble", "-p", "0", "-m", "8", "--json"]) == 2
    assert json.loads(capsys.readouterr().out)["kind"] == "bad_input"
