"""The routed experts' gradients and weights ride the expert-data-parallel group (d/EP ranks, t·EP apart: Megatron
Core's expert ranks, DeepSpeed-MoE's expert_data_parallel_group), not the data-parallel group of the dense
parameters: none where EP = d, and over one NIC per GPU where that group has one rank per node."""

from __future__ import annotations

import pytest

from microbatch.hardware import get_accelerator
from microbatch.model import get_model
from microbatch.predict.candidate import _stage_times, make_context
from microbatch.predict.collectives import group_bandwidth, ranks_per_node, ring_latency_s
from microbatch.predict.dp_comm import _collectives
from microbatch.predict.plan_config import PlanConfig
from microbatch.predict.roofline import allgather_time_s, allreduce_time_s, reduce_scatter_time_s

H100 = get_accelerator("h100-sxm")


def _ctx(d: int, ep: int, zero: int):
    cfg = PlanConfig(shape=get_model("mixtral-8x7b").with_seq(4096), gpu=H100, global_batch=4 * d, data_parallel=d,
                     expert_parallel=ep, tensor_parallel=1, zero=(zero,), micro_batches=(1,), recompute=("full",))  # fmt: skip
    ctx = make_context(cfg)
    tm = _stage_times(ctx, 1, "full")
    n = ctx.params[0]
    x = ctx.expert_params[0]
    return cfg, ctx, tm, n, x


def _edp_bw(cfg: PlanConfig, de: int) -> float:
    return group_bandwidth(cfg.gpu, de, cfg.tensor_parallel * cfg.expert_parallel) * cfg.efficiency.network


@pytest.mark.parametrize("zero", [0, 1])
def test_no_expert_gradient_moves_where_expert_parallelism_spans_the_data_parallel_ranks(zero):
    cfg, ctx, tm, n, x = _ctx(8, 8, zero)
    assert 0 < x < n  # this GPU holds one expert of each layer beside the dense parameters
    wb, gb, _ = ctx.state_bpp
    c = _collectives(ctx, zero, tm, n)
    if zero == 0:
        assert c.reduce == pytest.approx(allreduce_time_s((n - x) * gb, 8, ctx.bw_dp))
    else:
        assert c.reduce == pytest.approx(reduce_scatter_time_s((n - x) * gb, 8, ctx.bw_zero))
        assert c.gather == pytest.approx(allgather_time_s((n - x) * wb, 8, ctx.bw_zero))


def test_experts_reduce_over_their_own_group_at_one_nic_per_gpu():
    cfg, ctx, tm, n, x = _ctx(16, 8, 1)
    wb, gb, _ = ctx.state_bpp
    bw_e = _edp_bw(cfg, 2)
    # two ranks eight apart: one per node, one NIC's bandwidth, below the dense group's eight NICs
    assert ranks_per_node(cfg.gpu, 2, 8) == 1 and bw_e < ctx.bw_zero
    c = _collectives(ctx, 1, tm, n)
    dense = reduce_scatter_time_s((n - x) * gb, 16, ctx.bw_zero)
    assert c.reduce == pytest.approx(dense + reduce_scatter_time_s(x * gb, 2, bw_e))
    assert c.gather == pytest.approx(
        allgather_time_s((n - x) * wb, 16, ctx.bw_zero) + allgather_time_s(x * wb, 2, bw_e)
    )


def test_without_expert_parallelism_every_parameter_shares_the_data_parallel_group():
    cfg, ctx, tm, n, x = _ctx(16, 1, 0)
    _, gb, _ = ctx.state_bpp
    assert _collectives(ctx, 0, tm, n).reduce == pytest.approx(allreduce_time_s(n * gb, 16, ctx.bw_dp))


