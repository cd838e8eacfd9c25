"""knee_batch_size on two processes whose data ends a step apart (a helper's review, 2026-12-08): the rank whose
function returned first went on to the point's agreement while the other waited in its next step's: a hang. The
rank that ends now tells the others at their next step, and both keep the point."""

from __future__ import annotations

import pytest

_CHILD = """
import json, os
import torch, accelerate
from torch.utils.data import DataLoader, TensorDataset
from microbatch.integrations.accelerate import knee_batch_size
from microbatch.measure.timing import TimingConfig

rank = int(os.environ["RANK"])
g0 = torch.Generator().manual_seed(1)
n = 97 - rank  # one row more on rank 0: at b_m 8, 13 batches against 12
DATA = TensorDataset(torch.randn(n, 32, generator=g0), torch.randn(n, generator=g0))

@knee_batch_size(global_batch=48, use_cache=False, max_micro_batch=8,
                 timing=TimingConfig(warmup=1, min_repeats=3, max_repeats=1000, max_time_s=100.0, rel_tol=0.0))
def train(micro_batch, grad_accum, probe=None):
    acc = accelerate.Accelerator(cpu=True)  # the process group; the model is each rank's own (no DDP)
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for i, (x, y) in enumerate(DataLoader(DATA, batch_size=micro_batch)):
        torch.nn.functional.mse_loss(model(x).squeeze(-1), y).backward()
        if (i + 1) % grad_accum == 0:
            opt.step(); opt.zero_grad()
        if probe is not None:
            probe.step()
        elif i >= 1:
            break
    return acc.process_index

rank = train()
res = train.result
knee = res.recommendation.knee.micro_batch
out = {"b": knee, "points": [p.micro_batch for p in res.points if not p.oom]}
open(os.path.join(os.environ["OUT_DIR"], f"rank{rank}.json"), "w").write(json.dumps(out))
"""


@pytest.mark.timeout(240)
def test_data_that_ends_a_step_apart_does_not_hang_the_ranks(tmp_path):
    from _helpers import run_launched

    r0, r1 = run_launched(_CHILD, tmp_path)
    assert r0 == r1 and r0["points"] and r0["b"] in r0["points"]
