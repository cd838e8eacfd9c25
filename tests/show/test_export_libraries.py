"""Exports checked against the libraries' own sources (a read-only review, 2026-12-06): what each would refuse or
run otherwise than the plan is refused or said, not written."""

from __future__ import annotations

import warnings

import pytest

from microbatch.errors import ConfigError
from microbatch.hardware import get_accelerator
from microbatch.model import get_model
from microbatch.predict.plan import make_plan
from microbatch.predict.plan_config import PlanConfig
from microbatch.show.export import export_plan

H100 = get_accelerator("h100-80gb")


def _plan(model="gpt2", **kw):
    base = dict(shape=get_model(model), gpu=H100, global_batch=64, data_parallel=2, micro_batches=(2,))
    base.update(kw)
    plan = make_plan(PlanConfig(**base)).to_dict()
    assert plan["recommended"] is not None
    return plan


def test_deepspeed_refuses_its_moe_layers_under_zero_3():
    """deepspeed/runtime/engine.py: "Native DeepSpeed MoE is not supported with ZeRO Stage 3" (v0.16–0.18: an
    assert "MoE not supported with Stage 3")."""
    moe = dict(model="mixtral-8x7b", global_batch=64, data_parallel=8, tensor_parallel=2, sequence_parallel=True,
               expert_parallel=8, micro_batches=(1,))  # fmt: skip
    with pytest.raises(ConfigError, match=r"refuse ZeRO stage 3 .* plan again with zero 1 or 2"):
        export_plan(_plan(**moe, zero=(3,)), "deepspeed")
    assert export_plan(_plan(**moe, zero=(1,)), "deepspeed").config["zero_optimization"]["stage"] == 1


def test_deepspeed_pipeline_with_tensor_parallelism_names_the_topology():
    """PipelineModule(num_stages=p) alone takes dp = world / p, counting the t ranks as data-parallel, and the
    engine's batch check then fails (deepspeed/runtime/pipe/module.py, pipe/engine.py)."""
    notes = " ".join(export_plan(_plan(pipeline_parallel=2, tensor_parallel=2, zero=(1,)), "deepspeed").notes)
    assert "topology=PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2)" in notes
    assert "PipelineModule(num_stages=2, partition_method=" in " ".join(
        export_plan(_plan(pipeline_parallel=2, zero=(1,)), "deepspeed").notes
    )


def test_hf_refuses_tensor_parallelism_and_writes_no_deprecated_flag_it_does_not_need(tmp_path):
    with pytest.raises(
        ConfigError, match=r"no tensor parallelism .* export this plan to DeepSpeed or torchtitan"
    ):
        export_plan(_plan(tensor_parallel=2, zero=(1,)), "hf")
    cfg = export_plan(_plan(recompute=("none",)), "hf").config
    assert "gradient_checkpointing" not in cfg
    transformers = pytest.importorskip("transformers")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # transformers >= 5.23 warns on gradient_checkpointing
        transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", **cfg)


def test_lightning_fsdp_gets_no_norm_clip_it_would_refuse_and_says_how_to_clip():
    """Lightning's FSDPPrecision raises on gradient_clip_algorithm='norm' at the first optimizer step."""
    ex = export_plan(_plan(zero=(3,)), "lightning")
    trainer = ex.config["trainer"]
    assert trainer["strategy"] == "fsdp" and "gradient_clip_val" not in trainer
    assert "gradient_clip_algorithm" not in trainer
    assert any("self.trainer.model.clip_grad_norm_(1.0)" in n for n in ex.notes)
    z2 = export_plan(_plan(zero=(2,)), "lightning").config["trainer"]  # DeepSpeed clips: kept
    assert z2["gradient_clip_val"] == 1.0 and z2["strategy"] == "deepspeed_stage_2"


@pytest.mark.parametrize("seq,t", [(1023, 1), (1022, 2)])
def test_torchtitan_refuses_a_sequence_its_parallel_dims_do_not_divide(seq, t):
    """torchtitan asserts seq_len % (t · 2c) == 0 (parallel_dims.seq_len_divisor), even at c = 1."""
    plan = _plan(seq=seq, tensor_parallel=t, zero=(3,))
    with pytest.raises(ConfigError, match=rf"divisible by 2·t·c = {2 * t} .* and {seq} is not"):
        export_plan(plan, "torchtitan")
    assert (
        export_plan(_plan(seq=1024, tensor_parallel=t, zero=(3,)), "torchtitan").config["training"]["seq_len"]
        == 1024
    )


def test_torchtitan_notes_sharding_over_context_ranks_and_exposed_expert_exchange():
    ex = export_plan(_plan(seq=1024, context_parallel=2, zero=(0,)), "torchtitan")
    assert any("shards the weights over the context-parallel ranks" in n for n in ex.notes)
    moe = _plan(model="deepseek-v3", global_batch=1024, data_parallel=64, pipeline_parallel=16, expert_parallel=64,
                micro_batches=(1,), zero=(1,), ep_overlap=True, schedules=("1f1b",))  # fmt: skip
    notes = export_plan(moe, "torchtitan").notes
    assert any("only under DualPipeV" in n for n in notes)
