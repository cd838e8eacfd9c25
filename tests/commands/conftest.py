"""Fixtures the command tests share."""

from __future__ import annotations

import pytest

from tests.commands._cli import run


@pytest.fixture
def plan_json(tmp_path, capsys, monkeypatch):
    """A folder, made the working one, holding a gpt2 plan as ``plan.json`` and an empty folder ``t``."""
    monkeypatch.chdir(tmp_path)
    code, out, _ = run(["plan", "--model", "gpt2", "--gpu", "a100-80gb", "-B", "64", "--json"], capsys)
    assert code == 0
    (tmp_path / "plan.json").write_text(out, encoding="utf-8")
    (tmp_path / "t").mkdir()
    return tmp_path
