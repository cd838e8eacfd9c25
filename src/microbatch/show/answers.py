"""The text answers of the calculator commands — ``bubble``, ``simulate``, ``memory``, ``noise`` and
``bench-gpu`` — from their results (DESIGN: only show/ writes sentences; a command parses, calls, renders).
``color`` says whether the terminal takes ANSI colours (the command decides: :func:`use_color`)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from microbatch.precision import get_precision, weight_cache_bytes
from microbatch.run.noise import MAX_SUGGEST_SE, MIN_STEPS
from microbatch.show.text import bubble_lines, pct, render_stats_table, render_timeline_text
from microbatch.units import format_bytes, format_number

if TYPE_CHECKING:
    from microbatch.hardware import Accelerator
    from microbatch.model import ModelShape
    from microbatch.predict.apply_calibration import AppliedCalibration
    from microbatch.predict.memory import MemoryConfig, MemoryEstimate
    from microbatch.schedules.simulate import SimResult

__all__ = [
    "calibration_lines",
    "render_bubble",
    "render_memory",
    "render_microbench",
    "render_noise",
    "render_simulate",
]

Rows = list[list[tuple[float, float, str, int]]]
"""A diagram's rows: per rank, (start, end, label, colour index) of each op."""


def render_bubble(
    title: str, result: dict[str, Any], sim: SimResult | None, width: int, *, color: bool = False
) -> str:
    """``bubble``'s text: the numbers, the method, the notes and (given ``sim``) the diagram."""
    lines = [
        title,
        *bubble_lines(result["bubble_fraction"], result["bubble_ratio"], result["peak_in_flight"]),
    ]
    if "idle_time_per_stage" in result:
        lines.append(f"  idle per stage   {result['idle_time_per_stage']:g}  time units")
    lines.append(f"  method: {result['method']}")
    lines += [f"  note: {n}" for n in result["notes"]]
    if sim is not None:
        lines.append("")
        lines.append(render_timeline_text(sim.timeline_rows(), sim.makespan, width=width, color=color))
    return "\n".join(lines)


def render_simulate(
    sim: SimResult,
    rows: Rows,
    title: str,
    result: dict[str, Any],
    idle_source: str,
    time_unit: str,
    diagram_width: int | None,
    *,
    color: bool = False,
) -> str:
    """``simulate``'s text: numbers, closed form, notes, per-rank table and (unless ``diagram_width`` is None) the diagram."""
    unit = f" {time_unit}" if time_unit else ""
    lines = [
        title,
        f"  makespan         {format_number(sim.makespan)}{unit}",
        *bubble_lines(sim.bubble_fraction, sim.bubble_ratio, sim.peak_in_flight),
    ]
    cf = result.get("closed_form", {})
    if "bubble_fraction" in cf:
        formula = cf.get("formula", "(p−1)/(v·m+p−1)")
        lines.append(f"  closed form      {pct(cf['bubble_fraction']):>6}  {formula}, uniform stages")
    if "idle_time_per_stage" in cf:
        lines.append(
            f"  closed form      idle per stage {format_number(cf['idle_time_per_stage'])}{unit}  "
            + f"({idle_source})"
            + (
                f"; does not hold at these times (it needs {cf.get('valid_when')})"
                if cf.get("exact") is False
                else ""
            )
        )
    lines += [f"  note: {n}" for n in result["notes"]]
    lines += ["", render_stats_table(result["stage_stats"], time_unit=time_unit)]
    if diagram_width is not None:
        lines += [
            "",
            render_timeline_text(rows, sim.makespan, width=diagram_width, color=color, time_unit=time_unit),
        ]
    for key in ("svg", "png"):
        if key in result:
            lines.append(f"wrote {result[key]}")
    return "\n".join(lines)


def _table_unit(est: MemoryEstimate) -> str:
    """The unit of the memory table: the peak's (GiB for a model of any size; MiB, KiB for the small CPU models
    whose every column read 0.00G)."""
    return format_bytes(est.peak_bytes).split()[-1]


