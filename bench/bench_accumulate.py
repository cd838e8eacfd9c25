"""Overhead of ``microbatch.run.accumulate`` against the textbook hand-written loop (target: <= 3% slower).

Both run the same micro-batches of the built-in GPT on the CPU, on right-padded variable-length
sequences (labels -100 on padding):

    hand:      total = Σ count(mb);  for mb in chunks: (loss_fn(model, mb)[0] / total).backward()
    accumulate(count_fn): microbatch.accumulate(model, batch, loss_fn, micro_batch_size=b, count_fn=count)
    accumulate:           the same without count_fn (rescales the gradients at the end)

Gradients are set to None before every step (the usual ``zero_grad()``). The variants are
interleaved, their order rotated each round, to spread the noise of other jobs on the machine;
the table gives median tokens per wall second and per CPU second of the calling thread (with one
torch thread the work runs there, and CPU time is less disturbed by other jobs on a shared
machine), and the ratio to the hand loop as the median over rounds of the paired per-round ratio
(which cancels slow drifts of the machine's load).

    .venv/bin/python bench/bench_accumulate.py [--model tiny] [--rounds 15] [--threads 1] [--trivial]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from microbatch.measure.gpt import build_model
from microbatch.model import get_model
from microbatch.run.accumulate import accumulate, split


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--global-batch", type=int, default=32)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--trivial",
        action="store_true",
        help="an embedding + linear model instead of the GPT, so that the fixed per-step overhead dominates",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    shape = get_model(args.model, seq=args.seq)
    model: torch.nn.Module
    if args.trivial:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Embedding(shape.vocab, 8), torch.nn.Linear(8, shape.vocab))
    else:
        model = build_model(shape, seed=0)
    g = torch.Generator().manual_seed(0)
    rows, s, vocab = args.global_batch, shape.seq, shape.vocab
    lengths = torch.randint(2, s + 1, (rows,), generator=g)
    ids = torch.randint(1, vocab, (rows, s), generator=g)
    mask = torch.arange(s).view(1, -1) < lengths.view(-1, 1)
    batch = {"input_ids": ids * mask, "labels": ids.masked_fill(~mask, -100)}

    def loss_fn(m: torch.nn.Module, mb: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        logits = m(mb["input_ids"])[:, :-1]
        target = mb["labels"][:, 1:]
        loss = F.cross_entropy(
            logits.reshape(-1, vocab), target.reshape(-1), ignore_index=-100, reduction="sum"
        )
        return loss, (target != -100).sum()

    def count_fn(mb: dict[str, torch.Tensor]) -> torch.Tensor:
        return (mb["labels"][:, 1:] != -100).sum()

    tokens = int(count_fn(batch))
    chunks = split(batch, args.micro_batch)

    def hand() -> None:
        total = sum(int(count_fn(mb)) for mb in chunks)
        for mb in chunks:
            # Tensor.backward carries no annotations in torch's stubs.
            (loss_fn(model, mb)[0] / total).backward()  # type: ignore[no-untyped-call]

    variants: dict[str, Callable[[], object]] = {
        "hand-written loop": hand,
        "accumulate(count_fn)": lambda: accumulate(
            model, batch, loss_fn, micro_batch_size=args.micro_batch, count_fn=count_fn
        ),
        "accumulate (rescale at end)": lambda: accumulate(
            model, batch, loss_fn, micro_batch_size=args.micro_batch
        ),
    }
    names = list(variants)
    times: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    for n in names:  # warm-up
        model.zero_grad(set_to_none=True)
        variants[n]()
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for n in order:
            model.zero_grad(set_to_none=True)
            t0, c0 = time.perf_counter(), time.thread_time()
            variants[n]()
            cpu[n].append(time.thread_time() - c0)
            times[n].append(time.perf_counter() - t0)

    def paired(series: dict[str, list[float]], n: str) -> float:
        """Median over rounds of hand time / variant time in the same round (tokens/s ratio)."""
        return statistics.median(h / v for h, v in zip(series[names[0]], series[n], strict=True))

    print(
        f"accumulate overhead: {'embedding+linear' if args.trivial else args.model}, B={rows} rows × seq {s} "
        f"({tokens} valid tokens), b_m={args.micro_batch} (g={len(chunks)}), {args.rounds} interleaved rounds, "
        f"{args.threads} thread(s)"
    )
    print(
        f"{'variant':<30}{'tokens/s wall':>14}{'vs hand':>9}{'tokens/CPU-s':>14}{'vs hand':>9}"
        f"{'median ms':>11}{'min ms':>8}{'CPU ms/step over hand':>23}"
    )
    hand_cpu = statistics.median(cpu[names[0]])
    for n in names:
        med, med_cpu = statistics.median(times[n]), statistics.median(cpu[n])
        print(
            f"{n:<30}{tokens / med:>14,.0f}{paired(times, n):>9.3f}{tokens / med_cpu:>14,.0f}"
            f"{paired(cpu, n):>9.3f}{med * 1e3:>11.1f}{min(times[n]) * 1e3:>8.1f}{(med_cpu - hand_cpu) * 1e3:>23.3f}"
        )
    print(
        "tokens/s: medians over the rounds; 'vs hand': median over rounds of the paired ratio (same round); "
        "CPU-s: this thread's CPU time (time.thread_time), less disturbed by other jobs than wall time"
    )


if __name__ == "__main__":
    main()
