"""Text of a choice: the measured curve with the knee marked, the recommendation, and a tune's run.

Reads the dicts that ``recommend`` and ``tune`` print with ``--json``
(:meth:`microbatch.choose.knee.Recommendation.to_dict`, :meth:`microbatch.choose.result.TuneResult.to_dict`),
so a saved result renders the same as a fresh one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from microbatch.choose.bound import BOUND_MIN_POINTS, BOUND_SLACK, BOUND_WINDOW
from microbatch.records_fields import throughput_unit
from microbatch.units import format_bytes

__all__ = ["detail_lines", "render_curve", "render_recommendation", "render_tune", "use_line"]


def render_curve(d: Mapping[str, Any], points: Sequence[Mapping[str, Any]]) -> list[str]:
    """One line per measured b_m (throughput, step time, peak), the knee and the fastest marked (none when ``d`` has
    no choice: the points of a refused one), and the points measured with activation checkpointing on. A decode
    tune's throughput is generated tokens per second over its decode steps, the prefill apart (its own column)."""
    decode = d.get("mode") == "decode"
    head = ("decode tok/s", "ms/token") if decode else ("throughput", "step ms")
    lines = [
        f"{'b_m':>6} {head[0]:>14} {head[1]:>9} {'peak memory':>12}  " + ("prefill ms" if decode else "")
    ]
    knee, fastest = d.get("micro_batch"), (d.get("fastest_fitting") or {}).get("micro_batch")
    for p in sorted(points, key=lambda p: p["micro_batch"]):
        mark = []
        if p["micro_batch"] == knee:
            mark.append("knee")
        if p["micro_batch"] == fastest:
            mark.append("fastest")
        if p.get("checkpointing") is True:
            mark.append("checkpointed")
        if p.get("oom"):
            lines.append(f"{p['micro_batch']:>6} {'out of memory':>14}")
            continue
        st, pre = p.get("step_time_s"), p.get("prefill_s")
        prefill = f"{pre * 1e3:>10.2f}  " if decode and isinstance(pre, (int, float)) and pre == pre else ""
        lines.append(
            f"{p['micro_batch']:>6} {p['throughput']:>14,.1f} {'' if st is None else f'{st * 1e3:.2f}':>9} "
            f"{format_bytes(p.get('peak_memory_bytes')):>12}  {prefill}{', '.join(mark)}"
        )
    return lines


def _line(d: Mapping[str, Any]) -> float | None:
    """(1 − τ)·(1 + μ): the share of the reference the knee had to reach (rule fraction), else None."""
    if d.get("rule") != "fraction":
        return None
    return (1 - float(d["tolerance"])) * (1 + float(d.get("bound_margin") or 0.0))


def _margin_text(d: Mapping[str, Any], why: str, of: str = "it") -> str:
    """The line the knee had to clear, (1 − τ)·(1 + μ) of the reference, when rule fraction used μ."""
    mu = d.get("bound_margin")
    line = _line(d)
    if line is None or mu is None:
        return ""
    tau = float(d["tolerance"])
    reached = d.get("fraction_of_reference")
    within = " within the limits" if d.get("left_out") else ""
    short = (
        f": no measured b_m reached it, so the knee is the best measured{within}"
        if reached is not None and reached < line * (1 - 1e-9)
        else ""
    )
    return f"; the knee had to reach (1 − {tau:g})·(1 + {100 * mu:.1f}%) = {100 * line:.1f}% of {of} ({why}){short}"


def _bound_lines(d: Mapping[str, Any], unit: str) -> list[str]:
    bound = d.get("throughput_bound")
    if bound:
        on = bound["fitted_on"]
        ref = d.get("reference_throughput")
        below = ref is not None and ref > bound["throughput"] * (1 + 1e-12)  # the best measured beat it
        # fitted on the b_m the limits leave in: one measured past them and left out (latency, budget) may beat it
        limited = any(item["micro_batch"] > on[-1] for item in d.get("left_out") or [])
        return [
            f"bound: no b_m past {on[-1]}{' within the limits' if limited else ''} runs faster than "
            f"{bound['throughput']:,.1f} {unit} "
            f"(1 / the slope of step time against b_m, fitted on {', '.join(str(b) for b in on)}: "
            f"affine within {100 * bound['max_residual']:.1f}%)"
            + (f"; the best measured, {ref:,.1f} {unit}, is above it and is the reference" if below else "")
            + _margin_text(d, "two standard errors of that fit", "the reference" if below else "it")
        ]
    if d.get("reference") == "bound" and d.get("rule") == "fraction":
        contradicted = d.get("bound_contradicted") is not None  # its own line says why
        why = (
            "fitted, then dropped: a measured b_m beat it" if contradicted else d.get("bound_absent")
        ) or (  # a result written before the reason was kept
            f"fewer than {BOUND_MIN_POINTS} points, or step time over the {BOUND_WINDOW} largest misses a line by "
            f"more than {100 * BOUND_SLACK:g}%"
        )
        return [f"bound: none ({why}); best measured used" + _margin_text(d, "no fit to take it from")]
    return []


