"""``microbatch recommend``: pick the knee from measurements made elsewhere (JSON or CSV).

Also holds the choice options and the rendering that ``tune`` shares.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Callable
from pathlib import Path

import click

from microbatch.choose.knee import BOUND_MARGIN, BOUND_MIN_POINTS, BOUND_SLACK, BOUND_WINDOW
from microbatch.commands._common import emit, json_option, option_group
from microbatch.errors import ConfigError

CHOICE_FLAGS = (
    "memory_budget",
    "headroom",
    "max_latency_ms",
    "rule",
    "tolerance",
    "reference",
    "global_batch",
    "data_parallel",
)
"""Parameters :func:`choice_options` adds; the command receives them as one dict, ``choice_spec``."""


def choice_options(f: Callable) -> Callable:
    """The options that turn a curve into a choice (shared by ``tune`` and ``recommend``).

    The command receives one keyword argument ``choice_spec`` (a dict of the eight values) and
    passes it to :func:`choice_kwargs`.
    """
    opts = [
        click.option(
            "--memory-budget",
            help="Memory per device the choice must fit, e.g. 12GiB, 500MB (default: none; tune uses the device's total memory on CUDA, 80% of the available memory on the CPU).",
        ),
        click.option(
            "--headroom",
            type=float,
            default=None,
            help="Share of the budget kept free when predicting the largest fitting b_m (default 0.10).",
        ),
        click.option(
            "--max-latency-ms",
            type=float,
            help="Drop points whose step (decode: per-token) time exceeds this.",
        ),
        click.option(
            "--rule",
            type=click.Choice(["fraction", "gain"]),
            default="fraction",
            show_default=True,
            help="fraction: smallest b_m within the tolerance of the best; gain: stop when a doubling gains < tolerance.",
        ),
        click.option(
            "--tolerance", type=float, default=0.15, show_default=True, help="Tolerance τ of the rule."
        ),
        click.option(
            "--reference",
            type=click.Choice(["measured", "bound"]),
            default=None,
            help="What 'best' is for rule fraction. measured: the best measured throughput. bound: also "
            f"the most any larger b_m can reach, 1/slope of a line fitted to step time over the {BOUND_WINDOW} "
            "largest b_m (the roofline makes step time convex in b_m, so no larger b_m beats it), when "
            f"every point is within {100 * BOUND_SLACK:g}% of that line; a point is then within τ of the "
            f"bound only with a {100 * BOUND_MARGIN:g}% margin for the fit's error. "
            "Default: bound for tune (it stops early, so it must answer for what it did not measure), "
            "measured for recommend (a curve given whole is taken as the truth).",
        ),
        click.option("--global-batch", "-B", type=int, help="B_global, to report g = B / (b_m × d)."),
        click.option(
            "--data-parallel", "-d", type=int, default=1, show_default=True, help="d: data-parallel replicas."
        ),
    ]
    return option_group(f, "choice_spec", CHOICE_FLAGS, opts)


def choice_kwargs(choice_spec: dict, *, reference: str = "measured") -> dict:
    """Keyword arguments of :func:`microbatch.choose.knee.recommend` from the shared options (``choice_spec``);
    ``reference`` is the default when ``--reference`` is not given."""
    from microbatch.choose.knee import DEFAULT_HEADROOM, parse_bytes

    memory_budget, headroom = choice_spec["memory_budget"], choice_spec["headroom"]
    return dict(
        memory_budget_bytes=parse_bytes(memory_budget) if memory_budget is not None else None,
        headroom=DEFAULT_HEADROOM if headroom is None else headroom,
        max_latency_ms=choice_spec["max_latency_ms"],
        rule=choice_spec["rule"],
        tolerance=choice_spec["tolerance"],
        reference=choice_spec["reference"] or reference,
        global_batch=choice_spec["global_batch"],
        data_parallel=choice_spec["data_parallel"],
    )


def _size(b) -> str:
    if b is None:
        return "—"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(b) >= scale:
            return f"{b / scale:.2f} {unit}"
    return f"{b:.0f} B"


def render_recommendation(d: dict, points: list[dict] | None = None, unit: str = "samples/s") -> str:
    """Human text of a recommendation dict (and, if given, the measured curve)."""
    lines = []
    if points:
        lines.append(f"{'b_m':>6} {'throughput':>14} {'step ms':>9} {'peak memory':>12}  ")
        for p in sorted(points, key=lambda p: p["micro_batch"]):
            mark = []
            if p["micro_batch"] == d["micro_batch"]:
                mark.append("knee")
            if p["micro_batch"] == d["fastest_fitting"]["micro_batch"]:
                mark.append("fastest")
            if p.get("oom"):
                lines.append(f"{p['micro_batch']:>6} {'out of memory':>14}")
                continue
            st = p.get("step_time_s")
            lines.append(
                f"{p['micro_batch']:>6} {p['throughput']:>14,.1f} {'' if st is None else f'{st * 1e3:.2f}':>9} "
                f"{_size(p.get('peak_memory_bytes')):>12}  {', '.join(mark)}"
            )
        lines.append("")
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
        + f", peak {_size(d['peak_memory_bytes'])}"
    )
    f = d["fastest_fitting"]
    lines.append(
        f"fastest that fits: b_m = {f['micro_batch']}"
        + (f", g = {f['grad_accum']}" if f.get("grad_accum") is not None else "")
        + f"  — {f['throughput']:,.1f} {unit}, peak {_size(f['peak_memory_bytes'])}"
    )
    if bound:
        on = bound["fitted_on"]
        lines.append(
            f"bound: no b_m past {on[-1]} runs faster than {bound['throughput']:,.1f} {unit} "
            f"(1 / the slope of step time against b_m, fitted on {', '.join(str(b) for b in on)}: "
            f"affine within {100 * bound['max_residual']:.1f}%)"
        )
    elif d.get("reference") == "bound" and d.get("rule") == "fraction":
        lines.append(
            f"bound: none (fewer than {BOUND_MIN_POINTS} points, or step time over the {BOUND_WINDOW} largest misses a line "
            f"by more than {100 * BOUND_SLACK:g}%); best measured used"
        )
    fit = d.get("memory_fit")
    if fit:
        lines.append(
            f"memory fit: {_size(fit['intercept_bytes'])} + {_size(fit['slope_bytes_per_sample'])} × b_m "
            f"(on b_m = {', '.join(str(b) for b in fit.get('fitted_on', []))})"
        )
    if d.get("max_fitting_micro_batch") is not None:
        lines.append(
            f"largest b_m predicted to fit {_size(d['memory_budget_bytes'])} with {100 * d['headroom']:.0f}% "
            f"headroom: {d['max_fitting_micro_batch']}"
        )
    if not d.get("flattened", True):
        lines.append(
            "note: the curve had not flattened at the largest b_m measured; a larger b_m may be faster"
        )
    return "\n".join(lines)


def read_measurements(path: str) -> list[dict]:
    """Rows of a measurements file: a JSON list, a JSON object with ``points`` (tune's result.json), or CSV."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"measurements file {path!r} does not exist; give a JSON or CSV file of points")
    text = p.read_text()
    stripped = text.lstrip()
    if stripped.startswith(("[", "{")):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}); fix the file") from None
        if isinstance(data, dict):
            if "points" not in data:
                raise ConfigError(
                    f"{path}: a JSON object needs a 'points' list of {{micro_batch, throughput}}"
                )
            data = data["points"]
        if not isinstance(data, list):
            raise ConfigError(f"{path}: expected a list of {{micro_batch, throughput}} points")
        return data
    reader = csv.DictReader(io.StringIO(text))
    cols = [c.strip() for c in (reader.fieldnames or [])]
    missing = [c for c in ("micro_batch", "throughput") if c not in cols]
    if missing:
        raise ConfigError(
            f"{path}: CSV is missing column(s) {', '.join(missing)}; columns found: {', '.join(cols) or 'none'}; "
            "need micro_batch, throughput[, peak_memory_bytes, oom, step_time_s]"
        )
    return [
        {(k or "").strip(): (v.strip() if isinstance(v, str) else v) for k, v in row.items()}
        for row in reader
    ]


@click.command("recommend")
@click.option(
    "--measurements",
    "-m",
    required=True,
    help="JSON list (or tune's result.json) or CSV with columns micro_batch, throughput[, peak_memory_bytes, oom, step_time_s].",
)
@choice_options
@json_option
def cmd(measurements, choice_spec, as_json):
    """Pick the knee b_m from measurements made anywhere.

    \b
    Example: microbatch recommend --measurements curve.csv --global-batch 512 --data-parallel 4
    The knee is the smallest b_m within the tolerance of the best throughput (rule fraction),
    among the points that fit --memory-budget and --max-latency-ms.
    """
    from microbatch.choose.knee import points_from_records, recommend

    rows = read_measurements(measurements)
    points = points_from_records(rows, source=measurements)
    rec = recommend(points, **choice_kwargs(choice_spec))
    d = rec.to_dict()
    pts = [
        {
            "micro_batch": p.micro_batch,
            "throughput": p.throughput,
            "peak_memory_bytes": p.peak_memory_bytes,
            "oom": p.oom,
            "step_time_s": p.step_time_s,
        }
        for p in points
    ]
    emit(d, as_json, lambda: render_recommendation(d, pts, unit="per s"))
