"""Exports of the issue-29 layouts: expert and context parallelism, FP8, per-op and every-K recompute, async TP."""

from __future__ import annotations

import pytest

from microbatch.errors import ConfigError
from microbatch.hardware import get_accelerator
from microbatch.model import get_model
from microbatch.predict.plan import make_plan
from microbatch.predict.plan_config import PlanConfig
from microbatch.show.export import export_plan

H100 = get_accelerator("h100-80gb")


def _plan(**kw):
    base = dict(shape=get_model("mixtral-8x7b"), gpu=H100, global_batch=64, data_parallel=8, pipeline_parallel=4,
                tensor_parallel=2, sequence_parallel=True, micro_batches=(1,), zero=(1,), schedules=("1f1b",))  # fmt: skip
    base.update(kw)
    return make_plan(PlanConfig(**base)).to_dict()


def test_torchtitan_writes_ep_cp_fp8_op_and_async_tp():
    plan = _plan(expert_parallel=8, context_parallel=2, precision="fp8", fp8_recipe="rowwise", recompute=("op",),
                 async_tp=True, data_parallel=4, global_batch=32)  # fmt: skip
    ex = export_plan(plan, "torchtitan")
    par = ex.config["parallelism"]
    assert (par["expert_parallel_degree"], par["context_parallel_degree"]) == (8, 2)
    assert par["enable_async_tensor_parallel"] is True and ex.config["compile"]["enable"] is True
    assert ex.config["model"]["converters"] == ["quantize.linear.float8"]
    assert ex.config["quantize.linear.float8"]["recipe_name"] == "rowwise"
    assert ex.config["activation_checkpoint"] == {"mode": "selective", "selective_ac_option": "op"}
    text = ex.text()
    assert (
        '[quantize.linear.float8]\nrecipe_name = "rowwise"' in text
        and 'converters = ["quantize.linear.float8"]' in text
    )


def test_torchtitan_every_kth_layer_and_plain_full():
    every = export_plan(_plan(recompute=("full",), recompute_every=3), "torchtitan")
    assert every.config["activation_checkpoint"] == {"mode": "selective", "selective_ac_option": "3"}
    full = export_plan(_plan(recompute=("full",)), "torchtitan")
    assert full.config["activation_checkpoint"] == {"mode": "full"}
    assert "expert_parallel_degree" not in full.config["parallelism"]


def test_targets_refuse_what_they_lack():
    with pytest.raises(
        ConfigError, match="torchtitan has no MoE capacity factor \\(its MoE routes dropless\\)"
    ):
        export_plan(_plan(expert_parallel=8, capacity_factor=1.25), "torchtitan")
    with pytest.raises(ConfigError, match="hf has no expert parallelism"):
        export_plan(_plan(expert_parallel=8), "hf")
    with pytest.raises(ConfigError, match="lightning has no expert parallelism"):
        export_plan(_plan(expert_parallel=8), "lightning")
    with pytest.raises(
        ConfigError,
        match=r"deepspeed has no all-gather or ring context parallelism \(its Ulysses lives in Megatron-DeepSpeed",
    ):
        export_plan(_plan(context_parallel=2, data_parallel=4, global_batch=32), "deepspeed")
    with pytest.raises(ConfigError, match="deepspeed has no FP8 tensorwise recipe"):
        export_plan(_plan(precision="fp8"), "deepspeed")
    with pytest.raises(ConfigError, match="lightning has no FP8 rowwise recipe"):
        export_plan(_plan(precision="fp8", fp8_recipe="rowwise", tensor_parallel=1, sequence_parallel=False,
                          pipeline_parallel=1, data_parallel=8, global_batch=8,
                          shape=get_model("llama-3-8b"), schedules=None), "lightning")  # fmt: skip


def test_deepspeed_notes_moe_and_lightning_writes_transformer_engine():
    ex = export_plan(_plan(expert_parallel=8), "deepspeed")
    assert any("deepspeed.moe.layer.MoE(ep_size=8" in n for n in ex.notes)
    gpt2 = dict(shape=get_model("gpt2"), tensor_parallel=1, sequence_parallel=False, pipeline_parallel=1,
                global_batch=8, schedules=None, zero=(0,))  # fmt: skip
    lt = export_plan(_plan(precision="fp8", fp8_recipe="te-delayed", **gpt2), "lightning")
    assert (
        lt.config["trainer"]["precision"] == "transformer-engine"
        and lt.config["trainer"]["strategy"] == "ddp"
    )


def test_targets_refuse_te_recipes_and_per_micro_batch_reduction_they_cannot_run():
    """torchtitan's float8 is torchao's: Transformer Engine's recipes are not in its configuration; Lightning's TE
    plugin runs delayed scaling, not current; torch's pipelining reduces FSDP's gradients once, so a plan with
    pipeline_grad_reduce "each" (ZeRO-2 memory under a pipeline) does not export to torchtitan as if it could."""
    llama = dict(shape=get_model("llama-3-8b"), tensor_parallel=1, sequence_parallel=False, pipeline_parallel=1,
                 data_parallel=8, global_batch=8, schedules=None)  # fmt: skip
    with pytest.raises(ConfigError, match="torchtitan has no FP8 te-delayed recipe"):
        export_plan(_plan(precision="fp8", fp8_recipe="te-delayed", **llama), "torchtitan")
    gpt2 = {**llama, "shape": get_model("gpt2"), "zero": (0,)}
    with pytest.raises(ConfigError, match="lightning has no FP8 te-current recipe"):
        export_plan(_plan(precision="fp8", fp8_recipe="te-current", **gpt2), "lightning")
    lt = export_plan(_plan(precision="fp8", fp8_recipe="te-delayed", **gpt2), "lightning")
    assert lt.config["trainer"]["precision"] == "transformer-engine"
    each = dict(shape=get_model("llama-3-8b"), tensor_parallel=1, sequence_parallel=False, zero=(2,),
                pipeline_grad_reduce="each")  # fmt: skip
    with pytest.raises(
        ConfigError, match="torchtitan has no gradient reduce-scatters after each micro-batch"
    ):
        export_plan(_plan(**each), "torchtitan")
    assert export_plan(
        _plan(**{**each, "pipeline_grad_reduce": "last"}), "torchtitan"
    ).config  # the same, once


def test_torchtitan_names_the_receive_buffers_torch_keeps_per_micro_batch():
    """torch.distributed.pipelining allocates one receive buffer per micro-batch for every stage fed by another and
    holds them through the step (measured by `microbatch pipeline`, to the byte); the plan prices Megatron's, which
    frees each input after its backward: the export says how much more, b_m·s·h·e/t each (SP shards them)."""
    plan = _plan(global_batch=128, expert_parallel=8)  # m = 128 / 8 = 16; s 4096, h 4096, bf16, t 2 with SP
    notes = [n for n in export_plan(plan, "torchtitan").notes if "receive buffer" in n]
    each = 1 * 4096 * 4096 * 2 / 2
    assert len(notes) == 1 and f"16 × {each / 2**20:,.1f} MiB" in notes[0]
    assert f"{16 * each / 2**30:,.2f} GiB on each rank but the first" in notes[0]
    unpiped = _plan(pipeline_parallel=1, expert_parallel=8, tensor_parallel=4)
    assert not [n for n in export_plan(unpiped, "torchtitan").notes if "receive buffer" in n]
