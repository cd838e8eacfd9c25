"""The tune cache: measured points saved as JSON, keyed by what makes a measurement repeatable.

Points are saved under ``$MICROBATCH_CACHE_DIR`` (default ``~/.cache/microbatch``), keyed by
the model's fingerprint, sequence length, precision, device name, torch version, mode and
global batch, after every probe: a repeated ``tune`` reuses them and an interrupted one keeps
them. A cache that cannot be read or written is not an error.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from microbatch._json import dumps
from microbatch.measure.probes import Measurement

__all__ = ["cache_dir", "cache_key", "load_points", "save_points", "module_fingerprint", "class_name"]

Points = dict[tuple[int, bool], Measurement]
"""Measured points by (b_m, activation checkpointing on)."""


def cache_dir() -> Path:
    """``$MICROBATCH_CACHE_DIR`` or ``~/.cache/microbatch``."""
    env = os.environ.get("MICROBATCH_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "microbatch"


def cache_key(fields: dict[str, Any]) -> str:
    """A short hash of the fields that identify a measurement."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:20]


def load_points(key: str) -> Points:
    """The points saved under ``key`` (none when the file is missing or unreadable)."""
    path = cache_dir() / f"tune-{key}.json"
    try:
        data = json.loads(path.read_text())
        return {
            (int(d["micro_batch"]), bool(d.get("checkpointing"))): Measurement.from_dict(d)
            for d in data["points"]
        }
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def save_points(key: str, fields: dict[str, Any], points: Points) -> None:
    """Save ``points`` under ``key`` (atomically: written aside, then renamed)."""
    d = cache_dir()
    try:
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f"tune-{key}.json.tmp"
        tmp.write_text(dumps({"key": fields, "points": [m.to_dict() for m in points.values()]}))
        tmp.replace(d / f"tune-{key}.json")
    except OSError:
        pass  # a cache that cannot be written is not an error


def class_name(model: Any) -> str:
    """The user's class name (FSDP2's ``fully_shard`` swaps in a subclass named ``FSDP<name>``)."""
    name = type(model).__name__
    bases = {b.__name__ for b in type(model).__mro__[1:]}
    return name[4:] if name.startswith("FSDP") and name[4:] in bases else name


def module_fingerprint(model: Any) -> str:
    """A hash of a module's structure: its class, repr and parameter shapes and dtypes."""
    h = hashlib.sha256(type(model).__name__.encode())
    h.update(repr(model).encode())
    for name, p in model.named_parameters():
        h.update(f"{name}{tuple(p.shape)}{p.dtype}".encode())
    return h.hexdigest()[:16]
