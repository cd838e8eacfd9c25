"""``accumulate(on_oom="split")`` under DDP with ranks of different sizes (two gloo processes).

The ranks hold different numbers of rows (3 and 9) or are given micro-batches of different sizes,
and only one of them runs out of memory. What must hold: the ranks agree in the step's one
``all_reduce`` (:mod:`microbatch.run.accumulate.agree`) and take the same path — all redo the step at the size
the agreed rows give, all stop together when every rank is down to one row (a rank that stopped
alone would leave the other waiting in the next ``all_reduce``: a hang, caught here by the timeout),
all refuse different micro-batch sizes — and the gradients equal the full batch's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _helpers import WORKER_END, WORKER_START, two_rank_results
from test_accumulate import full_batch_grad, rel
from test_accumulate_oom import sorted_batch

WORKER = (
    WORKER_START
    + r"""
from _helpers import AllocationLimit
from test_accumulate_oom import sorted_batch, loss_fn, count_fn, logits_budget, S
from test_accumulate import make_model
from microbatch.errors import ConfigError, OutOfMemoryError
from microbatch.run.accumulate import accumulate, accumulate_micro_batches, split
from microbatch.run.accumulate.controller import MicroBatchController

batch = sorted_batch()
shard = {{k: (v[:3] if rank == 0 else v[3:]) for k, v in batch.items()}}  # 3 short rows, 9 long ones
results = {{}}


def grads(model):
    return torch.cat([p.grad.reshape(-1) for p in model.module.parameters()])


# (a) one controller size, different rows: rank 1 holds 2 rows of 9 tokens at most
model = torch.nn.parallel.DistributedDataParallel(make_model())
ctl = MicroBatchController(8)
limit = AllocationLimit(logits_budget(2, S) if rank == 1 else 10**12)
with limit:
    loss = accumulate(model, shard, loss_fn, controller=ctl, count_fn=count_fn)
results["rows"] = (grads(model), float(loss), [(e["old"], e["new"]) for e in ctl.summary()["history"]],
                   limit.failures)

# (b) micro-batches given: rank 0 already at one row, rank 1 at three rows and out of memory above one
model = torch.nn.parallel.DistributedDataParallel(make_model())
given = split(shard, 1 if rank == 0 else 3)
limit = AllocationLimit(logits_budget(1, S) if rank == 1 else 10**12)
with limit:
    loss = accumulate_micro_batches(model, given, loss_fn, count_fn=count_fn, on_oom="split")
results["one_row"] = (grads(model), float(loss), limit.failures)

# (c) the same, but rank 1 runs out of memory even at one row: both ranks raise, neither waits
model = torch.nn.parallel.DistributedDataParallel(make_model())
try:
    with AllocationLimit(logits_budget(1, S) - 1 if rank == 1 else 10**12):
        accumulate_micro_batches(model, given, loss_fn, count_fn=count_fn, on_oom="split")
    results["stop"] = "no error"
except OutOfMemoryError as e:
    results["stop"] = str(e)

# (d) different micro-batch sizes asked of the ranks: both refuse
model = torch.nn.parallel.DistributedDataParallel(make_model())
try:
    accumulate(model, shard, loss_fn, micro_batch_size=2 if rank == 0 else 4, on_oom="split")
    results["sizes"] = "no error"
except ConfigError as e:
    results["sizes"] = str(e)
"""
    + WORKER_END
)


@pytest.mark.timeout(120)
def test_ranks_of_different_sizes_agree_split_and_stop_together(tmp_path):
    # a rank left waiting in an all_reduce fails here
    res = two_rank_results(WORKER.format(tests=str(Path(__file__).parent)), tmp_path, timeout_s=90)
    ref, ref_loss = full_batch_grad(sorted_batch())
    for r in range(2):
        g, loss, history, _ = res[r]["rows"]
        assert rel(g, ref) < 1e-10 and abs(loss - ref_loss) < 1e-10 * abs(ref_loss), r
        # rows run 3 and 8: agreed ceil(11 / 2) = 6 -> 3; at 3 rank 1 fails again: 3 -> 1; the same on both
        assert history == [(8, 3), (3, 1)], (r, history)
        g, loss, _ = res[r]["one_row"]
        assert rel(g, ref) < 1e-10 and abs(loss - ref_loss) < 1e-10 * abs(ref_loss), r
        assert "a micro-batch of 1 row" in res[r]["stop"], res[r]["stop"]
        assert "ranks ran different micro-batch sizes" in res[r]["sizes"], res[r]["sizes"]
    assert [res[r]["rows"][3] for r in range(2)] == [0, 2]  # only rank 1 ran out of memory
    assert res[0]["one_row"][2] == 0 and res[1]["one_row"][2] >= 1
    assert "this rank 2, mean 3" in res[0]["sizes"] and "this rank 4, mean 3" in res[1]["sizes"]
