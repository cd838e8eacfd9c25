"""The HTML report: one self-contained file from saved results.

``build_report(results, out_path)`` takes the JSON objects the commands print with ``--json``
(or ``tune --out DIR`` writes), recognises each (:func:`classify`), and writes:

- ``out_path``: one HTML file with every figure inline as SVG (no network, no CDN, no script);
- ``<out_path stem>-figures/*.png``: the same figures as PNG images (``FIGURE_SIZE_PX``).

Figures: the throughput curve with the knee and the tolerance band; peak memory against b_m
with the linear fit, the measured points and the budget line; the bubble diagram, predicted
and measured; then tables: the plan with its recommendation and reasons (one per accelerator of
a comparison), predicted against measured with the errors, the exported configs, and the fields
of any other command's result.

This module holds the page and the plan's section; the other sections are in
:mod:`microbatch.show.html_sections`, their building blocks in :mod:`microbatch.show.html_parts`,
the figures (matplotlib, imported lazily) in :mod:`microbatch.show.figures`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from microbatch import __version__, records
from microbatch.envelope import MARK
from microbatch.errors import ConfigError
from microbatch.fields import short_repr
from microbatch.files import write_text
from microbatch.show.figures import FIGURE_SIZE_PX, Figure
from microbatch.show.html_parts import CSS, SOURCE
from microbatch.show.html_parts import bytes_column as _bytes_column
from microbatch.show.html_parts import esc as _esc
from microbatch.show.html_parts import mem as _mem
from microbatch.show.html_parts import name_of as _name
from microbatch.show.html_parts import num as _num
from microbatch.show.html_parts import pct as _pct
from microbatch.show.html_parts import seconds_column as _seconds_column
from microbatch.show.html_parts import table as _table
from microbatch.show.html_sections import (
    comparison_section,
    pipeline_section,
    simulate_section,
    summary_section,
    tune_section,
    validate_section,
)
from microbatch.show.html_sections import exports_section as _exports_section
from microbatch.show.plan_report import advice_words, explain_result, fit_label, lint_words
from microbatch.units import format_count

__all__ = ["classify", "load_results", "check_result", "build_report", "FIGURE_SIZE_PX", "Report"]


def classify(result: dict[str, Any]) -> str:
    """Which command produced ``result`` (:func:`microbatch.records.classify`: the envelope's
    ``command``; for a file written before the envelope, guessed from the keys)."""
    return records.classify(result)


def load_results(paths: Iterable[str | Path]) -> list[tuple[str, dict[str, Any]]]:
    """Read result files (JSON; a directory means its ``result.json``), each with its kind; a
    multi-GPU plan gives one result per accelerator (:func:`microbatch.records.load_results`).
    A result the report cannot answer from is refused naming its file (:func:`check_result`)."""
    out: list[tuple[str, dict[str, Any]]] = []
    for p in paths:
        for kind, res in records.load_results([p]):
            check_result(kind, res, source=str(p))
            out.append((kind, {**res, SOURCE: str(p)}))
    if not out:
        return records.load_results([])  # its refusal: no results given
    return out


_NEEDED = {
    "tune": ("micro_batch", "points"),
    "recommend": ("micro_batch",),
    "simulate": ("schedule", "stages", "microbatches", "bubble_fraction"),
    "validate": ("rows",),
}
"""The fields without which a kind of result has no answer to report: the knee and (a tune) the measured
points; a simulation's schedule and bubble; a validation's rows. A plan with none of candidates, plans or
recommended is refused too (:func:`check_result`). Other fields missing read ``—`` where they would
be shown."""

_OBJECT_LISTS = {
    "tune": ("points",),
    "plan": ("candidates",),
    "simulate": ("stage_stats",),
    "validate": ("rows",),
}
"""Fields that hold a list of objects (one a point, candidate, stage or row), where present."""


def check_result(kind: str, res: dict[str, Any], *, source: str) -> None:
    """Refuse a ``tune`` or ``recommend`` result missing a field of :data:`_NEEDED` (null, or, for
    ``points``, an empty list): ConfigError naming ``source``, the fields and the fix, before anything is
    written. A report of such a file would say ``b_m = None``; tune writes one only with the points it kept when
    none met its limits (``micro_batch`` null beside an ``error``: said so); otherwise the file was cut short,
    edited, or written by something else."""
    missing = [k for k in _NEEDED.get(kind, ()) if res.get(k) is None or res.get(k) == []]
    if kind == "plan" and not any(res.get(k) for k in ("candidates", "plans", "recommended")):
        missing = ["candidates"]  # a hollow plan: no row, no comparison, no choice to draw
    whole = f"give the whole JSON a microbatch {kind} wrote (its JSON output, or the result.json of its output folder)"
    if missing == ["micro_batch"] and res.get("error"):  # the points a tune kept when none met its limits
        raise ConfigError(
            f"{source}: the points of a tune that chose nothing ({res['error']}); choose from them with "
            "microbatch recommend on this file (without the limit), or tune again with another limit"
        )
    if missing:
        what = {"micro_batch": "no knee (micro_batch)", "points": "no measured points (points)"}
        raise ConfigError(
            f"{source}: a {kind} result with {' and '.join(what.get(k, f'no {k}') for k in missing)}: missing, null "
            f"or empty, so there is nothing to report; {whole}"
        )
    for key in _OBJECT_LISTS.get(kind, ()):
        v = res.get(key)
        if v is not None and not (isinstance(v, list) and all(isinstance(x, dict) for x in v)):
            raise ConfigError(
                f"{source}: the {kind} result's {key} is {short_repr(v)}, not a list of objects; {whole}"
            )
    rec = res.get("recommended") if kind == "plan" else None
    if rec is not None and not isinstance(rec, dict):
        raise ConfigError(
            f"{source}: the plan's recommended is {short_repr(rec)}, not a candidate object; {whole}"
        )
    for where, v in _text_in_numbers(res, kind):
        raise ConfigError(
            f"{source}: {where} is {short_repr(v)}, where the {kind} result holds a number; {whole}"
        )


_NUMBER_KEYS = ("_bytes", "_s", "_ms", "_fraction", "_se", "_pct", "%", "_MiB", "_of_best", "_of_reference",
                "throughput", "tokens_per_s", "micro_batch", "mfu", "tolerance", "_margin", "headroom")  # fmt: skip
"""How the results' number fields end (``peak_memory_bytes``, ``step_time_s``, ``bubble_fraction``, ...): a text
there (``"27%"``, a hand edit) is refused naming the field, before the drawing fails on it."""


_DRAWN = ("measured", "predicted", "with_comm", "before_run", "recommended", "fastest", "knee", "fastest_fitting",
          "candidates", "points", "stage_stats", "rows", "stages", "memory", "time", "timeline", "predicted_timeline",
          "memory_fit", "plans")  # fmt: skip
"""The parts of a result the report draws numbers from, looked into for text in a number field; others (a
calibration's ``term_sources``, notes, sources) hold words under any name."""


def _text_in_numbers(res: Any, path: str) -> Iterable[tuple[str, Any]]:
    """(``path.key``, value) for every text value under a number field of ``res`` or of the parts it draws
    (:data:`_DRAWN`: dicts, and lists of dicts)."""
    items = res.items() if isinstance(res, dict) else enumerate(res) if isinstance(res, list) else ()
    for k, v in items:
        where = f"{path}[{k}]" if isinstance(k, int) else f"{path}.{k}"
        if isinstance(v, str) and isinstance(k, str) and k.endswith(_NUMBER_KEYS):
            yield where, v
        elif isinstance(v, (dict, list)) and (isinstance(k, int) or k in _DRAWN):
            yield from _text_in_numbers(v, where)


def _plan_section(plan: dict[str, Any]) -> str:
    rec = plan.get("recommended") or {}
    cands = plan.get("candidates", [])
    parts = [
        f"<h2>Plan: {_esc(_name(plan.get('model')))} on {_esc(_name(plan.get('gpu')))}, "
        f"p = {_esc(plan.get('pipeline_parallel', 1))}, d = {_esc(plan.get('data_parallel', 1))}, "
        f"t = {_esc(plan.get('tensor_parallel', 1))}, global batch {_esc(plan.get('global_batch', ''))}</h2>"
    ]
    parts.append(_plan_dimensions(plan))
    if rec:
        parts.append(
            f"<p class='answer'>Recommended: b_m = <b>{_esc(rec.get('micro_batch'))}</b>, m = {_esc(rec.get('microbatches'))}, "
            f"{_schedule_words(rec)}"
            + (f" (v = {_esc(rec.get('virtual'))})" if (rec.get("virtual") or 1) > 1 else "")
            + f", recompute {_esc(rec.get('recompute'))}, ZeRO {_esc(rec.get('zero'))}: bubble {_pct(rec.get('bubble_fraction'))}, "
            f"peak {_mem(rec.get('peak_memory_bytes'))}, step {_num(rec.get('step_time_s'), '{:.3f}')} s, MFU {_pct(rec.get('mfu'))}.</p>"
        )
    parts += _plan_notes(plan, rec)
    parts += _candidates_table(cands, rec)
    parts.append(_exports_section(plan))
    return "".join(parts)


def _plan_dimensions(plan: dict[str, Any]) -> str:
    """One line of what a dense bf16 plan leaves out: parameters (total and active), expert and context
    parallelism, the precision (and FP8 recipe); empty for a plan from before they existed."""
    bits = []
    total, active = plan.get("total_params"), plan.get("active_params")
    if isinstance(total, int):
        bits.append(f"{format_count(total)} parameters" + (
            f", {format_count(active)} active per token" if isinstance(active, int) and active != total else ""
        ))  # fmt: skip
    for key, name in (("expert_parallel", "expert parallel EP"), ("context_parallel", "context parallel c")):
        if (plan.get(key) or 1) > 1:
            bits.append(f"{name} = {_esc(plan[key])}")
    if plan.get("precision"):
        recipe = plan.get("fp8_recipe")
        bits.append(f"precision {_esc(plan['precision'])}" + (f" ({_esc(recipe)} scaling)" if recipe else ""))
    return f"<p>{'; '.join(bits)}.</p>" if bits else ""


def _plan_notes(plan: dict[str, Any], rec: dict[str, Any]) -> list[str]:
    """The plan's reasons, explanation, lints and warnings, each as a list."""
    parts: list[str] = []
    for key in (
        "reasons",
        "explanation",
        "lints",
        "warnings",
        "advice",
        "notes",
        "calibration_notes",
        "rebalance",
    ):
        val = plan.get(key) or rec.get(key)  # advice: what would fit, where none does
        if key == "rebalance" and isinstance(val, dict):  # the uneven split the text's note names
            val = _rebalance_words(val)
        if key == "advice" and isinstance(val, dict):  # Plan.to_dict's data: the same sentences as the text
            val = advice_words(val)
        if key == "lints" and isinstance(val, list) and any(isinstance(x, dict) for x in val):
            val = lint_words(val)
        if key == "explanation" and not val:  # Plan.to_dict is data only: the words are show's
            try:
                val = explain_result(plan)
            except ConfigError:  # not a whole plan (another version's file): the table says it
                val = None
        if val:
            items = val if isinstance(val, list) else [val]
            parts.append(
                "<ul>"
                + "".join(f"<li>{_esc(v if isinstance(v, str) else v.get('message', v))}</li>" for v in items)
                + "</ul>"
            )
    return parts


def _rebalance_words(rb: dict[str, Any]) -> str:
    """The plan's ``rebalance`` in words, as the text's note says it."""
    split = ",".join(str(n) for n in rb.get("layers_per_stage") or [])
    was, now = rb.get("was_step_time_s"), rb.get("step_time_s")
    if not split or not isinstance(was, int | float) or not isinstance(now, int | float) or was <= 0:
        return ""
    return (
        f"The recommended layout idles {_pct(rb.get('was_simulated_idle'))} of its step; {split} layers per stage "
        f"run its settings in {now:.3g} s ({100 * (now / was - 1):+.1f}%, idle {_pct(rb.get('simulated_idle'))})."
    )


TABLE_ROWS = 20
"""The most b_m a plan's table shows (a global batch with many divisors gives a hundred)."""


def _idle(c: dict[str, Any]) -> str:
    """A candidate's simulated idle share, "-" where it was not simulated."""
    return _pct((c.get("time") or {}).get("simulated_idle")) if c.get("simulated") else "-"


def _candidates_table(cands: list[dict[str, Any]], rec: dict[str, Any]) -> list[str]:
    """The best candidate at each b_m as the plan ranks them (fitting first, the fastest first; of those that do not
    fit, the smallest peak first: :func:`microbatch.predict.plan_choice.sort_key`), in b_m order, the recommended one
    highlighted; with a line saying so when candidates were left out."""
    parts: list[str] = []

    def rank(c: dict[str, Any]) -> tuple[bool, float]:
        fits = c.get("fits", True)
        return (not fits, (c.get("step_time_s") if fits else c.get("peak_memory_bytes")) or 1e300)

    ranked = sorted(cands, key=rank)
    per_b: dict[Any, dict[str, Any]] = {}
    for c in ranked:
        per_b.setdefault(c.get("micro_batch"), c)
    every = sorted(per_b.values(), key=lambda c: c.get("micro_batch") or 0)
    shown = every[:TABLE_ROWS]
    if len(per_b) < len(cands):
        mark = " is highlighted, above its b_m's fastest where they differ" if rec else ": none fits"
        parts.append(
            f"<p>The best of {len(cands)} candidates at each micro-batch b_m (those that fit first, then the "
            f"fastest; where none fits, the smallest peak); the recommended one{mark}.</p>"
        )
    if len(every) > len(shown):
        parts.append(
            f"<p>The {len(shown)} smallest of {len(every)} b_m are shown (b_m {every[len(shown)].get('micro_batch')} "
            "and larger left out; the plan's JSON has them all).</p>"
        )

    def is_rec(c: dict[str, Any]) -> bool:
        keys = ("micro_batch", "schedule", "recompute", "zero", "virtual")
        return bool(rec) and all(c.get(k) == rec.get(k) for k in keys)

    if rec and not any(is_rec(c) for c in shown):
        # the knee is not the fastest at its b_m: show it above that b_m's fastest, as the text table does
        at = next(
            (i for i, c in enumerate(shown) if c.get("micro_batch") == rec.get("micro_batch")), len(shown)
        )
        shown.insert(at, rec)
    hi = next((i for i, c in enumerate(shown) if is_rec(c)), None)
    peaks = _bytes_column([c.get("peak_memory_bytes") for c in shown])
    unit, steps = _seconds_column([c.get("step_time_s") for c in shown], digits=3)
    rows = [
        [
            c.get("micro_batch"),
            c.get("microbatches"),
            c.get("schedule"),
            c.get("virtual"),
            c.get("recompute"),
            c.get("zero"),
            _pct(c.get("bubble_fraction")),
            _idle(c),
            peak,
            fit_label(c.get("fits"), c.get("fits_device")),
            step,
            _num(c.get("tokens_per_s")),
            _pct(c.get("mfu")),
        ]
        for c, peak, step in zip(shown, peaks, steps, strict=True)
    ]
    heads = ["b_m", "m", "schedule", "v", "recompute", "ZeRO", "bubble", "idle", "peak memory", "fits"]
    parts.append(_table([*heads, f"step ({unit})", "tokens/s", "MFU"], rows, hi))
    return parts


@dataclass(frozen=True, kw_only=True)
class Report:
    """What :func:`build_report` wrote."""

    html_path: Path
    """The HTML file."""
    png_paths: list[Path] = field(default_factory=list)
    """The PNG copies of the figures."""
    sections: list[str] = field(default_factory=list)
    """The kind of each section, in page order."""


_ORDER = {"tune": 0, "recommend": 0, "plan": 1, "simulate": 2, "pipeline": 3, "validate": 4}
"""Page order of the kinds of result; any other kind comes after, in the order given."""


def _section(kind: str, res: dict[str, Any], png_dir: Path | None, idx: int) -> tuple[str, list[Figure]]:
    """One result's HTML and figures."""
    if kind in ("tune", "recommend"):
        return tune_section(res, png_dir, kind, idx)
    if kind == "plan" and isinstance(res.get("plans"), list):  # a comparison across accelerators
        return comparison_section(res) + "".join(_plan_section(p) for p in res["plans"]), []
    if kind == "plan":
        return _plan_section(res), []
    if kind == "pipeline":
        return pipeline_section(res, png_dir, idx)
    if kind == "simulate":
        return simulate_section(res, png_dir, idx)
    if kind == "validate":
        return validate_section(res), []
    return summary_section(kind, res), []


def _plan_answer(plan: dict[str, Any]) -> str:
    """A plan's line in the answers: its recommendation, that nothing fits, or nothing for a file without either."""
    where = f"plan {_esc(_name(plan.get('model')))} on {_esc(_name(plan.get('gpu')))}"
    rec = plan.get("recommended")
    if "recommended" in plan and not rec:
        return f"{where}: <b>nothing fits</b>"
    if not isinstance(rec, dict):
        return ""
    return (
        f"{where}: b_m = <b>{_esc(rec.get('micro_batch'))}</b>, m = {_esc(rec.get('microbatches'))}, "
        f"{_schedule_words(rec)}, bubble {_pct(rec.get('bubble_fraction'))}, peak {_mem(rec.get('peak_memory_bytes'))}"
    )


def _schedule_words(rec: dict[str, Any]) -> str:
    """The candidate's schedule, or "no pipeline" where it has one stage (its ``schedule`` field names the 1F1B the
    planner times one stage with; the plan's own explanation says "no pipeline")."""
    return "no pipeline" if rec.get("pipeline_parallel", 2) == 1 else _esc(rec.get("schedule"))


def _answers(items: Sequence[tuple[str, dict[str, Any]]]) -> str:
    """The summary at the top: one line per result with its answer."""
    lines = []
    for kind, r in items:
        if kind in ("tune", "recommend") and r.get("micro_batch") is not None:
            g = f", g = {r['grad_accum']}" if r.get("grad_accum") is not None else ""
            what = _esc(f"{_name(r.get('model'))} {r.get('mode', '')}".strip() or kind)
            measured = len([p for p in r.get("points") or [] if not p.get("oom")])
            stopped = (
                f"; <b>interrupted</b>: chosen from the {measured} points measured before it stopped"
                if r.get("interrupted")
                else ""
            )
            lines.append(
                f"{what}: b_m = <b>{_esc(r['micro_batch'])}</b>{_esc(g)} (the knee; "
                f"{_pct(r.get('fraction_of_best'))} of the best measured throughput, peak "
                f"{_mem(r.get('peak_memory_bytes'))}{stopped})"
            )
        elif kind == "plan":  # one plan, or each accelerator's of a comparison
            many = r.get("plans")
            plans: list[Any] = many if isinstance(many, list) else [r]
            lines += [line for pl in plans if isinstance(pl, dict) and (line := _plan_answer(pl))]
        elif kind == "pipeline" and isinstance(r.get("measured"), dict):
            # the prediction made before the run (the replay of the measured op times is a check, in its section)
            before = (r.get("before_run") or {}).get("bubble_fraction")
            said = (
                f"predicted before the run {_pct(before)}"
                if before is not None
                else "no prediction before the run"
            )
            lines.append(
                f"pipeline {_esc(r.get('schedule', ''))}: measured bubble {_pct(r['measured'].get('bubble_fraction'))}, "
                + said
            )
    if not lines:
        return ""
    return "<h2>Answers</h2><ul class='answers'>" + "".join(f"<li>{x}</li>" for x in lines) + "</ul>"


def build_report(
    results: Sequence[tuple[str, dict[str, Any]]] | Sequence[dict[str, Any]],
    out_path: str | Path,
    *,
    title: str = "microbatch report",
    png: bool = True,
) -> Report:
    """Write the HTML report (and PNG figures beside it) from saved results.

    ``results``: result objects, or ``(kind, result)`` pairs as :func:`load_results` returns them.
    """
    out = Path(out_path)
    if out.suffix.lower() not in (".html", ".htm"):
        raise ConfigError(
            f"report path {str(out)!r} must end in .html; for example out_path report.html",
            params=("out_path",),
        )
    items = [(classify(r), r) if isinstance(r, dict) else r for r in results]
    for i, (kind, res) in enumerate(items):
        check_result(kind, res, source=f"result {i + 1}")
    png_dir = out.with_name(out.stem + "-figures") if png else None
    figs: list[Figure] = []
    sections: list[str] = []
    body: list[str] = []
    for i, (kind, res) in enumerate(sorted(items, key=lambda kr: _ORDER.get(kr[0], 9))):
        html_text, drawn = _section(kind, res, png_dir, i)
        if res.get(
            SOURCE
        ):  # which file each section is drawn from: results of other models or machines read apart
            html_text = html_text.replace("</h2>", f"</h2><p class='source'>from {_esc(res[SOURCE])}</p>", 1)
        body.append(html_text)
        figs += drawn
        sections.append(kind)
    doc = (
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
        f"<meta name='generator' content='{MARK} {__version__}'>"
        f"<meta name='viewport' content='width=device-width, initial-scale=1'><title>{_esc(title)}</title>"
        f"<style>{CSS}</style></head><body><h1>{_esc(title)}</h1>"
        "<p class='lead'>B_global = b_m × g × d. The global batch is a statistical choice; the micro-batch is a "
        "physical one. Bubble fractions are idle time over total stage time.</p>"
        + _answers(items)
        + "".join(body)
        + "</body></html>"
    )
    write_text(
        out, doc
    )  # whole or not at all; a full disk named (the results it was built from are where they were)
    for f in figs:  # only now: a report that failed earlier left no figure, nor replaced a good report's
        f.write_png()
    pngs = [f.png_path for f in figs if f.png_path]
    # without PNGs too (--no-png): the folder beside the report holds none of an earlier report's figures
    _drop_stale_pngs(png_dir if png_dir is not None else out.with_name(out.stem + "-figures"), pngs)
    return Report(html_path=out, png_paths=pngs, sections=sections)


def _drop_stale_pngs(png_dir: Path, written: list[Path]) -> None:
    """Remove the PNGs an earlier report wrote in ``png_dir`` (marked ours,
    :func:`microbatch.envelope.is_ours`) that this one did not: the folder holds this report's figures,
    as many as it says. A file not ours is left alone."""
    from microbatch.envelope import is_ours

    keep = {p.resolve() for p in written}
    for p in png_dir.glob("*.png") if png_dir.is_dir() else ():
        if p.is_file() and p.resolve() not in keep and is_ours(p):
            try:
                p.unlink(missing_ok=True)
            except OSError:  # the report is written; an old figure left behind loses nothing
                pass
