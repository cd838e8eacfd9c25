"""The published figures the tests check against: ``tests/data/published.json``, the one source.

It is a copy of the team's ``shared/reference/published.json`` (beside the checkout, where there is
one); ``tests/core/test_published.py`` fails when the two differ, so they cannot drift apart, and a
lone clone tests the same figures.
"""

from __future__ import annotations

import json
from pathlib import Path

_HERE = Path(__file__).resolve().parent
PUBLISHED_PATH = _HERE / "data" / "published.json"
"""The file every test reads."""
SHARED_PATH = _HERE.parents[1] / "shared" / "reference" / "published.json"
"""The team's reference it copies (absent in a lone clone)."""
PUBLISHED = json.loads(PUBLISHED_PATH.read_text())
