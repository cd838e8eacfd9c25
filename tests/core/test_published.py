"""One source of published figures: the tests' copy equals the team's reference, value for value."""

from __future__ import annotations

import json

import pytest
from _published import PUBLISHED, PUBLISHED_PATH, SHARED_PATH


def test_copy_equals_the_shared_reference():
    if not SHARED_PATH.exists():
        pytest.skip(f"no shared reference beside this checkout ({SHARED_PATH}); the copy is the source")
    shared = json.loads(SHARED_PATH.read_text())
    assert PUBLISHED == shared, (
        f"{PUBLISHED_PATH} differs from {SHARED_PATH}: copy the shared file over the tests' copy"
    )


def test_tests_read_the_copy():
    assert PUBLISHED_PATH.name == "published.json" and PUBLISHED_PATH.parent.name == "data"
    assert PUBLISHED == json.loads(PUBLISHED_PATH.read_text()) and len(PUBLISHED) > 0
