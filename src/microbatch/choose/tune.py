"""The search: measure throughput and peak memory as b_m doubles, fit memory, stop at the knee.

**Strategy** (:func:`search`). Start at b_m = 1 (or ``start``) and double. After two probes,
fit peak memory M(b) = M_0 + k·b on the largest probes (:func:`microbatch.choose.knee.fit_memory`) and
never probe a b_m predicted to exceed the budget less its headroom. Stop when

- the knee is settled (rule ``fraction`` with ``reference="bound"``, the default): the bound T̂
  on what any larger b_m can reach (:func:`microbatch.choose.knee.throughput_bound`: a line fitted to
  the step time of the five largest probes, valid because the roofline's step time is convex)
  is known and a measured point is within τ of max(best, T̂) with half the choice's margin
  (``SETTLE_MARGIN``), so no further probe can move the knee beyond it;
- the curve has flattened or fallen: the newest point gains less than τ per doubling over the
  best point before it (τ is the knee rule's tolerance), ``patience`` times in a row (default
  2: on a CPU, decoding a 124M-parameter model gained 5% from b_m = 1 to 2, then 30% per
  doubling up to 32 — one flat doubling is not a plateau; see BENCHMARKS.md), and, with
  ``reference="bound"``, at least four points are measured (enough to fit the bound);
- the next b_m is predicted not to fit, or ran out of memory (with ``checkpointing="auto"``,
  the search first switches activation checkpointing on at that b_m and goes on: where both
  fit, no recomputation is always the faster, so "try both, keep the faster that fits" only
  needs checkpointing where plain steps do not fit);
- ``max_micro_batch`` is reached, or the user presses Ctrl-C (what was measured is kept).

With ``refine=True`` one more probe halves the gap between the knee and the point below it
(for example 6 between 4 and 8); the knee moves there if it is within the tolerance.

**Answer** (:class:`TuneResult`): the knee and the fastest fitting b_m, each with throughput,
% of best and peak memory; g for a global batch; the predicted largest fitting b_m; the curve.

**Cache.** Points are saved as JSON under ``$MICROBATCH_CACHE_DIR`` (default
``~/.cache/microbatch``), keyed by the model's fingerprint, sequence length, precision, device
name, torch version, mode and global batch, after every probe: a repeated ``tune`` reuses them
and an interrupted one keeps them.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from microbatch._json import dumps
from microbatch.choose.knee import (
    BOUND_MARGIN,
    BOUND_MIN_POINTS,
    DEFAULT_HEADROOM,
    DEFAULT_RULE,
    DEFAULT_TOLERANCE,
    CurvePoint,
    Recommendation,
    check_reference,
    fit_memory,
    gain_per_doubling,
    knee_fraction,
    recommend,
    throughput_bound,
)
from microbatch.errors import ConfigError, check_positive_int
from microbatch.measure.probes import Measurement, TimingConfig

__all__ = ["TuneResult", "search", "tune", "tune_model", "cache_dir", "CHECKPOINTING"]

CHECKPOINTING = ("off", "on", "auto")

CPU_TIMING = TimingConfig(warmup=1, min_repeats=3, max_repeats=10, max_time_s=3.0, rel_tol=0.05)
"""Default timing on the CPU: short, because the CPU's knee is found at small b_m."""
CUDA_TIMING = TimingConfig(warmup=3, min_repeats=5, max_repeats=30, max_time_s=3.0, rel_tol=0.02)
"""Default timing on CUDA."""


def _point(m: Measurement) -> CurvePoint:
    return CurvePoint(
        micro_batch=m.micro_batch,
        throughput=None if m.oom else m.throughput,
        peak_memory_bytes=m.peak_memory_bytes,
        oom=m.oom,
        step_time_s=m.step_time_s,
    )


