"""Kernel microbenchmarks for the step-time model's constants and for ``plan --calibration``, on a GPU.

A thin caller of :func:`microbatch.measure.microbench.run_microbench` (the one implementation; the command is
``microbatch bench-gpu``): the layer GEMMs of ``--model`` at rows b_m·s, the M,N,K grid, causal SDPA,
streaming kernels (copy, add, GeLU, LayerNorm, softmax, dropout, one AdamW step), the launch floor, and, as
extra GEMMs, the shapes the constants of :mod:`microbatch.predict.gemm` were fitted to: the development
set's layers (``tests/data/published_runs.json``: rows = b_m·s = 2048, per tensor rank t the QKV, projection
and MLP GEMMs), a square 8,192 GEMM and a row ramp 128 … 16,384 at k 4,096, n 16,384. Prints one summary
table and writes the result (``MicrobenchResult`` JSON, readable by ``plan --calibration``).

Run on a GPU (no network; any torch >= 2.4)::

    PYTHONPATH=src python3 bench/gpu_microbench.py --out $OUT/microbench.json   # well under a minute
    PYTHONPATH=src python3 bench/gpu_microbench.py --smoke                      # CPU dry run, tiny shapes

Time: CUDA events after warm-up, median of the repeats (DESIGN: timing on a GPU).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

# (hidden, t) of the development set's layers: Narayanan et al. 2021 Table 1 (published_runs.json)
LAYERS = ((2304, 1), (3072, 2), (4096, 4), (6144, 8), (8192, 8), (12288, 8), (20480, 8), (25600, 8))
ROWS = 2048  # b_m 1 × s 2048


def extra_gemms(scale: int) -> tuple[tuple[str, int, int, int], ...]:
    """The development set's layer GEMMs, the square GEMM and the row ramp, every size divided by ``scale``."""
    rows = ROWS // scale
    out = []
    for h, t in LAYERS:
        h //= scale
        out += [(f"dev-h{h}-t{t}-{lab}", rows, k, n) for lab, k, n in
                (("qkv", h, 3 * h // t), ("proj", h // t, h), ("fc1", h, 4 * h // t), ("fc2", 4 * h // t, h))]  # fmt: skip
    big = 8192 // scale
    out.append(("square", big, big, big))
    k, n = 4096 // scale, 16384 // scale
    out += [("ramp", r // scale, k, n) for r in (128, 256, 512, 1024, 2048, 4096, 8192, 16384)]
    return tuple(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the result as JSON here")
    ap.add_argument("--model", default="gpt2", help="the model whose layer GEMMs and attention are timed")
    ap.add_argument("--micro-batches", default="1,2,4,8")
    ap.add_argument("--budget-s", type=float, default=40.0)
    ap.add_argument("--smoke", action="store_true", help="CPU, fp32, shapes divided by 16 (a dry run)")
    args = ap.parse_args()
    import torch

    from microbatch.measure.microbench import MicrobenchConfig, run_microbench
    from microbatch.model import get_model

    cuda = torch.cuda.is_available() and not args.smoke
    shape = get_model(args.model if cuda else "tiny")
    cfg = MicrobenchConfig(
        shape=shape, micro_batches=tuple(int(b) for b in args.micro_batches.split(",")),
        device="cuda" if cuda else "cpu", quick=not cuda, budget_s=args.budget_s if cuda else 20.0,
        extra_gemms=extra_gemms(1 if cuda else 16),
    )  # fmt: skip
    r = run_microbench(cfg)
    pct = lambda f: f"{100 * f:5.1f}%" if f is not None else "    -"  # noqa: E731
    print(
        f"{r.device_name} ({r.accelerator or 'not in the table'}), {r.dtype}, torch {r.torch_version}, {r.seconds_total:.1f} s"
    )
    for g in r.gemms:
        print(
            f"  gemm {g.label:<22} {g.rows:>6}x{g.k:>6}x{g.n:>6} {g.flops_per_s / 1e12:8.2f} TFLOP/s {pct(g.fraction_of_peak)}"
        )
    for a in r.attention:
        print(f"  sdpa causal s={a.seq:<6} {a.flops_per_s / 1e12:8.2f} TFLOP/s {pct(a.fraction_of_peak)}")
    for s in r.stream:
        print(f"  {s.kernel:<10} {s.bytes_per_s / 1e9:8.1f} GB/s {pct(s.fraction_of_bandwidth)}")
    if r.launch_s_per_kernel is not None:
        print(f"  launch {r.launch_s_per_kernel * 1e6:.2f} us/kernel")
    fr = [g.fraction_of_peak for g in r.gemms if g.label.startswith("dev-") and g.fraction_of_peak]
    if fr:
        print(
            f"dev-set GEMM fraction of peak: median {statistics.median(fr):.3f} (min {min(fr):.3f}, max {max(fr):.3f})"
        )
    if r.sustained_over_burst is not None:
        print(
            f"square 8192 GEMM: burst {(r.burst_square_flops_per_s or 0) / 1e12:.1f} TFLOP/s, under load "
            f"{(r.sustained_square_flops_per_s or 0) / 1e12:.1f}: sustained/burst {r.sustained_over_burst:.3f} "
            "(hardware_clocks.HOPPER_BURST_TO_SUSTAINED cites 0.847); kernels soaked "
            f"{r.soak_s:g} s each, SM clock under load {r.sm_clock_mhz or 'not read'} MHz"
        )
    for n in r.notes:
        print(f"note: {n}")
    if args.out:
        Path(args.out).write_text(r.to_json())


if __name__ == "__main__":
    main()
