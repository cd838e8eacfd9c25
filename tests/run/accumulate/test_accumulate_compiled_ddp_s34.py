"""``accumulate`` on ``torch.compile(DDP(model))``, the wrap order torch's DDP notes give (a helper's review,
2026-12-08): the compiled wrapper hid the DDP, so accumulate took one process — every micro-batch all-reduced, each
rank scaled by its own count (the ranks drifted apart), a hang where the ranks ran different numbers of micro-batches.
Two gloo processes with 3 and 9 rows (different micro-batch counts); the gradients must equal the full batch's."""

from __future__ import annotations

from pathlib import Path

import pytest
from _helpers import WORKER_END, WORKER_START, two_rank_results
from test_accumulate import full_batch_grad, rel
from test_accumulate_oom import sorted_batch

WORKER = (
    WORKER_START
    + r"""
from test_accumulate_oom import sorted_batch, loss_fn, count_fn
from test_accumulate import make_model
from microbatch.run.accumulate import accumulate
from microbatch.run.accumulate.scaling import group_and_world, is_ddp

batch = sorted_batch()
shard = {{k: (v[:3] if rank == 0 else v[3:]) for k, v in batch.items()}}  # 3 short rows, 9 long ones
results = {{}}
for with_count in (True, False):
    ddp = torch.nn.parallel.DistributedDataParallel(make_model())
    model = torch.compile(ddp, backend="eager")
    loss = accumulate(model, shard, loss_fn, micro_batch_size=2, count_fn=count_fn if with_count else None)
    g = torch.cat([p.grad.reshape(-1) for p in ddp.module.parameters()])
    results[with_count] = (g, float(loss), is_ddp(model), group_and_world(model)[1])
"""
    + WORKER_END
)


@pytest.mark.timeout(150)
def test_a_compiled_ddp_model_accumulates_the_full_batch_gradient_on_every_rank(tmp_path):
    res = two_rank_results(WORKER.format(tests=str(Path(__file__).parent)), tmp_path, timeout_s=120)
    ref, ref_loss = full_batch_grad(sorted_batch())
    for r in range(2):
        for with_count in (True, False):
            g, loss, ddp, world = res[r][with_count]
            assert ddp and world == 2, (r, with_count)
            assert rel(g, ref) < 1e-10 and abs(loss - ref_loss) < 1e-10 * abs(ref_loss), (
                r,
                with_count,
                rel(g, ref),
            )
