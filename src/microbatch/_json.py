"""JSON text with non-finite floats as null, so every parser reads what the library writes."""

from __future__ import annotations

import json
import math
import operator
from typing import Any

__all__ = ["finite", "dumps"]


def finite(obj: Any) -> Any:
    """``obj`` with NaN and ±inf floats replaced by None (dict keys as strings, tuples as lists), and the whole
    numbers of other libraries (NumPy's, a 0-d integer tensor: ``__index__``), which the checks accept, as ints."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    if type(obj).__module__ == "numpy" and hasattr(obj, "item"):  # a NumPy scalar (int, float, bool)
        return finite(obj.item())
    if not isinstance(obj, (int, str, type(None))) and hasattr(type(obj), "__index__"):
        try:
            return operator.index(obj)
        except TypeError:
            return obj
    return obj


def dumps(obj: Any) -> str:
    """JSON text of ``obj`` with non-finite floats as null (valid JSON for every parser)."""
    return json.dumps(finite(obj), indent=2, allow_nan=False)
