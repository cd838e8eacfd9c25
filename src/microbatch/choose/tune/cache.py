"""The tune cache: measured points saved as JSON, keyed by everything that changes a measurement.

Points are saved under ``$MICROBATCH_CACHE_DIR`` (default ``~/.cache/microbatch``) after every
probe: a repeated ``tune`` reuses them and an interrupted one keeps them. The key
(:func:`cache_key` of the fields :mod:`microbatch.choose.tune` gathers) holds the model's structure,
what the step is fed (:func:`batch_structure` of ``make_batch(b)`` for two b), the loss function
(:func:`callable_identity`), the optimizer and its settings (:func:`optimizer_identity`), the
device and its name, threads, precision, mode, checkpointing, the timing settings, B_global and d,
and the torch, Python and microbatch versions. A change to any of them measures again. Each point
keeps when it was measured (``measured_at``) so that an answer served from the cache can say so
(:class:`~microbatch.choose.result.CacheUse`). A cache that cannot be read or written is not an error.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from microbatch._json import dumps, loads
from microbatch.measure.probes import Measurement

__all__ = [
    "CachedAnswer",
    "batch_structure",
    "cache_dir",
    "cache_key",
    "callable_identity",
    "class_name",
    "load_points",
    "module_fingerprint",
    "optimizer_identity",
    "save_points",
    "versions",
]

Points = dict[tuple[int, bool], Measurement]
"""Measured points by (b_m, activation checkpointing on)."""


def cache_dir() -> Path:
    """``$MICROBATCH_CACHE_DIR`` or ``~/.cache/microbatch``."""
    env = os.environ.get("MICROBATCH_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "microbatch"


def cache_key(fields: dict[str, Any]) -> str:
    """A short hash of the fields that identify a measurement."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:20]


Stamps = dict[tuple[int, bool], float]
"""When each point was measured (seconds since the epoch), by (b_m, checkpointing)."""


def load_points(key: str, stamps: Stamps | None = None) -> Points:
    """The points saved under ``key`` (none when the file is missing or unreadable); when each was
    measured goes into ``stamps`` if given (points saved before stamps existed: the file's time)."""
    path = cache_dir() / f"tune-{key}.json"
    try:
        data = loads(path.read_text())
        points = {
            (int(d["micro_batch"]), bool(d.get("checkpointing"))): Measurement.from_dict(d)
            for d in data["points"]
        }
        if stamps is not None:
            saved = path.stat().st_mtime
            for d in data["points"]:
                at = d.get("measured_at")
                key_ = (int(d["micro_batch"]), bool(d.get("checkpointing")))
                stamps[key_] = float(at) if isinstance(at, (int, float)) else saved
        return points
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def save_points(key: str, fields: dict[str, Any], points: Points, stamps: Stamps | None = None) -> str | None:
    """Save ``points`` under ``key`` (atomically: written aside, then renamed), each with when it
    was measured (``stamps``; now for a point without one). A cache that cannot be written is not an error: the
    reason is returned (None when saved), for the run's notes."""
    d = cache_dir()
    now = time.time()
    rows = [dict(m.to_dict(), measured_at=(stamps or {}).get(k, now)) for k, m in points.items()]
    try:
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f"tune-{key}.json.tmp"
        tmp.write_text(dumps({"key": fields, "points": rows}))
        tmp.replace(d / f"tune-{key}.json")
    except OSError as e:
        return f"{d}: {e.strerror or e}"
    return None


class CachedAnswer(UserWarning):
    """Warned by :func:`microbatch.tune` and :func:`microbatch.choose.tune.tune_model` when points of
    the answer came from the cache (``warnings.simplefilter("ignore", CachedAnswer)`` silences it)."""


def batch_structure(batch: Any, depth: int = 0) -> Any:
    """What a step is fed, without its values: tensors as (shape, dtype, device), containers
    recursively, other objects by type (numbers and strings by value: they are settings)."""
    if depth > 6:
        return type(batch).__name__
    shape = getattr(batch, "shape", None)
    if shape is not None and hasattr(batch, "dtype"):
        return ["tensor", list(shape), str(batch.dtype), str(getattr(batch, "device", ""))]
    if isinstance(batch, Mapping):
        return {
            str(k): batch_structure(v, depth + 1) for k, v in sorted(batch.items(), key=lambda kv: str(kv[0]))
        }
    if isinstance(batch, (list, tuple)):
        return [type(batch).__name__, [batch_structure(v, depth + 1) for v in batch]]
    if batch is None or isinstance(batch, (bool, int, float, str)):
        return batch
    return type(batch).__name__


def callable_identity(fn: Callable[..., Any] | None) -> str | None:
    """A callable's module, qualified name and a hash of its code (a lambda or a function whose body
    changed is another loss); None for None (the default loss)."""
    if fn is None:
        return None
    inner: Any = getattr(fn, "__func__", fn)  # a bound method: its function
    name = f"{getattr(inner, '__module__', '?')}.{getattr(inner, '__qualname__', type(inner).__name__)}"
    code = getattr(inner, "__code__", None)
    if code is None:
        return f"{name} {type(fn).__name__} {getattr(fn, 'func', '')!r}"  # partials, callable objects
    h = hashlib.sha256(code.co_code)
    h.update(repr(code.co_consts).encode())
    h.update(repr(code.co_names).encode())
    return f"{name} {h.hexdigest()[:12]}"


def optimizer_identity(optimizer: Any) -> dict[str, Any] | None:
    """An optimizer's class and its settings (defaults and each group's, parameters left out)."""
    if optimizer is None:
        return None
    groups = [
        {k: v for k, v in g.items() if k != "params"} | {"n_params": len(g.get("params", []))}
        for g in getattr(optimizer, "param_groups", [])
    ]
    defaults = getattr(optimizer, "defaults", {})
    return {
        "class": f"{type(optimizer).__module__}.{type(optimizer).__qualname__}",
        "defaults": json.loads(json.dumps(defaults, sort_keys=True, default=str)),
        "groups": json.loads(json.dumps(groups, sort_keys=True, default=str)),
    }


PROBE_REVISION = 2
"""How the probes measure, counted up when a change would make a cached point differ from a new one at the same
version: 2 (2026-12-06) decoding timed on the steady heap and the built-in GPT's KV cache in autocast's dtype."""


def versions() -> dict[str, str]:
    """The torch, Python and microbatch versions (a new release may time differently) and the probes' revision
    (:data:`PROBE_REVISION`: a change of how they measure within one version)."""
    import torch

    from microbatch import __version__

    return {
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "microbatch": __version__,
        "probes": str(PROBE_REVISION),
    }


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