@dataclass
class SearchLog:
    """What the search did besides measuring."""

    stop_reason: str = ""
    """Why the search stopped."""
    skipped: list[int] = field(default_factory=list)
    """b_m not probed because the fit predicted they would not fit."""
    interrupted: bool = False
    """Ctrl-C ended the search."""
    oom_events: int = 0
    """Probes that ran out of memory."""
    probes: int = 0
    """Probes measured now (not from the cache)."""
    cached: int = 0
    """Points taken from the cache."""


SETTLE_MARGIN = BOUND_MARGIN / 2
"""The search settles once a measured point reaches (1 − τ)(1 + μ/2) of the reference: halfway
between the bare line (which settled on a point that only just reached it: a decode run stopped at
64 with 85.1% of T̂, 80% of the sweep's best) and the choice's own line (which costs one more
doubling too often). Chosen by simulation (BENCHMARKS.md, "Measure: tune")."""


def search(
    measure: Callable[[int, bool], Measurement],
    *,
    start: int = 1,
    max_micro_batch: int | None = None,
    memory_budget_bytes: int | None = None,
    headroom: float = DEFAULT_HEADROOM,
    tolerance: float = DEFAULT_TOLERANCE,
    checkpointing: str = "off",
    patience: int = 2,
    refine: bool = False,
    rule: str = DEFAULT_RULE,
    reference: str = "bound",
    known: dict[tuple[int, bool], Measurement] | None = None,
    on_point: Callable[[Measurement, bool], None] | None = None,
    log: SearchLog | None = None,
) -> list[Measurement]:
    """Doubling search (see the module docstring). ``measure(b, checkpointing)`` probes one point;
    ``known`` holds cached points; ``on_point(m, from_cache)`` is called after each point."""
    check_positive_int("start micro-batch", start)
    if max_micro_batch is not None:
        check_positive_int("max micro-batch", max_micro_batch)
    if checkpointing not in CHECKPOINTING:
        raise ConfigError(f"checkpointing {checkpointing!r} is not known; use on, off or auto")
    check_reference(reference)
    log = log if log is not None else SearchLog()
    known = dict(known or {})
    points: list[Measurement] = []
    ckpt = checkpointing == "on"
    usable = None if memory_budget_bytes is None else memory_budget_bytes * (1.0 - headroom)

    def probe(b: int) -> Measurement:
        key = (b, ckpt)
        if key in known:
            m, cached = known[key], True
            log.cached += 1
        else:
            m, cached = measure(b, ckpt), False
            log.probes += 1
            log.oom_events += int(m.oom)
        points.append(m)
        if on_point is not None:
            on_point(m, cached)
        return m

    def mode_points() -> list[CurvePoint]:
        return [_point(p) for p in points if p.checkpointing == ckpt]

    def settled() -> str | None:
        """Why the knee cannot move any more (rule fraction against the bound), or None."""
        if rule != "fraction" or reference != "bound":
            return None
        ok = [
            p
            for p in mode_points()
            if p.ok and (memory_budget_bytes is None or (p.peak_memory_bytes or 0) <= memory_budget_bytes)
        ]
        bound = throughput_bound(ok)
        if bound is None:
            return None
        best = max(p.throughput for p in ok)
        if best < (1.0 - tolerance) * (1.0 + SETTLE_MARGIN) * max(bound.throughput, best):
            return None  # no measured point reaches the settle line yet
        knee = knee_fraction(ok, tolerance, bound=bound.throughput, margin=BOUND_MARGIN)
        first, last = bound.fitted_on[0], bound.fitted_on[-1]
        return (
            f"knee settled: no micro-batch past {last} can beat {bound.throughput:,.1f}/s (the step-time "
            f"line fitted from {first} to {last}), and {knee.micro_batch} is within {100 * tolerance:g}% of it"
        )

    def predicted_not_to_fit(b: int) -> bool:
        if usable is None:
            return False
        fit = fit_memory(mode_points())
        return fit is not None and fit.predict(b) > usable

    b = start
    flat = 0
    try:
        while True:
            if max_micro_batch is not None and b > max_micro_batch:
                log.stop_reason = f"reached the largest micro-batch allowed ({max_micro_batch})"
                break
            if predicted_not_to_fit(b):
                if checkpointing == "auto" and not ckpt:
                    ckpt = True
                    continue
                log.skipped.append(b)
                log.stop_reason = f"micro-batch {b} is predicted not to fit the memory budget"
                break
            m = probe(b)
            if m.oom:
                if checkpointing == "auto" and not ckpt:
                    ckpt = True
                    continue
                log.stop_reason = f"micro-batch {b} ran out of memory"
                break
            why = settled()
            if why:
                log.stop_reason = why
                break
            ok = [p for p in points if not p.oom and p.micro_batch < b and p.throughput]
            if ok:
                best = max(ok, key=lambda p: p.throughput)
                gain = gain_per_doubling(best.micro_batch, best.throughput, b, m.throughput)
                flat = flat + 1 if gain < tolerance else 0
                # against the bound, the flat rule waits until a bound could be fitted: two flat
                # doublings among the first three probes are weak evidence on a noisy machine
                enough = reference != "bound" or len(ok) + 1 >= BOUND_MIN_POINTS
                if flat >= patience and enough:
                    log.stop_reason = (
                        f"throughput flattened: {b} gains {100 * gain:.1f}% per doubling over {best.micro_batch}"
                        f" (< {100 * tolerance:g}%)"
                    )
                    break
            b *= 2
        if refine:
            _refine(points, probe, rule, tolerance, memory_budget_bytes, predicted_not_to_fit, reference)
    except KeyboardInterrupt:
        log.interrupted = True
        log.stop_reason = "interrupted (Ctrl-C); the points measured so far are kept"
    return points


