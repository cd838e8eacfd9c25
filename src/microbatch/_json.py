"""JSON text with non-finite floats as null, so every parser reads what the library writes."""

from __future__ import annotations

import json
import math
from typing import Any

__all__ = ["finite", "dumps"]


def finite(obj: Any) -> Any:
    """``obj`` with NaN and ±inf floats replaced by None (dict keys as strings, tuples as lists)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def dumps(obj: Any) -> str:
    """JSON text of ``obj`` with non-finite floats as null (valid JSON for every parser)."""
    return json.dumps(finite(obj), indent=2, allow_nan=False)
