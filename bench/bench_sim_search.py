"""The search and the knee replayed on recorded curves, under each margin rule, with noise.

Drives ``microbatch.choose.tune.search.search`` (then, as ``tune`` does, ``confirm_knee``; ``--no-confirm``
leaves it out) with synthetic measurements: a recorded curve (the
exhaustive sweeps of ``bench/bench_tune.py`` in ``bench/results/bench_tune-*.json``: CPU decoding
and training) times log-normal noise, many seeds. For each rule of the margin μ the knee must clear
(``fixed``: μ = 5% whenever the reference is the bound; ``se``: μ = the fitted bound's relative
standard error, :func:`microbatch.choose.bound.choice_margin`; ``2se``: twice that, the library's rule) it reports the
share of seeds whose choice is within τ of the curve's own best (by the curve, not the noisy
probe), the mean probes' cost against the whole sweep's (time share), and the chosen b_m against
the knee of the curve itself (memory: log2 of the ratio, 0 = the same b_m).

Then the recorded H200 tune curves (``bench/results/h200-2026-11-30*/**/ours_*.json``: CUDA
events, no noise added) are replayed through ``recommend(reference="bound")`` under each rule.

    python bench/bench_sim_search.py [--seeds 400] [--noise 0.0 0.03 0.05] [--json OUT]
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import random
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

import microbatch.choose.knee as knee_mod  # noqa: E402
import microbatch.choose.tune.search as search_mod  # noqa: E402
from microbatch.choose.bound import BOUND_MARGIN, ThroughputBound, choice_margin  # noqa: E402
from microbatch.choose.config import ChoiceConfig  # noqa: E402
from microbatch.choose.curve import CurvePoint  # noqa: E402
from microbatch.choose.knee import recommend  # noqa: E402
from microbatch.choose.tune.config import SearchConfig  # noqa: E402
from microbatch.choose.tune.confirm import CONFIRM_BUDGET, confirm_knee  # noqa: E402
from microbatch.choose.tune.search import SearchLog, curve_point, search  # noqa: E402
from microbatch.measure.probes import Measurement  # noqa: E402

TAU = 0.15


def margin_rule(name: str):  # type: ignore[no-untyped-def]
    def fixed(bound: ThroughputBound | None) -> float:
        return BOUND_MARGIN

    def se(bound: ThroughputBound | None) -> float:
        return bound.relative_error if bound is not None else BOUND_MARGIN

    def se2(bound: ThroughputBound | None) -> float:  # the library's rule (BOUND_CONFIDENCE = 2)
        return choice_margin(bound)

    return {"fixed": fixed, "se": se, "2se": se2}[name]


def use_rule(name: str) -> None:
    rule = margin_rule(name)
    knee_mod.choice_margin = rule  # type: ignore[attr-defined]
    search_mod.choice_margin = rule  # type: ignore[attr-defined]


def recorded_sweeps(pattern: str = "bench_tune-*.json") -> dict[str, list[dict[int, float]]]:
    out: dict[str, list[dict[int, float]]] = {"decode": [], "train": []}
    for f in sorted(glob.glob(str(ROOT / "bench/results" / pattern))):
        for row in json.loads(Path(f).read_text()):
            curve = {int(b): float(t) for b, t in row["sweep_points"] if t}
            out["decode" if row["mode"] == "decode" else "train"].append(curve)
    return out


def probe_cost(b: int, t: float, start: float) -> float:
    """A probe's cost: a fixed start plus time proportional to one step (b / T)."""
    return start + b / t


def true_knee(curve: dict[int, float]) -> int:
    best = max(curve.values())
    return min(b for b, t in curve.items() if t >= (1 - TAU) * best)


def one(
    curve: dict[int, float], noise: float, rng: random.Random, start: float, confirm: float | None
) -> dict[str, Any]:
    calls: list[int] = []
    now = [0.0]  # the simulated clock: each probe advances it by its cost

    def measure(b: int, ckpt: bool) -> Measurement:
        calls.append(b)
        now[0] += probe_cost(b, curve[b], start)
        t = curve[b] * math.exp(rng.gauss(0.0, noise)) if noise else curve[b]
        return Measurement(micro_batch=b, throughput=t, step_time_s=b / t, peak_memory_bytes=b)

    choice = ChoiceConfig(tolerance=TAU, reference="bound")
    log = SearchLog(clock=lambda: now[0])  # confirm_knee budgets with the probes' simulated cost
    pts = search(measure, SearchConfig(max_micro_batch=max(curve)), choice, log=log)
    if confirm is not None:  # as tune and the integrations do after the search: the knee measured again
        pts = confirm_knee(measure, pts, choice, log, budget=confirm)
    rec = recommend([curve_point(p) for p in pts], choice)
    b = rec.knee.micro_batch
    best = max(curve.values())
    cost = sum(probe_cost(c, curve[c], start) for c in calls)
    whole = sum(probe_cost(bb, t, start) for bb, t in curve.items())
    return {
        "within": curve[b] >= (1 - TAU) * best,
        "fraction": curve[b] / best,
        "share": cost / whole,
        "log2_vs_knee": math.log2(b / true_knee(curve)),
    }


