"""Out-of-memory splitting in real training: 200 steps of the built-in GPT whose loss curve does not see
the splits, and on a GPU a real CUDA out-of-memory with GPT-2 (see ``test_accumulate_oom.py`` for the
gradient checks and the injection of out-of-memory at the allocation point).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_accumulate import rel
from test_accumulate_oom import BYTES, count_fn

from microbatch.run.accumulate import accumulate
from microbatch.run.accumulate.controller import MicroBatchController

# -- 200 steps of the built-in GPT: the loss curve does not see the splits --------------------------


def gpt_loss_fn(vocab: int):
    def fn(model, mb):
        width = max(2, int(mb["attention_mask"].sum(1).max()))  # trim the padding: long rows cost more
        ids, labels = mb["input_ids"][:, :width], mb["labels"][:, :width]
        logits = model(ids)[:, :-1]
        target = labels[:, 1:]
        loss_sum = F.cross_entropy(
            logits.reshape(-1, vocab), target.reshape(-1), ignore_index=-100, reduction="sum"
        )
        return loss_sum, (target != -100).sum()

    return fn


class HeadLimit:
    """The logits' allocation fails (torch.OutOfMemoryError) over ``max_bytes``: a forward pre-hook on the
    output layer, which allocates the largest tensor of the step. Cheaper than :class:`AllocationLimit`,
    which sees every kernel; counts the failures."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes, self.failures, self.model = max_bytes, 0, None

    def attach(self, head: torch.nn.Module, vocab: int) -> None:
        def hook(module, args):
            x = args[0]
            nbytes = x.numel() // x.shape[-1] * vocab * x.element_size()
            if nbytes > self.max_bytes:
                self.failures += 1
                raise torch.OutOfMemoryError(f"Tried to allocate {nbytes} bytes for the logits")

        head.register_forward_pre_hook(hook)


def train_tiny_gpt(steps: int, rows: int, seq: int, limit: HeadLimit, **how) -> list[float]:
    """``steps`` AdamW steps of the tiny GPT in float64 on random-length sequences; the loss per step."""
    from microbatch.measure.gpt import build_model
    from microbatch.model import get_model

    shape = get_model("tiny", seq=seq)
    model = build_model(shape, dtype=torch.float64, seed=0)
    limit.attach(model.head, shape.vocab)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    fn, losses = gpt_loss_fn(shape.vocab), []
    for _ in range(steps):
        lengths = torch.randint(2, shape.seq + 1, (rows,), generator=g)
        ids = torch.randint(1, shape.vocab, (rows, shape.seq), generator=g)
        mask = (torch.arange(shape.seq).view(1, -1) < lengths.view(-1, 1)).long()
        batch = {"input_ids": ids * mask, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
        opt.zero_grad(set_to_none=True)
        losses.append(float(accumulate(model, batch, fn, count_fn=count_fn, **how)))
        opt.step()
    return losses


@pytest.fixture
def one_thread():
    """One torch thread: on a shared 2-core machine two threads ran this test 20x slower (OpenMP spinning)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.timeout(120)
def test_training_with_splits_follows_the_loss_curve_of_a_size_that_never_fails(one_thread):
    steps, rows, seq, vocab = 200, 8, 32, 512
    budget = 8 * 28 * vocab * BYTES  # (rows, width, vocab) logits: 8 rows fail past width 28; 4 always fit
    ctl = MicroBatchController(8, grow_after=1)  # back to 8 after every clean step: splits keep coming
    adaptive = HeadLimit(budget)
    curve = train_tiny_gpt(steps, rows, seq, adaptive, controller=ctl)
    fixed = HeadLimit(budget)
    reference = train_tiny_gpt(steps, rows, seq, fixed, micro_batch_size=4, on_oom="raise")
    assert fixed.failures == 0  # the reference never ran out of memory
    assert 50 <= ctl.splits < steps and adaptive.failures == ctl.splits and ctl.steps == steps
    worst = max(abs(a - b) / b for a, b in zip(curve, reference, strict=True))
    print(f"{ctl.splits} splits in {steps} steps; largest relative loss difference {worst:.2e}")
    assert worst < 1e-10
    assert len({round(x, 6) for x in reference}) > steps // 2  # the curve moves: the equality is not trivial


# -- on a GPU: a real CUDA out-of-memory with a GPT-2-sized model -----------------------------------


@pytest.mark.cuda
@pytest.mark.timeout(300)
def test_real_cuda_out_of_memory_recovers_and_memory_returns_to_baseline():
    """GPT-2 (124M) in fp32 under a per-process memory cap that 16 rows × 1024 tokens exceed.

    The step at 16 rows runs out of memory (torch.OutOfMemoryError from the caching allocator), is
    redone at 8, 4, ... until it fits; its gradient equals that of a step run at the size that fits;
    afterwards the memory allocated equals the baseline of that clean step within 1%.
    """
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from microbatch.measure.gpt import build_model
    from microbatch.model import get_model

    dev = torch.device("cuda", 0)
    shape = get_model("gpt2", seq=1024)
    model = build_model(shape, dtype=torch.float32, seed=0, device=dev)
    g = torch.Generator().manual_seed(0)
    rows = 16
    ids = torch.randint(0, shape.vocab, (rows, shape.seq), generator=g).to(dev)
    batch = {"input_ids": ids, "labels": ids}

    def fn(m, mb):
        logits = m(mb["input_ids"])[:, :-1]
        target = mb["labels"][:, 1:]
        return F.cross_entropy(
            logits.reshape(-1, shape.vocab), target.reshape(-1), reduction="sum"
        ), target.numel()

    # The cap: weights + gradients + what 2 rows need, measured on this device, with room to spare.
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    static = torch.cuda.memory_allocated(dev)
    accumulate(model, {k: v[:2] for k, v in batch.items()}, fn, micro_batch_size=2)
    two_rows_peak = torch.cuda.max_memory_allocated(dev)
    model.zero_grad(set_to_none=True)
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(dev).total_memory
    cap = static + 2 * (two_rows_peak - static)  # fits 4 rows at most: 16 and 8 must fail
    torch.cuda.set_per_process_memory_fraction(cap / total, dev)
    try:
        ctl = MicroBatchController(rows)
        loss = accumulate(model, batch, fn, controller=ctl)
        got = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double()
        after = torch.cuda.memory_allocated(dev)
        size = ctl.micro_batch_size
        model.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
        ref_loss = accumulate(model, batch, fn, micro_batch_size=size)
        baseline = torch.cuda.memory_allocated(dev)
        ref = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double()
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, dev)
    assert ctl.splits >= 2 and size <= 4
    assert all("OutOfMemoryError" in e.reason for e in ctl.history)
    assert abs(after - baseline) <= 0.01 * baseline, (after, baseline)
    assert rel(got, ref) < 1e-4  # fp32, other summation order on the GPU
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-5)
