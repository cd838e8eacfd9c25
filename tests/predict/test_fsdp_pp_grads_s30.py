"""FSDP2 under a pipeline, reducing after the last micro-batch, holds each stage's gradients whole in its reduce
dtype (torch's ``to_accumulated_grad_if_needed``: the bf16 gradient upcast to fp32 and accumulated), not in bf16:
a read of torchtitan and torch's source (2026-12-07). Checked by hand against the stage's parameters, in the memory
estimate and in the planner, which must agree."""

from __future__ import annotations

import pytest

from microbatch.hardware import get_accelerator
from microbatch.model import get_model
from microbatch.predict.memory import estimate_memory
from microbatch.predict.memory_config import MemoryConfig
from microbatch.predict.plan import make_plan
from microbatch.predict.plan_config import PlanConfig
from microbatch.predict.stages import stage_params

SHAPE = get_model("llama-3-70b")
BASE = dict(micro_batch=1, tensor_parallel=8, pipeline_parallel=4, data_parallel=4, microbatches=16, zero=3)


def grads(**kw) -> float:
    return estimate_memory(SHAPE, MemoryConfig(**{**BASE, **kw})).stages[0].gradients_bytes


def test_held_gradients_are_fp32_whole_under_torchtitans_reduce_dtype():
    params = stage_params(SHAPE, 0, 4, 20, 8)  # stage 0: 20 layers and the embedding, over t = 8
    assert grads() == pytest.approx(params * 4)  # fp32, unsharded: FSDP2's accumulated gradient
    assert grads(reduce_dtype="half") == pytest.approx(params * 2)  # reduce_dtype=bf16: accumulated in bf16
    assert grads(grad_dtype="fp32") == pytest.approx(params * 4)  # already fp32: no more
    assert grads(pipeline_grad_reduce="each") == pytest.approx(
        params * 2 / 4
    )  # reduced each micro-batch: a shard
    assert grads(zero=1) == pytest.approx(params * 2)  # ZeRO-1 keeps bf16 gradients (Megatron's, DeepSpeed's)


def test_the_planner_holds_the_same_gradients():
    cfg = PlanConfig(
        shape=SHAPE, gpu=get_accelerator("h100-sxm"), global_batch=64, data_parallel=4, pipeline_parallel=4,
        tensor_parallel=8, micro_batches=(1,), schedules=("1f1b",), zero=(3,), recompute=("full",),
    )  # fmt: skip
    row = make_plan(cfg).candidates[0]
    est = estimate_memory(SHAPE, MemoryConfig(**{**BASE, "recompute": "full"}))
    assert row.memory["gradients"] == pytest.approx(est.stages[row.peak_stage].gradients_bytes)
    assert row.memory["gradients"] == pytest.approx(stage_params(SHAPE, row.peak_stage, 4, 20, 8) * 4)


def test_each_micro_batch_accumulates_the_stage_s_gradients_at_the_streaming_rate(monkeypatch):
    from microbatch.predict import dp_comm
    from microbatch.predict.collectives import fsdp2_accumulate_s

    assert fsdp2_accumulate_s(1e9, 4, 2, 1e12) == pytest.approx(0.010)  # 10 B a parameter: bf16 into fp32

    def row(**kw):
        cfg = PlanConfig(
            shape=SHAPE, gpu=get_accelerator("h100-sxm"), global_batch=64, data_parallel=4, pipeline_parallel=4,
            tensor_parallel=8, micro_batches=(1,), schedules=("1f1b",), zero=(3,), recompute=("full",), **kw,
        )  # fmt: skip
        return make_plan(cfg).candidates[0]

    with_it, each = row(), row(pipeline_grad_reduce="each")
    monkeypatch.setattr(dp_comm, "_accumulate_s", lambda ctx, n: 0.0)
    without, each_without = row(), row(pipeline_grad_reduce="each")
    gpu = get_accelerator("h100-sxm")
    rate = gpu.memory_bandwidth_bytes_per_s * PlanConfig.efficiency.memory
    n = stage_params(
        SHAPE, 0, 4, 20, 8
    )  # the bottleneck: a stage of 20 layers with the embedding or the output
    m = with_it.microbatches  # 64 / (4 · 1) = 16
    added = with_it.time["zero_comm_s"] - without.time["zero_comm_s"]
    assert m == 16 and added == pytest.approx(m * n * (2 * 4 + 2) / rate, rel=1e-6)
    # a shard reduced each micro-batch (Llama 3's FSDP): no whole gradient accumulated, nothing added
    assert each.time["zero_comm_s"] == each_without.time["zero_comm_s"]


def test_nothing_fits_without_sequence_parallelism_and_the_advice_says_it_would():
    from dataclasses import replace

    from microbatch.predict.plan import what_would_fit

    cfg = PlanConfig(
        shape=SHAPE.with_seq(8192), gpu=get_accelerator("a100-80gb"), global_batch=64, data_parallel=8,
        tensor_parallel=8, micro_batches=(8,), zero=(3,), recompute=("full",),
    )  # fmt: skip
    assert make_plan(cfg).recommended is None
    advice = what_would_fit(cfg)
    first = advice.alternatives[0]
    with_sp = make_plan(replace(cfg, sequence_parallel=True)).recommended
    assert first.setting == "sequence_parallel" and first.value == 8 and first.fits and with_sp is not None
    assert first.best.peak_memory_bytes == with_sp.peak_memory_bytes < cfg.memory_budget_bytes
    # with sequence parallelism given, nothing to say of it
    sp = replace(cfg, sequence_parallel=True)
    assert all(a.setting != "sequence_parallel" for a in what_would_fit(sp).alternatives)