def _dividing(most: int, d: Mapping[str, Any]) -> str:
    """Beside the largest b_m predicted to fit, where a global batch is held and it does not divide B/d, the largest
    that does (a walk-through: "36" under -B 64, which no step can run)."""
    big_b, dp = d.get("global_batch"), d.get("data_parallel") or 1
    if not most or not big_b or big_b % dp:
        return ""
    per = big_b // dp
    if per % most == 0:
        return ""
    best = max((b for b in range(1, min(most, per) + 1) if per % b == 0), default=None)
    return f" (the largest dividing B/d = {per}: {best})" if best else ""


def _noise_lines(d: Mapping[str, Any]) -> list[str]:
    """The b_m the measurements cannot tell from the knee, and how the knee was chosen among them."""
    same = [b for b in d.get("indistinguishable") or [] if b != d["micro_batch"]]
    out = []
    if same:
        line = _line(d)
        reached = line is None or float(d.get("fraction_of_reference") or 0.0) >= line - 1e-9
        out.append(
            (
                f"indistinguishable at the measured noise: b_m {', '.join(str(b) for b in same)} (two standard "
                "errors of the medians); "
                if d.get("noise_from", "repeats") == "repeats"
                else "indistinguishable at the curve's own scatter (no repeats measured: the residuals of its "
                f"largest points about a line, which a bend of the curve inflates): b_m {', '.join(map(str, same))}; "
            )
            + (
                "the knee is the least memory among them that reaches the line"
                if reached
                else "none reaches the line, so the knee is the fastest measured"
            )
        )
    if d.get("bound_contradicted") is not None:
        out.append(
            f"bound dropped: b_m {d['bound_contradicted']} measured faster than the line through the tail "
            "allowed (a projection never overrides a measurement); the reference is the best measured"
        )
    return out


def render_recommendation(
    d: Mapping[str, Any], points: Sequence[Mapping[str, Any]] | None = None, unit: str = "samples/s"
) -> str:
    """Human text of a recommendation dict (and, if given, the measured curve)."""
    lines = [*render_curve(d, points), ""] if points else []
    g = d.get("grad_accum")
    bound = d.get("throughput_bound")
    lines.append(
        f"knee ({d['rule']}, τ = {d['tolerance']:g}): b_m = {d['micro_batch']}"
        + (f", g = {g}" if g is not None else "")
        + f"  — {d['throughput']:,.1f} {unit}, {100 * (d['fraction_of_best'] or 0):.1f}% of best"
        + (
            f", {100 * d['fraction_of_reference']:.1f}% of the bound"
            if bound and d.get("reference_throughput", 0) > d["fastest_fitting"]["throughput"]
            else ""
        )
        + f", peak {format_bytes(d['peak_memory_bytes'])}"
    )
    f = d["fastest_fitting"]
    lines.append(
        f"fastest that fits: b_m = {f['micro_batch']}"
        + (f", g = {f['grad_accum']}" if f.get("grad_accum") is not None else "")
        + f"  — {f['throughput']:,.1f} {unit}, peak {format_bytes(f['peak_memory_bytes'])}"
    )
    return "\n".join(lines + detail_lines(d, unit))