def _stage_rows(est: MemoryEstimate) -> list[str]:
    """One row per stage (bytes in :func:`_table_unit`), the peak stage marked."""
    lines: list[str] = []
    peak = est.peak_stage.stage
    unit = _table_unit(est)

    def col(n: float, width: int = 9) -> str:
        return format_bytes(n, unit=unit).replace(f" {unit}", unit[0] if unit != "B" else " B").rjust(width)

    for st in est.stages:
        mark = " <- peak" if st.stage == peak else ""
        lines.append(
            f"{st.stage:>5} {st.layers:>6} {st.in_flight:>9} {col(st.weights_bytes)} {col(st.gradients_bytes)} "
            f"{col(st.optimizer_bytes)} {col(st.activations_bytes)} {col(st.other_bytes, 8)} "
            f"{col(st.peak_bytes)}{mark}"
        )
    if len(est.stages) > 12:
        top = sorted(est.stages, key=lambda s: -s.peak_bytes)[:1]
        lines.append(f"(highest: stage {top[0].stage})")
    return lines


def render_memory(
    shape: ModelShape,
    cfg: MemoryConfig,
    est: MemoryEstimate,
    out: dict[str, Any],
    acc: Accelerator | None,
    applied: AppliedCalibration | None,
) -> str:
    """``memory``'s text: the setting, one row per stage, the peak and whether it fits."""

    w, g, o = cfg.state_bytes_per_param()
    moe = shape.moe
    params = f"{shape.param_count():,} parameters" + (
        f" ({shape.active_param_count():,} active; E={moe.experts}, top-k={moe.top_k}, EP={cfg.expert_parallel})"
        if moe is not None
        else ""
    )
    lines = [
        f"{shape.name}: {params}; b_m={cfg.micro_batch} s={cfg.seq or shape.seq} "
        f"t={cfg.tensor_parallel}{' +SP' if cfg.sequence_parallel else ''} p={cfg.pipeline_parallel} "
        f"{f'c={cfg.context_parallel} ' if cfg.context_parallel > 1 else ''}"
        + (f"v={cfg.virtual} m={cfg.m} {cfg.schedule}" if cfg.pipeline_parallel > 1 else "(no pipeline)")
        + f"; recompute {cfg.recompute}"
        f"{f' (one layer in {cfg.recompute_every})' if cfg.recompute == 'full' and cfg.recompute_every > 1 else ''}; "
        f"{_precision_words(cfg)} "
        f"({w}+{g}+{o} = {w + g + o} B/param{_cache_words(cfg)}), {cfg.loss_kernel} loss"
        f"{', eager layers' if cfg.layer_kernels == 'eager' else ''}, ZeRO {cfg.zero} over "
        f"d={cfg.data_parallel}"
        + "".join(
            f" ({k} {getattr(cfg, k)})"
            for k, usual in (("zero3_impl", "fsdp2"), ("reduce_dtype", "auto"))
            if getattr(cfg, k) != usual
        )  # fmt: skip
        + (
            f" in groups of {cfg.shard_degree} (hybrid: {cfg.data_parallel // cfg.shard_degree} replicas)"
            if cfg.shard_degree is not None and cfg.zero >= 1 and cfg.shard_degree < cfg.data_parallel
            else ""
        )
        + (
            (
                " (held as ZeRO 2 through the step: weights whole from the first forward, gradients "
                "reduce-scattered after each micro-batch)"
                if cfg.pipeline_grad_reduce == "each"
                else " (held as ZeRO 1 through the step: FSDP under a pipeline keeps weights and gradients whole)"
            )
            if cfg.pipeline_parallel > 1 and cfg.zero >= 2
            else ""
        ),
        "",
        f"{'stage':>5} {'layers':>6} {'in-flight':>9} {'weights':>9} {'grads':>9} {'optim':>9} "
        f"{'activ':>9} {'other':>8} {'peak':>9}",
    ]
    peak = est.peak_stage.stage
    lines += _stage_rows(est)
    unit = _table_unit(est)
    terms = ", ".join(f"{k} {format_bytes(v, unit=unit)}" for k, v in est.peak_stage.activation_terms.items())
    lines += [
        "",
        f"peak {format_bytes(est.peak_bytes, unit=unit)} on stage {peak} (activations: {terms})",
    ]
    if acc is not None:
        verdict = "fits" if out["fits"] else "does NOT fit"
        budget, whole = (
            format_bytes(out["memory_budget_bytes"], unit="GiB"),
            format_bytes(acc.memory_bytes, unit="GiB"),
        )
        lines.append(
            f"{verdict} in {budget} of {acc.name} ({whole} × (1 − headroom {out['memory_headroom']:g}), as plan keeps)"
            + (
                "; it fits the whole device, with less than the headroom free"
                if out["fits_device"] and not out["fits"]
                else ""
            )
        )
    if applied:
        lines += [""] + calibration_lines(applied)
    lines += [f"note: {n}" for n in out.get("notes", [])]
    return "\n".join(lines)


