"""ZeRO-2/3 under a pipeline as FSDP runs in torch.distributed.pipelining (issue 28, item 3).

The stage turns off FSDP's gradient sync and resharding after backward until the last micro-batch and
reduces the gradients once after it (pipelining/stage.py); torchtitan does not reshard after forward under
PP. So the stage holds ZeRO-1's state through the step — but its gradients whole in FSDP2's reduce dtype, fp32
by default, in which it accumulates them (``to_accumulated_grad_if_needed``, 2026-12-07) — gathers its weights
once and reduce-scatters its gradients once, exposed. By hand against the planner and the memory model."""

from __future__ import annotations

from dataclasses import replace

import pytest

from microbatch.hardware import get_accelerator
from microbatch.model import get_model
from microbatch.predict.candidate import _stage_times, evaluate, make_context
from microbatch.predict.collectives import ranks_per_node, ring_latency_s
from microbatch.predict.memory import MemoryConfig, estimate_memory
from microbatch.predict.plan import PlanConfig
from microbatch.predict.roofline import allgather_time_s, model_flops_per_step, reduce_scatter_time_s
from microbatch.predict.state import resident_zero

H100 = get_accelerator("h100-sxm")
LLAMA = get_model("llama-3-8b")


def test_resident_zero():
    assert [resident_zero(z, 1) for z in (0, 1, 2, 3)] == [0, 1, 2, 3]
    assert [resident_zero(z, 4) for z in (0, 1, 2, 3)] == [0, 1, 1, 1]


def _mem(zero: int, p: int) -> dict:
    est = estimate_memory(
        LLAMA,
        MemoryConfig(
            micro_batch=1, seq=4096, pipeline_parallel=p, microbatches=8, data_parallel=8, zero=zero
        ),
    )
    s = est.stages[0]
    return {"w": s.weights_bytes, "g": s.gradients_bytes, "o": s.optimizer_bytes, "other": s.other_bytes}


def test_memory_under_a_pipeline_is_zero1s():
    z1, z2, z3 = _mem(1, 4), _mem(2, 4), _mem(3, 4)
    assert z3 == z2 and {k: v for k, v in z3.items() if k != "g"} == {k: v for k, v in z1.items() if k != "g"}
    assert z3["g"] == pytest.approx(2 * z1["g"])  # whole, in fp32 (FSDP2's reduce dtype), not bf16
    # without a pipeline ZeRO-3 shards the weights over d = 8 and holds two gathered layers
    one, three = _mem(1, 1), _mem(3, 1)
    assert three["w"] == pytest.approx(one["w"] / 8)
    assert three["other"] > one["other"]


def _cfg(**kw) -> PlanConfig:
    base = dict(shape=LLAMA, gpu=H100, global_batch=64, data_parallel=8, pipeline_parallel=2, seq=4096,
                micro_batches=(1,), recompute=("full",), zero=(3,), schedules=("1f1b",))  # fmt: skip
    base.update(kw)
    return PlanConfig(**base)


def _candidate(cfg: PlanConfig, m: int, z: int = 3):
    ctx = make_context(cfg)
    return ctx, evaluate(
        ctx, 1, m, "1f1b", 1, "full", z, model_flops_per_step(cfg.shape, cfg.global_batch, 4096)
    )