def detail_lines(d: Mapping[str, Any], unit: str, *, left_out: bool = True) -> list[str]:
    """What qualifies the knee, in the text's words (the HTML report shows the same): b_m the noise cannot tell
    apart, the bound and its line, the memory fit, the largest b_m predicted to fit, the b_m left out (unless
    ``left_out`` is False) and a curve that had not flattened."""
    lines = _noise_lines(d)
    lines += _bound_lines(d, unit)
    fit = d.get("memory_fit")
    if fit:
        lines.append(
            f"memory fit: {format_bytes(fit['intercept_bytes'])} + {format_bytes(fit['slope_bytes_per_sample'])}"
            f" × b_m (on b_m = {', '.join(str(b) for b in fit.get('fitted_on', []))})"
        )
    most = d.get("max_fitting_micro_batch")
    if most is not None:
        lines.append(
            f"largest b_m predicted to fit {format_bytes(d['memory_budget_bytes'])} with "
            f"{100 * d['memory_headroom']:.0f}% headroom: {most or 'none'}"
            + _dividing(most, d)
            + (
                f" (the knee, b_m = {d['micro_batch']}, was measured at {format_bytes(d['peak_memory_bytes'])}: "
                "within the budget, not within the headroom the prediction keeps)"
                if most < d["micro_batch"]
                else ""
            )
        )
    left = d.get("left_out") or []
    reasons: dict[str, list[str]] = {}
    for item in left:
        reasons.setdefault(item["why"], []).append(str(item["micro_batch"]))
    for why, sizes in reasons.items() if left_out else ():
        lines.append(f"left out: b_m {', '.join(sizes)} ({why})")
    oom_above = d.get("out_of_memory_above")
    larger_left = [
        str(i["micro_batch"]) for i in left if i["micro_batch"] > d["fastest_fitting"]["micro_batch"]
    ]
    if not d.get("flattened", True) and not str(d.get("stop_reason", "")).startswith("knee settled"):
        # a settled knee is bounded: no larger b_m can move it, flattened or not; nor can one that ran out of memory
        lines.append(
            "note: the curve had not flattened at the largest b_m measured; "
            + (
                "the larger b_m ran out of memory, so none is within reach"
                if oom_above
                else f"the larger b_m measured ({', '.join(larger_left)}) are past the limits"
                if larger_left
                else "a larger b_m may be faster"
            )
        )
    return lines


def use_line(d: Mapping[str, Any]) -> str:
    """The answer in one plain line: ``use b_m = 4, g = 64 (b_m x g x d = 4 x 64 x 1 = 256)``; without a
    global batch g is left to the caller: ``use b_m = 4 (g = B_global / (b_m x d): no global batch given)``."""
    b_m, g, dp = d["micro_batch"], d.get("grad_accum"), d.get("data_parallel") or 1
    ckpt = " with activation checkpointing on (as it was measured)" if d.get("checkpointing") is True else ""
    if g is None or d.get("global_batch") is None:
        return f"use b_m = {b_m}{ckpt} (g = B_global / (b_m x d): no global batch given)"
    return f"use b_m = {b_m}, g = {g}{ckpt} (b_m x g x d = {b_m} x {g} x {dp} = {b_m * g * dp})"


def cache_line(cache: Mapping[str, Any], again: str = "use_cache=False") -> str:
    """One line for an answer served (partly) from the cache: how many points, when they were
    measured, where, and how to measure again (``again``: the caller's words for it; the command
    line passes its flag)."""
    import time

    at = cache.get("oldest_measured_at")
    when = f", measured from {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(at))}" if at else ""
    return (
        f"from the cache: {cache['points']} of {cache['points'] + cache['measured']} points{when} "
        f"({cache['file']}); {again} measures them again"
    )


def render_tune(d: Mapping[str, Any], unit: str | None = None, *, again: str = "use_cache=False") -> str:
    """Human text of a tune result dict: what was tuned, the curve and the choice, how it stopped,
    and last the answer in one plain line (:func:`use_line`), where a terminal leaves the eye.
    ``unit``: the throughput's, by default what the points counted (:func:`~microbatch.records_fields.throughput_unit`);
    ``again``: how to measure cached points again, in the caller's words (:func:`cache_line`)."""
    head = (
        f"tune {d['model']} ({d['mode']}, "
        + (f"seq {d['seq']}, " if d.get("seq") is not None else "")
        + f"{d['precision']}, {d['device_name']}, "
        f"torch {d['torch_version']})"
    )
    tail = [
        f"stopped: {d['stop_reason']}",
        f"{d['probes']} probes measured, {d['cached']} from the cache, {d['oom_events']} out of memory, "
        f"{d['wall_time_s']:.1f} s; memory method: {d['memory_method']}",
    ]
    if d.get("cache"):
        tail.append(cache_line(d["cache"], again))
    if d.get("static_bytes"):
        what = "process, weights" + (", gradients, optimizer" if d["mode"] == "train" else "")
        tail.append(f"static memory ({what}): {format_bytes(d['static_bytes'], digits=0, unit='MiB')}")
    if d.get("memory_budget_bytes") is not None:
        tail.append(
            f"memory budget: {format_bytes(d['memory_budget_bytes'], unit='GiB')} ({d['memory_budget_source']})"
        )
    if d.get("timing_choice"):
        tail.append(str(d["timing_choice"]))
    tail += [f"note: {n}" for n in d.get("notes") or []]
    if d.get("interrupted"):
        tail.append("interrupted: the choice uses the points measured so far")
    tail += ["", use_line(d)]
    return "\n".join(
        [head, "", render_recommendation(d, d["points"], unit=unit or throughput_unit(d)), *tail]
    )
