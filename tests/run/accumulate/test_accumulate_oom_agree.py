"""``on_oom="split"``: what the ranks agree on (microbatch.run.accumulate.agree), the copy of the old gradients running
out of memory (not split), and the messages of a call without a controller.

Two gloo processes check that a parameter no rank used keeps ``.grad = None`` as under plain DDP
(``find_unused_parameters=True``), that one used on rank 0 only gets the same gradient as under
plain DDP, and that an out-of-memory while copying the old gradients on rank 1 makes both ranks raise
(no hang: bounded by a timeout).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from _helpers import WORKER_END, WORKER_START, run_two_ranks, two_rank_results
from test_accumulate import make_model, rel, set_pre_grads
from test_accumulate_oom import AllocationLimit, S, logits_budget, loss_fn, sorted_batch
from torch.utils._python_dispatch import TorchDispatchMode

from microbatch.errors import ConfigError, OutOfMemoryError
from microbatch.run.accumulate import accumulate
from microbatch.run.accumulate.agree import agreement_parts, sizes_agree
from microbatch.run.accumulate.controller import MicroBatchController


class CloneFails(TorchDispatchMode):
    """Every ``clone`` (the copy of the old gradients) fails as CUDA's allocator would; counts the failures."""

    def __init__(self) -> None:
        super().__init__()
        self.failures = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.clone.default:
            self.failures += 1
            raise torch.OutOfMemoryError("Tried to allocate the copy of a gradient (test)")
        return func(*args, **(kwargs or {}))


# -- the sizes the ranks ran: a pure function of the reduced sums --------------------------------


def test_sizes_agree_catches_a_rank_at_the_mean():
    def reduce(sizes):
        parts = [agreement_parts(oom=False, copy_failed=False, size=s, rows=s, has_grad=[]) for s in sizes]
        return [sum(col) for col in zip(*parts, strict=True)]

    for sizes in ([2, 4, 6], [1, 3], [5, 5, 5, 7, 3], [0, 8, 4]):
        _, _, size_sum, size_sq_sum, _ = reduce(sizes)
        assert sum(sizes) != len(sizes) * 4 or 4 in sizes  # [2, 4, 6]: the sum alone passes the rank at 4
        assert not any(sizes_agree(s, len(sizes), size_sum, size_sq_sum) for s in sizes), sizes
    for sizes in ([4, 4, 4], [1], [0, 0], [2**20] * 8):
        _, _, size_sum, size_sq_sum, _ = reduce(sizes)
        assert all(sizes_agree(s, len(sizes), size_sum, size_sq_sum) for s in sizes), sizes
    assert float(3 * 4) == 2 + 4 + 6  # what the old check compared, and why it let the rank at 4 through


# -- the copy of the old gradients: its out-of-memory is not the micro-batch's -------------------


def test_out_of_memory_copying_the_old_gradients_is_not_split():
    model, batch = make_model(), sorted_batch()
    pre = set_pre_grads(model)
    ctl = MicroBatchController(8)
    calls = []

    def counting(m, mb):
        calls.append(1)
        return loss_fn(m, mb)

    with CloneFails() as fails, pytest.raises(OutOfMemoryError, match="setting aside the gradients") as e:
        accumulate(model, batch, counting, controller=ctl)
    assert "not the micro-batch's size" in str(e.value) and "Tried to allocate the copy" in str(e.value)
    assert fails.failures == 1 and calls == [] and ctl.splits == 0 and ctl.micro_batch_size == 8
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), pre, strict=True))


# -- a call without a controller: no step numbers; micro_batch_size named ------------------------


def test_without_a_controller_the_log_says_this_call(caplog):
    model, batch = make_model(), sorted_batch()
    with caplog.at_level(logging.WARNING, logger="microbatch"), AllocationLimit(logits_budget(4, S)):
        accumulate(model, batch, loss_fn, micro_batch_size=8, on_oom="split")
    (record,) = [r for r in caplog.records if r.name == "microbatch.run.controller"]
    assert record.getMessage().startswith("this call: out of memory at micro-batch 8, redoing the step at 4")
    with (
        AllocationLimit(logits_budget(1, S) - 1),
        pytest.raises(OutOfMemoryError, match=r"^this call: a micro-batch of 1 row"),
    ):
        accumulate(model, batch, loss_fn, micro_batch_size=2, on_oom="split")
    for bad in (0, -1, None, 2.5):
        with pytest.raises(ConfigError, match=rf"^micro_batch_size must be a whole number >= 1, got {bad}"):
            accumulate(model, batch, loss_fn, micro_batch_size=bad, on_oom="split")


# -- two ranks: unused parameters, and the copy failing on one rank ------------------------------

