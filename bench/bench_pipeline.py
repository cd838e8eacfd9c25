"""Pipeline runs against their predictions: bubble before the run, after-the-fact replay and
measured; activation memory per rank measured against predicted (gloo on the CPU).

For each model, p and schedule: ``microbatch.run.pipeline.before_run.predict_run(cfg)`` profiles the
stages on one process and calibrates the runtime (the prediction made before the ranks start); the
ranks then run for at least ``--steps`` steps and ``--measure-s`` seconds of steps (the measured
bubble's standard error over steps is printed beside it), and the run's own op times are replayed
on torch's order. The "stand-in" column is the loaded calibration run's own measured bubble (its
stages spin for the profiled CPU times), for comparison with the simulator's prediction. Memory:
the peak of saved-activation storages actually alive per rank (weak references) against the
in-flight rule × saved bytes per micro-batch (calibrated) and predict/memory's formula
(uncalibrated). Also GPipe's and 1F1B's measured memory at m and 2m.

    python bench/bench_pipeline.py                          # tiny and small, p = 2 and 4
    python bench/bench_pipeline.py --models tiny --stages 2 --only 1f1b
    python bench/bench_pipeline.py --repeat 3               # each case 3 times: the measurement's own spread
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import replace


def cases(p: int) -> list[tuple[str, int, int]]:
    """(schedule, m, v) at p ranks: m = 2p (DualPipeV's least), v = 2 where the schedule interleaves."""
    m = 2 * p
    return [("gpipe", m, 1), ("1f1b", m, 1), ("interleaved-1f1b", m, 2), ("zb-h1", m, 1), ("dualpipev", m, 2)]


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,small")
    ap.add_argument("--stages", default="2,4")
    ap.add_argument("--steps", type=int, default=8, help="fewest steps of each run (the first warms up)")
    ap.add_argument(
        "--measure-s",
        type=float,
        default=3.0,
        help="more steps where the predicted step is short: enough to measure this many seconds "
        "(at most 64 steps); one step's bubble on tiny moves by 6-8 points on a shared CPU",
    )
    ap.add_argument(
        "--repeat", type=int, default=1, help="run each case N times (prediction and run each time)"
    )
    ap.add_argument("--only", default=None, help="comma-separated schedule names")
    args = ap.parse_args(argv)

    from microbatch.errors import ConfigError, PipelineError
    from microbatch.run.pipeline.before_run import predict_run
    from microbatch.run.pipeline.config import PipelineConfig
    from microbatch.run.pipeline.launch import run_pipeline
    from microbatch.run.pipeline.memory import boundary_bytes
    from microbatch.run.pipeline.report import PipelineReport
    from microbatch.run.pipeline.resolved import resolve

    def run_predicted(cfg: PipelineConfig) -> PipelineReport:
        """The prediction made before the run, then the run with enough steps that the measured
        bubble's own noise is small: the prediction does not depend on the run's steps."""
        before = predict_run(cfg)
        steps = max(cfg.steps, min(64, 1 + math.ceil(args.measure_s / max(before.step_time_s, 1e-6))))
        return replace(run_pipeline(replace(cfg, steps=steps)), before_run=before)

    load = os.getloadavg()[0]
    t_all = time.perf_counter()
    bubble_rows, memory_rows, growth = [], [], []
    refused: list[str] = []
    for model in args.models.split(","):
        for p in (int(x) for x in args.stages.split(",")):
            for name, m, v in cases(p):
                if args.only and name not in args.only.split(","):
                    continue
                cfg = PipelineConfig(
                    schedule=name,
                    stages=p,
                    microbatches=m,
                    virtual=v,
                    model=model,
                    steps=args.steps,
                    timeout_s=300,
                )
                try:
                    reps = [run_predicted(cfg) for _ in range(max(1, args.repeat))]
                    rep = reps[0]
                except PipelineError as e:
                    print(f"  FAILED {model} p={p} {name} v={v}: {e}", file=sys.stderr, flush=True)
                    refused.append(f"{model} p={p} {name} v={v} (failed: {str(e)[:120]})")
                    continue
                except ConfigError as e:  # p·v stages > the model's layers + 2
                    print(f"  refused {model} p={p} {name} v={v}: {e}", file=sys.stderr, flush=True)
                    refused.append(f"{model} p={p} {name} v={v}")
                    continue
                for r in reps:
                    b, pw, meas = r.before_run, r.predicted.with_comm, r.measured
                    assert b is not None  # made by run_predicted
                    bubble_rows.append(
                        (model, p, name, m, v, b.bubble_fraction, pw.bubble_fraction, meas.bubble_fraction,
                         b.step_time_s, meas.step_time_s, b.runtime.get("loaded_bubble"),
                         meas.bubble_se, r.steps)
                    )  # fmt: skip
                for row in rep.memory:
                    memory_rows.append((model, p, name, m, row))
                if name in ("gpipe", "1f1b"):
                    twice = run_pipeline(
                        PipelineConfig(
                            schedule=name,
                            stages=p,
                            microbatches=2 * m,
                            model=model,
                            steps=args.steps,
                            timeout_s=300,
                        )
                    )
                    buf = boundary_bytes(resolve(cfg)) or 0.0
                    for row, row2 in zip(rep.memory, twice.memory, strict=True):
                        growth.append((model, p, name, m, row.rank, row.measured_peak_bytes,
                                       row2.measured_peak_bytes, buf))  # fmt: skip
                print(f"  done {model} p={p} {name} m={m} v={v}", file=sys.stderr, flush=True)

    print(
        f"pipeline bubble and memory, gloo on the CPU, at least {args.steps} steps and {args.measure_s:g} s "
        f"of steps (at most 64; the first warms up); load {load:.2f}"
    )
    head = (
        f"{'model':<6}{'p':>2}  {'schedule':<17}{'m':>3}{'v':>2}  {'before':>7}  {'replay':>7}  {'measured':>8}  "
        f"{'|before-meas|':>13}  {'step ms before/meas':>20}  {'stand-in':>8}  {'meas se':>7} {'steps':>5}"
    )
    print(head)
    print("-" * len(head))
    diffs = []
    stand_in = []
    for model, p, name, m, v, bb, br, bm, sb, sm, bs, se, n in bubble_rows:
        diffs.append(abs(bb - bm) * 100)
        if bs is not None:
            stand_in.append(abs(bs - bm) * 100)
        print(
            f"{model:<6}{p:>2}  {name:<17}{m:>3}{v:>2}  {bb:7.1%}  {br:7.1%}  {bm:8.1%}  {abs(bb - bm) * 100:10.1f} pt"
            f"  {sb * 1e3:9.1f} / {sm * 1e3:8.1f}  {_pct(bs):>8}  {'-' if se is None else f'{se * 100:.1f} pt':>7} {n:>5}"
        )
    if diffs:
        print(
            f"|before - measured| bubble: mean {sum(diffs) / len(diffs):.1f} points, max {max(diffs):.1f} over "
            f"{len(diffs)} runs (goal <= 5 in every run); {sum(d <= 5 for d in diffs)} runs within 5"
        )
    if stand_in:  # the loaded calibration's own measured bubble (a stand-in pipeline), for comparison
        print(
            f"|stand-in - measured| bubble: mean {sum(stand_in) / len(stand_in):.1f} points, max {max(stand_in):.1f}; "
            f"{sum(d <= 5 for d in stand_in)} of {len(stand_in)} runs within 5"
        )
    if args.repeat > 1:  # the same case run again: how far the measurement and the prediction move alone
        by_case: dict[tuple[str, int, str], list[tuple[float, float]]] = {}
        for model, p, name, _m, _v, bb, _br, bm, _sb, _sm, _bs, _se, _n in bubble_rows:
            by_case.setdefault((model, p, name), []).append((bb, bm))
        print(
            f"over {args.repeat} repeats of each case: range of the measured bubble / of the before-run prediction"
        )
        for (model, p, name), xs in by_case.items():
            before, measured = [x[0] for x in xs], [x[1] for x in xs]
            print(
                f"  {model:<6}{p:>2}  {name:<17} measured {min(measured):.1%}-{max(measured):.1%} "
                f"({(max(measured) - min(measured)) * 100:.1f} pt), before {min(before):.1%}-{max(before):.1%} "
                f"({(max(before) - min(before)) * 100:.1f} pt)"
            )
    print()
    head = f"{'model':<6}{'p':>2}  {'schedule':<17}{'m':>3}{'rank':>5}  {'measured KiB':>12}  {'pred KiB':>9}  {'error':>7}  {'uncal err':>9}"
    print(head)
    print("-" * len(head))
    errs: dict[str, list[float]] = {}
    for model, p, name, m, row in memory_rows:
        e, u = row.error_pct, row.uncalibrated_error_pct
        if e is not None:
            errs.setdefault(name, []).append(abs(e))
        print(
            f"{model:<6}{p:>2}  {name:<17}{m:>3}{row.rank:>5}  {row.measured_peak_bytes / 1024:12.1f}  "
            f"{(row.predicted_bytes or 0) / 1024:9.1f}  {'-' if e is None else f'{e:+.1f}%':>7}  "
            f"{'-' if u is None else f'{u:+.1f}%':>9}"
        )
    for name, xs in errs.items():
        print(
            f"{name} calibrated memory error: max {max(xs):.1f}%, {sum(x <= 10 for x in xs)} of {len(xs)} "
            "ranks within 10%"
        )
    print()
    # from m to 2m: GPipe's in-flight activations double; 1F1B's in-flight count stays min(p - rank, m),
    # but torch's runtime keeps one receive buffer per micro-batch on every stage fed by another rank
    # (b_m x s x h x dtype bytes), so there the peak grows by exactly m buffers: growth / (m x buffer)
    # = 1.00 is the buffers alone, more is activations held per micro-batch as well (rank 0 is fed by
    # no rank; it keeps the m chunks of the batch's token ids)
    print(
        f"{'model':<6}{'p':>2}  {'schedule':<9}{'rank':>5}  measured KiB at m -> 2m   growth / (m x recv buffer)"
    )
    for model, p, name, m, rank, a, b, buf in growth:
        print(
            f"{model:<6}{p:>2}  {name:<9}{rank:>5}  m={m}: {a / 1024:.1f} -> m={2 * m}: {b / 1024:.1f} (x{b / a:.2f})"
            f"   {(b - a) / (m * buf):.2f}"
        )
    if refused:
        print(f"not run (refused: more stages than the model's layers + 2, or failed): {'; '.join(refused)}")
    print(
        f"total {time.perf_counter() - t_all:.0f} s; load at start {load:.2f}, at end {os.getloadavg()[0]:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
