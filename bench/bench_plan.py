"""Planner search speed: candidates evaluated per second over a large layout space.

Space: Megatron-Turing 530B (105 layers, h = 20480, 128 heads, s = 2048) on 2,240 A100 80GB GPUs
(Narayanan et al. 2021 Table 1's 530B run), B_global = 2240; every t in {1, 2, 4, 8}, every
pipeline depth p dividing 2240/t (p <= 105; uneven splits allowed), d = 2240/(t·p) when d | B,
every b_m dividing B/d, every schedule that can serve (p, m, v) (gpipe, 1f1b, zb-h1,
interleaved-1f1b with every v > 1 such that p·v divides 105), recompute none/selective/full,
ZeRO 0-3. A candidate counts once it has its per-stage peak memory, fits/does not fit, step
time, tokens/s and MFU (closed forms; no simulation, as in calculon's search).

calculon's anchor (published.json, search_speed_anchor): 8,112 configurations in 67 s on a
2-core machine, about 121 per second.

Run: .venv/bin/python bench/bench_plan.py [--repeat N]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from microbatch.hardware import get_accelerator  # noqa: E402
from microbatch.model import get_model  # noqa: E402
from microbatch.predict.plan import search_layouts  # noqa: E402

CALCULON_PER_S = 8112 / 67


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3, help="timed repetitions (best is reported)")
    ap.add_argument("--gpus", type=int, default=2240)
    ap.add_argument("--global-batch", type=int, default=2240)
    args = ap.parse_args()
    shape = get_model("megatron-530b")
    gpu = get_accelerator("a100-80gb")
    runs = []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        best, evaluated, feasible = search_layouts(
            shape, gpu, global_batch=args.global_batch, num_gpus=args.gpus
        )
        runs.append((time.perf_counter() - t0, evaluated, feasible, best))
    secs, evaluated, feasible, best = min(runs, key=lambda r: r[0])
    rate = evaluated / secs
    rows = [
        ("model / GPUs / B_global", f"{shape.name} / {args.gpus} x {gpu.name} / {args.global_batch}"),
        ("candidates evaluated", f"{evaluated:,}"),
        ("candidates that fit", f"{feasible:,}"),
        (f"seconds (best of {args.repeat})", f"{secs:.2f}"),
        ("candidates per second", f"{rate:,.0f}"),
        ("calculon (anchor)", f"{CALCULON_PER_S:,.0f} per second"),
        ("speed-up over anchor", f"{rate / CALCULON_PER_S:,.0f}x"),
    ]
    if best is not None:
        rows.append((
            "best layout",
            f"t={best.tensor_parallel} p={best.pipeline_parallel} d={best.data_parallel} b_m={best.micro_batch} "
            f"m={best.microbatches} {best.schedule} v={best.virtual} recompute={best.recompute} ZeRO={best.zero}: "
            f"{best.step_time_s:.1f} s/step, MFU {100 * best.mfu:.1f}%, peak {best.peak_memory_bytes / 2**30:.1f} GiB",
        ))  # fmt: skip
    width = max(len(k) for k, _ in rows)
    print("planner search speed")
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")


if __name__ == "__main__":
    main()
