"""Every ```python block of README.md runs as written.

Each block runs alone, in a fresh interpreter (a subprocess with a timeout, the checkout's package
first on the path, the tuner's cache in a temporary folder), from a temporary folder. A block that
cannot run here is marked by an HTML comment on the line right before its fence,
``<!-- readme-test: skip (the reason) -->``; the reason is required and the skips are counted, so a
new skip is a decision, not an accident.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
SKIP = re.compile(r"<!--\s*readme-test:\s*skip\s*\((?P<why>[^)]+)\)\s*-->")
MAX_SKIPS = 2
"""The blocks that may be skipped: fragments of the user's own framework loops (their trainer, module
and loop bodies are theirs; tests/integrations/ runs each integration on a real loop)."""


def python_blocks(text: str) -> list[tuple[int, str, str | None]]:
    """(line of the fence, code, the skip reason or None) of every ```python block in ``text``."""
    lines = text.splitlines()
    blocks = []
    i = 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            start = i
            j = i + 1
            while j < len(lines) and lines[j].strip() != "```":
                j += 1
            before = next((lines[k] for k in range(start - 1, -1, -1) if lines[k].strip()), "")
            m = SKIP.search(before)
            blocks.append(
                (start + 1, "\n".join(lines[start + 1 : j]) + "\n", m["why"].strip() if m else None)
            )
            i = j
        i += 1
    return blocks


BLOCKS = python_blocks(README.read_text(encoding="utf-8"))


def test_the_extractor_finds_blocks_and_skips():
    text = "x\n```python\na = 1\n```\n<!-- readme-test: skip (needs torchrun) -->\n\n```python\nb = 2\n```\n"
    assert python_blocks(text) == [(2, "a = 1\n", None), (7, "b = 2\n", "needs torchrun")]
    assert len(BLOCKS) >= 4, "README.md lost its Python blocks (or the fences changed)"
    skipped = [why for _, _, why in BLOCKS if why is not None]
    assert len(skipped) <= MAX_SKIPS, f"more README blocks skipped than allowed: {skipped}"
    assert all(len(why) >= 15 for why in skipped), "each skip says why"


@pytest.mark.parametrize(("line", "code", "skip"), BLOCKS, ids=[f"README.md:{b[0]}" for b in BLOCKS])
def test_readme_block_runs(line, code, skip, tmp_path):
    if skip is not None:
        pytest.skip(f"README.md:{line}: {skip}")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(x for x in (str(ROOT / "src"), os.environ.get("PYTHONPATH", "")) if x),
        "MICROBATCH_CACHE_DIR": str(tmp_path / "cache"),
        "OMP_NUM_THREADS": "1",
    }
    script = tmp_path / f"readme_{line}.py"
    script.write_text(code, encoding="utf-8")
    try:
        r = subprocess.run(
            [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"README.md:{line}: the block ran past 120 s")
    assert r.returncode == 0, f"README.md:{line} failed (exit {r.returncode}):\n{r.stderr[-3000:]}"
