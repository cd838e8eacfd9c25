"""Shared test set-up: the tests mirror the package's layers (tests/<layer>/test_<module>.py).

The folder of this file is put on ``sys.path`` so every test, in any layer folder, imports the
shared helpers (``_published``) the same way.
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
