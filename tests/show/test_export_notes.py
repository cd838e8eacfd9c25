"""What an export's target runs otherwise than the plan priced, found against the real libraries' code (torchtitan
0.2.1/0.2.2, lightning 2.6.6, deepspeed master): refused with the rule, or said in a note with the code that matches
the plan; the tests need none of them installed."""

from __future__ import annotations

from dataclasses import replace

import pytest

from microbatch.errors import ConfigError
from microbatch.hardware import get_accelerator
from microbatch.model import get_model
from microbatch.predict.gemm import COMPILED_NORM_MEMORY, DEFAULT_EFFICIENCY
from microbatch.predict.plan import PlanConfig, make_plan
from microbatch.show.export import export_plan

H100 = get_accelerator("h100-sxm")


def _plan(**kw):
    base = dict(shape=get_model("gpt2"), gpu=H100, global_batch=64, data_parallel=8, micro_batches=(2,))
    base.update(kw)
    plan = make_plan(PlanConfig(**base)).to_dict()
    assert plan["recommended"] is not None
    return plan


def test_torchtitan_refuses_dualpipev_with_experts_and_recompute():
    """torchtitan 0.2.1+ ``distributed/dual_pipe_v.py`` get_dual_pipe_v_flag raises NotImplementedError for DualPipeV
    with expert parallelism and activation checkpointing while the EP overlap (default on) is set."""
    moe = dict(
        shape=get_model("mixtral-8x7b"), global_batch=64, data_parallel=8, pipeline_parallel=4, expert_parallel=8,
        micro_batches=(1,), zero=(3,), schedules=("dualpipev",),
    )  # fmt: skip
    with pytest.raises(
        ConfigError, match="DualPipeV with expert parallelism and activation checkpointing"
    ) as err:
        export_plan(_plan(**moe, recompute=("full",)), "torchtitan")
    assert err.value.params == ("recompute", "schedule")
    ok = export_plan(_plan(**moe, recompute=("none",)), "torchtitan")  # no checkpointing: runs as planned
    assert ok.config["parallelism"]["pipeline_parallel_schedule"] == "DualPipeV"


def test_lightning_notes_fsdp_wrapping_fp8_masters_and_fp32_gradients():
    """lightning 2.6.6: the registered "fsdp" strategy has no auto_wrap_policy (one unit at the root); the
    "transformer-engine" precision casts the weights to bf16; DeepSpeed/FSDP strategies reduce in the model's dtype."""
    fsdp = export_plan(_plan(zero=(3,)), "lightning")
    assert fsdp.config["trainer"]["strategy"] == "fsdp"
    assert any("auto_wrap_policy" in n for n in fsdp.notes)
    ddp = export_plan(_plan(zero=(0,)), "lightning")
    assert not any("auto_wrap_policy" in n for n in ddp.notes)
    fp8 = export_plan(_plan(zero=(0,), precision="fp8", fp8_recipe="te-delayed"), "lightning")
    assert fp8.config["trainer"]["precision"] == "transformer-engine"
    assert any("no fp32 master copy" in n for n in fp8.notes)
    assert not any("master copy" in n for n in ddp.notes)
    fp32 = export_plan(_plan(zero=(1,), grad_dtype="fp32"), "lightning")
    assert any("grad_accum_dtype" in n for n in fp32.notes)
    assert not any("grad_accum_dtype" in n for n in export_plan(_plan(zero=(1,)), "lightning").notes)


def test_a_compiled_plan_turns_compile_on_where_the_config_can():
    compiled = replace(DEFAULT_EFFICIENCY, fused_elementwise=True, fused_norm_memory=COMPILED_NORM_MEMORY)
    plan = _plan(zero=(3,), efficiency=compiled)
    assert plan["elementwise"] == "compiled" and _plan(zero=(3,))["elementwise"] == "eager"
    assert export_plan(plan, "torchtitan").config["compile"]["enable"] is True
    assert "compile" not in export_plan(_plan(zero=(3,)), "torchtitan").config
    hf = export_plan(_plan(zero=(0,), efficiency=compiled), "hf")
    assert hf.config["torch_compile"] is True and not any("elementwise" in n for n in hf.notes)
    ds = export_plan(plan, "deepspeed")
    assert any("torch.compile the model" in n for n in ds.notes)
    fused = _plan(zero=(0,), efficiency=replace(DEFAULT_EFFICIENCY, fused_elementwise=True))
    assert fused["elementwise"] == "fused"
    assert any("hand-written fused" in n for n in export_plan(fused, "hf").notes)


def test_deepspeed_names_its_partition_and_the_overlaps_it_lacks():
    """deepspeed ``runtime/pipe/module.py``: partition_method defaults to 'parameters' (balanced parameters, not
    blocks); no config key overlaps TP collectives or the expert all-to-all."""
    plan = _plan(shape=get_model("llama-2-7b"), data_parallel=2, pipeline_parallel=4, zero=(1,),
                 layers_per_stage=(7, 9, 9, 7))  # fmt: skip
    ex = export_plan(plan, "deepspeed")
    assert any("partition_method='type:<YourBlock>'" in n for n in ex.notes)
    assert any("[7, 9, 9, 7]" in n and "_partition_layers" in n for n in ex.notes)
    tp = _plan(shape=get_model("llama-2-7b"), data_parallel=2, tensor_parallel=4, sequence_parallel=True,
               async_tp=True, zero=(1,))  # fmt: skip
    assert any("async TP" in n and "run exposed" in n for n in export_plan(tp, "deepspeed").notes)