def _precision_words(cfg: MemoryConfig) -> str:
    """The precision, with its FP8 recipe where the GEMMs are FP8."""
    return (
        f"{cfg.precision} {cfg.fp8_recipe}"
        if get_precision(cfg.precision).gemm_dtype == "fp8"
        else cfg.precision
    )


def _cache_words(cfg: MemoryConfig) -> str:
    """`` + n B a layer parameter of FP8 weights cached`` where the recipe keeps them (Transformer Engine's), else ``""``."""
    n = weight_cache_bytes(cfg.precision, cfg.fp8_recipe)
    return f" + {n} B a layer parameter of cached FP8 weights" if n else ""


def render_microbench(d: dict[str, Any]) -> str:
    """``bench-gpu``'s text: a short table: GEMMs, attention, streaming, collectives, then the notes."""

    def frac(f: float | None) -> str:
        return f"{100 * f:5.1f}%" if f is not None else "     -"

    lines = [
        f"{d['device_name']} ({d['accelerator'] or 'not in the accelerator table'}), {d['dtype']}, torch "
        f"{d['torch_version']}; {d['timer']}; {d['seconds_total']:.1f} s",
        f"GEMMs (model {d['model']}, s = {d['seq']}, b_m {', '.join(map(str, d['micro_batches']))}; then the grid)",
        "  label      rows      k      n     seconds   TFLOP/s  of peak",
    ]
    for g in d["gemms"]:
        lines.append(
            f"  {g['label']:<7} {g['rows']:>7} {g['k']:>6} {g['n']:>6}  {g['seconds']:.3e}  "
            f"{g['flops_per_s'] / 1e12:8.3f}  {frac(g['fraction_of_peak'])}"
        )
    for a in d["attention"]:
        lines.append(
            f"attention causal s={a['seq']:<6} b={a['batch']} heads={a['heads']} d={a['head_dim']}: "
            f"{a['flops_per_s'] / 1e12:.3f} TFLOP/s {frac(a['fraction_of_peak'])}"
        )
    for s in d["stream"]:
        lines.append(
            f"stream {s['kernel']:<9} {s['bytes_per_s'] / 1e9:8.1f} GB/s {frac(s['fraction_of_bandwidth'])}"
        )
    for c in d["collectives"]:
        lines.append(
            f"{c['op']} over {c['world_size']} ranks: bus {c['bus_bytes_per_s'] / 1e9:.1f} GB/s {frac(c['fraction_of_link'])}"
        )
    if d.get("overlap_slowdown") is not None:
        lines.append(f"a GEMM beside an all-reduce: {d['overlap_slowdown']:+.1%} against alone")
    if d["launch_s_per_kernel"] is not None:
        lines.append(f"launch floor: {d['launch_s_per_kernel'] * 1e6:.2f} µs per eager kernel")
    if d.get("layer_host_s_per_kernel") is not None:
        lines.append(
            f"host time of an eager layer: {d['layer_host_s_per_kernel'] * 1e6:.2f} µs per counted kernel "
            "(forward and backward, the planner's launch cost)"
        )
    if d.get("sm_clock_mhz") is not None or d.get("power_limit_w") is not None:
        clock, top, watts = d.get("sm_clock_mhz"), d.get("max_sm_clock_mhz"), d.get("power_limit_w")
        lines.append(
            "board: "
            + (f"power limit {watts:,.0f} W; " if watts else "")
            + (f"SM clock under a long GEMM {clock:,.0f} MHz" if clock else "SM clock not read")
            + (f" of {top:,.0f} maximum" if clock and top else "")
        )
    burst, held = d.get("burst_square_flops_per_s"), d.get("sustained_square_flops_per_s")
    if burst and held:
        lines.append(
            f"square 8,192 GEMM: {burst / 1e12:,.0f} TFLOP/s in a burst, {held / 1e12:,.0f} under load "
            f"({held / burst:.3f} of it; the Hopper rows assume 0.847)"
        )
    if d.get("soak_s"):
        lines.append(f"each GEMM and attention kernel timed after {d['soak_s']:g} s of back-to-back calls")
    lines += [f"note: {n}" for n in d["notes"]]
    return "\n".join(lines)


