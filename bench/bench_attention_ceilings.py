"""Attention ceilings against the kernel benchmarks they come from (issue 28 item 1).

Each series of ``tests/data/attention_bars.json`` (the flash-attention repository's FA2 release figures for the
A100 and H100, the FlashAttention-3 paper's cuDNN and FA3 bars, cudnn-frontend's H200 and B200 training benchmarks)
beside what the planner's attention terms give for it: the kernel class's ceiling and ramp on that accelerator
(:func:`microbatch.predict.attention.kernel_figures`) × its peak × the shared curves read at s/ramp (:func:`~microbatch.predict.attention.flash_rate_fraction` for a forward,
:func:`~microbatch.predict.attention.flash_fwd_bwd_factor` for a forward + backward). "fitted" marks the series a
ceiling was fitted to; the others were not fitted to anything here. At the bars' own clock: no sustained-clock
factor (the roofline applies the row's own, :mod:`microbatch.hardware_clocks`).

Run: .venv/bin/python bench/bench_attention_ceilings.py [--json]
"""

from __future__ import annotations

import json
from pathlib import Path

from _table_cli import run_table

from microbatch.hardware import get_accelerator
from microbatch.predict.attention import flash_fwd_bwd_factor, flash_rate_fraction, kernel_figures
from microbatch.predict.attention_core import window_span

DATA = Path(__file__).resolve().parent.parent / "tests" / "data" / "attention_bars.json"


def predicted_tflops(series: dict, seq: int) -> float:
    """The planner's rate for one bar: ceiling × peak × the curve (forward, or forward + backward) read at s/k, k
    the kernel's ramp on that accelerator."""
    acc = get_accelerator(series["gpu"])
    ceiling, ramp = kernel_figures(series["kernel"], acc.name, acc.attention_fraction, acc.attention_ramp)
    assert ceiling is not None
    d, causal, direction = series["head_dim"], series["causal"], series["direction"]
    keys = window_span(seq, series.get("window")) / ramp  # a sliding window: the curve at its causal length σ
    shape = (
        flash_fwd_bwd_factor(keys, d, causal)
        if direction == "fwd_bwd"
        else flash_rate_fraction(keys, 1.0, d, causal, backward=direction == "bwd")
    )
    return acc.flops("bf16") / 1e12 * ceiling * shape


def rows() -> list[dict]:
    """One row per series: each length's bar (None where the figure's label is not legible), the prediction,
    the error (%, None without a bar)."""
    data = json.loads(DATA.read_text())
    out = []
    for series in data["series"]:
        pairs = []
        for s, bar in zip(series.get("seq", data["seq"]), series["tflops"], strict=True):
            p = predicted_tflops(series, s)
            pairs.append(
                {
                    "seq": s,
                    "bar": bar,
                    "predicted": p,
                    "error_pct": None if bar is None else 100 * (p / bar - 1),
                }
            )
        out.append(series | {"pairs": pairs})
    return out


def render(table: list[dict]) -> None:
    """The rows as text."""
    header = None
    for r in table:
        seqs = tuple(p["seq"] for p in r["pairs"])
        if seqs != header:  # a new block of lengths: name its columns
            header = seqs
            cols = " ".join(f"{_k(x):>6}" for x in seqs)
            print(
                f"\n{'gpu':10} {'kernel':9} {'dir':8} {'d':>4} {'causal':6} {'fit':4}  error (%) at s = {cols}"
            )
        errors = " ".join(
            "      " if p["error_pct"] is None else f"{p['error_pct']:+6.1f}" for p in r["pairs"]
        )
        print(f"{r['gpu']:10} {r['kernel']:9} {r['direction']:8} {r['head_dim']:>4} {str(r['causal']):6} "
              f"{'yes' if r['fitted'] else 'no':4}  {' ' * 17}{errors}")  # fmt: skip


def _k(s: int) -> str:
    """A length as the figures write it: 512, 1k, ... 64k."""
    return f"{s // 1024}k" if s >= 1024 else str(s)


if __name__ == "__main__":
    run_table(__doc__, rows, render)
