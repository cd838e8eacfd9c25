"""Exports a review checked against the consumers' own source (2026-12-07, evening): DeepSpeed 0.19's engine and
Lightning 2.6's Transformer Engine plugin run something else than these plans priced, so the export refuses or says."""

from __future__ import annotations

import pytest

from microbatch.errors import ConfigError
from microbatch.hardware import get_accelerator
from microbatch.model import get_model
from microbatch.predict.plan import make_plan
from microbatch.predict.plan_config import PlanConfig
from microbatch.show.export import export_plan


def _plan(**kw):
    base = dict(shape=get_model("llama-2-7b"), gpu=get_accelerator("h100-80gb"), global_batch=64, data_parallel=2,
                pipeline_parallel=4, micro_batches=(1,), zero=(0,))  # fmt: skip
    return make_plan(PlanConfig(**{**base, **kw})).to_dict()


def test_deepspeed_refuses_a_bf16_pipeline_at_zero_0():
    """engine.py _do_optimizer_sanity_check: bf16 model, bf16 accumulation, pipeline → BFLOAT16 (its bf16
    optimizer, sharding master and moments over d), whatever stage 0 says."""
    with pytest.raises(ConfigError, match="bf16 optimizer even at ZeRO stage 0") as err:
        export_plan(_plan(), "deepspeed")
    assert set(err.value.params) == {"zero", "grad_dtype"}
    ok = export_plan(_plan(zero=(1,)), "deepspeed").config  # its ZeRO-1 optimizer: what the plan priced
    assert ok["zero_optimization"]["stage"] == 1 and "data_types" not in ok
    fused = export_plan(_plan(zero=(1,), grad_dtype="bf16+fp32"), "deepspeed").config
    assert fused["data_types"] == {"grad_accum_dtype": "fp32"}
    fp16 = export_plan(
        _plan(precision="fp16-mixed"), "deepspeed"
    ).config  # fp16 at stage 0: its FP16 optimizer
    assert fp16["zero_optimization"]["stage"] == 0 and fp16["fp16"] == {"enabled": True}


def test_deepspeed_says_which_release_runs_bf16_without_zero():
    one = export_plan(_plan(shape=get_model("gpt2"), pipeline_parallel=1, data_parallel=1), "deepspeed")
    assert one.config["zero_optimization"]["stage"] == 0
    assert any("0.17.6 or later" in n for n in one.notes)
    zero1 = export_plan(
        _plan(shape=get_model("gpt2"), pipeline_parallel=1, data_parallel=1, zero=(1,)), "deepspeed"
    )
    assert not any("0.17.6" in n for n in zero1.notes)


def test_lightning_takes_only_the_recipe_its_plugin_runs():
    """lightning/fabric/plugins/precision/transformer_engine.py: recipe = DelayedScaling() when none is given."""
    gpt2 = dict(shape=get_model("gpt2"), pipeline_parallel=1, data_parallel=4, precision="fp8")
    with pytest.raises(
        ConfigError, match=r"no FP8 tensorwise recipe .*runs delayed scaling: fp8_recipe te-delayed"
    ):
        export_plan(_plan(**gpt2), "lightning")
    te = export_plan(_plan(fp8_recipe="te-delayed", **gpt2), "lightning").config["trainer"]
    assert te["precision"] == "transformer-engine"