def _refine(points, probe, rule, tolerance, budget, predicted_not_to_fit, reference) -> None:
    ok = [_point(p) for p in points if not p.oom]
    if len(ok) < 2:
        return
    try:
        knee = recommend(
            ok, rule=rule, tolerance=tolerance, memory_budget_bytes=budget, reference=reference
        ).knee
    except ConfigError:
        return
    lower = [p.micro_batch for p in ok if p.micro_batch < knee.micro_batch]
    if not lower:
        return
    mid = (max(lower) + knee.micro_batch) // 2
    measured = {p.micro_batch for p in points}
    if mid in measured or mid <= max(lower) or predicted_not_to_fit(mid):
        return
    probe(mid)


# -- results ------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class TuneResult:
    """The measured curve and the choice made from it."""

    points: list[Measurement]
    """Every point, in the order measured (cached ones included)."""
    recommendation: Recommendation
    """The knee and the fastest fitting b_m."""
    model: str
    """Model name (registry name, config path, or the user's module class)."""
    seq: int | None
    """Sequence length probed (the longest the data holds)."""
    mode: str
    """``train`` or ``decode``."""
    device: str
    """Device type (``cpu``, ``cuda``)."""
    device_name: str
    """The device's name (GPU model or CPU model)."""
    precision: str
    """``fp32`` or ``bf16-mixed``."""
    checkpointing: str
    """The setting asked for: ``off``, ``on`` or ``auto`` (each point says what it used)."""
    torch_version: str
    """torch.__version__ of the run."""
    memory_budget_bytes: int | None
    """The budget given (None: none)."""
    memory_method: str
    """How peak memory was measured."""
    stop_reason: str
    """Why the search stopped."""
    skipped: list[int]
    """b_m not probed because the memory fit predicted they would not fit."""
    interrupted: bool
    """Ctrl-C ended the search."""
    oom_events: int
    """Probes that ran out of memory (in the probe process or caught in this one)."""
    probes: int
    """Points measured in this run."""
    cached: int
    """Points reused from the cache."""
    wall_time_s: float
    """Time of the whole tune (setup included)."""
    memory_budget_source: str = "none"
    """Where the budget came from: ``given``, ``device total`` (CUDA) or ``80% of available host
    memory`` (the CPU child's limit), or ``none``."""
    static_bytes: int | None = None
    """Memory before activations (process, weights, gradients, optimizer state) where measured."""
    fingerprint: str = ""
    """Cache key of the run."""

    def to_dict(self) -> dict:
        d = self.recommendation.to_dict()
        fit = self.recommendation.memory_fit
        d["predicted_max_micro_batch"] = d["max_fitting_micro_batch"]
        largest = max(
            (p for p in self.points if not p.oom and p.peak_memory_bytes),
            key=lambda p: p.micro_batch,
            default=None,
        )
        d["memory_fit_error_at_largest"] = (
            (fit.predict(largest.micro_batch) - largest.peak_memory_bytes) / largest.peak_memory_bytes
            if fit is not None and largest is not None
            else None
        )
        d.update(
            points=[p.to_dict() for p in self.points],
            model=self.model,
            seq=self.seq,
            mode=self.mode,
            device=self.device,
            device_name=self.device_name,
            precision=self.precision,
            checkpointing=self.checkpointing,
            torch_version=self.torch_version,
            memory_method=self.memory_method,
            stop_reason=self.stop_reason,
            skipped=self.skipped,
            interrupted=self.interrupted,
            oom_events=self.oom_events,
            probes=self.probes,
            cached=self.cached,
            wall_time_s=self.wall_time_s,
            static_bytes=self.static_bytes,
            fingerprint=self.fingerprint,
        )
        # The budget is the user's; keep the key even when None (recommend's dict has it).
        d["memory_budget_bytes"] = self.memory_budget_bytes
        d["memory_budget_source"] = self.memory_budget_source
        return d

    def save(self, out_dir: str | os.PathLike) -> Path:
        """Write ``result.json`` (everything in :meth:`to_dict`) under ``out_dir``; return its path."""
        p = Path(out_dir)
        p.mkdir(parents=True, exist_ok=True)
        path = p / "result.json"
        path.write_text(dumps(self.to_dict()))
        return path


