"""``grad_dtype bf16+fp32``: DeepSpeed's ``BF16_Optimizer`` (deepspeed/runtime/bf16_optimizer.py, read 2026-12-07),
which keeps the backward's bf16 gradients beside a whole fp32 buffer, adds each micro-batch's into it, all-reduces
that buffer in fp32 after the backward, and steps with the partition it owns. Checked by hand: the bytes per
parameter, each micro-batch's accumulation, the all-reduce, the step's extra passes, the memory the planner and
``estimate_memory`` hold, the ZeRO stages it runs at, and the DeepSpeed export."""

from __future__ import annotations

import pytest

from microbatch.errors import ConfigError
from microbatch.hardware import get_accelerator
from microbatch.model import get_model
from microbatch.predict import dp_comm
from microbatch.predict.dp_comm import CLIP_PASSES
from microbatch.predict.memory import estimate_memory
from microbatch.predict.memory_config import MemoryConfig
from microbatch.predict.plan import make_plan
from microbatch.predict.plan_config import PlanConfig
from microbatch.predict.state import bf16_fp32_accumulate_bytes, bytes_per_param, reduced_grad_bytes

SHAPE = get_model("llama-2-7b")
A100 = get_accelerator("a100-80gb")


def row(**kw):
    base = dict(shape=SHAPE, gpu=A100, global_batch=64, data_parallel=8, micro_batches=(1,), zero=(1,),
                recompute=("full",))  # fmt: skip
    return make_plan(PlanConfig(**{**base, **kw})).candidates[0]


def test_bytes_per_parameter_and_per_micro_batch_by_hand():
    assert bytes_per_param("bf16-mixed", "bf16+fp32") == (
        2,
        2 + 4,
        4 + 8,
    )  # bf16 and fp32 gradients both kept
    assert bytes_per_param("bf16-mixed", "half")[1] == 2 and bytes_per_param("bf16-mixed", "fp32")[1] == 4
    # zero the bf16 grads (2), AccumulateGrad in place (2 + 2 read, 2 written), .to(fp32) (2 read, 4 written),
    # add_ into the fp32 buffer (4 + 4 read, 4 written)
    assert bf16_fp32_accumulate_bytes("bf16+fp32", 2) == 2 + 6 + 6 + 12 == 26
    assert bf16_fp32_accumulate_bytes("half", 2) == bf16_fp32_accumulate_bytes("fp32", 2) == 0
    assert reduced_grad_bytes("bf16+fp32", 6) == 4 and reduced_grad_bytes("half", 2) == 2


@pytest.mark.parametrize(
    "kw",
    [dict(precision="fp16-mixed"), dict(moments="bf16"), dict(master="remainder"), dict(precision="fp32")],
)
def test_only_what_the_bf16_optimizer_runs(kw):
    args = {"precision": "bf16-mixed", "moments": "fp32", "master": "fp32", **kw}
    with pytest.raises(ConfigError, match="DeepSpeed's bf16 optimizer"):
        bytes_per_param(args["precision"], "bf16+fp32", "adamw", args["moments"], args["master"])


@pytest.mark.parametrize("zero", [0, 2, 3])
def test_zero_stages_other_than_its_own_are_refused_before_planning(zero):
    with pytest.raises(ConfigError, match=f"ZeRO {zero}.*use zero 1") as err:
        row(grad_dtype="bf16+fp32", zero=(zero,))
    assert err.value.params == ("grad_dtype", "zero")
    with pytest.raises(ConfigError, match=f"ZeRO {zero}"):
        MemoryConfig(micro_batch=1, data_parallel=8, zero=zero, grad_dtype="bf16+fp32")
    # one data-parallel rank: ZeRO 0 and 1 hold the same bytes, and the planner searches that
    assert MemoryConfig(micro_batch=1, data_parallel=1, zero=0, grad_dtype="bf16+fp32").zero == 0


def test_the_planner_searches_zero_1_only():
    cfg = PlanConfig(shape=SHAPE, gpu=A100, global_batch=64, data_parallel=8, grad_dtype="bf16+fp32")
    assert {c.zero for c in make_plan(cfg).candidates} == {1}


