"""The planner's answer as text: the trade-off table, the comparison across accelerators, the
recommendation in words. Plain data in, strings out (the library never prints; the commands do).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from microbatch.errors import ConfigError
from microbatch.hardware import Accelerator
from microbatch.moe import Experts, as_experts
from microbatch.predict.candidate import Candidate
from microbatch.predict.experts import rows_per_expert
from microbatch.predict.plan import Plan, PlanConfig
from microbatch.predict.plan_advice import (
    advice_from_dict,
    lint_from_dict,
)
from microbatch.predict.state import StateSettings
from microbatch.show.plan_words import Words, advice_lines, gib, lint_sentence, say

__all__ = [
    "TABLE_COLUMNS",
    "advice_lines",
    "advice_words",
    "lint_words",
    "comparison_rows",
    "explain",
    "explain_result",
    "lint_sentence",
    "plan_dict",
    "plan_table_rows",
    "plan_advice",
    "plan_lints",
    "render_plan",
    "text_table",
    "Words",
]

TABLE_COLUMNS = (  # bubble: the schedule's closed form, balanced stages; idle: the simulated step's, imbalance in it
    "b_m",
    "m",
    "schedule",
    "v",
    "recompute",
    "ZeRO",
    "bubble",
    "idle",
    "peak",
    "step",
    "tokens/s",
    "MFU",
    "fits",
)


def idle_share(c: Candidate) -> float:
    """The idle share a sentence quotes: the simulated step's (stage imbalance in it) where ``c`` was simulated, else
    the schedule's closed form."""
    return (
        float(c.time["simulated_idle"]) if c.simulated and "simulated_idle" in c.time else c.bubble_fraction
    )


_MFU_PAST_ONE = (
    " (its model FLOPs count attention's whole s×s matrix, as MFU does; a causal kernel runs half)"
)
"""Said beside an MFU over 100% (a long sequence: :attr:`microbatch.predict.candidate.Candidate.mfu`)."""


def _form(c: Candidate) -> str:
    """`` (closed form)`` where :func:`idle_share` is the schedule's closed form, not a simulated step's."""
    return "" if c.simulated and "simulated_idle" in c.time else " (closed form)"


def _row(c: Candidate) -> list[str]:
    return [
        str(c.micro_batch),
        str(c.microbatches),
        c.schedule if c.pipeline_parallel > 1 else "-",
        str(c.virtual),
        c.recompute,
        str(c.zero),
        f"{100 * c.bubble_fraction:.1f}%",
        f"{100 * c.time['simulated_idle']:.1f}%" if c.simulated and "simulated_idle" in c.time else "-",
        gib(c.peak_memory_bytes),
        f"{c.step_time_s:.3g} s",
        f"{c.tokens_per_s:,.0f}",
        f"{100 * c.mfu:.1f}%",
        fit_label(c.fits, c.fits_device),
    ]


def fit_label(fits: object, fits_device: object) -> str:
    """``yes`` (inside the headroom), ``tight`` (inside the device, not its headroom) or ``no``."""
    return "yes" if fits else ("tight" if fits_device is True else "no")


def plan_table_rows(plan: Plan, *, per_micro_batch: bool = True, limit: int = 12) -> list[list[str]]:
    """Rows for a text table, header first.

    ``per_micro_batch``: the best candidate at each b_m (the trade-off across b_m), and the
    recommendation (marked ``*``) above the fastest at its b_m (``+``) where they differ; otherwise
    the ``limit`` best candidates.
    """
    rows = [list(TABLE_COLUMNS)]
    if per_micro_batch:
        seen: dict[int, Candidate] = {}
        for c in plan.candidates:  # sorted: first seen is the best at that b_m
            seen.setdefault(c.micro_batch, c)
        chosen = [seen[b] for b in sorted(seen)]
        rec = plan.recommended
        if rec is not None and rec not in chosen:  # the knee beside the fastest at its b_m
            chosen.insert(chosen.index(seen[rec.micro_batch]), rec)
    else:
        chosen = list(plan.candidates[:limit])
    for c in chosen:
        r = _row(c)
        if c is plan.recommended:
            r[0] = r[0] + "*"
        elif c is plan.fastest:
            r[0] = r[0] + "+"
        rows.append(r)
    return rows


