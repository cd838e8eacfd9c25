"""The published figures the tests check against (``shared/reference/published.json``).

Read from the project's shared folder beside the checkout when it is there (the team's source of
truth), else from the copy in ``tests/data/`` so that a lone clone tests the same figures.
"""

from __future__ import annotations

import json
from pathlib import Path

_HERE = Path(__file__).resolve().parent
_CANDIDATES = (
    _HERE.parents[1] / "shared" / "reference" / "published.json",
    _HERE / "data" / "published.json",
)
PUBLISHED_PATH = next((p for p in _CANDIDATES if p.exists()), _CANDIDATES[-1])
PUBLISHED = json.loads(PUBLISHED_PATH.read_text())