WORKER = (
    WORKER_START
    + r"""
from test_accumulate_oom import sorted_batch, loss_fn, count_fn
from test_accumulate_oom_agree import CloneFails
from test_accumulate import make_model, set_pre_grads
from microbatch.errors import OutOfMemoryError
from microbatch.run.accumulate import accumulate



class WithUnused(torch.nn.Module):
    def __init__(self, use_extra):
        super().__init__()
        self.inner = make_model()
        self.unused = torch.nn.Linear(3, 3).double()  # no rank uses it
        self.extra = torch.nn.Parameter(torch.tensor(0.5, dtype=torch.float64))  # rank 0 only
        self.use_extra = use_extra

    def forward(self, ids):
        out = self.inner(ids)
        return out * self.extra if self.use_extra else out


batch = sorted_batch()
shard = {{k: (v[:6] if rank == 0 else v[6:]) for k, v in batch.items()}}
results = {{}}
for mode in ("raise", "split"):
    model = torch.nn.parallel.DistributedDataParallel(
        WithUnused(rank == 0), find_unused_parameters=True, broadcast_buffers=False
    )
    loss = accumulate(model, shard, loss_fn, micro_batch_size=2, on_oom=mode, count_fn=count_fn)
    results[mode] = ({{n: (None if p.grad is None else p.grad.clone()) for n, p in model.module.named_parameters()}},
                     float(loss))
# the copy of the old gradients runs out of memory on rank 1 only: both ranks raise, nothing changed
model = torch.nn.parallel.DistributedDataParallel(make_model())
pre = set_pre_grads(model.module, seed=10 + rank)
import contextlib
try:
    with (CloneFails() if rank == 1 else contextlib.nullcontext()):
        accumulate(model, shard, loss_fn, micro_batch_size=3, on_oom="split")
    results["copy"] = "no error"
except OutOfMemoryError as e:
    results["copy"] = str(e)
results["copy_kept"] = all(torch.equal(p.grad, g) for p, g in zip(model.module.parameters(), pre, strict=True))
"""
    + WORKER_END
)


@pytest.mark.timeout(180)
def test_ddp_unused_parameters_stay_none_and_a_failed_copy_raises_on_every_rank(tmp_path):
    res = two_rank_results(WORKER.format(tests=str(Path(__file__).parent)), tmp_path)
    for r in range(2):
        plain, plain_loss = res[r]["raise"]
        split, split_loss = res[r]["split"]
        # plain DDP: the parameter no rank used keeps None (AdamW skips it); rank 0's extra is averaged
        assert plain["unused.weight"] is None and plain["unused.bias"] is None
        assert split["unused.weight"] is None and split["unused.bias"] is None, r
        assert plain["extra"] is not None and float(plain["extra"].abs()) > 0
        assert set(plain) == set(split)
        for name, g in plain.items():
            if g is not None:
                assert rel(split[name], g) < 1e-10, (r, name)
        assert abs(split_loss - plain_loss) < 1e-10 * abs(plain_loss)
        assert "setting aside the gradients" in res[r]["copy"] and "on 1 of 2 ranks" in res[r]["copy"], res[r]
        assert res[r]["copy_kept"]
    assert "Tried to allocate the copy" in res[1]["copy"] and "on another rank" in res[0]["copy"]


# -- two ranks: out of memory before the first forward after DDP's first synchronised backward ---------

BUCKETS_WORKER = (
    r"""
import os, sys, torch, torch.distributed as dist
from microbatch.run.accumulate import accumulate
from microbatch.run.accumulate.controller import MicroBatchController

rank, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{{port}}", rank=rank, world_size=2)
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1).double(), broadcast_buffers=False)
x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 1, dtype=torch.float64)


def ok(m, mb):
    return torch.nn.functional.mse_loss(m(mb[0]), mb[1], reduction="sum"), len(mb[0])


def oom_on_rank1_before_forward(m, mb):
    if rank == 1 and len(mb[0]) > 2:  # as moving the micro-batch to the device can, before any forward
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes")
    return ok(m, mb)


model.zero_grad()
accumulate(model, (x, y), ok, micro_batch_size=4)  # one synchronised DDP backward: its buckets rebuild next
ctl = MicroBatchController(4)
model.zero_grad()
loss = accumulate(model, (x, y), oom_on_rank1_before_forward, controller=ctl)
grads = [p.grad.clone() for p in model.parameters()]
model.zero_grad()
full = accumulate(model, (x, y), ok, micro_batch_size=8)
results = {{"size": ctl.micro_batch_size, "loss": float(loss), "full": float(full),
            "same": all(torch.allclose(a, p.grad, rtol=1e-12, atol=0) for a, p in zip(grads, model.parameters()))}}
"""
    + WORKER_END
)


@pytest.mark.timeout(120)
def test_a_rank_out_of_memory_before_ddp_rebuilds_its_buckets_does_not_hang(tmp_path):
    """DDP rebuilds its gradient buckets (a broadcast) in the first forward after its first synchronised
    backward; rank 1 runs out of memory before that forward. The step settles the buckets on every rank first:
    both redo it at half the rows, with the full batch's gradient; before, rank 0 waited in the broadcast."""
    script = tmp_path / "worker.py"
    script.write_text(BUCKETS_WORKER.format())
    run_two_ranks(script, tmp_path, timeout_s=90)
    for r in range(2):
        res = torch.load(tmp_path / f"r{r}.pt")
        assert res["size"] == 2 and res["same"], (r, res)
        assert res["loss"] == pytest.approx(res["full"], rel=1e-12)
