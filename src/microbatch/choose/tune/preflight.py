"""Checks made before any model is built or any probe starts (check before work).

A tune that is refused after six probes, or a model whose weights and optimizer state do not fit
the host, wastes minutes and can take the machine down with it. Every check here reads only the
settings and the model's shape: no torch, no allocation.

- :func:`check_walk`: the walk has a point to measure and a point the global batch accepts.
- :func:`static_train_bytes` / :func:`check_static_fits`: the model's weights (+ gradients and
  Adam's two moments for training) against the memory budget, before the model is built.
- :func:`microbatch.model.check_seq`: a sequence no longer than the model's learned position table.
- :func:`microbatch.measure.hf.require_transformers`: the optional ``transformers``, when needed.
"""

from __future__ import annotations

from collections.abc import Mapping

from microbatch.batch import divisors, first_micro_batch, nearest_multiples, next_micro_batch, per_replica
from microbatch.choose.config import ChoiceConfig
from microbatch.choose.tune.config import SearchConfig
from microbatch.errors import ConfigError
from microbatch.model import ModelShape
from microbatch.predict.state import model_state_bytes
from microbatch.units import format_bytes, format_count

__all__ = [
    "check_smallest_time",
    "SMALLEST_FIT_MARGIN",
    "check_smallest_fits",
    "walk_sizes",
    "check_walk",
    "KEYWORD_NAMES",
    "static_train_bytes",
    "check_static_fits",
]


def walk_sizes(search: SearchConfig, per_replica: int | None = None) -> list[int]:
    """The b_m the walk may probe: start, then :func:`microbatch.batch.next_micro_batch` (doubling,
    or the divisors of ``per_replica`` = B_global / d when given) up to ``max_micro_batch`` (the
    first 64 with no cap)."""
    sizes: list[int] = []
    b: int | None = first_micro_batch(search.start, per_replica)
    cap = search.max_micro_batch
    while b is not None and (b <= cap if cap is not None else len(sizes) < 64):
        sizes.append(b)
        b = next_micro_batch(b, per_replica)
    return sizes


KEYWORD_NAMES = {"start": "start", "max": "max_micro_batch", "B": "global_batch", "d": "data-parallel size"}
"""How the Python API names them (``microbatch.tune(..., global_batch=...)``, the configs' fields; d
is the world size under torch.distributed unless ``data_parallel`` is given). The command line passes
its flags (``microbatch.commands.tune.FLAG_NAMES``)."""


def check_walk(search: SearchConfig, choice: ChoiceConfig, names: Mapping[str, str] = KEYWORD_NAMES) -> None:
    """ConfigError when no b_m of the walk could be chosen: nothing to measure, or none whose
    b_m·d divides the global batch (the knee is chosen among those only). ``names``: how the
    caller's user spells the settings (KEYWORD_NAMES, or the command line's flags), so the fix names what to change."""

    def given(key: str, value: object) -> str:
        name = names[key]
        return f"{name} {value}" if name.startswith("-") or " " in name else f"{name}={value}"

    cap = search.max_micro_batch
    if cap is not None and search.start > cap:
        raise ConfigError(
            f"{given('start', search.start)} is above {given('max', cap)}: nothing would be measured; "
            f"use {given('start', cap)} or less, or raise {names['max']}"
        )
    if choice.global_batch is None:
        return
    d = choice.data_parallel or 1
    per = per_replica(choice.global_batch, d)
    if per is None:
        near = nearest_multiples(choice.global_batch, d)
        raise ConfigError(
            f"{given('B', choice.global_batch)} is not divisible by {given('d', d)}: no micro-batch "
            f"b_m gives B = b_m × g × d; use a multiple of {d}, e.g. {' or '.join(map(str, near))}"
        )
    sizes = walk_sizes(search, per)
    if not any(per % b == 0 for b in sizes):
        fix = (
            f"use {given('start', 1)} (or another divisor of {per})"
            if search.start > per
            else f"use a {names['start']} that divides {per} (e.g. 1), or raise {names['max']}"
        )
        probed = (
            f"which none of the probed b_m ({', '.join(map(str, sizes[:6]))}{', ...' if len(sizes) > 6 else ''}) "
            "divides"
            if sizes
            else f"and no divisor of {per} ({', '.join(map(str, divisors(per)[:8]))}) lies from "
            f"{given('start', search.start)} to {given('max', cap)}"
        )
        raise ConfigError(
            f"{given('B', choice.global_batch)} with {given('d', d)} leaves {per} samples per replica, "
            f"{probed} (B = b_m × g × d needs a whole g); {fix}"
        )


def static_train_bytes(params: int, mode: str) -> int:
    """Bytes the probes keep for the whole run before any activation: fp32 weights, and for
    training fp32 gradients and AdamW's two fp32 moments (4 + 4 + 8 = 16 B/param,
    :func:`microbatch.predict.state.model_state_bytes` with ``precision="fp32"``; the probes hold
    fp32 master weights under autocast, so bf16-mixed is the same). Decoding: weights only (4 B/param)."""
    if mode != "train":
        return 4 * params
    return int(sum(model_state_bytes(params, precision="fp32").values()))


