"""The pipeline hand-off as Megatron runs it: 1/t per tensor rank, then an NVLink all-gather unless SP."""

from __future__ import annotations

import pytest

from microbatch.hardware import get_accelerator
from microbatch.model import get_model
from microbatch.predict.candidate import layer_costs, make_context
from microbatch.predict.collectives import group_bandwidth, pipeline_send_time_s, scatter_gather_send_s
from microbatch.predict.plan import PlanConfig

A100 = get_accelerator("a100-80gb")


def test_scatter_gather_by_hand() -> None:
    # 1 MB over t = 4: 250 kB over the 25 GB/s pipeline link (10 us), then 3/4 MB over 200 GB/s NVLink (3.75 us)
    assert scatter_gather_send_s(1e6, 4, 25e9, 200e9) == pytest.approx(10e-6 + 3.75e-6)
    # sequence parallelism: the s/t shard is the whole message, no gather (Megatron's p2p_communication)
    assert scatter_gather_send_s(1e6, 4, 25e9, 200e9, sequence_parallel=True) == pytest.approx(10e-6)
    assert scatter_gather_send_s(1e6, 1, 25e9, 200e9) == pytest.approx(40e-6)  # t = 1: the whole tensor
    # the accelerator form: same numbers at the groups' bandwidths
    bw_pp, bw_tp = group_bandwidth(A100, 2, 8), group_bandwidth(A100, 8, 1)
    got = pipeline_send_time_s(1e6, A100, tensor_parallel=8, pipeline_stride=8, sequence_parallel=True)
    assert got == pytest.approx(1e6 / 8 / bw_pp)
    assert pipeline_send_time_s(1e6, A100, tensor_parallel=8, pipeline_stride=8) == pytest.approx(
        1e6 / 8 / bw_pp + 7 / 8 * 1e6 / bw_tp
    )


@pytest.mark.parametrize("sp", [False, True])
def test_planner_sends_with_the_gather_unless_sequence_parallel(sp: bool) -> None:
    shape = get_model("gpt2")
    cfg = PlanConfig(
        gpu=A100, shape=shape, global_batch=48, pipeline_parallel=3, tensor_parallel=2, sequence_parallel=sp
    )
    ctx = make_context(cfg)
    nbytes = 2 * 2 * cfg.seq_len * shape.hidden  # bf16, b_m = 2
    bw_tp = group_bandwidth(A100, 2, 1) * cfg.efficiency.network
    send = nbytes / 2 / ctx.bw_pp
    gather = 0.0 if sp else 1 / 2 * nbytes / bw_tp
    assert layer_costs(ctx, 2).p2p_s == pytest.approx(send + gather)
    assert gather or sp
