"""The planner's GEMM model against XLA's published GEMM table (issue 28 item 1: "GEMM efficiency as a function of
shape per accelerator ... from published kernel benchmarks").

``tests/data/xla_gemm_bf16.json`` holds XLA's measured bf16 GEMM rates for its GPU cost model (openxla/xla
``matmul_interpolator_data.h``: an H100 ``sm_90`` and a B200, m, n, k from 256 to 4,096, batch 1). The planner's
time for each shape (:func:`microbatch.predict.gemm.gemm_time_s`, default efficiencies) is taken at the burst clock
(``sustained_clock_fraction`` 1: a kernel table times kernels alone) and compared, unfitted: nothing was chosen from
these rates. XLA states neither its inputs (zeros draw less power, and clock higher, than random data) nor its
clock, so the comparison bounds the shape terms (waves, tiles, short k, few rows) better than the ceiling.

Run: .venv/bin/python bench/bench_gemm_xla.py [--json]
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from _table_cli import run_table

from microbatch.hardware import get_accelerator
from microbatch.predict.gemm import gemm_flops, gemm_time_s

DATA = Path(__file__).resolve().parent.parent / "tests" / "data" / "xla_gemm_bf16.json"
ROWS = {"sm_90": "h100-sxm", "sm_100_B200": "b200"}
"""XLA's table keys and the accelerator rows they are read as."""
BANDS = (("m·n·k < 2^30", 0, 2**30), ("2^30 <= m·n·k < 2^34", 2**30, 2**34), ("m·n·k >= 2^34", 2**34, 2**63))
"""Size bands: launch- and tile-bound shapes, the middle, the largest (4,096 × 4,096 × 1,024 and up)."""


def errors(key: str) -> list[tuple[int, int, int, float, float]]:
    """(m, n, k, XLA's fraction of peak, the planner's) for each shape of table ``key``."""
    acc = get_accelerator(ROWS[key], sustained_clock_fraction=1.0)
    peak = acc.flops("bf16")
    table = json.loads(DATA.read_text())["tables"][key]
    return [
        (m, n, k, f / peak, gemm_flops(m, k, n) / gemm_time_s(m, k, n, acc) / peak) for m, n, k, f in table
    ]


def rows() -> list[dict]:
    """Per table and size band: shapes, the median and mean |error| (%) of the planner's rate against XLA's."""
    out = []
    for key in ROWS:
        pts = errors(key)
        for label, lo, hi in BANDS:
            errs = [100 * (ours / xla - 1) for m, n, k, xla, ours in pts if lo <= m * n * k < hi]
            out.append({"table": key, "accelerator": ROWS[key], "band": label, "shapes": len(errs),
                        "median_error_pct": statistics.median(errs),
                        "mean_abs_error_pct": sum(map(abs, errs)) / len(errs)})  # fmt: skip
        for shape in ((4096, 4096, 4096), (4096, 4096, 1024), (1024, 4096, 4096)):
            xla, ours = next((x, o) for m, n, k, x, o in pts if (m, n, k) == shape)
            out.append({"table": key, "accelerator": ROWS[key], "shape": list(shape), "xla_fraction": xla,
                        "planner_fraction": ours, "error_pct": 100 * (ours / xla - 1)})  # fmt: skip
    return out


def render(table: list[dict]) -> None:
    """The rows as text."""
    for r in table:
        if "band" in r:
            print(f"{r['table']:12} {r['accelerator']:9} {r['band']:22} {r['shapes']:>3} shapes  median "
                  f"{r['median_error_pct']:+6.1f}%  mean |error| {r['mean_abs_error_pct']:5.1f}%")  # fmt: skip
        else:
            m, n, k = r["shape"]
            print(f"{r['table']:12} {r['accelerator']:9} m {m} n {n} k {k}: XLA {r['xla_fraction']:.3f} of peak, "
                  f"planner {r['planner_fraction']:.3f} ({r['error_pct']:+.1f}%)")  # fmt: skip
    print(
        "error < 0: the planner's GEMM slower than XLA's table (at the burst clock; XLA's inputs and clock unstated)"
    )


if __name__ == "__main__":
    run_table(__doc__, rows, render)
