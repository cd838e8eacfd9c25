"""The gradient noise scale under FSDP: its first micro-batch's gradient is reduced over the ranks (FSDP reduces every
backward), so the small batch is every rank's first micro-batch; labelled with one rank's items, |G|² came out 84x too
high and tr(Σ) 59% too low (a read-only audit, 2026-12-06). Two gloo ranks, a linear model whose per-item gradient is
its input: the hook's estimates against McCandlish et al.'s formulas by hand."""

from __future__ import annotations

import pytest
import torch
from _helpers import WORKER_END, two_rank_results

WORKER = (
    """
import sys
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from microbatch.run.accumulate import accumulate
from microbatch.run.noise import GradientNoiseScale

rank, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
D = 16
model = torch.nn.Sequential(torch.nn.Linear(D, 1, bias=False).double())
fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
g = torch.Generator().manual_seed(7)
x = torch.linspace(-0.3, 0.3, D, dtype=torch.float64) + torch.randn(32, D, generator=g, dtype=torch.float64)
mine = x[rank * 16:(rank + 1) * 16]
noise = GradientNoiseScale(decay=1.0)
accumulate(model, mine, lambda m, xb: (m(xb).sum(), xb.shape[0]), micro_batch_size=4, noise=noise)
results = {"g_sq": noise.estimate.g_sq, "trace_sigma": noise.estimate.trace_sigma, "x": x}
"""
    + WORKER_END
)


@pytest.mark.timeout(180)
def test_fsdp_noise_counts_every_ranks_first_micro_batch_as_the_small_batch(tmp_path):
    from microbatch.run.noise import g_sq_estimate, trace_sigma_estimate

    res = two_rank_results(WORKER, tmp_path, weights_only=False)
    x = res[0]["x"]
    big = x.mean(0)
    small = torch.cat([x[:4], x[16:20]]).mean(0)  # both ranks' first micro-batch: 8 items
    kw = dict(b_small=8, g_small_sq=float(small @ small), b_big=32, g_big_sq=float(big @ big))
    for r in range(2):
        assert res[r]["g_sq"] == pytest.approx(g_sq_estimate(**kw), rel=1e-9)
        assert res[r]["trace_sigma"] == pytest.approx(trace_sigma_estimate(**kw), rel=1e-9)


def test_noise_under_fsdps_older_wrapper_is_refused():
    """Its gradients are each rank's flat shard: their norm is not the gradient's."""
    from microbatch.errors import ConfigError
    from microbatch.run.accumulate import accumulate
    from microbatch.run.noise import GradientNoiseScale

    class FullyShardedDataParallel(torch.nn.Linear):  # the class name the wrapper gives a module
        pass

    model = FullyShardedDataParallel(4, 1)
    with pytest.raises(ConfigError, match=r"noise with FSDP's older wrapper .* fully_shard \(FSDP2\) or DDP"):
        accumulate(
            model,
            torch.ones(8, 4),
            lambda m, x: (m(x).sum(), 8),
            micro_batch_size=2,
            noise=GradientNoiseScale(),
        )