def calibration_lines(applied: AppliedCalibration) -> list[str]:
    """What ``plan``/``memory --calibration`` applied, in words, then each note."""
    c, m = applied.calibration, applied.memory
    if applied.sources:
        head = f"kernel terms from a microbenchmark of {c.device_name or c.device} ({c.accelerator}):"
        rows = [f"  {term}: {where}" for term, where in applied.sources.items()]
        return [head, *rows, "  memory model (bytes): analytic, a microbenchmark measures no memory"] + [
            f"note: {n}" for n in applied.notes
        ]
    head = (
        f"calibrated from {c.model} s={c.seq} {c.precision} on {c.device_name or c.device} (b_m "
        f"{', '.join(map(str, c.micro_batches))}): activations × {m.activation_scale:.3f}, "
        f"+ {format_bytes(m.fixed_bytes, unit='GiB')} fixed, fitted with {c.loss_kernel} loss (priced so unless "
        "told another)"
    )
    if applied.efficiency is c.efficiency and c.efficiency is not None:
        e = c.efficiency
        head += f"; GEMM efficiency {e.gemm_max:.2f} of peak, half of it at {e.half_rows:,.0f} rows"
    return [head] + [f"note: {n}" for n in applied.notes]


def _scatter(rel_se: float | None, steps: int) -> str:
    """`` (± x% standard error over n steps)``, or nothing where no error was computed."""
    return "" if rel_se is None else f" (± {100 * rel_se:.0f}% standard error over {steps} steps)"


def render_noise(r: dict[str, Any], *, steps: str = "steps") -> str:
    """``noise``'s text, from its result dict; ``steps`` names the setting for more steps, in the caller's words."""
    lines = [
        f"gradient noise scale: {r['model']}, seq {r['seq']}, B_global {r['global_batch']}, b_m {r['micro_batch']}, "
        f"{r['steps']} steps"
        + (f" (interrupted: {r['steps']} of {r['steps_asked']} measured)" if r.get("interrupted") else ""),
        "  data: random tokens (Zipf unigram) at initialisation; a demonstration, not your data",
    ]
    if r["g_sq"] is None:
        return "\n".join([*lines, "  nothing measured: interrupted before the first step finished"])
    lines += [f"  |G|²   (smoothed)  = {r['g_sq']:.4g}", f"  tr(Σ)  (smoothed)  = {r['trace_sigma']:.4g}"]
    b_tokens, b_seqs = r["b_simple_tokens"], r["b_simple_sequences"]
    if math.isfinite(b_tokens) and r.get("g_sq_resolved") is False:
        low = r.get("b_simple_lower_tokens")
        bound = (
            f"B_simple ≥ {low:,.0f} tokens = {low / r['tokens_per_sequence']:,.1f} sequences (mean tr(Σ) over |G|² "
            "at its mean plus two standard errors)"
            if low
            else "B_simple not bounded"
        )
        lines.append(
            f"  {bound}: |G|² is within two standard errors of 0 over {r['steps']} steps, so the ratio of the means "
            f"({b_tokens:,.0f} tokens) is no estimate and no B_global is suggested; run more {steps}"
        )
    elif math.isfinite(b_tokens):
        lines.append(
            f"  B_simple = tr(Σ)/|G|² = {b_tokens:,.0f} tokens = {b_seqs:,.1f} sequences of {r['tokens_per_sequence']}"
            + _scatter(r.get("b_simple_rel_se"), r["steps"])
        )
        lines.append(
            f"  suggestion: B_global near {max(1, round(b_seqs))} sequences (the statistical choice; "
            "b_m is the physical one)"
            if r.get("g_sq_resolved") is True and (r.get("b_simple_rel_se") or 0.0) <= MAX_SUGGEST_SE
            else f"  no B_global suggested: {r['steps']} steps are too few to tell |G|² from its scatter "
            f"({MIN_STEPS} or more); run more {steps}"
            if r.get("g_sq_resolved") is None
            else f"  no B_global suggested: its standard error is past {MAX_SUGGEST_SE:.0%}; run more {steps}"
        )
    else:
        what = "|G|²" if not r["g_sq"] > 0 else "tr(Σ)"
        sign = "≤ 0" if what == "|G|²" else "< 0"
        lines.append(
            f"  B_simple: {what} not resolved above its estimator's scatter ({sign}); run more {steps}"
        )
    return "\n".join(lines)
