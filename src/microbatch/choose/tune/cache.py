"""The tune cache: measured points saved as JSON, keyed by everything that changes a measurement.

Points are saved under ``$MICROBATCH_CACHE_DIR`` (default ``$XDG_CACHE_HOME/microbatch`` or ``~/.cache/microbatch``) after every
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

import contextlib
import hashlib
import importlib.metadata
import json
import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from microbatch._json import dumps, loads
from microbatch.files import write_text
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
    "host_identity",
    "holds_under",
    "well_formed",
]

Points = dict[tuple[int, bool], Measurement]
"""Measured points by (b_m, activation checkpointing on)."""


def cache_dir() -> Path:
    """``$MICROBATCH_CACHE_DIR``, else ``$XDG_CACHE_HOME/microbatch`` (the freedesktop base-directory rule: an
    absolute path), else ``~/.cache/microbatch``; where no home can be found (``docker run --user 12345``: no
    ``HOME``, no passwd entry: ``Path.home()`` raised and tune ended in a traceback, a review) or it is not an
    absolute path (``HOME=``: the cache went to the working folder's ``.cache``), a folder of this user's in the
    temporary folder."""
    env = os.environ.get("MICROBATCH_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    if os.path.isabs(xdg):
        return Path(xdg) / "microbatch"
    try:
        home = Path.home() if os.environ.get("HOME", "x") else Path()  # HOME= is read as "/" by expanduser
    except (RuntimeError, KeyError):
        home = Path()
    if not home.is_absolute():
        return _private_temp_cache()
    return home / ".cache" / "microbatch"


_PRIVATE: list[Path] = []
"""This process's own cache folder, where the shared temporary folder's could not be trusted."""


def _private_temp_cache() -> Path:
    """``<tmp>/microbatch-cache-<uid>``, made 0700, where it is this user's own folder and no one else may write in
    it; else a fresh private folder for this process (another user could have made the predictable one first, to
    plant points or to refuse the writes: a review)."""
    import stat
    import tempfile

    uid = os.getuid() if hasattr(os, "getuid") else 0
    folder = Path(tempfile.gettempdir()) / f"microbatch-cache-{uid}"
    try:
        folder.mkdir(mode=0o700)
    except FileExistsError:
        pass
    except OSError:
        folder = Path()
    try:
        st = os.lstat(folder)
        ours = (
            stat.S_ISDIR(st.st_mode) and st.st_uid == uid and not st.st_mode & 0o022 and folder.is_absolute()
        )
    except OSError:
        ours = False
    if ours:
        return folder
    if not _PRIVATE:
        _PRIVATE.append(Path(tempfile.mkdtemp(prefix="microbatch-cache-")))
    return _PRIVATE[0]


def cache_key(fields: dict[str, Any]) -> str:
    """A short hash of the fields that identify a measurement."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:20]


Stamps = dict[tuple[int, bool], float]
"""When each point was measured (seconds since the epoch), by (b_m, checkpointing)."""


def load_points(
    key: str, stamps: Stamps | None = None, budget_bytes: float | None = None,
    budgets: dict[tuple[int, bool], float | None] | None = None, meta: dict[str, Any] | None = None,
) -> Points:  # fmt: skip
    """The points saved under ``key`` that still hold under the memory budget ``budget_bytes``
    (:func:`holds_under`), each well formed (:func:`well_formed`; none when the file is missing or unreadable);
    when each was measured goes into ``stamps`` if given (points saved before stamps existed: the file's time), and
    the budget each met into ``budgets``, to be saved again as it was. ``meta`` gets ``unconfirmed``: the points
    saved by a run that had not finished re-measuring its knee (:func:`save_points`; none in a file from before)."""
    path = cache_dir() / f"tune-{key}.json"
    try:
        if (
            not path.is_file()
        ):  # missing, or a FIFO or device under the entry's name: reading one waited forever
            return {}
        data = loads(path.read_text())
        rows = [d for d in data["points"] if well_formed(d) and holds_under(d, budget_bytes)]
        if meta is not None:
            meta["unconfirmed"] = {
                (int(d["micro_batch"]), bool(d.get("checkpointing")))
                for d in rows
                if d.get("confirmed") is False
            }
        points = {
            (int(d["micro_batch"]), bool(d.get("checkpointing"))): Measurement.from_dict(d) for d in rows
        }
        if stamps is not None:
            saved = path.stat().st_mtime
            for d in rows:
                at = d.get("measured_at")
                key_ = (int(d["micro_batch"]), bool(d.get("checkpointing")))
                stamps[key_] = float(at) if isinstance(at, (int, float)) else saved
        if budgets is not None:
            budgets.update(
                {(int(d["micro_batch"]), bool(d.get("checkpointing"))): d.get("budget_bytes") for d in rows}
            )
        return points
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def holds_under(row: Mapping[str, Any], budget_bytes: float | None) -> bool:
    """Whether a saved point still holds under the memory budget ``budget_bytes`` (None: no limit). A point the limit
    shaped (out of memory, or timed on the tracking heap because its steady heap did not fit) holds only under a
    budget no larger than the one it met (``budget_bytes`` saved with it): an out-of-memory at 400 MiB was reused at
    2 GiB, where the size fits (a helper's run). A point the limit did not touch holds under any budget (one over a
    smaller budget is left out by its peak)."""
    if not (row.get("oom") or row.get("timed_heap") == "tracking"):
        return True
    if "budget_bytes" not in row:  # saved before budgets were: measured again
        return False
    then = row["budget_bytes"]
    if then is None:  # met with no limit: it holds under none, and under any
        return True
    return budget_bytes is not None and isinstance(then, (int, float)) and then >= budget_bytes


def well_formed(row: Any) -> bool:
    """Whether a saved point has the types a measurement has: a whole ``micro_batch`` of at least 1, booleans where
    flags are, finite numbers of at least 0 (or nothing) where figures are, text (or nothing) where words are, and a
    positive throughput unless it ran out of memory. A file that parses but holds anything else (edited, or written
    by another tool) is not used: a point with ``"throughput": "fast"`` ended every later run in a traceback, one with
    ``"memory_method": 5`` too, and a ``"peak_memory_bytes": -5`` in a refusal naming a flag tune does not have."""
    if not isinstance(row, Mapping):
        return False
    b = row.get("micro_batch")
    if not isinstance(b, int) or isinstance(b, bool) or b < 1:
        return False
    if any(not isinstance(row.get(k, False), bool) for k in ("oom", "checkpointing")):
        return False
    for k in _FIGURES:
        v = row.get(k)
        if v is not None and (
            isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0
        ):
            return False
    if any(row.get(k) is not None and not isinstance(row.get(k), str) for k in _WORDS):
        return False
    t = row.get("throughput")
    return bool(row.get("oom")) or (isinstance(t, (int, float)) and t > 0)


_WORDS = ("memory_method", "clock", "error", "timed_heap")
"""A point's text fields (``Measurement``'s strings)."""

_FIGURES = (
    "throughput", "samples_per_s", "tokens_per_s", "step_time_s", "micro_step_s", "optimizer_step_s", "prefill_s",
    "spread", "throughput_se", "peak_memory_bytes", "peak_allocated_bytes", "repeats",
)  # fmt: skip


def save_points(
    key: str, fields: dict[str, Any], points: Points, stamps: Stamps | None = None,
    budgets: dict[tuple[int, bool], float | None] | None = None,
    unconfirmed: Collection[tuple[int, bool]] = (),
) -> str | None:  # fmt: skip
    """Save ``points`` under ``key`` (atomically: written to a file of this process's own, then renamed over), each
    with when it was measured (``stamps``; now for a point without one) and the memory budget it met (``budgets``,
    :func:`holds_under`), beside the points other processes saved under the same key (:func:`_merged`: two tunes
    sharing the cache each wrote only its own, and the first one's were lost), each marked ``confirmed`` False where
    it is in ``unconfirmed`` (saved by a run that has not finished re-measuring its knee: a later run served such a
    knee from the cache says it was not). Never written in place (:func:`microbatch.files.write_text`'s
    ``always_whole``: a FIFO under the entry's name is refused, not waited on). A cache that cannot be written is not
    an error: the reason is returned (None when saved), for the run's notes."""
    d = cache_dir()
    now = time.time()
    rows = [
        dict(
            m.to_dict(),
            measured_at=(stamps or {}).get(k, now),
            budget_bytes=(budgets or {}).get(k),
            confirmed=k not in unconfirmed,
        )
        for k, m in points.items()
    ]
    try:
        d.mkdir(parents=True, exist_ok=True)
        with _locked(d / LOCK_NAME):  # the read of the others' points and the rename, one process at a time
            rows = _merged(d / f"tune-{key}.json", rows)
            write_text(d / f"tune-{key}.json", dumps({"key": fields, "points": rows}), always_whole=True)
    except OSError as e:
        return f"{d}: {e.strerror or e}"
    return None


LOCK_NAME = ".tune.lock"
"""The cache folder's one lock file (empty): a save holds it from reading the others' points to its rename."""


def _merged(path: Path, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` and the well-formed points of the file at ``path`` (another process's, or this one's left out under
    its budget: :func:`holds_under` reads each on load), as they were saved; where both hold a point, the one measured
    later (``measured_at``; a tie: ``rows``'), so a copy this process read does not overwrite a point another process
    measured again since. ``rows`` alone where the file is missing or unreadable."""

    def key(r: Mapping[str, Any]) -> tuple[int, bool]:
        return r["micro_batch"], bool(r.get("checkpointing"))

    def when(r: Mapping[str, Any]) -> float:
        at = r.get("measured_at")
        return float(at) if isinstance(at, (int, float)) and not isinstance(at, bool) else 0.0

    try:
        old = loads(path.read_text())["points"] if path.is_file() else []
        merged = {key(r): r for r in old if well_formed(r)}
    except (OSError, ValueError, KeyError, TypeError):
        return rows
    for r in rows:
        if key(r) not in merged or when(r) >= when(merged[key(r)]):
            merged[key(r)] = r
    return [merged[k] for k in sorted(merged, key=lambda k: (k[1], k[0]))]


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``path`` (created) while inside; nothing where the file system refuses one."""
    try:
        import fcntl

        fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o666)  # read-only: another user's lock file still locks
    except (OSError, ImportError):
        yield
        return
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


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
    extra = getattr(fn, "microbatch_identity", None)  # what its code does not say (the Trainer a probe calls)
    inner: Any = getattr(fn, "__func__", fn)  # a bound method: its function
    name = f"{getattr(inner, '__module__', '?')}.{getattr(inner, '__qualname__', type(inner).__name__)}"
    code = getattr(inner, "__code__", None)
    if code is None:
        return f"{name} {type(fn).__name__} {getattr(fn, 'func', '')!r}"  # partials, callable objects
    h = hashlib.sha256(code.co_code)
    h.update(repr(code.co_consts).encode())
    h.update(repr(code.co_names).encode())
    return f"{name} {h.hexdigest()[:12]}" + (f" {extra}" if extra is not None else "")


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


PROBE_REVISION = 5
"""How the probes measure, counted up when a change would make a cached point differ from a new one at the same
version: 2 (2026-12-06) decoding timed on the steady heap and the built-in GPT's KV cache in autocast's dtype; 3
(2026-12-07) a probe's child that crashed is an error, no longer an out-of-memory point; 4 (2026-12-07) tokens are
counted only in a batch of token ids (an image's channels were counted as its tokens); 5 (2026-12-07) a padded
batch's tokens are its attention mask's ones (its padding was counted), a tokenizer's ``BatchEncoding`` read as a
dict."""


def versions() -> dict[str, str]:
    """The torch, Python and microbatch versions (a new release may time differently) and the probes' revision
    (:data:`PROBE_REVISION`: a change of how they measure within one version). torch is imported keeping a Ctrl-C
    (:func:`~microbatch.interrupts.imported_keeping_interrupts`): its start-up swallowed one."""
    from microbatch import __version__
    from microbatch.interrupts import imported_keeping_interrupts

    torch = imported_keeping_interrupts("torch")

    out = {
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "microbatch": __version__,
        "probes": str(PROBE_REVISION),
    }
    try:  # its models' kernels and defaults, whether or not this process imported it yet
        out["transformers"] = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        pass
    return out


THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "ATEN_CPU_CAPABILITY", "DNNL_MAX_CPU_ISA")
"""Environment variables that change how a CPU probe computes (its threads, its kernels), in the key."""


def host_identity() -> dict[str, Any]:
    """What of this process's setting changes a CPU measurement and the device's name does not say: the cores it may
    use (its affinity, not the machine's count: ``taskset -c 0`` ran a run's points again as cached) and
    :data:`THREAD_ENV`."""
    from microbatch.hardware import usable_cores

    return {"cores": usable_cores(), "env": {k: os.environ[k] for k in THREAD_ENV if k in os.environ}}


def class_name(model: Any) -> str:
    """The user's class name (FSDP2's ``fully_shard`` swaps in a subclass named ``FSDP<name>``)."""
    name = type(model).__name__
    bases = {b.__name__ for b in type(model).__mro__[1:]}
    return name[4:] if name.startswith("FSDP") and name[4:] in bases else name


def module_fingerprint(model: Any) -> str:
    """A hash of a module's structure: its class, repr, parameter shapes, dtypes and which are trained
    (``requires_grad``: freezing half the layers ran as cached, 19% slower in truth), and a Hugging Face model's
    config, attention implementation and gradient checkpointing (neither is in its repr)."""
    h = hashlib.sha256(type(model).__name__.encode())
    h.update(repr(model).encode())
    for name, p in model.named_parameters():
        h.update(f"{name}{tuple(p.shape)}{p.dtype}{p.requires_grad}".encode())
    config = getattr(model, "config", None)
    to_json = getattr(config, "to_json_string", None)
    if callable(to_json):
        try:
            h.update(str(to_json()).encode())
        except Exception:  # noqa: BLE001 - a config that does not serialise: its class stands for it
            h.update(type(config).__name__.encode())
        h.update(str(getattr(config, "_attn_implementation", None)).encode())
    with (
        warnings.catch_warnings()
    ):  # transformers renamed it (is_activation_checkpointing) and warns on the old name
        warnings.simplefilter("ignore")
        ckpt = getattr(model, "is_activation_checkpointing", None)
        if ckpt is None:
            ckpt = getattr(model, "is_gradient_checkpointing", None)
    h.update(str(ckpt).encode())
    return h.hexdigest()[:16]
