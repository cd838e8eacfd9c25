"""The README's quoted output of every deterministic command equals what the command prints now.

A README block is a shell transcript: ``$ microbatch ...`` lines (a trailing backslash continues one) and the output
quoted under each. The commands that compute without measuring (batch, bubble, simulate, memory, plan, export) are
run in-process from a temporary folder, ``> file`` written there, and the quoted lines compared with stdout and
stderr together: a line ``...`` elides, so the quoted pieces must appear in order, the first at the start. A review
found the ``plan`` table three rows stale after the rows were settled on the simulator (2026-12-07); nothing had
compared it."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from tests.commands._cli import run

README = Path(__file__).resolve().parents[2] / "README.md"
DETERMINISTIC = {"batch", "bubble", "simulate", "memory", "plan", "export"}


def transcripts(text: str) -> list[tuple[int, list[tuple[str, list[str]]]]]:
    """(line of the fence, [(command, quoted output lines)]) of each fenced block that starts with ``$ microbatch``."""
    lines, out, i = text.splitlines(), [], 0
    while i < len(lines):
        if lines[i].strip() == "```" and i + 1 < len(lines) and lines[i + 1].startswith("$ microbatch "):
            start, j, steps = i + 1, i + 1, []
            while j < len(lines) and lines[j].strip() != "```":
                if lines[j].startswith("$ "):
                    cmd = lines[j][2:]
                    while cmd.rstrip().endswith("\\"):
                        j += 1
                        cmd = cmd.rstrip()[:-1] + " " + lines[j].strip()
                    steps.append((cmd, []))
                else:
                    steps[-1][1].append(lines[j])
                j += 1
            out.append((start, steps))
            i = j
        i += 1
    return out


def _pieces(quoted: list[str]) -> list[list[str]]:
    """The quoted lines split at ``...`` lines, trailing blank lines dropped."""
    pieces: list[list[str]] = [[]]
    for line in quoted:
        if line.strip() == "...":
            pieces.append([])
        else:
            pieces[-1].append(line.rstrip())
    for p in pieces:
        while p and not p[-1]:
            p.pop()
    return pieces


def matches(quoted: list[str], actual: list[str]) -> str | None:
    """None when ``quoted`` (with ``...`` elisions) is found in ``actual`` in order, the first piece at the start and,
    unless the quote ends in ``...``, the last at the end; else the first quoted line not found there (or what the
    command prints past the quote's end)."""
    actual = list(actual)
    while actual and not actual[-1]:
        actual.pop()
    pieces = _pieces(quoted)
    at = 0
    for k, piece in enumerate(pieces):
        if not piece:
            continue
        n = len(piece)
        found = [s for s in range(at, len(actual) - n + 1) if actual[s : s + n] == piece]
        if k == 0 and (not found or found[0] != 0):
            return next((q for q, a in zip(piece, actual + [""] * n, strict=False) if q != a), piece[0])
        if not found:
            return next((q for q in piece if q not in actual[at:]), piece[0])
        at = found[0] + n
        if k == len(pieces) - 1 and found[-1] + n < len(actual):  # the quote's last line is the output's last
            return f"(the quote ends before the output does: {actual[found[-1] + n]!r} follows)"
    return None


BLOCKS = [
    (line, steps)
    for line, steps in transcripts(README.read_text(encoding="utf-8"))
    if all(shlex.split(cmd, comments=True)[1] in DETERMINISTIC for cmd, _ in steps)
]


def test_the_transcripts_are_found():
    text = "```\n$ microbatch batch -B 8 \\\n    -b 2\nB = 8\n...\nend\n$ microbatch bubble -p 2\nx\n```\n"
    assert transcripts(text) == [
        (1, [("microbatch batch -B 8  -b 2", ["B = 8", "...", "end"]), ("microbatch bubble -p 2", ["x"])])
    ]
    assert matches(["B = 8", "...", "end"], ["B = 8", "a", "b", "end"]) is None
    assert matches(["B = 8", "...", "end"], ["B = 9", "end"]) == "B = 8"
    assert (
        matches(["a", "...", "c"], ["a", "b", "c", ""]) is None
        and matches(["a", "...", "d"], ["a", "c"]) == "d"
    )
    assert matches(["a", "...", "c"], ["a", "c", "b"]).startswith(
        "(the quote ends before"
    )  # a line the quote lacks
    assert matches(["a", "b", "..."], ["a", "b", "c"]) is None  # an open end
    assert len(BLOCKS) >= 6, "README.md lost its command transcripts (or the fences changed)"


@pytest.mark.parametrize(("line", "steps"), BLOCKS, ids=[f"README.md:{b[0]}" for b in BLOCKS])
def test_the_readme_shows_what_the_command_prints(line, steps, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MICROBATCH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("COLUMNS", "200")
    for cmd, quoted in steps:
        args = shlex.split(cmd, comments=True)[1:]
        target = None
        if ">" in args:
            k = args.index(">")
            args, target = args[:k], args[k + 1]
        code, out, err = run(args, capsys)
        assert code == (2 if any(q.startswith("error:") for q in quoted) else 0), (
            line,
            cmd,
            code,
            err[-500:],
        )
        if target is not None:
            (tmp_path / target).write_text(out, encoding="utf-8")
        actual = [x.rstrip() for x in (out + err).splitlines()]
        miss = matches(quoted, actual)
        assert miss is None, (
            f"README.md:{line} `{cmd}` (exit {code}) does not print:\n{miss}\nit prints:\n"
            + "\n".join(actual)
        )
