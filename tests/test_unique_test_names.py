"""Test modules have unique basenames: the suite runs without __init__.py packages (pytest's rootdir imports), where
two tests/<dir>/test_x.py collide at collection ("import file mismatch"); CI failed on one pair (2026-12-07)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_no_two_test_modules_share_a_basename():
    names = Counter(p.name for p in TESTS.rglob("test_*.py") if "__pycache__" not in p.parts)
    assert not [n for n, k in names.items() if k > 1], sorted(n for n, k in names.items() if k > 1)
    assert names["test_unique_test_names.py"] == 1  # the walk sees this very file