COMPARISON_HEADERS = ("gpu", "memory", "b_m", "m", "schedule", "recompute", "ZeRO", "peak", "step", "tokens/s",
                      "tokens/s/GPU", "MFU")  # fmt: skip
"""The columns of the accelerators compared, as the text and the HTML tables head them."""


def comparison_records(plans: list[Plan]) -> list[dict[str, Any]]:
    """One record per accelerator, its recommendation in numbers (``plan --json``'s ``comparison``): None where
    nothing fits, and then ``tight_peak_bytes``, the smallest candidate's peak when it fits the device but not the
    headroom (else None)."""
    out: list[dict[str, Any]] = []
    for pl in plans:
        c, g = pl.recommended, pl.config.gpu
        rec: dict[str, Any] = {"gpu": g.name, "memory_bytes": g.memory_bytes, "fits": c is not None}
        if c is None:
            small = min(pl.candidates, key=lambda x: x.peak_memory_bytes, default=None)
            tight = small is not None and small.fits_device is True  # inside the device, not its headroom
            rec["tight_peak_bytes"] = small.peak_memory_bytes if tight and small is not None else None
        values = (
            (c.micro_batch, c.microbatches, c.schedule, c.recompute, c.zero, c.peak_memory_bytes, c.step_time_s,
             c.tokens_per_s, c.tokens_per_s / pl.config.num_gpus, c.mfu)
            if c is not None else (None,) * 10
        )  # fmt: skip
        keys = ("micro_batch", "microbatches", "schedule", "recompute", "zero", "peak_memory_bytes", "step_time_s",
                "tokens_per_s", "tokens_per_s_per_gpu", "mfu")  # fmt: skip
        out.append({**rec, **dict(zip(keys, values, strict=True))})
    return out


def comparison_rows(records: list[dict[str, Any]]) -> list[list[str]]:
    """The table of :func:`comparison_records` (header first); a record written before they were numbers (its
    values already the table's strings, keyed by the headers) is shown as it is."""
    rows = [list(COMPARISON_HEADERS)]
    for r in records:
        if "memory_bytes" not in r:  # an older plan --json: display strings keyed by the headers
            rows.append([str(r.get(h, "—")) for h in COMPARISON_HEADERS])
            continue
        head = [str(r.get("gpu")), gib(r["memory_bytes"])]
        if not r.get("fits"):
            tight = r.get("tight_peak_bytes")
            peak = f"tight: {gib(tight)}" if tight is not None else "nothing fits"
            rows.append([*head, "-", "-", "-", "-", "-", peak, "-", "-", "-", "-"])
            continue
        rows.append([
            *head, str(r["micro_batch"]), str(r["microbatches"]), str(r["schedule"]), str(r["recompute"]),
            str(r["zero"]), gib(r["peak_memory_bytes"]), f"{r['step_time_s']:.3g} s", f"{r['tokens_per_s']:,.0f}",
            f"{r['tokens_per_s_per_gpu']:,.0f}", f"{100 * r['mfu']:.1f}%",
        ])  # fmt: skip
    return rows


def explain(plan: Plan, *, words: Words = None) -> str:
    """The trade-off in words: bubble against kernel efficiency against memory (``words``: :data:`Words`)."""
    cfg = plan.config
    return _explain(
        plan.recommended, plan.candidates, pipeline_parallel=cfg.pipeline_parallel,
        memory_budget_bytes=cfg.memory_budget_bytes, lints=plan_lints(plan, words=words), advice=plan_advice(plan),
        fastest=plan.fastest, knee=plan.knee, choose=cfg.choose, tolerance=cfg.tolerance, margin=cfg.margin,
        moe=(cfg.shape.moe, cfg.seq_len, cfg.expert_parallel, cfg.capacity_factor) if cfg.shape.moe else None,
        words=words,
    )  # fmt: skip