# -- cache ---------------------------------------------------------------------------
def cache_dir() -> Path:
    """``$MICROBATCH_CACHE_DIR`` or ``~/.cache/microbatch``."""
    env = os.environ.get("MICROBATCH_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "microbatch"


def _cache_key(fields: dict) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:20]


def _cache_load(key: str) -> dict[tuple[int, bool], Measurement]:
    path = cache_dir() / f"tune-{key}.json"
    try:
        data = json.loads(path.read_text())
        return {
            (int(d["micro_batch"]), bool(d.get("checkpointing"))): Measurement.from_dict(d)
            for d in data["points"]
        }
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def _cache_save(key: str, fields: dict, points: dict[tuple[int, bool], Measurement]) -> None:
    d = cache_dir()
    try:
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f"tune-{key}.json.tmp"
        tmp.write_text(dumps({"key": fields, "points": [m.to_dict() for m in points.values()]}))
        tmp.replace(d / f"tune-{key}.json")
    except OSError:
        pass  # a cache that cannot be written is not an error


def device_name(device: str) -> str:
    """The GPU's name, or the CPU's model name from /proc/cpuinfo."""
    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_name(torch.device(device))
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip() + f" ({os.cpu_count()} cpus)"
    except OSError:
        pass
    import platform

    return platform.processor() or "cpu"


def _class_name(model) -> str:
    """The user's class name (FSDP2's ``fully_shard`` swaps in a subclass named ``FSDP<name>``)."""
    name = type(model).__name__
    bases = {b.__name__ for b in type(model).__mro__[1:]}
    return name[4:] if name.startswith("FSDP") and name[4:] in bases else name


