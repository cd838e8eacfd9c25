"""Norm kernels against the planner's memory-bound rates (issue 28 item 1: "the memory-bound operators at measured
fractions of bandwidth").

Each row of ``tests/data/norm_bars.json`` (cudnn-frontend's H200 norm benchmark: eager PyTorch, torch.compile and
cuDNN's fused kernels at each model's hidden width) beside the rate the planner gives a norm's forward + backward:
5 passes (2 forward, 3 backward: :func:`microbatch.predict.memory_ops.elementwise_backward_ratio`) at the eager norm
fraction (``RooflineEfficiency.norm_memory``, measured on an H200 by ``bench/gpu_microbench.py``: LayerNorm forward)
or, fused, at the streaming rate (``RooflineEfficiency.memory``); compiled at ``COMPILED_NORM_MEMORY``, which is
taken from these rows (the others are checks). The measured side is the benchmark's own time: 2 passes at its
forward GB/s plus 3 at its backward GB/s.

Run: .venv/bin/python bench/bench_norms.py [--json]
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from _table_cli import run_table

from microbatch.hardware import get_accelerator
from microbatch.predict.gemm import COMPILED_NORM_MEMORY, DEFAULT_EFFICIENCY
from microbatch.predict.memory_ops import elementwise_backward_ratio

DATA = Path(__file__).resolve().parent.parent / "tests" / "data" / "norm_bars.json"
MODES = {"pytorch": "eager", "torch_compile": "compiled", "cudnn": "fused"}
"""The benchmark's backends and the planner's mode each stands for."""


def measured_fraction(row: dict, bandwidth: float) -> float:
    """The benchmark's forward + backward as one fraction of ``bandwidth`` (bytes/s): 5 passes over its time."""
    back = elementwise_backward_ratio()
    seconds_per_pass_byte = 1 / (row["fwd_gbps"] * 1e9) + back / (row["bwd_gbps"] * 1e9)
    return (1 + back) / seconds_per_pass_byte / bandwidth


def planner_fraction(mode: str) -> float:
    """The fraction of bandwidth the planner runs a norm's forward and backward at in ``mode``: eager
    ``norm_memory``; compiled (``plan --compile``) :data:`~microbatch.predict.gemm.COMPILED_NORM_MEMORY`, the
    median of the compiled rows here (derived from them, so its error is 0 by construction); fused (the
    hand-written kernels of Megatron and Transformer Engine) the streaming rate ``memory``."""
    eff = DEFAULT_EFFICIENCY
    return {"eager": eff.norm_memory, "compiled": COMPILED_NORM_MEMORY}.get(mode, eff.memory)


def rows() -> list[dict]:
    """Per backend: the median measured fraction over the models, its range, the planner's, the error (%)."""
    data = json.loads(DATA.read_text())
    bw = get_accelerator(data["gpu"]).memory_bandwidth_bytes_per_s
    out = []
    for backend, mode in MODES.items():
        fractions = [measured_fraction(r, bw) for r in data["rows"] if r["backend"] == backend]
        median = statistics.median(fractions)
        ours = planner_fraction(mode)
        out.append({"backend": backend, "mode": mode, "models": len(fractions), "median": median,
                    "low": min(fractions), "high": max(fractions), "planner": ours,
                    "error_pct": 100 * (ours / median - 1)})  # fmt: skip
    return out


def render(table: list[dict]) -> None:
    """The rows as text."""
    print(
        f"{'backend':14} {'planner mode':13} {'models':>6}  measured fwd+bwd (median, range)  planner  error"
    )
    for r in table:
        print(f"{r['backend']:14} {r['mode']:13} {r['models']:>6}  {r['median']:.3f} ({r['low']:.3f}-{r['high']:.3f})"
              f"{'':14} {r['planner']:.3f}  {r['error_pct']:+5.1f}%")  # fmt: skip
    print("error > 0: the planner runs the norm faster than the benchmark did (its time too short)")


if __name__ == "__main__":
    run_table(__doc__, rows, render)