def explain_result(result: dict[str, Any], *, words: Words = None) -> str:
    """:func:`explain` for a plan read back from ``plan --json`` (:meth:`Plan.to_dict`)."""
    try:
        rec = result.get("recommended")
        fast = result.get("fastest")
        experts = as_experts((result.get("model_shape") or {}).get("moe"))
        cap = result.get("capacity_factor")
        moe = None if experts is None else (
            experts, int(result["seq"]), int(result.get("expert_parallel", 1)), None if cap is None else float(cap)
        )  # fmt: skip
        return _explain(
            Candidate.from_dict(rec) if rec else None,
            [Candidate.from_dict(c) for c in result.get("candidates", [])],
            pipeline_parallel=int(result.get("pipeline_parallel", 1)),
            memory_budget_bytes=float(result["memory_budget_bytes"]),
            lints=lint_words(result.get("lints"), words=words),
            advice=advice_words(result.get("advice")),
            fastest=Candidate.from_dict(fast) if fast else None,
            knee=Candidate.from_dict(result["knee"]) if result.get("knee") else None,
            choose=str(result.get("choose", "fastest")),
            words=words,
            tolerance=float(result.get("tolerance", 0.0)),
            margin=float(result.get("margin", 0.0)),
            moe=moe,
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(
            f"not a plan result ({type(e).__name__}: {e}); give a plan's JSON output (Plan.to_dict())"
        ) from None


def _explain(
    c: Candidate | None,
    candidates: Sequence[Candidate],
    *,
    pipeline_parallel: int,
    memory_budget_bytes: float,
    lints: Sequence[str],
    advice: Sequence[str],
    fastest: Candidate | None = None,
    knee: Candidate | None = None,
    choose: str = "fastest",
    tolerance: float = 0.0,
    margin: float = 0.0,
    moe: tuple[Experts, int, int, float | None] | None = None,
    words: Words = None,
) -> str:
    if c is None:  # the headline; the rest of the advice (what would fit) is listed after it
        return advice[0] if advice else "nothing fits"
    p = pipeline_parallel
    parts = [
        f"Recommended b_m = {c.micro_batch} (m = g = {c.microbatches}, "
        f"{c.schedule if p > 1 else 'no pipeline'}"
        + (f", v = {c.virtual}" if c.virtual > 1 else "")
        + f", recompute {c.recompute}, ZeRO {c.zero}): {c.step_time_s:.3g} s per step, "
        f"{c.tokens_per_s:,.0f} tokens/s, MFU {100 * c.mfu:.1f}%{_MFU_PAST_ONE if c.mfu > 1 else ''}, "
        f"peak {gib(c.peak_memory_bytes)} of {gib(memory_budget_bytes)} usable."
    ]
    best_at: dict[int, Candidate] = {}
    for x in candidates:
        best_at.setdefault(x.micro_batch, x)
    smaller = [x for b, x in sorted(best_at.items()) if b < c.micro_batch]
    larger = [x for b, x in sorted(best_at.items()) if b > c.micro_batch]
    if smaller:
        s = _like(candidates, smaller[-1], c)
        saved = c.peak_memory_bytes - s.peak_memory_bytes
        if not s.fits:
            why = f"does not fit ({gib(s.peak_memory_bytes)})"
        elif p == 1:
            why = (
                (
                    f"would save {gib(saved)}"
                    if saved > 0
                    else f"would take {gib(-saved)} more (ZeRO {s.zero})"
                )
                + " but its GEMMs reach "
                f"{100 * s.gemm_efficiency:.0f}% of peak (vs {100 * c.gemm_efficiency:.0f}%) and its step takes "
                f"{s.step_time_s:.3g} s"
            )
        else:
            why = (
                f"would cut the idle share to {100 * idle_share(s):.1f}%{_form(s)} (from {100 * idle_share(c):.1f}%"
                f"{_form(c)}) "
                f"but its GEMMs reach {100 * s.gemm_efficiency:.0f}% of peak (vs {100 * c.gemm_efficiency:.0f}%) "
                f"and its step takes {s.step_time_s:.3g} s"
            )
        parts.append(f"Smaller b_m = {s.micro_batch}{_run_as(s, smaller[-1], p)} {why}.")
    if larger:
        g = _like(candidates, larger[0], c)
        if not g.fits:
            why = f"does not fit: {gib(g.peak_memory_bytes)} > {gib(memory_budget_bytes)}"
        else:
            why = (
                f"would run GEMMs at {100 * g.gemm_efficiency:.0f}% of peak but leave "
                f"{100 * idle_share(g):.1f}% of the pipeline idle{_form(g)}" if p > 1 else
                f"would run GEMMs at {100 * g.gemm_efficiency:.0f}% of peak for {gib(g.peak_memory_bytes)}"
            )  # fmt: skip
            why += f"; its step takes {g.step_time_s:.3g} s"
        parts.append(f"Larger b_m = {g.micro_batch}{_run_as(g, larger[0], p)} {why}.")
    if moe is not None:
        parts.append(_moe_knee(c, *moe))
    choice = _choice_line(fastest, knee, choose, tolerance, margin, say("choose", words))
    if choice:
        parts.append(choice)
    if lints:
        parts.append("Check: " + "; ".join(lints) + ".")  # each lint a clause; they ran together with " "
    return " ".join(parts)


def _like(candidates: Sequence[Candidate], best: Candidate, c: Candidate) -> Candidate:
    """The candidate at ``best``'s b_m run as ``c`` is (schedule, v, recompute, ZeRO), to compare like with like, where
    it fits; else ``best`` (that b_m's first listed: whether anything there fits, and at what cost)."""
    same = (c.schedule, c.virtual, c.recompute, c.zero)
    like = (
        x
        for x in candidates
        if x.micro_batch == best.micro_batch and (x.schedule, x.virtual, x.recompute, x.zero) == same
    )
    found = next(like, None)
    return found if found is not None and found.fits else best


def _run_as(x: Candidate, row: Candidate, p: int) -> str:
    """`` run as the recommendation (…)`` when the compared candidate ``x`` is not the table's row ``row`` for its
    b_m (:func:`_like` compares like with like), else ``""``: the words then say which row they describe."""
    if x is row:
        return ""
    how = ([x.schedule] if p > 1 else []) + ([f"v = {x.virtual}"] if x.virtual > 1 else [])
    return f" run as the recommendation ({', '.join([*how, f'recompute {x.recompute}', f'ZeRO {x.zero}'])})"


def _moe_knee(c: Candidate, moe: Experts, seq: int, ep: int, capacity: float | None) -> str:
    """The MoE knee in words: the rows each expert's GEMMs see at the recommended b_m, and the assumption."""
    rows = rows_per_expert(moe, c.micro_batch, seq, ep, capacity or 1.0)
    load = (
        f"buffers padded to capacity factor {capacity:g}" if capacity
        else "dropless, experts assumed evenly loaded"
    )  # fmt: skip
    return (
        f"Mixture of experts (E = {moe.experts}, top-k = {moe.top_k}, EP = {ep}): each expert's GEMMs see "
        f"EP·b_m·s·K/E = {rows:,.0f} rows per micro-batch at b_m = {c.micro_batch} (b_m·s = "
        f"{c.micro_batch * seq:,} for the attention): {ep * moe.top_k / moe.experts:.3g}× a dense layer's rows, so "
        f"the knee of b_m is where those rows leave the GEMMs' small-row ramp ({load})."
    )


def _same(a: Candidate, b: Candidate) -> bool:
    return (a.micro_batch, a.recompute, a.zero, a.schedule, a.virtual) == (
        b.micro_batch, b.recompute, b.zero, b.schedule, b.virtual
    )  # fmt: skip


def _label(c: Candidate) -> str:
    return (
        f"b_m = {c.micro_batch}, recompute {c.recompute}, ZeRO {c.zero}"
        + (f", {c.schedule}" if c.pipeline_parallel > 1 else "")
        + (f" v = {c.virtual}" if c.virtual > 1 else "")
        + f" ({c.tokens_per_s:,.0f} tokens/s, {gib(c.peak_memory_bytes)})"
    )


def _choice_line(
    fastest: Candidate | None,
    knee: Candidate | None,
    choose: str,
    tolerance: float,
    margin: float,
    choose_word: str = "choose",
) -> str:
    """One line: the knee beside the fastest, and why they differ (or that they are the same);
    ``choose_word`` names the setting that picks one (the parameter, or a command's flag)."""
    if fastest is None or knee is None:  # a result written before the planner chose the knee
        return ""
    rule = (
        f"the least memory within (1 − {tolerance:g})·(1 + {margin:g}) = "
        f"{100 * (1 - tolerance) * (1 + margin):.2f}% of the fastest's tokens/s"
    )
    if _same(fastest, knee):
        return f"It is both the fastest that fits and the knee ({rule})."
    gain = 100 * (fastest.tokens_per_s / knee.tokens_per_s - 1)
    more = fastest.peak_memory_bytes - knee.peak_memory_bytes
    why = f"the fastest is {gain:.1f}% faster for {gib(more)} more memory per GPU"
    if choose == "knee":
        return f"Fastest: {_label(fastest)}; {why}; the knee is {rule} ({choose_word} fastest takes the fastest)."
    return f"Knee: {_label(knee)}; {why}; chosen the fastest ({choose_word} knee takes the knee: {rule})."


def text_table(rows: Sequence[Sequence[str]]) -> str:
    """Rows (header first) as a right-aligned text table with a rule under the header."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _clock_note(gpu: Accelerator) -> str:
    """`` (500 W of 700, sustained clock × 0.731)`` when the board runs under its rating or at another clock than
    its datasheet's (the Hopper rows' sustained clock, :data:`microbatch.hardware_clocks.HOPPER_BURST_TO_SUSTAINED`),
    else ``""``."""
    w, rated, f = gpu.power_limit_w, gpu.rated_power_w, gpu.sustained_clock_fraction
    limit = f"{w:,.0f} W of {rated:,.0f}" if w and rated and w < rated else ""
    clock = f"sustained clock × {f:.3f}" if f != 1 else ""
    return f" ({', '.join(x for x in (limit, clock) if x)})" if limit or clock else ""


def _settings_note(cfg: PlanConfig) -> str:
    """``, fp8 te-current, full recompute of 1 layer in 4, eager loss, optimizer lion`` for the settings away from their
    defaults that the table's columns leave unsaid (the precision, every-K recompute, the loss, the training state's
    settings by their names), else ``""``."""
    said = [f"{cfg.precision} {cfg.fp8_recipe}" if cfg.precision == "fp8" else cfg.precision]
    said = [] if said == ["bf16-mixed"] else said
    if cfg.recompute_every > 1:  # it applies where a row recomputes fully
        said.append(
            f"full recompute of 1 layer in {cfg.recompute_every}"
            + ("" if cfg.recompute == ("full",) else " where full")
        )
    if cfg.loss_kernel != "fused":
        said.append(f"{cfg.loss_kernel} loss")
    if cfg.layer_kernels != "fused":
        said.append(f"{cfg.layer_kernels} layers")
    plain = StateSettings()  # the state settings away from their defaults, by their names
    said += [f"{k} {getattr(cfg, k)}" for k in ("optimizer", "grad_dtype", "moments_dtype", "master_weights",
                                                   "loss_dtype") if getattr(cfg, k) != getattr(plain, k)]  # fmt: skip
    said += [f"{k} {getattr(cfg, k)}" for k, usual in (("zero3_impl", "fsdp2"), ("reduce_dtype", "auto"))
             if getattr(cfg, k) != usual]  # fmt: skip
    return "".join(f", {x}" for x in said)


def render_plan(plan: Plan, *, all_rows: bool = False, words: Words = None) -> str:
    """The plan as text: header, trade-off table, recommendation in words, pitfalls (``words``:
    :data:`Words`)."""
    cfg = plan.config
    head = (
        f"{cfg.shape.name} on {cfg.num_gpus} × {cfg.gpu.name}{_clock_note(cfg.gpu)}: B_global = {cfg.global_batch}, d = "
        f"{cfg.data_parallel}, p = {cfg.pipeline_parallel}, t = {cfg.tensor_parallel}"
        f"{' + SP' if cfg.sequence_parallel else ''}"
        f"{f', c = {cfg.context_parallel} ({cfg.cp_comm})' if cfg.context_parallel > 1 else ''}"
        f"{f', EP = {cfg.expert_parallel}' if cfg.expert_parallel > 1 else ''}"
        f"{f', HSDP {cfg.replicas} × {cfg.shard_degree}' if cfg.replicas > 1 else ''}"
        f", s = {cfg.seq_len}{_settings_note(cfg)}; {plan.evaluated} candidates, "
        f"{sum(c.fits for c in plan.candidates)} fit in {gib(cfg.memory_budget_bytes)}"
    )
    title = (
        "best candidates"
        if all_rows
        else "best candidate at each b_m (* = recommended, + = fastest where it differs)"
    )
    rows = plan_table_rows(plan, per_micro_batch=not all_rows, limit=20)
    if any(r[-1] == "tight" for r in rows[1:]):
        title += f"; tight = inside the device's {gib(cfg.gpu.memory_bytes)}, not its headroom"
    parts = [head, "", title, text_table(rows), "", explain(plan, words=words)]
    # With no recommendation the explanation is the advice's headline: list only the rest.
    advice = plan_advice(plan)[1:] if plan.recommended is None else plan_advice(plan)
    if advice:
        parts += [""] + [f"- {a}" for a in advice]
    return "\n".join(parts)


# -- the planner's pitfalls and advice in words ---------------------------------------------------------
def plan_lints(plan: Plan, *, words: Words = None) -> list[str]:
    """The plan's pitfalls in words (``words``: :data:`Words`)."""
    return [lint_sentence(x, words=words) for x in plan.lints]


def plan_advice(plan: Plan) -> list[str]:
    """The plan's advice in words (none when something fits)."""
    return advice_lines(plan.advice) if plan.advice is not None else []


def advice_words(advice: object) -> list[str]:
    """The advice of a plan read back: sentences as written (``plan --json``), or data (:meth:`Plan.to_dict`)."""
    if isinstance(advice, dict):
        return advice_lines(advice_from_dict(advice))
    return [str(a) for a in advice or []]  # type: ignore[attr-defined]


def lint_words(lints: object, *, words: Words = None) -> list[str]:
    """The lints of a plan read back: sentences as written (``plan --json``), or data (:meth:`Plan.to_dict`)."""
    return [x if isinstance(x, str) else lint_sentence(lint_from_dict(x), words=words) for x in lints or []]  # type: ignore[attr-defined]


def plan_dict(plan: Plan, *, words: Words = None) -> dict[str, Any]:
    """:meth:`Plan.to_dict` with the lints and the advice in words: what ``plan --json`` writes
    (``words``: :data:`Words`)."""
    return {**plan.to_dict(), "lints": plan_lints(plan, words=words), "advice": plan_advice(plan)}