def test_memory_holds_both_gradients_whole():
    half, both = row(), row(grad_dtype="bf16+fp32")
    n = half.memory["gradients"] / 2  # ZeRO-1 keeps the bf16 gradients whole: 2 B each
    assert both.memory["gradients"] == pytest.approx(n * 6)
    assert both.memory["optimizer"] == half.memory["optimizer"]  # master and moments sharded as ZeRO-1's
    est = estimate_memory(SHAPE, MemoryConfig(micro_batch=1, data_parallel=8, zero=1, grad_dtype="bf16+fp32",
                                              recompute="full", microbatches=8))  # fmt: skip
    assert est.stages[0].gradients_bytes == pytest.approx(n * 6)


def test_each_micro_batch_adds_26_bytes_a_parameter_and_the_fp32_all_reduce_is_exposed(monkeypatch):
    half, half_exposed = row(), row(dp_overlap=False)
    both = row(grad_dtype="bf16+fp32")
    monkeypatch.setattr(dp_comm, "_bf16_fp32_accumulate_s", lambda ctx, n: 0.0)
    no_acc = row(grad_dtype="bf16+fp32")
    n = half.memory["gradients"] / 2
    rate = A100.memory_bandwidth_bytes_per_s * PlanConfig.efficiency.memory
    m = both.microbatches
    assert m == 8
    assert both.time["dp_comm_s"] - no_acc.time["dp_comm_s"] == pytest.approx(m * n * 26 / rate, rel=1e-9)
    # ZeRO-1 exposed: reduce-scatter of 2 B + all-gather of 2 B, each (d−1)/d·2n/bw; the bf16 optimizer's
    # all-reduce of the fp32 buffer is 2·(d−1)/d·4n/bw = 4 of those, never hidden even with dp_overlap on
    assert no_acc.time["dp_comm_s"] == pytest.approx(2.5 * half_exposed.time["dp_comm_s"], rel=1e-9)
    assert (
        half.time["dp_comm_s"] < half_exposed.time["dp_comm_s"]
    )  # half's reduce-scatter hides behind backward
    assert both.time["pipeline_s"] == half.time["pipeline_s"]  # the compute is the same


def test_the_step_reads_and_clears_the_whole_fp32_buffer():
    half, both = row(), row(grad_dtype="bf16+fp32")
    n = half.memory["gradients"] / 2
    rate = A100.memory_bandwidth_bytes_per_s * PlanConfig.efficiency.memory
    # half clips its shard (3 passes of 2 B over n/8); the bf16 optimizer clips every fp32 gradient (3 passes of
    # 4 B over n) and zeroes the buffer (one pass): the optimizer itself reads fp32 either way (unfused torch)
    added = (CLIP_PASSES + 1) * n * 4 / rate - CLIP_PASSES * n / 8 * 2 / rate
    assert both.time["optimizer_s"] - half.time["optimizer_s"] == pytest.approx(added, rel=1e-9)
    noclip = row(grad_dtype="bf16+fp32", grad_clip=False)
    half_noclip = row(grad_clip=False)
    assert noclip.time["optimizer_s"] - half_noclip.time["optimizer_s"] == pytest.approx(
        2 * n * 4 / rate, rel=1e-9
    )


def test_other_frameworks_are_told():
    from microbatch.show.export import export_plan

    plan = make_plan(PlanConfig(shape=get_model("gpt2"), gpu=A100, global_batch=64, data_parallel=2,
                                micro_batches=(2,), grad_dtype="bf16+fp32")).to_dict()  # fmt: skip
    with pytest.raises(ConfigError, match="torchtitan has no DeepSpeed's bf16 optimizer"):
        export_plan(plan, "torchtitan")
    notes = " ".join(export_plan(plan, "lightning").notes)
    assert "grad_dtype bf16+fp32" in notes and "'grad_accum_dtype': 'fp32'" in notes
    one = make_plan(PlanConfig(shape=get_model("gpt2"), gpu=A100, global_batch=64, data_parallel=1,
                               micro_batches=(2,), grad_dtype="bf16+fp32")).to_dict()  # fmt: skip
    assert export_plan(one, "deepspeed").config["zero_optimization"] == {
        "stage": 1
    }  # its engine's stage for it


def test_hybrid_sharding_is_refused():
    """DeepSpeed's bf16 optimizer partitions over every data-parallel rank: a shard degree below d is not it."""
    with pytest.raises(ConfigError, match="not over shard groups") as err:
        row(grad_dtype="bf16+fp32", shard_degree=4)
    assert err.value.params == ("grad_dtype", "shard_degree")
    with pytest.raises(ConfigError, match="not over shard groups"):
        MemoryConfig(micro_batch=1, data_parallel=8, zero=1, shard_degree=4, grad_dtype="bf16+fp32")
