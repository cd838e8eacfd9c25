"""Exhaustive sweep against `tune` on the CPU: time to answer, quality of the answer, memory fit.

For each case (the built-in small GPT training; a GPT-2-small-shaped decoder decoding) it

1. sweeps every power of two from 1 until the child runs out of memory under the budget (or a
   cap), as an exhaustive search or a batch-size finder does (the best measured throughput, and
   the knee of the full curve);
2. runs ``tune_model`` with the same budget and cap, cache off;
3. reports: tune's wall time as a share of the sweep's (target <= 40%), whether tune's choice is
   within the tolerance of the sweep's best throughput, judged two ways: on the sweep's own
   figure at tune's b_m, and *paired* (tune's b_m and the sweep's best b_m re-measured in one
   child, alternately, ``--pairs`` times each, medians compared: the machine's speed drifts by up
   to 25% over a minute on a shared VM, and a pair measured together cancels it), the memory fit's error at the
   largest b_m the sweep measured (fit from tune's points only, i.e. extrapolated), and the
   out-of-memory events in the children (counted), and whether the parent survived (it reports
   only that it is alive: it has no out-of-memory counter of its own).

Usage: python bench/bench_tune.py [--quick] [--threads N] [--repeat N] [--pairs N] [--json OUT]
Prints one summary table (a row per case and repeat).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from microbatch.choose.config import ChoiceConfig  # noqa: E402
from microbatch.choose.curve import CurvePoint  # noqa: E402
from microbatch.choose.knee import find_knee  # noqa: E402
from microbatch.choose.memory_fit import fit_memory  # noqa: E402
from microbatch.choose.tune import tune_model  # noqa: E402
from microbatch.choose.tune.config import ProbeConfig, SearchConfig  # noqa: E402
from microbatch.choose.tune.probing import CPU_TIMING  # noqa: E402
from microbatch.measure.childprobe import ChildProber  # noqa: E402
from microbatch.measure.spec import ProbeSpec  # noqa: E402
from microbatch.measure.timing import TimingConfig  # noqa: E402

GiB = 2**30


def sweep(spec: ProbeSpec, cap: int, budget: int) -> tuple[list, float]:
    t0 = time.perf_counter()
    prober = ChildProber(spec, limit_bytes=budget)
    pts = []
    try:
        b = 1
        while b <= cap:
            m = prober.measure(b)
            pts.append(m)
            if m.oom:
                break
            b *= 2
    finally:
        prober.close()
    return pts, time.perf_counter() - t0


def paired(spec: ProbeSpec, budget: int, a: int, b: int, pairs: int) -> float:
    """median T(a) / median T(b), measured alternately a, b, a, b... in one child."""
    if a == b:
        return 1.0
    prober = ChildProber(spec, limit_bytes=budget)
    ta, tb = [], []
    try:
        for _ in range(pairs):
            ta.append(prober.measure(a).throughput)
            tb.append(prober.measure(b).throughput)
    finally:
        prober.close()
    return statistics.median(ta) / statistics.median(tb)


def case(name, *, model, mode, seq, cap, budget, timing, threads, tolerance=0.15, pairs=3):
    spec = ProbeSpec(model=model, seq=seq, mode=mode, timing=timing, threads=threads)
    full, t_full = sweep(spec, cap, budget)
    r = tune_model(
        model,
        probe=ProbeConfig(seq=seq, mode=mode, timing=timing, threads=threads),
        search=SearchConfig(max_micro_batch=cap, use_cache=False),
        choice=ChoiceConfig(memory_budget_bytes=budget, tolerance=tolerance),
    )
    ok = [m for m in full if not m.oom]
    best = max(ok, key=lambda m: m.throughput)
    at = {m.micro_batch: m for m in ok}
    choice = r.recommendation.knee.micro_batch
    # tune's choice judged on the sweep's own measurement of that b_m when it has one
    chosen_tp = at[choice].throughput if choice in at else r.recommendation.knee.throughput
    frac = chosen_tp / best.throughput
    frac_paired = paired(spec, budget, choice, best.micro_batch, pairs) if pairs else None
    full_knee = find_knee(
        [CurvePoint(micro_batch=m.micro_batch, throughput=m.throughput) for m in ok], tolerance=tolerance
    ).micro_batch
    fit = fit_memory(
        [
            CurvePoint(
                micro_batch=p.micro_batch, throughput=p.throughput, peak_memory_bytes=p.peak_memory_bytes
            )
            for p in r.points
            if not p.oom
        ]
    )
    largest = max(ok, key=lambda m: m.micro_batch)
    fit_err = (
        (fit.predict(largest.micro_batch) - largest.peak_memory_bytes) / largest.peak_memory_bytes
        if fit
        else None
    )
    tuned_largest = max((p for p in r.points if not p.oom), key=lambda p: p.micro_batch)
    fit_err_in = (
        (fit.predict(tuned_largest.micro_batch) - tuned_largest.peak_memory_bytes)
        / tuned_largest.peak_memory_bytes
        if fit
        else None
    )
    return {
        "case": name,
        "model": model,
        "mode": mode,
        "seq": seq,
        "budget_bytes": budget,
        "sweep_points": [(m.micro_batch, None if m.oom else round(m.throughput, 1)) for m in full],
        "sweep_time_s": t_full,
        "sweep_best_micro_batch": best.micro_batch,
        "sweep_knee": full_knee,
        "tune_points": [(p.micro_batch, None if p.oom else round(p.throughput, 1)) for p in r.points],
        "tune_time_s": r.wall_time_s,
        "tune_choice": choice,
        "tune_fastest": r.recommendation.fastest.micro_batch,
        "time_share": r.wall_time_s / t_full,
        "choice_fraction_of_best": frac,
        "within_tolerance": frac >= 1 - tolerance,
        "choice_fraction_of_best_paired": frac_paired,
        "within_tolerance_paired": None if frac_paired is None else frac_paired >= 1 - tolerance,
        "reference": r.recommendation.reference,
        "bound": r.recommendation.bound.throughput if r.recommendation.bound else None,
        "fit_error_at_sweep_largest": fit_err,
        "fit_error_at_tune_largest": fit_err_in,
        "sweep_largest": largest.micro_batch,
        "tune_largest": tuned_largest.micro_batch,
        "oom_events_children": sum(m.oom for m in full) + r.oom_events,
        # not a count: the parent has no out-of-memory counter to read; reaching this line says only
        # that it survived every probe (an over-committed host would have killed it outright)
        "parent_survived": True,
        "stop_reason": r.stop_reason,
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="smaller caps (a smoke run)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads in the probe processes")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--repeat", type=int, default=1, help="run each case this many times (default 1)")
    ap.add_argument(
        "--pairs",
        type=int,
        default=3,
        help="paired re-measurements of tune's and the sweep's best b_m (0: skip)",
    )
    ap.add_argument("--only", choices=["train", "decode"], help="run one case only")
    ap.add_argument(
        "--clock",
        choices=["wall", "process"],
        default="process",
        help="probe clock: process CPU time (steady on a shared machine; default) or wall time",
    )
    args = ap.parse_args()
    os.environ.setdefault("MICROBATCH_CACHE_DIR", tempfile.mkdtemp(prefix="mb-bench-"))
    timing = (
        CPU_TIMING if not args.quick else TimingConfig(warmup=1, min_repeats=2, max_repeats=3, max_time_s=1)
    )
    timing = replace(timing, clock=args.clock)
    cases = [
        dict(name="small GPT, train", model="small", mode="train", seq=128, cap=8 if args.quick else 256),
        dict(
            name="GPT-2-small shape, decode",
            model="gpt2",
            mode="decode",
            seq=40,
            cap=4 if args.quick else 1024,
        ),
    ]
    rows = []
    for rep in range(args.repeat):
        for c in cases:
            if args.only and c["mode"] != args.only:
                continue
            row = case(
                c["name"],
                model=c["model"],
                mode=c["mode"],
                seq=c["seq"],
                cap=c["cap"],
                budget=3 * GiB,
                timing=timing,
                threads=args.threads,
                pairs=args.pairs,
            )
            row["repeat"] = rep + 1
            rows.append(row)
            if args.json:
                Path(args.json).write_text(json.dumps(rows, indent=2))
    hdr = (
        f"{'case':<28}{'sweep s':>9}{'tune s':>8}{'share':>7}{'choice':>7}{'% best':>8}{'paired':>8}{'sweep knee':>11}"
        f"{'fit err@max':>12}{'child OOM, parent':>19}"
    )
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        fe = r["fit_error_at_sweep_largest"]
        fp = r["choice_fraction_of_best_paired"]
        print(
            f"{r['case']:<28}{r['sweep_time_s']:>9.1f}{r['tune_time_s']:>8.1f}{100 * r['time_share']:>6.0f}%"
            f"{r['tune_choice']:>7}{100 * r['choice_fraction_of_best']:>7.1f}%"
            f"{'' if fp is None else f'{100 * fp:.1f}%':>8}"
            f"{r['sweep_knee']:>11}"
            f"{'' if fe is None else f'{100 * fe:+.1f}% @' + str(r['sweep_largest']):>12}"
            f"{str(r['oom_events_children']) + (', survived' if r['parent_survived'] else ', died'):>19}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
