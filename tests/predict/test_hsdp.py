"""Hybrid sharding (HSDP: FSDP's HYBRID_SHARD, torchtitan's data_parallel_shard_degree × replicate degree): ZeRO
shards inside groups of shard_degree data-parallel ranks, the d / shard_degree groups all-reduce their gradient
shards. By hand against the memory model, the planner, the CLI and the torchtitan export (issue 28 item 3,
"hierarchy")."""

from __future__ import annotations

import pytest
from _helpers import plan_json

from microbatch.errors import ConfigError
from microbatch.hardware import get_accelerator
from microbatch.model import get_model
from microbatch.predict.candidate import _stage_times, evaluate, make_context
from microbatch.predict.collectives import ranks_per_node, ring_latency_s
from microbatch.predict.dp_comm import _unit_collectives
from microbatch.predict.memory import MemoryConfig, estimate_memory
from microbatch.predict.plan import PlanConfig, make_plan
from microbatch.predict.roofline import allreduce_time_s, model_flops_per_step
from microbatch.predict.state import zero_groups
from microbatch.show.export import export_plan

H100 = get_accelerator("h100-sxm")
LLAMA = get_model("llama-3-8b")


def test_zero_groups():
    assert zero_groups(64) == (64, 1)
    assert zero_groups(64, 1, 8) == (8, 8)
    assert zero_groups(64, 2, 8) == (16, 8)  # the context-parallel ranks shard with their group
    assert zero_groups(64, 1, 64) == (64, 1)
    with pytest.raises(
        ConfigError, match=r"shard_degree 3 must divide data_parallel 64 .* \[1, 2, 4, 8, 16, 32, 64\]"
    ):
        zero_groups(64, 1, 3)
    for bad in (0, -8, True, 2.0):
        with pytest.raises(ConfigError, match="shard_degree must be a positive integer"):
            zero_groups(64, 1, bad)  # type: ignore[arg-type]


def test_memory_shards_over_the_group_only():
    def state(**kw) -> tuple[float, float, float]:
        s = estimate_memory(LLAMA, MemoryConfig(micro_batch=1, seq=4096, zero=3, **kw)).stages[0]
        return s.weights_bytes, s.gradients_bytes, s.optimizer_bytes

    hybrid = state(data_parallel=64, shard_degree=8)
    assert hybrid == pytest.approx(state(data_parallel=8))  # what a group of 8 holds
    full = state(data_parallel=64)
    assert hybrid[0] == pytest.approx(8 * full[0]) and hybrid[2] == pytest.approx(8 * full[2])
    assert state(data_parallel=64, shard_degree=64) == pytest.approx(full)


def _cfg(**kw) -> PlanConfig:
    base = dict(shape=LLAMA, gpu=H100, global_batch=256, data_parallel=64, seq=4096, micro_batches=(1,),
                recompute=("full",), zero=(3,), shard_degree=8)  # fmt: skip
    base.update(kw)
    return PlanConfig(**base)