def test_fsdp_gathers_experts_per_unit_on_their_own_ring_and_not_at_all_where_ep_is_d():
    for d, ep in ((16, 8), (8, 8)):
        cfg, ctx, tm, n, x = _ctx(d, ep, 3)
        wb = ctx.state_bpp[0]
        units = ctx.split[tm.k]
        alpha = units * ring_latency_s(d, -(-d // ranks_per_node(cfg.gpu, d, 1)))
        ag = allgather_time_s((n - x) * wb, d, ctx.bw_zero) + alpha
        de = d // ep
        if de > 1:
            alpha_e = units * ring_latency_s(de, -(-de // ranks_per_node(cfg.gpu, de, ep)))
            ag += allgather_time_s(x * wb, de, _edp_bw(cfg, de)) + alpha_e
        c = _collectives(ctx, 3, tm, n)
        assert c.kind == "zero3" and c.gather == pytest.approx(ag)


def test_under_a_pipeline_each_stage_reduces_its_own_parameters_and_experts():
    """The slowest stage's reduction and update set the step: each probed stage priced with its own dense
    parameters and experts, not the most parameters of one stage beside the most experts of another (DeepSeek-V3,
    p 4: the embedding's stage has 3 dense blocks, the last 16 MoE layers; the mixed pair read 127.96 ms)."""
    from microbatch.predict.dp_comm import data_parallel_comm
    from microbatch.predict.plan import make_plan

    cfg = PlanConfig(shape=get_model("deepseek-v3").with_seq(4096), gpu=H100, global_batch=512, data_parallel=64,
                     expert_parallel=64, pipeline_parallel=4, zero=(1,), micro_batches=(1,), recompute=("full",),
                     schedules=("1f1b",), choose="fastest")  # fmt: skip
    c = make_plan(cfg).candidates[0]
    ctx = make_context(cfg)
    tm = _stage_times(ctx, 1, "full")
    m = 512 // 64
    per = {i: data_parallel_comm(ctx, m, 1, tm, ctx.params[i], ctx.expert_params[i]) for i in ctx.probe}
    mixed = data_parallel_comm(ctx, m, 1, tm, max(ctx.params.values()), max(ctx.expert_params.values()))
    slowest = max(per.values(), key=sum)
    assert sum(mixed) > sum(slowest) * 1.001  # the mixed pair is no stage's
    got = (c.time["dp_comm_s"], c.time["zero_comm_s"], c.time["optimizer_s"])
    assert got == pytest.approx(slowest, rel=1e-9)


@pytest.mark.parametrize("ep_overlap", [False, True])
def test_the_hosts_launches_run_beside_the_all_to_all_and_faster_gemms_never_slow_a_step(ep_overlap):
    """A pass takes max(host, device + exposed all-to-all): the launch gap was max(0, host − device) with the whole
    all-to-all added on top, and an overlap that hid part of it shortened a host-bound pass (Qwen3-30B-A3B, d 8,
    EP 2, t 8: twice the FLOP/s gave a step 1.8% slower, a review)."""
    from dataclasses import replace

    from microbatch.predict.dp_comm import overlap_sigma
    from microbatch.predict.plan import make_plan
    from microbatch.predict.plan_context import layer_costs
    from microbatch.predict.steptime import layer_pass_times, overlap_expert_comm

    steps = []
    for f in (1.0, 2.0):
        acc = replace(H100, peak_flops={k: v * f for k, v in H100.peak_flops.items()})
        cfg = PlanConfig(shape=get_model("qwen3-30b-a3b").with_seq(8192), gpu=acc, global_batch=32, data_parallel=8,
                         expert_parallel=2, tensor_parallel=8, zero=(1,), micro_batches=(1,), recompute=("none",),
                         ep_overlap=ep_overlap, choose="fastest")  # fmt: skip
        steps.append(make_plan(cfg).candidates[0].step_time_s)
        ctx = make_context(cfg)
        lt = layer_costs(ctx, 1).layer
        slack_f, slack_b = lt.host_slack_s
        device_f = lt.total_s - max(0.0, slack_f - lt.ep_comm_s) - lt.ep_comm_s  # the forward's device work
        lo = overlap_expert_comm(lt, overlap_sigma(ctx)) if ep_overlap else lt
        forward = layer_pass_times(lo, "none")[0]
        assert forward == pytest.approx(max(device_f + slack_f, device_f + lo.ep_comm_s), rel=1e-9)
    assert steps[1] < steps[0]
