"""Out-of-memory splitting in ``accumulate``: its overhead on steps that do not fail (target <= 1%) and
the cost of one split, in step times.

The built-in GPT on the CPU, right-padded sequences of random lengths (labels -100 on padding), the
loss trimming each micro-batch's padding to its longest row.

- **overhead**: ``accumulate(micro_batch_size=b)`` against ``accumulate(..., on_oom="split")`` and
  against ``accumulate(..., controller=MicroBatchController(b))`` on steps that never fail. The
  variants are interleaved, their order rotated each round; the ratio is the median over rounds of
  the paired per-round ratio, on wall time and on this thread's CPU time (``time.thread_time``, less
  disturbed by other jobs on a shared machine).
- **one split**: a byte budget on the logits (a forward pre-hook on the output layer raises
  ``torch.OutOfMemoryError`` when the ``(rows, width, vocab)`` logits would exceed it) that b rows
  of the longest sequences exceed and b/2 rows fit. Rows sorted longest first fail in the first
  micro-batch's forward ("early"); shortest first, in the last micro-batch ("late", after the
  others have run forward and backward). The cost is (time of the step that splits) / (time of the
  same step run at b/2 without failing) − 1, in step times: the wasted partial attempt, restoring
  the gradients, freeing, and the log record.

    .venv/bin/python bench/bench_oom.py [--model tiny] [--rounds 15] [--threads 1]
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
from microbatch.run.accumulate import accumulate
from microbatch.run.accumulate.agree import check_can_agree as _check_can_agree
from microbatch.run.accumulate.controller import MicroBatchController
from microbatch.run.accumulate.microbatches import batch_rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--global-batch", type=int, default=32)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import logging

    logging.getLogger("microbatch").setLevel(logging.ERROR)  # the split's log record is built, not shown

    shape = get_model(args.model, seq=args.seq)
    model = build_model(shape, seed=0)
    g = torch.Generator().manual_seed(0)
    rows, s, vocab, b = args.global_batch, shape.seq, shape.vocab, args.micro_batch
    lengths = torch.randint(2, s // 2 + 1, (rows,), generator=g)
    lengths[0] = s  # one full-length row: only the micro-batch holding it is over the budget at b rows
    ids = torch.randint(1, vocab, (rows, s), generator=g)

    def make(order: torch.Tensor) -> dict[str, torch.Tensor]:
        ln = lengths[order]
        mask = (torch.arange(s).view(1, -1) < ln.view(-1, 1)).long()
        x = ids[order] * mask
        return {"input_ids": x, "attention_mask": mask, "labels": x.masked_fill(mask == 0, -100)}

    batch = make(torch.arange(rows))
    longest_first = make(torch.argsort(lengths, descending=True, stable=True))
    shortest_first = make(torch.argsort(lengths, stable=True))

    def loss_fn(m: torch.nn.Module, mb: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(2, int(mb["attention_mask"].sum(1).max()))
        logits = m(mb["input_ids"][:, :width])[:, :-1]
        target = mb["labels"][:, 1:width]
        loss = F.cross_entropy(
            logits.reshape(-1, vocab), target.reshape(-1), ignore_index=-100, reduction="sum"
        )
        return loss, (target != -100).sum()

    def count_fn(mb: dict[str, torch.Tensor]) -> torch.Tensor:
        return (mb["labels"][:, 1:] != -100).sum()

    budget = {"bytes": float("inf")}

    def gate(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
        x = inputs[0]
        nbytes = x.numel() // x.shape[-1] * vocab * x.element_size()
        if nbytes > budget["bytes"]:
            raise torch.OutOfMemoryError(f"Tried to allocate {nbytes} bytes for the logits (bench budget)")

    model.head.register_forward_pre_hook(gate)
    fail_bytes = (b // 2) * s * vocab * 4  # b rows of the longest row fail; b/2 fit (fp32 logits)

    def first_failing(mbatch: dict[str, torch.Tensor]) -> int:
        """Index of the first micro-batch of b rows whose logits exceed the budget (where the step fails)."""
        widths = [int(mbatch["attention_mask"][i : i + b].sum(1).max()) for i in range(0, rows, b)]
        return next(i for i, w in enumerate(widths) if min(b, rows - i * b) * w * vocab * 4 > fail_bytes)

    def step(fn: Callable[[], object], limited: bool) -> tuple[float, float]:
        model.zero_grad(set_to_none=True)
        budget["bytes"] = fail_bytes if limited else float("inf")
        t0, c0 = time.perf_counter(), time.thread_time()
        fn()
        return time.perf_counter() - t0, time.thread_time() - c0

    overhead: dict[str, Callable[[], object]] = {
        "plain accumulate": lambda: accumulate(model, batch, loss_fn, micro_batch_size=b, count_fn=count_fn),
        'on_oom="split"': lambda: accumulate(
            model, batch, loss_fn, micro_batch_size=b, on_oom="split", count_fn=count_fn
        ),
        "controller": lambda: accumulate(
            model, batch, loss_fn, controller=MicroBatchController(b), count_fn=count_fn
        ),
    }
    splits: dict[str, tuple[Callable[[], object], bool]] = {
        "clean step at b/2 (early order)": (
            lambda: accumulate(model, longest_first, loss_fn, micro_batch_size=b // 2, count_fn=count_fn),
            False,
        ),
        "split step, fails early": (
            lambda: accumulate(
                model, longest_first, loss_fn, micro_batch_size=b, on_oom="split", count_fn=count_fn
            ),
            True,
        ),
        "clean step at b/2 (late order)": (
            lambda: accumulate(model, shortest_first, loss_fn, micro_batch_size=b // 2, count_fn=count_fn),
            False,
        ),
        "split step, fails late": (
            lambda: accumulate(
                model, shortest_first, loss_fn, micro_batch_size=b, on_oom="split", count_fn=count_fn
            ),
            True,
        ),
    }
    allv: dict[str, tuple[Callable[[], object], bool]] = {n: (f, False) for n, f in overhead.items()}
    allv.update(splits)
    names = list(allv)
    wall: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    for n in names:  # warm-up
        step(*allv[n])
    for r in range(args.rounds):
        for n in names[r % len(names) :] + names[: r % len(names)]:
            w, c = step(*allv[n])
            wall[n].append(w)
            cpu[n].append(c)

    def paired(series: dict[str, list[float]], n: str, base: str) -> float:
        """Median over rounds of variant time / base time in the same round."""
        return statistics.median(v / h for v, h in zip(series[n], series[base], strict=True))

    tokens = int(count_fn(batch))
    print(
        f"on_oom='split': {args.model}, B={rows} rows × seq {s} ({tokens} valid tokens), b_m={b} "
        f"(g={-(-rows // b)}), {args.rounds} interleaved rounds, {args.threads} thread(s)"
    )
    print(
        f"split steps: b_m={b} -> {b // 2}; 'early' fails in micro-batch {first_failing(longest_first)}, 'late' "
        f"in micro-batch {first_failing(shortest_first)} of {-(-rows // b)} (0-based)"
    )
    print(f"{'variant':<34}{'median ms':>10}{'CPU ms':>9}{'vs base (wall)':>16}{'vs base (CPU)':>15}  base")
    bases = {n: "plain accumulate" for n in overhead}
    bases.update(
        {
            "clean step at b/2 (early order)": "clean step at b/2 (early order)",
            "split step, fails early": "clean step at b/2 (early order)",
            "clean step at b/2 (late order)": "clean step at b/2 (late order)",
            "split step, fails late": "clean step at b/2 (late order)",
        }
    )
    for n in names:
        base = bases[n]
        print(
            f"{n:<34}{statistics.median(wall[n]) * 1e3:>10.1f}{statistics.median(cpu[n]) * 1e3:>9.1f}"
            f"{paired(wall, n, base):>16.4f}{paired(cpu, n, base):>15.4f}  {base}"
        )
    # What the split path adds to a step that does not fail, timed alone (the paired ratios above
    # carry the noise of a shared machine): the row count, the FSDP/DDP check that walks the modules,
    # a controller, and the try/except around the step.
    reps = 2000
    c0 = time.thread_time()
    for _ in range(reps):
        batch_rows(batch)
        _check_can_agree(model)
        MicroBatchController(b).record_step()
    extra_s = (time.thread_time() - c0) / reps
    plain_cpu = statistics.median(cpu["plain accumulate"])
    print(
        f"{'split-path fixed cost, timed alone':<34}{extra_s * 1e3:>10.4f} ms CPU per step = "
        f"{extra_s / plain_cpu:.4%} of the plain step's {plain_cpu * 1e3:.1f} ms CPU"
    )
    print(
        "overhead target: on_oom='split' / plain <= 1.01 on steps that do not fail; a split step's cost in "
        "step times is its ratio - 1 against the clean step at b/2 (same rows, same order)"
    )


if __name__ == "__main__":
    main()