def module_fingerprint(model) -> str:
    """A hash of a module's structure: its class, repr and parameter shapes and dtypes."""
    h = hashlib.sha256(type(model).__name__.encode())
    h.update(repr(model).encode())
    for name, p in model.named_parameters():
        h.update(f"{name}{tuple(p.shape)}{p.dtype}".encode())
    return h.hexdigest()[:16]


# -- the two entry points ------------------------------------------------------------
def _run(
    prober,
    *,
    fingerprint_fields: dict,
    model_label: str,
    seq: int | None,
    mode: str,
    device: str,
    precision: str,
    checkpointing: str,
    memory_budget_bytes: int | None,
    budget_source: str,
    headroom: float,
    max_latency_ms: float | None,
    rule: str,
    tolerance: float,
    reference: str,
    global_batch: int | None,
    data_parallel: int,
    start: int,
    max_micro_batch: int | None,
    refine: bool,
    patience: int,
    use_cache: bool,
    on_point: Callable[[Measurement, bool], None] | None,
    t_start: float,
) -> TuneResult:
    import torch

    name = device_name(device)
    fields = dict(
        fingerprint_fields,
        seq=seq,
        precision=precision,
        device=name,
        torch=torch.__version__,
        mode=mode,
        global_batch=global_batch,
        data_parallel=data_parallel,
    )
    key = _cache_key(fields)
    known = _cache_load(key) if use_cache else {}
    log = SearchLog()

    def measure(b: int, ckpt: bool) -> Measurement:
        prober.start()
        m = prober.measure(b, checkpointing=ckpt)
        if use_cache:
            known[(b, ckpt)] = m
            _cache_save(key, fields, known)
        return m

    try:
        points = search(
            measure,
            start=start,
            max_micro_batch=max_micro_batch,
            memory_budget_bytes=memory_budget_bytes,
            headroom=headroom,
            tolerance=tolerance,
            checkpointing=checkpointing,
            patience=patience,
            refine=refine,
            rule=rule,
            reference=reference,
            known=known,
            on_point=on_point,
            log=log,
        )
    finally:
        prober.close()
    rec = recommend(
        [_point(p) for p in points],
        rule=rule,
        tolerance=tolerance,
        reference=reference,
        memory_budget_bytes=memory_budget_bytes,
        headroom=headroom,
        max_latency_ms=max_latency_ms,
        global_batch=global_batch,
        data_parallel=data_parallel,
    )
    methods = {p.memory_method for p in points if p.memory_method}
    return TuneResult(
        points=points,
        recommendation=rec,
        model=model_label,
        seq=seq,
        mode=mode,
        device=device,
        device_name=name,
        precision=precision,
        checkpointing=checkpointing,
        torch_version=torch.__version__,
        memory_budget_bytes=memory_budget_bytes,
        memory_method=", ".join(sorted(methods)),
        stop_reason=log.stop_reason,
        skipped=log.skipped,
        interrupted=log.interrupted,
        oom_events=log.oom_events,
        probes=log.probes,
        cached=log.cached,
        wall_time_s=time.perf_counter() - t_start,
        memory_budget_source=budget_source,
        static_bytes=getattr(prober, "static_bytes", None),
        fingerprint=key,
    )


def _check_common(rule, tolerance, checkpointing, mode, precision, memory_budget_bytes, headroom):
    from microbatch.choose.knee import RULES

    if rule not in RULES:
        raise ConfigError(f"knee rule {rule!r} is not known; use one of {', '.join(RULES)}")
    if not (0 <= tolerance < 1):
        raise ConfigError(f"tolerance {tolerance!r} must be in [0, 1), e.g. 0.15")
    if checkpointing not in CHECKPOINTING:
        raise ConfigError(f"checkpointing {checkpointing!r} is not known; use on, off or auto")
    if mode not in ("train", "decode"):
        raise ConfigError(f"mode {mode!r} is not known; use train or decode")
    if precision not in ("fp32", "bf16-mixed"):
        raise ConfigError(f"precision {precision!r} is not known; use fp32 or bf16-mixed")
    if memory_budget_bytes is not None and memory_budget_bytes <= 0:
        raise ConfigError(f"memory budget {memory_budget_bytes!r} must be > 0 bytes, e.g. 12GiB")
    if not (0 <= headroom < 1):
        raise ConfigError(f"headroom {headroom!r} must be in [0, 1), e.g. 0.1")


