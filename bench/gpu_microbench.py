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
    # -- the ceilings and the terms the step-time model needs beyond the layer GEMMs ---------------
    extra: dict[str, Any] = {}
    big = 8192 // scale
    a, b = torch.randn(big, big, device=dev, dtype=dtype), torch.randn(big, big, device=dev, dtype=dtype)
    s = run(lambda: a @ b)
    extra["gemm_square"] = {"n": big, "flops_per_s": 2.0 * big**3 / s,
                            "fraction_of_peak": 2.0 * big**3 / s / peak if peak else None}  # fmt: skip
    # the small-row ramp: one layer shape (h 4096, t 1 fc1), rows 128 .. 16384
    k, n = 4096 // scale, 16384 // scale
    w = torch.randn(k, n, device=dev, dtype=dtype)
    ramp = []
    for r in (128, 256, 512, 1024, 2048, 4096, 8192, 16384):
        r //= scale
        x = torch.randn(r, k, device=dev, dtype=dtype)
        s = run(lambda x=x: x @ w)
        ramp.append({"rows": r, "flops_per_s": 2.0 * r * k * n / s,
                     "fraction_of_peak": 2.0 * r * k * n / s / peak if peak else None})  # fmt: skip
    extra["gemm_rows_ramp"] = {"k": k, "n": n, "points": ramp}
    # per-kernel launch cost of eager PyTorch: 2000 tiny adds, wall clock per launch
    one = torch.ones(1, device=dev)
    for _ in range(100):
        one.add_(1.0)
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(2000):
        one.add_(1.0)
    if cuda:
        torch.cuda.synchronize()
    extra["launch_s_per_kernel"] = (time.perf_counter() - t0) / 2000
    # attention at s 2048, 32 heads of 128, b 1: unfused (scores, softmax, dropout) against SDPA
    sq, heads, hd = (
        2048 // (4 if not cuda else 1),
        32 // (4 if not cuda else 1),
        128 // (4 if not cuda else 1),
    )
    q, kk, v = (torch.randn(1, heads, sq, hd, device=dev, dtype=dtype) for _ in range(3))
    sc = torch.randn(1, heads, sq, sq, device=dev, dtype=dtype)
    el = sc.element_size()
    s_soft = run(lambda: torch.softmax(sc, dim=-1))
    s_drop = run(lambda: torch.nn.functional.dropout(sc, 0.1, training=True))
    s_qk = run(lambda: q @ kk.transpose(-1, -2))
    s_sdpa = run(lambda: torch.nn.functional.scaled_dot_product_attention(q, kk, v, is_causal=True))
    fl_sdpa = 4.0 * heads * sq * sq * hd / 2  # causal: half of QK^T and PV
    extra["attention"] = {
        "seq": sq, "heads": heads, "head_dim": hd,
        "softmax_bytes_per_s": 2 * sc.numel() * el / s_soft,
        "dropout_bytes_per_s": 3 * sc.numel() * el / s_drop,
        "qk_flops_per_s": 2.0 * heads * sq * sq * hd / s_qk,
        "sdpa_causal_flops_per_s": fl_sdpa / s_sdpa,
        "sdpa_causal_fraction_of_peak": fl_sdpa / s_sdpa / peak if peak else None,
    }  # fmt: skip
    # the optimizer step: AdamW (foreach) over 256 M fp32 parameters, bytes moved per second
    numel = (256 * 2**20) // (scale * scale)
    prm = torch.nn.Parameter(torch.zeros(numel, device=dev))
    prm.grad = torch.randn(numel, device=dev)
    opt = torch.optim.AdamW([prm], lr=1e-4, foreach=True)
    s_opt = run(opt.step, repeats=5, warmup=2)
    extra["adamw"] = {"params": numel, "seconds": s_opt, "seconds_per_param": s_opt / numel,
                      "bytes_per_s_if_16B_read_12B_written": 28 * numel / s_opt}  # fmt: skip
    out["extra"] = extra
    print(f"square GEMM {big}: {extra['gemm_square']['flops_per_s'] / 1e12:.1f} TFLOP/s")
    print("rows ramp:", ", ".join(f"{p_['rows']}:{p_['flops_per_s'] / 1e12:.0f}" for p_ in ramp), "TFLOP/s")
    print(
        f"launch {extra['launch_s_per_kernel'] * 1e6:.1f} us/kernel; AdamW {s_opt * 1e3:.2f} ms for {numel} params"
    )
    print(
        "attention:",
        json.dumps(
            {k_: (f"{v_:.3g}" if isinstance(v_, float) else v_) for k_, v_ in extra["attention"].items()}
        ),
    )
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