def test_zero3_gathers_in_the_group_and_all_reduces_across_replicas_by_hand():
    cfg = _cfg()
    assert (cfg.zero_group, cfg.replicas) == (8, 8)
    ctx = make_context(cfg)
    flops = model_flops_per_step(LLAMA, 256, 4096)
    hybrid = evaluate(ctx, 1, 4, "1f1b", 1, "full", 3, flops).to_dict()["time"]["zero_comm_s"]
    # the same plan without the replicas' all-reduce is the plan of one group of 8 over a quarter of the batch
    group = make_context(_cfg(data_parallel=8, global_batch=32, shard_degree=None))
    alone = evaluate(group, 1, 4, "1f1b", 1, "full", 3, flops / 8).to_dict()["time"]["zero_comm_s"]
    tm = _stage_times(ctx, 1, "full")
    n, gb = ctx.max_params, ctx.state_bpp[1]
    units = ctx.split[tm.k]
    # replicas 8 GPUs apart: one per node, 8 nodes; the shard's gradients n·gb/8 all-reduced each micro-step
    alpha = units * ring_latency_s(8, -(-8 // ranks_per_node(H100, 8, 8)), allreduce=True)
    # one GPU per node across the replicas: the NIC's achievable rate, not NVLink's (group_bandwidth's rule)
    nic = H100.inter_node_bytes_per_s * H100.inter_node_achievable
    assert ctx.bw_rep == pytest.approx(nic) and ctx.bw_zero > 2 * nic  # the group itself is inside a node
    assert gb == 2 and ctx.cfg.reduce_bytes == 4  # FSDP2's shards all-reduced in its reduce dtype (fp32)
    ar = allreduce_time_s(n * 4 / 8, 8, nic) + alpha
    sig = 0.189
    back = tm.ik + tm.wk
    ag, rs, _ = _unit_collectives(ctx, tm, n)  # the group's own, as the lone group's: compare the difference

    def exposed(c: float, x: float) -> float:
        return max(c - x, sig * min(c / (1 + sig), x))

    # FSDP2 all-reduces on a stream of its own: the reduce-scatters' and all-reduces' queues run side by side, the
    # longer one's time and one unit of the other (2026-12-08; before, their sum)
    side = max(rs, ar) + min(rs, ar) / units
    extra = 4 * (exposed(ag + side, back) - exposed(ag + rs, back)) + 4 * ar / units  # each backward's last
    assert hybrid - alone == pytest.approx(extra, rel=1e-9)
    assert hybrid > alone
    # FSDP1 all-reduces after the reduce-scatter on its one stream: the sum
    one = make_context(_cfg(zero3_impl="fsdp1"))
    serial = evaluate(one, 1, 4, "1f1b", 1, "full", 3, flops).to_dict()["time"]["zero_comm_s"]
    lone1 = evaluate(make_context(_cfg(data_parallel=8, global_batch=32, shard_degree=None, zero3_impl="fsdp1")), 1, 4,
                     "1f1b", 1, "full", 3, flops / 8).to_dict()["time"]["zero_comm_s"]  # fmt: skip
    ag1, rs1, _ = _unit_collectives(one, tm, n)
    ar1 = allreduce_time_s(n * one.cfg.reduce_bytes / 8, 8, nic) + alpha
    extra1 = 4 * (exposed(ag1 + rs1 + ar1, back) - exposed(ag1 + rs1, back)) + 4 * ar1 / units
    assert serial - lone1 == pytest.approx(extra1, rel=1e-9)
    summed = 4 * (exposed(ag + rs + ar, back) - exposed(ag + rs, back)) + 4 * ar / units
    assert hybrid - alone <= summed  # side by side never costs more than one after the other


def test_no_shard_degree_is_the_whole_group_and_zero0_ignores_it():
    a = make_plan(_cfg(shard_degree=None)).candidates[0]
    b = make_plan(_cfg(shard_degree=64)).candidates[0]
    assert a.step_time_s == b.step_time_s and a.peak_memory_bytes == b.peak_memory_bytes
    # a shard degree asks for sharding: auto ZeRO searches the sharded stages only (ZeRO 0, plain DDP over all d
    # ranks, ignores the groups: a plan recommending it under "HSDP 8 x 8" contradicted its own header)
    assert {c.zero for c in make_plan(_cfg(zero=None, shard_degree=8, global_batch=4096)).candidates} <= {
        1,
        2,
        3,
    }
    # asked for alone, ZeRO 0 with a shard degree shards nothing: refused, naming both
    with pytest.raises(
        ConfigError, match=r"shard_degree 8 shards the training state .* zero 0 shards nothing"
    ):
        _cfg(zero=(0,), shard_degree=8, global_batch=4096)
    # a group of one rank shards nothing: auto ZeRO offers only 0
    assert {c.zero for c in make_plan(_cfg(zero=None, shard_degree=1)).candidates} == {0}


def test_zero1_adds_one_replica_all_reduce_behind_the_last_backward():
    flops = model_flops_per_step(LLAMA, 256, 4096)
    ctx = make_context(_cfg(zero=(1,)))
    lone = make_context(_cfg(zero=(1,), data_parallel=8, global_batch=32, shard_degree=None))
    tm = _stage_times(ctx, 1, "full")
    n, gb = ctx.max_params, ctx.state_bpp[1]
    ar = allreduce_time_s(n * gb / 8, 8, ctx.bw_rep) + ring_latency_s(
        8, 8, allreduce=True
    )  # one bucketed call
    from microbatch.predict.roofline import allgather_time_s, reduce_scatter_time_s

    rs = reduce_scatter_time_s(n * gb, 8, ctx.bw_zero)
    sig, back = 0.189, tm.ik + tm.wk

    def exposed(c: float, x: float) -> float:
        return max(c - x, sig * min(c / (1 + sig), x))

    hybrid = evaluate(ctx, 1, 4, "1f1b", 1, "full", 1, flops).to_dict()["time"]["dp_comm_s"]
    alone = evaluate(lone, 1, 4, "1f1b", 1, "full", 1, flops / 8).to_dict()["time"]["dp_comm_s"]
    assert alone == pytest.approx(exposed(rs, back) + allgather_time_s(n * 2, 8, lone.bw_zero))
    assert hybrid - alone == pytest.approx(exposed(rs + ar, back) - exposed(rs, back), rel=1e-9)


@pytest.mark.parametrize("z", [1, 2, 3])
@pytest.mark.parametrize("c", [1, 2])
def test_planner_and_memory_model_agree(z, c):
    for p in (1, 2):
        plan = make_plan(_cfg(zero=(z,), pipeline_parallel=p, context_parallel=c, schedules=("1f1b",)))
        for cand in plan.candidates:
            est = estimate_memory(
                LLAMA,
                MemoryConfig(micro_batch=cand.micro_batch, seq=4096, data_parallel=64, shard_degree=8, zero=z,
                             pipeline_parallel=p, microbatches=cand.microbatches, schedule=cand.schedule,
                             recompute=cand.recompute, context_parallel=c),
            )  # fmt: skip
            assert cand.peak_memory_bytes == pytest.approx(est.peak_bytes, rel=1e-9)


def test_the_replicas_sit_a_whole_shard_group_apart_with_context_parallelism():
    ctx = make_context(_cfg(context_parallel=2, data_parallel=32, shard_degree=4, global_batch=128))
    assert (ctx.cfg.zero_group, ctx.cfg.replicas) == (8, 8)
    from microbatch.predict.collectives import group_bandwidth

    assert ctx.bw_rep == pytest.approx(group_bandwidth(H100, 8, 8))  # stride t·shard·c = 8: a node apart
    assert ctx.bw_zero == pytest.approx(group_bandwidth(H100, 8, 1))


def test_refusals():
    with pytest.raises(ConfigError, match="shard_degree 3 must divide data_parallel 64"):
        _cfg(shard_degree=3)
    with pytest.raises(ConfigError, match="shard_degree 8 with expert_parallel 8"):
        PlanConfig(shape=get_model("mixtral-8x7b"), gpu=H100, global_batch=64, data_parallel=64, shard_degree=8,
                   expert_parallel=8)  # fmt: skip
    with pytest.raises(ConfigError, match="shard_degree 4 with expert_parallel 8"):  # the memory model too
        MemoryConfig(micro_batch=1, data_parallel=16, expert_parallel=8, shard_degree=4, zero=3)


def test_cli_and_exports(capsys):
    args = ["plan", "--model", "llama-3-8b", "--gpu", "h100-sxm", "-B", "256", "-d", "64", "--seq", "4096",
            "-b", "1", "--zero", "3", "--recompute", "full", "--json"]  # fmt: skip
    hybrid = plan_json([*args, "--shard-degree", "8"], capsys)
    full = plan_json(args, capsys)
    assert hybrid["shard_degree"] == 8 and full["shard_degree"] is None
    assert hybrid["recommended"]["peak_memory_bytes"] > full["recommended"]["peak_memory_bytes"]
    par = export_plan(hybrid, "torchtitan").config["parallelism"]
    assert (par["data_parallel_shard_degree"], par["data_parallel_replicate_degree"]) == (8, 8)
    par = export_plan(full, "torchtitan").config["parallelism"]
    assert (par["data_parallel_shard_degree"], par["data_parallel_replicate_degree"]) == (64, 1)
    with pytest.raises(ConfigError, match="deepspeed has no hybrid sharding over groups of 8"):
        export_plan(hybrid, "deepspeed")
    # one group of all d ranks is no hybrid: it exports anywhere
    whole = plan_json([*args, "--shard-degree", "64"], capsys)
    assert export_plan(whole, "deepspeed").config["zero_optimization"]["stage"] == 3
    # a hand-edited file: refused, not written as 12 × 5
    bad = {**hybrid, "recommended": {**hybrid["recommended"], "shard_degree": 5}}
    with pytest.raises(ConfigError, match="shard_degree 5 must divide data_parallel 64"):
        export_plan(bad, "torchtitan")
    from microbatch.cli import main

    assert main([*args, "--shard-degree", "3"]) == 2
    assert "--shard-degree 3 must divide --data-parallel 64" in capsys.readouterr().out  # the flags' names
