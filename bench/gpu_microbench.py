"""Kernel microbenchmarks for the step-time model's constants: GEMM and streaming efficiency on a GPU.

The roofline (:mod:`microbatch.predict.roofline`) assumes large half-precision GEMMs reach 80% of the
datasheet peak and streaming kernels 80% of the memory bandwidth (``RooflineEfficiency`` defaults,
from NVIDIA's guides, not measured here). This script measures both on the machine it runs on, at
the GEMM shapes of the development set's layers (``tests/data/published_runs.json``: rows = b_m·s =
2048, per tensor rank t the QKV, projection and MLP GEMMs) and for the elementwise kernels a layer
runs (copy, add, GeLU, LayerNorm), and prints each as a fraction of the accelerator table's figures,
so a constant can cite a measurement instead of a guide. Nothing is fitted to published step times.

Run on a GPU (no network; any torch >= 2.4)::

    PYTHONPATH=src python3 bench/gpu_microbench.py --out $OUT/microbench.json   # < 1 minute
    PYTHONPATH=src python3 bench/gpu_microbench.py --smoke                      # CPU dry run, tiny shapes

Time: CUDA events after warm-up, median of the repeats (DESIGN: timing on a GPU).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

# (hidden, t) of the development set's layers: Narayanan et al. 2021 Table 1 (published_runs.json)
LAYERS = ((2304, 1), (3072, 2), (4096, 4), (6144, 8), (8192, 8), (12288, 8), (20480, 8), (25600, 8))
ROWS = 2048  # b_m 1 × s 2048


def _timer(torch: Any, cuda: bool):  # type: ignore[no-untyped-def]
    def run(fn, repeats: int = 20, warmup: int = 5) -> float:  # type: ignore[no-untyped-def]
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(repeats):
            if cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                torch.cuda.synchronize()
                times.append(a.elapsed_time(b) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return statistics.median(times)

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--smoke", action="store_true", help="CPU, fp32, shapes divided by 16 (a dry run)")
    args = ap.parse_args()
    import torch

    from microbatch.hardware import get_accelerator, match_accelerator

    cuda = torch.cuda.is_available() and not args.smoke
    dev = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    scale = 1 if cuda else 16
    name = torch.cuda.get_device_name() if cuda else "cpu"
    key = match_accelerator(name) if cuda else None
    acc = get_accelerator(key) if key else None
    peak = acc.flops("bf16") if acc else None
    bw = acc.memory_bandwidth_bytes_per_s if acc else None
    run = _timer(torch, cuda)
    rows = ROWS // scale
    out: dict[str, Any] = {
        "device": name,
        "accelerator": key,
        "dtype": str(dtype),
        "rows": rows,
        "gemm": [],
        "stream": [],
    }
    for h, t in LAYERS:
        h //= scale
        for label, k, n in (
            ("qkv", h, 3 * h // t),
            ("proj", h // t, h),
            ("fc1", h, 4 * h // t),
            ("fc2", 4 * h // t, h),
        ):
            x = torch.randn(rows, k, device=dev, dtype=dtype)
            w = torch.randn(k, n, device=dev, dtype=dtype)
            s = run(lambda x=x, w=w: x @ w)
            fl = 2.0 * rows * k * n / s
            out["gemm"].append({"hidden": h, "t": t, "gemm": label, "k": k, "n": n, "seconds": s, "flops_per_s": fl,
                                "fraction_of_peak": fl / peak if peak else None})  # fmt: skip
    n_el = (64 * 2**20) // scale
    x = torch.randn(n_el, device=dev, dtype=dtype)
    y = torch.randn(n_el, device=dev, dtype=dtype)
    ln = torch.nn.LayerNorm(4096 // scale, device=dev, dtype=dtype)
    xl = x.view(-1, 4096 // scale)
    e = x.element_size()
    for label, fn, nbytes in (
        ("copy", lambda: y.copy_(x), 2 * n_el * e),
        ("add", lambda: torch.add(x, y), 3 * n_el * e),
        ("gelu", lambda: torch.nn.functional.gelu(x), 2 * n_el * e),
        ("layernorm", lambda: ln(xl), 2 * n_el * e),
    ):
        s = run(fn)
        out["stream"].append({"kernel": label, "bytes": nbytes, "seconds": s, "bytes_per_s": nbytes / s,
                              "fraction_of_bandwidth": nbytes / s / bw if bw else None})  # fmt: skip
    fr = [g["fraction_of_peak"] for g in out["gemm"] if g["fraction_of_peak"]]
    sf = [g["fraction_of_bandwidth"] for g in out["stream"] if g["fraction_of_bandwidth"]]
    print(f"{name} ({key or 'not in the table'}), {dtype}, rows {rows}")
    for g in out["gemm"]:
        f = f"{100 * g['fraction_of_peak']:.1f}% of peak" if g["fraction_of_peak"] else ""
        print(
            f"  gemm h={g['hidden']:>6} t={g['t']} {g['gemm']:<4} {g['flops_per_s'] / 1e12:8.1f} TFLOP/s  {f}"
        )
    for g in out["stream"]:
        f = f"{100 * g['fraction_of_bandwidth']:.1f}% of bandwidth" if g["fraction_of_bandwidth"] else ""
        print(f"  {g['kernel']:<9} {g['bytes_per_s'] / 1e9:8.1f} GB/s  {f}")
    if fr:
        print(
            f"GEMM fraction of peak: median {statistics.median(fr):.3f} (min {min(fr):.3f}, max {max(fr):.3f})"
        )
    if sf:
        print(f"streaming fraction of bandwidth: median {statistics.median(sf):.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
