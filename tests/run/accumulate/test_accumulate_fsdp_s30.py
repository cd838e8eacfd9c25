"""FSDP2 on two gloo ranks that run different numbers of micro-batches (7 and 2 rows at 2 a micro-batch: 4 and 1):
every forward and backward is a collective there, so the rank with fewer runs fillers and neither waits (it hung in
an all-gather before); the gradient is the whole batch's, from one process in float64 without the library."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _helpers import WORKER_END, WORKER_START, two_rank_results
from torch import nn

WORKER = (
    WORKER_START
    + """
from torch import nn
from torch.distributed.fsdp import fully_shard
from microbatch.run.accumulate import accumulate, accumulate_micro_batches, split

def make():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()

def lf(m, mb):
    return torch.nn.functional.cross_entropy(m(mb[0]), mb[1], reduction="sum"), mb[1].shape[0]

g = torch.Generator().manual_seed(2)
x, y = torch.randn(9, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (9,), generator=g)
mine = slice(0, 7) if rank == 0 else slice(7, 9)
results = {{}}
for label, kw in (("count_fn", dict(count_fn=lambda mb: mb[1].shape[0])), ("no count_fn", {{}})):
    model = make()
    fully_shard(model[0])
    fully_shard(model)
    loss = accumulate(model, (x[mine], y[mine]), lf, micro_batch_size=2, **kw)
    results[label] = ([p.grad.full_tensor() for p in model.parameters()], float(loss))
model = make()
fully_shard(model)
given = split((x[mine], y[mine]), 3 if rank == 0 else 1)  # 3 and 2 micro-batches
loss = accumulate_micro_batches(model, given, lf, count_fn=lambda mb: mb[1].shape[0])
results["given"] = ([p.grad.full_tensor() for p in model.parameters()], float(loss))
results["x"], results["y"] = x, y
"""
    + WORKER_END
)


@pytest.mark.timeout(180)
def test_fsdp2_ranks_with_different_numbers_of_micro_batches_meet(tmp_path):
    res = two_rank_results(WORKER.format(tests=str(Path(__file__).parent)), tmp_path, weights_only=False)
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    full = F.cross_entropy(ref(res[0]["x"]), res[0]["y"])
    full.backward()
    for r in range(2):
        for label in ("count_fn", "no count_fn", "given"):
            grads, loss = res[r][label]
            diff = max((a - p.grad).abs().max().item() for a, p in zip(grads, ref.parameters(), strict=True))
            assert diff < 1e-12, (r, label, diff)
            assert loss == pytest.approx(full.item(), rel=1e-12)