def test_one_gather_and_one_exposed_reduce_scatter_by_hand():
    cfg = _cfg()
    ctx, c = _candidate(cfg, 8)
    tm = _stage_times(ctx, 1, "full")
    n = max(ctx.params[i] for i in ctx.probe)  # the stage holding the most
    wb, gb, _ = ctx.state_bpp
    units = ctx.split[tm.k]
    alpha = units * ring_latency_s(8, -(-8 // ranks_per_node(H100, 8, 1)))
    ag = allgather_time_s(n * wb, 8, ctx.bw_dp) + alpha
    rs = reduce_scatter_time_s(n * 4, 8, ctx.bw_dp) + alpha  # FSDP2's reduce dtype: fp32 (torchtitan's)
    assert gb == 2
    sig = 0.189
    hidden = max(ag - tm.fk, sig * min(ag / (1 + sig), tm.fk))
    rate = H100.memory_bandwidth_bytes_per_s * 0.8
    copy = 2 * n * wb / rate  # FSDP2 copies the weights out once
    copy_in = (
        n * (wb + 4) / rate
    )  # and the gradients into the reduce-scatter buffer once, on the compute stream
    t = c.to_dict()["time"]
    accumulate = 8 * n * (2 * 4 + wb) / rate  # each micro-batch's gradients added into the fp32 ones (FSDP2)
    assert t["zero_comm_s"] == pytest.approx(hidden + ag / units + rs + copy + copy_in + accumulate)
    assert t["dp_comm_s"] == 0.0
    # ZeRO-2 under a pipeline is the same FSDP: the same exposed seconds (FSDP2's copies included)
    _, z2 = _candidate(cfg, 8, 2)
    assert z2.to_dict()["time"]["zero_comm_s"] == pytest.approx(t["zero_comm_s"])
    # under torch's pipelining it is FSDP2 whatever zero3_impl says (the flag's help): the same seconds
    _, fsdp1 = _candidate(replace(cfg, zero3_impl="fsdp1"), 8)
    assert fsdp1.to_dict()["time"]["zero_comm_s"] == pytest.approx(t["zero_comm_s"])


def test_does_not_grow_with_the_micro_batches_and_zero3_holds_zero1s_memory():
    cfg = _cfg()
    ctx, few = _candidate(cfg, 4)
    _, many = _candidate(replace(cfg, global_batch=128), 16)
    n = max(ctx.params[i] for i in ctx.probe)
    per_micro_batch = (
        n * (2 * 4 + 2) / (H100.memory_bandwidth_bytes_per_s * 0.8)
    )  # the accumulation alone grows
    grown = many.to_dict()["time"]["zero_comm_s"] - few.to_dict()["time"]["zero_comm_s"]
    assert grown == pytest.approx(
        12 * per_micro_batch
    )  # the collectives do not: one gather, one reduce-scatter
    _, z1 = _candidate(cfg, 8, 1)
    _, z3 = _candidate(cfg, 8, 3)
    assert z3.peak_memory_bytes == pytest.approx(z1.peak_memory_bytes + n * (4 - 2))  # its gradients in fp32
    # without the pipeline ZeRO-3 gathers every micro-step: it grows with m
    flat = _cfg(pipeline_parallel=1, schedules=None)
    _, a = _candidate(flat, 4)
    _, b = _candidate(replace(flat, global_batch=128), 16)
    assert b.to_dict()["time"]["zero_comm_s"] > 3 * a.to_dict()["time"]["zero_comm_s"]


@pytest.mark.parametrize(
    "model, p, ep, schedules",
    [
        ("llama-3-8b", 2, 1, ("1f1b", "interleaved-1f1b", "dualpipev")),
        ("mixtral-8x7b", 4, 4, ("1f1b", "dualpipev")),
    ],
)
def test_the_planner_and_the_memory_model_agree_under_a_pipeline(model, p, ep, schedules):
    from microbatch.predict.plan import make_plan

    shape = get_model(model)
    cfg = _cfg(shape=shape, pipeline_parallel=p, expert_parallel=ep, zero=(2, 3), schedules=schedules,
               recompute=("full", "none"))  # fmt: skip
    plan = make_plan(cfg)
    assert {c.schedule for c in plan.candidates} == set(schedules)
    for c in plan.candidates:
        est = estimate_memory(
            shape,
            MemoryConfig(micro_batch=c.micro_batch, seq=4096, pipeline_parallel=p, microbatches=c.microbatches,
                         schedule=c.schedule, virtual=c.virtual, data_parallel=8, zero=c.zero,
                         recompute=c.recompute, expert_parallel=ep),
        )  # fmt: skip
        assert c.peak_memory_bytes == pytest.approx(est.peak_bytes, rel=1e-9), c
        one = estimate_memory(
            shape,
            MemoryConfig(micro_batch=c.micro_batch, seq=4096, pipeline_parallel=p, microbatches=c.microbatches,
                         schedule=c.schedule, virtual=c.virtual, data_parallel=8, zero=1, grad_dtype="fp32",
                         recompute=c.recompute, expert_parallel=ep),
        )  # fmt: skip
        # ZeRO-1's memory under the pipeline, its gradients in fp32 (FSDP2 accumulates in its reduce dtype)
        assert est.peak_bytes == pytest.approx(one.peak_bytes)


# -- gradients reduce-scattered after each micro-batch (pipeline_grad_reduce="each"; Llama 3's FSDP) ----------
def test_each_holds_zero2s_memory_under_a_pipeline():
    assert [resident_zero(z, 4, "each") for z in (0, 1, 2, 3)] == [0, 1, 2, 2]
    assert [resident_zero(z, 1, "each") for z in (0, 1, 2, 3)] == [0, 1, 2, 3]

    def mem(zero: int, reduce: str) -> dict:
        est = estimate_memory(LLAMA, MemoryConfig(micro_batch=1, seq=4096, pipeline_parallel=4, microbatches=8,
                                                  data_parallel=8, zero=zero, pipeline_grad_reduce=reduce))  # fmt: skip
        s = est.stages[0]
        return {"w": s.weights_bytes, "g": s.gradients_bytes, "o": s.optimizer_bytes, "other": s.other_bytes}

    last, each = mem(2, "last"), mem(2, "each")
    assert each["g"] == pytest.approx(last["g"] / 2 / 8)  # sharded over d = 8, not accumulated whole in fp32
    assert (
        each["w"] == last["w"] and each["o"] == last["o"]
    )  # weights whole (not resharded), optimizer sharded
    assert mem(3, "each") == each  # ZeRO-3 keeps its weights gathered from the first forward: ZeRO-2's memory


def test_each_reduce_scatters_every_micro_batch_behind_its_backward_by_hand():
    cfg = _cfg(pipeline_grad_reduce="each", reduce_dtype="half")  # FSDP2 under the pipeline, reducing bf16
    ctx, c = _candidate(cfg, 8)
    tm = _stage_times(ctx, 1, "full")
    n = max(ctx.params[i] for i in ctx.probe)
    wb, gb, _ = ctx.state_bpp
    units = ctx.split[tm.k]
    alpha = units * ring_latency_s(8, -(-8 // ranks_per_node(H100, 8, 1)))
    ag = allgather_time_s(n * wb, 8, ctx.bw_dp) + alpha
    rs = reduce_scatter_time_s(n * gb, 8, ctx.bw_dp) + alpha
    sig, back = 0.189, tm.ik + tm.wk
    rate = H100.memory_bandwidth_bytes_per_s * 0.8
    copy, copy_in = 2 * n * wb / rate, n * (wb + gb) / rate  # FSDP2's copies: out once, in every micro-batch
    gather = max(ag - tm.fk, sig * min(ag / (1 + sig), tm.fk)) + ag / units + copy
    per_micro_batch = max(rs - back, sig * min(rs / (1 + sig), back)) + copy_in
    tail = rs / units  # the last micro-batch's last unit: nothing after it to hide behind
    assert c.to_dict()["time"]["zero_comm_s"] == pytest.approx(gather + 8 * per_micro_batch + tail)
    # it grows with m (one reduce-scatter per micro-batch), where "last" does not
    _, many = _candidate(replace(cfg, global_batch=128), 16)
    grown = many.to_dict()["time"]["zero_comm_s"] - c.to_dict()["time"]["zero_comm_s"]
    assert grown == pytest.approx(8 * per_micro_batch)
    # and it holds less: the gradients sharded
    _, last = _candidate(_cfg(reduce_dtype="half"), 8)
    assert c.peak_memory_bytes < last.peak_memory_bytes


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(pipeline_parallel=1, schedules=None), "applies under a pipeline"),
        (dict(zero=(0, 1)), "applies to ZeRO 2 or 3"),
    ],
)
def test_each_refused_where_it_changes_nothing(kw, words):
    from microbatch.errors import ConfigError

    with pytest.raises(ConfigError, match=words) as e:
        _cfg(pipeline_grad_reduce="each", **kw)
    assert "pipeline_grad_reduce" in e.value.params
    with pytest.raises(ConfigError, match="is not known; use last"):
        _cfg(pipeline_grad_reduce="sometimes")
    with pytest.raises(ConfigError, match="applies under a pipeline"):
        MemoryConfig(micro_batch=1, zero=2, data_parallel=8, pipeline_grad_reduce="each")