def check_static_fits(shape: ModelShape, mode: str, budget: int | None, budget_source: str) -> None:
    """ConfigError, before the model is built, when its static memory exceeds ``budget``."""
    if budget is None:
        return
    params = shape.param_count()
    need = static_train_bytes(params, mode)
    if need > budget:
        what = (
            "fp32 weights, gradients and AdamW's two moments, 16 B/param"
            if mode == "train"
            else ("fp32 weights, 4 B/param")
        )
        raise ConfigError(
            f"model {shape.name} ({format_count(params)} parameters) needs {format_bytes(need)} before any "
            f"activation ({what}), over the memory budget {format_bytes(budget)} ({budget_source}); "
            "use a smaller model, raise memory_budget_bytes, or plan it with `microbatch plan` (sharding, pipelining)",
            params=("memory_budget_bytes",),
        )


SMALLEST_FIT_MARGIN = 2.0
"""How far over the budget the predicted peak of the smallest probe must be before tune refuses to start:
the memory model is not the measurement (eager kernels on the CPU hold buffers it does not count, a probe's
allocator rounds), so a prediction within this factor of the budget is left to the probe to find out, and
only a size that no error of the model explains is refused (seq 10^12, a context past any budget)."""


def check_smallest_fits(
    shape: ModelShape, *, seq: int, start: int, checkpointing: str, precision: str, budget: int | None,
    budget_source: str,
) -> None:  # fmt: skip
    """ConfigError, before any probe, when the smallest micro-batch's predicted training peak (with
    checkpointing if the search may use it) is over :data:`SMALLEST_FIT_MARGIN` × ``budget``."""
    if budget is None:
        return
    from microbatch.predict.memory import MemoryConfig, estimate_memory
    from microbatch.predict.memory_fit import MEASURED_LOSS_KERNEL

    rc = "none" if checkpointing == "off" else "full"
    cfg = MemoryConfig(
        micro_batch=start, seq=seq, precision=precision, recompute=rc, loss_kernel=MEASURED_LOSS_KERNEL
    )
    peak = estimate_memory(shape.with_seq(seq), cfg).peak_bytes
    if peak > SMALLEST_FIT_MARGIN * budget:
        raise ConfigError(
            f"model {shape.name} at seq {seq:,} needs about {format_bytes(peak)} at b_m {start}"
            f"{' with checkpointing' if rc == 'full' else ''} (the memory model), over {SMALLEST_FIT_MARGIN:g}× the "
            f"memory budget {format_bytes(budget)} ({budget_source}); give a shorter seq, "
            + ("checkpointing auto, " if rc == "none" else "")
            + "or a larger memory_budget_bytes",
            params=("seq", "memory_budget_bytes", "checkpointing"),
        )


CPU_CORE_FLOPS_BOUND = 4e12
"""A bound on one CPU core's rate, in the FLOPs :func:`~microbatch.predict.roofline.model_flops_per_step` counts (the
causal attention full): 4 TFLOP/s, a Sapphire Rapids core's AMX peak in bf16 (1,024 FMA a cycle × 2 × 2 GHz = 4.1e12),
where two 512-bit FMA units in fp32 give 2 × 16 × 2 × 3.5e9 = 224e9 and this VM's cores measured 108-177 GFLOP/s of
that count (a review of the first bound, 200 GFLOP/s, which an AMX core passes): a probe slower than the bound is
surely slower on the machine, so the check refuses only what cannot run."""
SMALLEST_TIME_STEPS = 2
"""Micro-steps the first probe runs at the least (its setup step and one timed; warm-up and repeats come on top)."""


def check_smallest_time(
    shape: ModelShape, *, seq: int, start: int, mode: str, timeout_s: float, cores: int
) -> None:
    """ConfigError, before any probe on a CPU, when the smallest micro-batch's :data:`SMALLEST_TIME_STEPS` steps
    cannot end within the probe's ``timeout_s`` even at :data:`CPU_CORE_FLOPS_BOUND` a core: the model's FLOPs
    (:func:`microbatch.predict.roofline.model_flops_per_step`, a third of them for a decode step's forward) over that
    bound (a new user's sweep, 2026-12-08: tiny at seq 100,000 probed b_m 1 for 10 minutes before failing)."""
    from microbatch.predict.roofline import model_flops_per_step

    flops = model_flops_per_step(shape.with_seq(seq), start, seq) / (3 if mode != "train" else 1)
    seconds = SMALLEST_TIME_STEPS * flops / (CPU_CORE_FLOPS_BOUND * max(1, cores))
    if seconds > timeout_s:
        raise ConfigError(
            f"model {shape.name} at seq {seq:,}: b_m {start}'s first {SMALLEST_TIME_STEPS} steps are "
            f"{SMALLEST_TIME_STEPS * flops:.3g} FLOPs, at least {seconds:,.0f} s on {cores} cores even at "
            f"{CPU_CORE_FLOPS_BOUND / 1e9:g} GFLOP/s a core, past the probe timeout of {timeout_s:g} s; give a "
            "shorter seq, a smaller model, or a longer probe_timeout_s",
            params=("seq", "probe_timeout_s"),
        )