def _cpu_default_limit() -> int | None:
    """80% of MemAvailable: the child's hard limit when no budget is given (protects the host)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(int(line.split()[1]) * 1024 * 0.8)
    except OSError:
        pass
    return None


def tune_model(
    model: Any = None,
    *,
    hf_config: str | None = None,
    backend: str = "builtin",
    seq: int | None = None,
    mode: str = "train",
    device: str = "cpu",
    precision: str = "fp32",
    checkpointing: str = "off",
    memory_budget_bytes: int | None = None,
    headroom: float = DEFAULT_HEADROOM,
    max_latency_ms: float | None = None,
    rule: str = DEFAULT_RULE,
    tolerance: float = DEFAULT_TOLERANCE,
    reference: str = "bound",
    global_batch: int | None = None,
    data_parallel: int = 1,
    start: int = 1,
    max_micro_batch: int | None = 1024,
    refine: bool = False,
    patience: int = 2,
    timing: TimingConfig | None = None,
    new_tokens: int = 32,
    use_cache: bool = True,
    in_process: bool | None = None,
    threads: int | None = None,
    on_point: Callable[[Measurement, bool], None] | None = None,
) -> TuneResult:
    """Tune a registry model (name or :class:`~microbatch.model.ModelShape`) or a Hugging Face config.

    ``seq`` is the longest sequence the data holds (memory is set by the longest sequence;
    default: the shape's). On the CPU each probe runs in a child process under a hard memory
    limit (``memory_budget_bytes``, or 80% of the available memory); ``in_process=True`` probes
    in this process instead (faster to start, no protection). On CUDA probes run in this process
    and OOM is caught by type. ``threads`` sets torch's threads in the child only (this process's
    setting is left alone). With no budget the search uses the device's total memory on CUDA and
    80% of the available memory on the CPU (the child's hard limit); ``memory_budget_source``
    in the result says which. ``patience``: flat doublings in a row that stop the search.
    ``reference``: ``bound`` (default: the knee is within τ of max(best measured, T̂), the bound
    on any larger b_m, and the search stops once that knee is settled) or ``measured`` (within τ
    of the best measured; the search stops on the flat rule alone); see :mod:`microbatch.choose.knee`.
    """
    from microbatch.measure.childprobe import ChildProber
    from microbatch.measure.probes import InProcessProber, ProbeSpec, build_probe
    from microbatch.model import ModelShape, get_model

    t_start = time.perf_counter()
    _check_common(rule, tolerance, checkpointing, mode, precision, memory_budget_bytes, headroom)
    check_reference(reference)
    if (model is None) == (hf_config is None):
        raise ConfigError(
            "give exactly one of a model (name or shape) or hf_config (--model NAME or --hf-config PATH)"
        )
    if seq is not None:
        check_positive_int("seq", seq, fix="give the longest sequence the data holds, e.g. --seq 1024")
    if mode == "decode" and checkpointing != "off":
        checkpointing = "off"  # decoding has no backward pass: nothing to recompute
    shape_dict = None
    name = None
    if isinstance(model, ModelShape):
        shape = model
        shape_dict = {k: v for k, v in model.to_dict().items() if k != "param_count"}
        label = model.name
    elif model is not None:
        shape = get_model(str(model))
        name = str(model)
        label = shape.name if backend == "builtin" else f"hf:{shape.name}"
    else:
        shape = None
        label = str(hf_config)
    if seq is None:
        if shape is None:
            raise ConfigError("--seq is required with --hf-config: give the longest sequence the data holds")
        seq = shape.seq
    if timing is None:
        timing = CUDA_TIMING if device.startswith("cuda") else CPU_TIMING
    spec = ProbeSpec(
        model=name,
        shape=shape_dict,
        hf_config=hf_config,
        backend=backend,
        seq=seq,
        mode=mode,
        device=device,
        precision=precision,
        timing=timing,
        new_tokens=new_tokens,
        global_batch=global_batch,
        data_parallel=data_parallel,
        threads=threads,
    )
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("--device cuda: no CUDA device is available here; use --device cpu")
    if in_process is None:
        in_process = device.startswith("cuda")
    budget_source = "given" if memory_budget_bytes is not None else "none"
    if memory_budget_bytes is None and device.startswith("cuda"):
        memory_budget_bytes, budget_source = _cuda_total(device), "device total"
    elif memory_budget_bytes is None and not in_process:
        memory_budget_bytes = _cpu_default_limit()
        budget_source = "none" if memory_budget_bytes is None else "80% of available host memory"
    if in_process:
        probe = build_probe(spec)
        if device.startswith("cuda"):
            _check_cuda_budget(probe, memory_budget_bytes, device)
        prober = InProcessProber(probe)
    else:
        prober = ChildProber(spec, limit_bytes=memory_budget_bytes)
        prober.start()  # fails early on a budget below the static memory or b_m = 1 out of memory
    if shape is not None:
        fp = {
            "shape": {k: v for k, v in shape.to_dict().items() if k not in ("name", "seq")},
            "backend": backend,
        }
    else:
        fp = {
            "hf_config": json.loads(
                Path(hf_config if Path(hf_config).is_file() else Path(hf_config) / "config.json").read_text()
            )
        }
    fp["timing"] = timing.__dict__ if hasattr(timing, "__dict__") else str(timing)
    fp["in_process"] = in_process
    fp["threads"] = threads
    return _run(
        prober,
        fingerprint_fields=fp,
        model_label=label,
        seq=seq,
        mode=mode,
        device=device,
        precision=precision,
        checkpointing=checkpointing,
        memory_budget_bytes=memory_budget_bytes,
        budget_source=budget_source,
        headroom=headroom,
        max_latency_ms=max_latency_ms,
        rule=rule,
        tolerance=tolerance,
        reference=reference,
        global_batch=global_batch,
        data_parallel=data_parallel,
        start=start,
        max_micro_batch=max_micro_batch,
        refine=refine,
        patience=patience,
        use_cache=use_cache,
        on_point=on_point,
        t_start=t_start,
    )


def _cuda_total(device) -> int:
    """Total memory of a CUDA device (the default budget there: a probe may use it all)."""
    import torch

    return int(torch.cuda.mem_get_info(torch.device(device))[1])


def _check_cuda_budget(probe, budget: int | None, device: str) -> None:
    from microbatch.measure.probes import static_bytes

    if budget is None:
        return
    need = static_bytes(probe) + probe.dev.context_bytes
    if need > budget:
        raise ConfigError(
            f"memory budget {budget} bytes ({budget / 2**30:.2f} GiB) is below the model's static memory on "
            f"{device}: it needs at least {need} bytes ({need / 2**30:.2f} GiB: CUDA context, weights"
            + (", gradients and Adam's state" if probe.__class__.__name__ == "TrainProbe" else "")
            + "); raise --memory-budget or choose a smaller model"
        )


def tune(
    model,
    make_batch: Callable[[int], Any],
    *,
    loss_fn: Callable[[Any, Any], Any] | None = None,
    optimizer=None,
    device=None,
    precision: str = "fp32",
    checkpointing: str = "off",
    memory_budget_bytes: int | None = None,
    headroom: float = DEFAULT_HEADROOM,
    max_latency_ms: float | None = None,
    rule: str = DEFAULT_RULE,
    tolerance: float = DEFAULT_TOLERANCE,
    reference: str = "bound",
    global_batch: int | None = None,
    data_parallel: int | None = None,
    start: int = 1,
    max_micro_batch: int | None = 1024,
    refine: bool = False,
    patience: int = 2,
    timing: TimingConfig | None = None,
    use_cache: bool | None = None,
    on_point: Callable[[Measurement, bool], None] | None = None,
) -> TuneResult:
    """Tune the user's own training step, in this process.

    ``make_batch(b)`` returns one micro-batch of b samples (a tensor of token ids, a dict for
    ``model(**batch)``, or anything ``loss_fn(model, batch)`` accepts; default loss: the output's
    ``.loss``, or next-token cross-entropy of logits for a tensor of tokens). ``optimizer``
    defaults to AdamW over the trainable parameters; its state is allocated by one full step before
    measuring. The model may be wrapped in DDP or FSDP or compiled with ``torch.compile``
    (compilation happens in the setup and warm-up calls, outside the timings). Under
    ``torch.distributed`` every rank must call ``tune`` with the same arguments: probes are
    synchronised (see :mod:`microbatch.measure.probes`), d defaults to the world size, and the cache
    is off.

    Peak memory: CUDA allocator statistics on a GPU; on the CPU the process's peak RSS, reset
    before each probe (``/proc/self/clear_refs``), so the figure includes the whole process. There
    is no child process here: on the CPU an over-committed host can kill this process, so give a
    ``max_micro_batch``. ``reference``: as in :func:`tune_model`.
    """
    import torch

    from microbatch.measure.probes import InProcessProber, TrainProbe

    t_start = time.perf_counter()
    _check_common(rule, tolerance, checkpointing, "train", precision, memory_budget_bytes, headroom)
    check_reference(reference)
    dist = torch.distributed.is_available() and torch.distributed.is_initialized()
    if data_parallel is None:
        data_parallel = torch.distributed.get_world_size() if dist else 1
    if use_cache is None:
        use_cache = not dist
    params = list(model.parameters())
    if device is None:
        device = params[0].device if params else torch.device("cpu")
    device = torch.device(device)
    dev_str = str(device) if device.type == "cuda" else "cpu"
    if timing is None:
        timing = CUDA_TIMING if device.type == "cuda" else CPU_TIMING

    def g_for(b: int) -> int | None:
        return None if global_batch is None else max(1, global_batch // (b * data_parallel))

    probe = TrainProbe(
        model,
        make_batch,
        loss_fn=loss_fn,
        optimizer=optimizer,
        device=device,
        precision=precision,
        timing=timing,
        grad_accum_for=g_for,
    )
    budget_source = "given" if memory_budget_bytes is not None else "none"
    if device.type == "cuda":
        if memory_budget_bytes is None:
            memory_budget_bytes, budget_source = _cuda_total(device), "device total"
        _check_cuda_budget(probe, memory_budget_bytes, dev_str)
    inner = model
    while hasattr(inner, "module") or hasattr(inner, "_orig_mod"):
        inner = getattr(inner, "_orig_mod", None) or inner.module
    fp = {
        "module": module_fingerprint(inner),
        "class": type(model).__name__,
        "timing": timing.__dict__,
        "in_process": True,
    }
    return _run(
        InProcessProber(probe),
        fingerprint_fields=fp,
        model_label=_class_name(inner),
        seq=None,
        mode="train",
        device=device.type,
        precision=precision,
        checkpointing=checkpointing,
        memory_budget_bytes=memory_budget_bytes,
        budget_source=budget_source,
        headroom=headroom,
        max_latency_ms=max_latency_ms,
        rule=rule,
        tolerance=tolerance,
        reference=reference,
        global_batch=global_batch,
        data_parallel=data_parallel,
        start=start,
        max_micro_batch=max_micro_batch,
        refine=refine,
        patience=patience,
        use_cache=use_cache,
        on_point=on_point,
        t_start=t_start,
    )
