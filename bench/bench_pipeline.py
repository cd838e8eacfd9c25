"""Measured pipeline bubble vs the simulator's prediction, as m grows (p = 2, gloo on the CPU).

For each (schedule, m, v): run ``microbatch.run.launch.run_pipeline`` for a few steps on a built-in
model with a fixed global batch, then print the measured bubble (idle share of p × step time,
mean over the steps after the first), the simulator's prediction fed with the measured
per-stage F/B/I/W times on torch's own action order, the closed form (p−1)/(v·m+p−1), the
measured and predicted in-flight counts and the largest relative gradient error against the
unsplit model.

    python bench/bench_pipeline.py                   # small model, B = 16, 4 steps
    python bench/bench_pipeline.py --model tiny --global-batch 8
"""

from __future__ import annotations

import argparse
import sys
import time

CASES = [
    ("gpipe", 1, 1),
    ("gpipe", 2, 1),
    ("gpipe", 4, 1),
    ("gpipe", 8, 1),
    ("1f1b", 2, 1),
    ("1f1b", 4, 1),
    ("1f1b", 8, 1),
    ("interleaved-1f1b", 2, 2),
    ("interleaved-1f1b", 4, 2),
    ("interleaved-1f1b", 8, 2),
    ("zbv", 2, 2),
    ("zbv", 4, 2),
    ("zbv", 8, 2),
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--only", default=None, help="comma-separated schedule names")
    args = ap.parse_args(argv)

    from microbatch.run.launch import run_pipeline
    from microbatch.run.pipeline_config import PipelineConfig
    from microbatch.schedules.simulate import bubble_fraction

    p = args.stages
    rows = []
    t_all = time.perf_counter()
    for name, m, v in CASES:
        if args.only and name not in args.only.split(","):
            continue
        cfg = PipelineConfig(
            schedule=name,
            stages=p,
            microbatches=m,
            virtual=v,
            model=args.model,
            global_batch=args.global_batch,
            steps=args.steps,
            check_gradients=True,
            timeout_s=300,
        )
        rep = run_pipeline(cfg)
        meas, pred = rep["measured"], rep["predicted"]
        rows.append(
            (
                name,
                m,
                v,
                meas["bubble_fraction"],
                pred["bubble_fraction"],
                pred["with_comm"]["bubble_fraction"],
                bubble_fraction(p, m, v),
                [s["peak_in_flight"] for s in meas["stage_stats"]],
                pred["peak_in_flight"],
                meas["step_time_s"] * 1e3,
                rep["max_grad_rel_error"],
            )
        )
        print(f"  done {name} m={m} v={v}", file=sys.stderr, flush=True)

    print(
        f"pipeline bubble, p = {p}, model {args.model}, B = {args.global_batch}, {args.steps} steps "
        "(first is warm-up), gloo on the CPU"
    )
    head = (
        f"{'schedule':<17}{'m':>3}{'v':>3}  {'measured':>8}  {'predicted':>9}  {'|diff|':>6}  {'pred+comm':>9}  "
        f"{'(p-1)/(vm+p-1)':>14}  {'in flight meas/pred':>20}  {'step ms':>8}  {'grad err':>8}"
    )
    print(head)
    print("-" * len(head))
    diffs = []
    for name, m, v, bm, bp, bpc, bc, im, ip, ms, ge in rows:
        diffs.append(abs(bm - bp))
        fl = f"{'/'.join(f'{x:g}' for x in im)} vs {'/'.join(f'{x:g}' for x in ip)}"
        print(
            f"{name:<17}{m:>3}{v:>3}  {bm:8.1%}  {bp:9.1%}  {abs(bm - bp):6.1%}  {bpc:9.1%}  {bc:14.1%}  {fl:>20}  "
            f"{ms:8.1f}  {ge:8.1e}"
        )
    if diffs:
        print(
            f"|measured - predicted| bubble: mean {sum(diffs) / len(diffs):.1%}, max {max(diffs):.1%} "
            f"over {len(diffs)} runs; total {time.perf_counter() - t_all:.0f} s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
