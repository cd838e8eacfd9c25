"""The planner's FSDP (ZeRO-3) step as the data-parallel width grows, with and without the overlap slowdown.

Issue 28: published FSDP runs grew 3–11% in step time from 128 to 512 GPUs where the plan stayed flat.
Prints, for a few models and accelerators (s = 4,096, b_m = 2, full recompute, ZeRO-3, the fastest plan),
the predicted step at d = 128 and d = 512 with σ = 0 (communication hidden for free) and with the cited
σ = 0.189 (:data:`microbatch.predict.collectives.OVERLAP_COMPUTE_SLOWDOWN`). Arithmetic only, no timing.

    .venv/bin/python bench/bench_fsdp_width.py
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from microbatch.hardware import get_accelerator  # noqa: E402
from microbatch.model import get_model  # noqa: E402
from microbatch.predict.collectives import OVERLAP_COMPUTE_SLOWDOWN  # noqa: E402
from microbatch.predict.gemm import DEFAULT_EFFICIENCY  # noqa: E402
from microbatch.predict.plan import PlanConfig, make_plan  # noqa: E402


def step_s(gpu: str, model: str, d: int, sigma: float, seq: int = 4096, micro_batch: int = 2) -> float:
    cfg = PlanConfig(
        gpu=get_accelerator(gpu), shape=get_model(model, seq=seq), global_batch=micro_batch * d, data_parallel=d,
        zero=(3,), micro_batches=(micro_batch,), recompute=("full",), choose="fastest", memory_headroom=0.0,
        efficiency=replace(DEFAULT_EFFICIENCY, overlap_slowdown=sigma),
    )  # fmt: skip
    best = make_plan(cfg).fastest
    if best is None:
        raise SystemExit(f"{model} on {d} x {gpu} does not fit")
    return best.step_time_s


def main() -> None:
    print("ZeRO-3, s 4096, b_m 2, full recompute: predicted step at d = 128 -> d = 512")
    for gpu in ("a100-80gb", "h100-sxm"):
        for model in ("llama-2-7b", "llama-3-8b"):
            cells = []
            for sigma in (0.0, OVERLAP_COMPUTE_SLOWDOWN):
                a, b = step_s(gpu, model, 128, sigma), step_s(gpu, model, 512, sigma)
                cells.append(f"sigma {sigma:.3f}: {a:.3f} s -> {b:.3f} s ({100 * (b / a - 1):+.1f}%)")
            print(f"  {gpu:<10} {model:<11} " + "; ".join(cells))


if __name__ == "__main__":
    main()