def simulate(
    curves: list[dict[int, float]], noise: float, seeds: int, start: float, confirm: float | None
) -> dict[str, float]:
    """``confirm``: the confirmation's budget (a share of the search's time), None for none."""
    rows = []
    for i, curve in enumerate(curves):
        rng = random.Random(1000 * i + int(noise * 1000))
        rows += [one(curve, noise, rng, start, confirm) for _ in range(seeds if noise else 1)]
    return {
        "within_tau": sum(r["within"] for r in rows) / len(rows),
        "worst_fraction": min(r["fraction"] for r in rows),
        "time_share": statistics.mean(r["share"] for r in rows),
        "log2_vs_knee": statistics.mean(r["log2_vs_knee"] for r in rows),
        "runs": len(rows),
    }


def h200_curves() -> list[tuple[str, list[CurvePoint]]]:
    out = []
    for f in sorted(glob.glob(str(ROOT / "bench/results/h200-2026-11-30*/**/ours_*.json"), recursive=True)):
        d = json.loads(Path(f).read_text())
        pts = [
            CurvePoint(
                micro_batch=p["micro_batch"],
                throughput=p["throughput"],
                peak_memory_bytes=p["peak_memory_bytes"],
            )
            for p in d["points"]
            if p["throughput"]
        ]
        out.append((str(Path(f).relative_to(ROOT / "bench/results")), pts))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=400, help="noisy runs per recorded curve (default 400)")
    ap.add_argument(
        "--noise", type=float, nargs="+", default=[0.0, 0.03, 0.05], help="log-normal σ per probe"
    )
    ap.add_argument("--rules", nargs="+", default=["fixed", "se", "2se"], choices=["fixed", "se", "2se"])
    ap.add_argument("--json", help="write the table's rows here")
    ap.add_argument(
        "--sweeps", default="bench_tune-*.json", help="which bench/results files hold the sweeps (a glob)"
    )
    ap.add_argument(
        "--no-confirm",
        action="store_true",
        help="search and choose only (default: confirm the knee, as tune does)",
    )
    ap.add_argument(
        "--confirm-budget",
        type=float,
        nargs="+",
        default=[CONFIRM_BUDGET],
        help=f"the confirmation's time as a share of the search's (default {CONFIRM_BUDGET:g}, as tune "
        "runs it; inf: unbounded, the code before 2026-12-01 afternoon)",
    )
    args = ap.parse_args()
    budgets: list[float | None] = [None] if args.no_confirm else list(args.confirm_budget)
    sweeps = recorded_sweeps(args.sweeps)
    # a probe's fixed start, in units of one step at the sweep's b_m = 16 (profiled decode sweep:
    # start 3.7 s against 2.6 s at b_m = 64, BENCHMARKS.md "Measure: tune")
    rows: list[dict[str, Any]] = []
    print(
        f"{'case':8} {'noise':>5} {'rule':6} {'confirm':>7} {'within τ':>8} {'worst':>6} {'time':>6} {'log2 b/knee':>11}"
    )
    for case, curves in sweeps.items():
        for noise in args.noise:
            for rule in args.rules:
                use_rule(rule)
                start = statistics.median(1.4 * 64 / c[64] for c in curves)
                for budget in budgets:
                    r = simulate(curves, noise, args.seeds, start, budget)
                    rows.append(
                        {"case": case, "curves": len(curves), "noise": noise, "rule": rule,
                         "confirm": budget is not None, "confirm_budget": budget, **r}
                    )  # fmt: skip
                    print(
                        f"{case:8} {noise:5.2f} {rule:6} {'no' if budget is None else f'{budget:g}×':>7}"
                        f" {100 * r['within_tau']:7.1f}% {100 * r['worst_fraction']:5.1f}%"
                        f" {100 * r['time_share']:5.1f}% {r['log2_vs_knee']:+11.2f}"
                    )
    print("\nH200 tune curves (CUDA events), recommend(reference='bound'):")
    for name, pts in h200_curves():
        picks = []
        for rule in args.rules:
            use_rule(rule)
            rec = recommend(pts, ChoiceConfig(tolerance=TAU, reference="bound"))
            picks.append(f"{rule}: {rec.knee.micro_batch} (μ {100 * rec.margin:.1f}%)")
            rows.append(
                {
                    "case": "h200",
                    "curve": name,
                    "rule": rule,
                    "knee": rec.knee.micro_batch,
                    "margin": rec.margin,
                }
            )
        print(f"  {name:48} " + ", ".join(picks))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
