"""A decode probe's per-step latency against the whole generation's mean step, timed here step by step.

A decode step's attention reads the whole cache, so its time grows with the position: the probe times its steps
around the generation's middle token (:func:`microbatch.measure.probes.decode_lead`), where an affine cost's step is
the mean one. This script builds the built-in GPT (4 layers, h 256, 4 heads, vocabulary 4,096, seq 2,048), runs
:class:`~microbatch.measure.probes.DecodeProbe` with 1,984 new tokens after a 64-token prompt (one thread, the process
clock), then decodes the same generation itself, timing every step, and prints the probe's latency beside the
generation's mean, its first and its last quarter's. Without the lead the probe read the first steps only.

Usage: python bench/bench_decode_middle.py [--new-tokens N] [--batch B] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from microbatch.measure.gpt import GPT
from microbatch.measure.probes import DecodeProbe
from microbatch.measure.timing import TimingConfig
from microbatch.shape import ModelShape


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, default=1984)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    torch.set_num_threads(1)
    seq = 64 + a.new_tokens
    shape = ModelShape(name="bench", layers=4, hidden=256, heads=4, vocab=4096, seq=seq)
    torch.manual_seed(0)
    model = GPT(shape).eval()
    timing = TimingConfig(
        warmup=1, min_repeats=3, max_repeats=10, max_time_s=3.0, rel_tol=0.05, clock="process"
    )
    probe = DecodeProbe(model, vocab=shape.vocab, seq=seq, new_tokens=a.new_tokens, timing=timing)
    got = probe.measure(a.batch)
    prompt = torch.randint(0, shape.vocab, (a.batch, 64))
    steps: list[float] = []
    with torch.no_grad():
        logits, cache = model.prefill(prompt, capacity=seq)
        tok = logits.argmax(-1)
        for _ in range(a.new_tokens):
            t0 = time.process_time()
            logits, cache = model.decode_step(tok, cache)
            tok = logits.argmax(-1)
            steps.append(time.process_time() - t0)
    quarter = len(steps) // 4
    out = {
        "probe_step_ms": 1e3 * got.step_time_s,
        "generation_mean_ms": 1e3 * statistics.fmean(steps),
        "first_quarter_ms": 1e3 * statistics.fmean(steps[:quarter]),
        "last_quarter_ms": 1e3 * statistics.fmean(steps[-quarter:]),
        "new_tokens": a.new_tokens,
        "batch": a.batch,
    }
    out["probe_error_pct"] = 100 * (out["probe_step_ms"] / out["generation_mean_ms"] - 1)
    print(
        f"b {a.batch}, {a.new_tokens} new tokens after 64: probe {out['probe_step_ms']:.2f} ms a step; the generation "
        f"{out['generation_mean_ms']:.2f} ms mean ({out['first_quarter_ms']:.2f} first quarter, "
        f"{out['last_quarter_ms']:.2f} last): probe {out['probe_error_pct']:+.1f}%"
    )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
