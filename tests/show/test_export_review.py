"""Exports checked against the real libraries (deepspeed 0.19.8, transformers 5.22/5.25, lightning 2.6.6,
torchtitan 0.2.2): what each would refuse is refused here with the fix, and what is written is what the plan timed.
The rules come from those libraries' code, named in each test; the tests need none of them installed."""

from __future__ import annotations

import json
import re
import tomllib
from dataclasses import replace

import pytest
from _helpers import plan_json

from microbatch.cli import main
from microbatch.errors import ConfigError
from microbatch.hardware import get_accelerator
from microbatch.model import get_model
from microbatch.predict.plan import PlanConfig, make_plan
from microbatch.show.export import export_plan

A100 = get_accelerator("a100-80gb")


def _plan(shape=None, **kw):
    base = dict(
        shape=shape or get_model("gpt2"), gpu=A100, global_batch=64, data_parallel=2, micro_batches=(2,)
    )
    base.update(kw)
    plan = make_plan(PlanConfig(**base)).to_dict()
    assert plan["recommended"] is not None
    return plan


def _mixtral(**kw):
    base = dict(shape=get_model("mixtral-8x7b"), gpu=get_accelerator("h100-80gb"), global_batch=64, data_parallel=8,
                tensor_parallel=2, sequence_parallel=True, expert_parallel=8, micro_batches=(1,), zero=(3,))  # fmt: skip
    base.update(kw)
    return _plan(**base)


# -- torchtitan -----------------------------------------------------------------------------------
def test_torchtitan_selective_is_no_checkpointing_under_flash_and_refused_without():
    """The planner's selective recomputes the attention core only; torchtitan's mode "selective" without an option
    is option "2" (every second block in full): under flash attention nothing is to recompute (mode "none")."""
    plan = _plan(recompute=("selective",))
    assert plan["recommended"]["recompute"] == "selective" and plan["model_shape"]["flash_attention"] is True
    ex = export_plan(plan, "torchtitan")
    assert ex.config["activation_checkpoint"] == {"mode": "none"}
    assert any('mode = "none"' in n and "attention core" in n for n in ex.notes)
    no_flash = _plan(replace(get_model("gpt2"), flash_attention=False), recompute=("selective",))
    with pytest.raises(ConfigError, match=r"without flash attention.*plan again with recompute op") as err:
        export_plan(no_flash, "torchtitan")
    assert err.value.params == ("recompute",)
    plan["flash_attention"] = False  # a plan that records the flag it was made with
    with pytest.raises(ConfigError, match="recompute selective"):
        export_plan(plan, "torchtitan")
    flagged = _plan(recompute=("selective",), flash_attention=False)  # plan --no-flash-attention
    assert flagged["flash_attention"] is False
    with pytest.raises(ConfigError, match="recompute selective"):
        export_plan(flagged, "torchtitan")


def test_torchtitan_refuses_ddp_beside_tensor_or_pipeline_parallelism(tmp_path, capsys):
    """torchtitan's parallelize: "DDP has not supported > 1D parallelism" when dp_replicate < world."""
    for kw in (dict(tensor_parallel=2), dict(pipeline_parallel=2)):
        with pytest.raises(
            ConfigError, match=r"DDP has not supported > 1D parallelism.*plan again with zero 3"
        ):
            export_plan(_plan(zero=(0,), **kw), "torchtitan")
        par = export_plan(_plan(zero=(3,), **kw), "torchtitan").config["parallelism"]
        assert (par["data_parallel_shard_degree"], par["data_parallel_replicate_degree"]) == (2, 1)
        # ZeRO >= 1 sharded over groups of one (HSDP with shard degree 1) is DDP there too (review, 2026-12-05)
        with pytest.raises(ConfigError, match=r"ZeRO 1 with shard degree 1 over d = 2 ranks as DDP"):
            export_plan(_plan(zero=(1,), shard_degree=1, **kw), "torchtitan")
    par = export_plan(_plan(zero=(0,)), "torchtitan").config["parallelism"]  # plain DDP is fine
    assert (par["data_parallel_replicate_degree"], par["data_parallel_shard_degree"]) == (2, 1)
    f = tmp_path / "p.json"
    f.write_text(json.dumps(_plan(zero=(0,), tensor_parallel=2)))
    assert main(["export", "--plan", str(f), "--format", "torchtitan"]) == 2
    assert "plan again with --zero 3" in capsys.readouterr().err


def test_torchtitan_refuses_zb_h1_with_one_stage_per_rank():
    """zb-h1 runs as torch's InterleavedZeroBubble, a multi-stage class: torchtitan refuses 1 stage per rank."""
    plan = _plan(pipeline_parallel=4, schedules=("zb-h1",), zero=(1,), global_batch=128)
    assert plan["recommended"]["schedule"] == "zb-h1" and plan["recommended"]["virtual"] == 1
    with pytest.raises(ConfigError, match=r"InterleavedZeroBubble.*at least 2 stages per rank") as err:
        export_plan(plan, "torchtitan")
    fix = str(err.value).split("plan again with schedules ")[1]
    assert fix.split(", ") == ["gpipe", "1f1b", "interleaved-1f1b with virtual 2 or more", "dualpipev"]
    assert err.value.params == ("virtual", "schedules")  # the command line writes both as the plan's flags
    from microbatch.commands._flags import cli_message

    assert "plan again with --schedule gpipe, 1f1b, interleaved-1f1b with --virtual 2" in cli_message(
        err.value, "export"
    )
    inter = _plan(
        pipeline_parallel=2, schedules=("interleaved-1f1b",), virtuals=(2,), zero=(1,), global_batch=128
    )
    par = export_plan(inter, "torchtitan").config["parallelism"]
    assert (
        par["pipeline_parallel_schedule"] == "Interleaved1F1B"
        and par["pipeline_parallel_layers_per_stage"] == 3
    )


def test_torchtitan_writes_fp32_and_refuses_fp16():
    """torchtitan 0.2's training.mixed_precision_param defaults to bfloat16 and takes bfloat16 or float32 only."""
    fp32 = export_plan(_plan(precision="fp32", zero=(3,)), "torchtitan").config["training"]
    assert fp32["mixed_precision_param"] == "float32"
    assert "mixed_precision_param" not in export_plan(_plan(zero=(3,)), "torchtitan").config["training"]
    with pytest.raises(ConfigError, match=r"no fp16-mixed.*plan again with precision bf16-mixed") as err:
        export_plan(_plan(precision="fp16-mixed"), "torchtitan")
    assert err.value.params == ("precision",)
    # torchtitan's maybe_enable_amp: no autocast with TP or PP unless FSDP/HSDP/CP shards (here d = 1)
    alone = export_plan(_plan(data_parallel=1, pipeline_parallel=2, schedules=("1f1b",)), "torchtitan")
    assert any("trains in float32" in n for n in alone.notes)
    assert not any("trains in float32" in n for n in export_plan(_plan(zero=(3,)), "torchtitan").notes)


def test_torchtitan_expert_tensor_parallel_is_t_and_ep_needs_sharded_ranks():
    """The planner splits each expert's F over the t ranks: torchtitan's expert_tensor_parallel_degree = t
    (0.2 takes etp = tp or 1); EP comes out of the FSDP-sharded ranks, so ZeRO 0 (no FSDP) cannot hold it."""
    par = export_plan(_mixtral(), "torchtitan").config["parallelism"]
    degrees = (
        par["expert_parallel_degree"],
        par["expert_tensor_parallel_degree"],
        par["tensor_parallel_degree"],
    )
    assert degrees == (8, 2, 2)
    flat = _mixtral(tensor_parallel=1, sequence_parallel=False, pipeline_parallel=4, schedules=("1f1b",))
    flat = export_plan(flat, "torchtitan")
    assert "expert_tensor_parallel_degree" not in flat.config["parallelism"]
    no_fsdp = _mixtral()
    no_fsdp["recommended"].update(zero=0, tensor_parallel=1)  # DDP over d = 8: no sharded ranks for EP
    with pytest.raises(ConfigError, match="expert_parallel 8 does not divide") as err:
        export_plan(no_fsdp, "torchtitan")
    assert err.value.params == ("zero", "expert_parallel")


def test_torchtitan_says_which_releases_read_it(tmp_path, capsys):
    """torchtitan 0.3 reads no TOML, 0.1 spells FP8 and the stages' keys otherwise: the file's first comment and a note
    say it is for 0.2.0–0.2.2."""
    ex = export_plan(_plan(), "torchtitan")
    first = ex.text().splitlines()[0]
    assert first.startswith("#") and "torchtitan 0.2.x (0.2.0–0.2.2, TOML job config)" in first
    assert any("torchtitan 0.2.x (0.2.0–0.2.2, TOML job config)" in n for n in ex.notes)
    assert tomllib.loads(ex.text()) == ex.config
    f, out = tmp_path / "p.json", tmp_path / "t.toml"
    f.write_text(json.dumps(_plan()))
    assert main(["export", "--plan", str(f), "--format", "torchtitan", "-o", str(out)]) == 0
    lines = out.read_text().splitlines()
    assert lines[0].startswith("# written by microbatch export") and "0.2.0–0.2.2" in lines[1]
    assert "0.2.0–0.2.2" in capsys.readouterr().err


# -- Lightning --------------------------------------------------------------------------------------
def test_lightning_precision_in_lightnings_words():
    """Lightning 2.6 takes 16-mixed and 32-true; "fp16-mixed" and "fp32" are ValueErrors there."""
    want = {"bf16-mixed": "bf16-mixed", "fp16-mixed": "16-mixed", "fp32": "32-true"}
    for prec, word in want.items():
        assert (
            export_plan(_plan(precision=prec, zero=(0,)), "lightning").config["trainer"]["precision"] == word
        )
    lightning = pytest.importorskip("lightning")
    kw = dict(export_plan(_plan(precision="fp32", zero=(0,)), "lightning").config["trainer"], devices=2)
    trainer = lightning.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, **kw)
    assert type(trainer.precision_plugin).__name__ == "Precision" and trainer.accumulate_grad_batches == 16


def test_lightning_refuses_fp8_under_fsdp_or_deepspeed_and_tensor_parallelism():
    """Lightning's FSDPPrecision and DeepSpeedPrecision refuse 'transformer-engine'; its Trainer has no TP keyword
    (devices = d·t would run DDP over d·t replicas: a t× global batch)."""
    fp8 = dict(gpu=get_accelerator("h100-80gb"), precision="fp8", fp8_recipe="te-delayed")
    for zero, strategy in ((1, "deepspeed_stage_1"), (3, "fsdp")):
        with pytest.raises(
            ConfigError, match=rf"its {strategy} strategy, for ZeRO {zero}, refuses it"
        ) as err:
            export_plan(_plan(zero=(zero,), **fp8), "lightning")
        assert err.value.params == ("zero",)
    ddp = export_plan(_plan(zero=(0,), **fp8), "lightning").config["trainer"]
    assert (ddp["precision"], ddp["strategy"]) == ("transformer-engine", "ddp")
    with pytest.raises(ConfigError, match=r"global batch would be 2 × 16 × 4 = 128, not 64") as err:
        export_plan(_plan(tensor_parallel=2, zero=(0,)), "lightning")
    assert "ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2)" in str(err.value)
    assert err.value.params == ("tensor_parallel",)


# -- Hugging Face ------------------------------------------------------------------------------------
def test_hf_writes_gradient_checkpointing_that_every_version_reads(tmp_path):
    """activation_checkpointing is a TrainingArguments field only from transformers 5.23 (5.22 and 4.x: a
    TypeError); gradient_checkpointing is read by 4.x to 5.25."""
    ex = export_plan(_plan(recompute=("full",), recompute_every=3), "hf")
    assert ex.config["gradient_checkpointing"] is True and "activation_checkpointing" not in ex.config
    assert any('activation_checkpointing_kwargs={"every_n_layers": 3}' in n for n in ex.notes)
    assert (
        "gradient_checkpointing" not in export_plan(_plan(recompute=("none",)), "hf").config
    )  # off: the default
    transformers = pytest.importorskip("transformers")
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to="none", **ex.config
    )
    assert args.gradient_checkpointing is True and args.gradient_accumulation_steps == 16


# -- DeepSpeed ---------------------------------------------------------------------------------------
def test_deepspeed_moe_note_overrides_its_dropping_defaults():
    """deepspeed.moe.layer.MoE defaults to capacity_factor=1.0, drop_tokens=True, no expert TP."""
    dropless = " ".join(export_plan(_mixtral(zero=(1,)), "deepspeed").notes)
    assert "MoE(ep_size=8, drop_tokens=False, enable_expert_tensor_parallelism=True, ...)" in dropless
    capped = " ".join(export_plan(_mixtral(zero=(1,), capacity_factor=1.25, tensor_parallel=1,
                                           sequence_parallel=False, pipeline_parallel=4), "deepspeed").notes)  # fmt: skip
    assert "MoE(ep_size=8, capacity_factor=1.25, ...)" in capped and "drop_tokens=False" not in capped


def test_deepspeed_accumulates_in_fp32_when_the_plan_does_and_asks_for_mpu_with_tp():
    """The plan's grad_dtype fp32 (18 B/param) is DeepSpeed's data_types.grad_accum_dtype; DeepSpeed's engine
    refuses it for a bf16 model without ZeRO ("unsupported mix"); with t > 1 and no pipeline its batch check
    counts all d·t ranks unless mpu= is given."""
    cfg = export_plan(_plan(grad_dtype="fp32", zero=(2,)), "deepspeed").config
    assert cfg["data_types"] == {"grad_accum_dtype": "fp32"} and cfg["bf16"] == {"enabled": True}
    # bf16 accumulating in fp32 at ZeRO 1 is DeepSpeed's bf16 optimizer: bf16 gradients beside the fp32 ones
    both = export_plan(_plan(grad_dtype="bf16+fp32", zero=(1,)), "deepspeed").config
    assert both["data_types"] == {"grad_accum_dtype": "fp32"} and both["zero_optimization"] == {"stage": 1}
    with pytest.raises(
        ConfigError, match=r"bf16 optimizer.*20 B/param, the plan priced 18.*grad_dtype bf16\+fp32"
    ):
        export_plan(_plan(grad_dtype="fp32", zero=(1,)), "deepspeed")
    assert "data_types" not in export_plan(_plan(zero=(1,)), "deepspeed").config  # half: the model's dtype
    with pytest.raises(ConfigError, match=r"only under ZeRO 1, 2 or 3.*plan again with zero 1") as err:
        export_plan(_plan(grad_dtype="fp32", zero=(0,)), "deepspeed")
    assert err.value.params == ("zero", "grad_dtype")
    full = export_plan(_plan(grad_dtype="fp32", precision="fp32", zero=(0,)), "deepspeed").config
    assert full["data_types"] == {"grad_accum_dtype": "fp32"} and "bf16" not in full
    notes = export_plan(_plan(tensor_parallel=2, zero=(1,)), "deepspeed").notes
    assert any("pass mpu=" in n and "train_batch_size 64 != 2 × 16 × 4" in n for n in notes)
    assert not any("mpu=" in n for n in export_plan(_plan(zero=(1,)), "deepspeed").notes)


# -- minor -------------------------------------------------------------------------------------------
def test_export_gpu_takes_the_aliases_plan_takes(tmp_path, capsys):
    cmp = plan_json(["plan", "--model", "gpt2", "--gpu", "a100-80gb,h100-80gb", "-B", "64", "--json"], capsys)
    assert [p["gpu"]["name"] for p in cmp["plans"]] == ["a100-80gb", "h100-sxm"]
    f = tmp_path / "cmp.json"
    f.write_text(json.dumps(cmp))
    for name in ("h100-80gb", "H100_80GB", "h100-sxm"):
        assert main(["export", "--plan", str(f), "--format", "deepspeed", "--gpu", name]) == 0
        h100 = [p for p in cmp["plans"] if p["gpu"]["name"] == "h100-sxm"][0]["recommended"]
        assert json.loads(capsys.readouterr().out)["train_micro_batch_size_per_gpu"] == h100["micro_batch"]
    assert export_plan(cmp["plans"][1], "hf", gpu="h100").config["per_device_train_batch_size"] >= 1
    with pytest.raises(ConfigError, match="has no plan for gpu 'l4'"):
        export_plan(cmp, "hf", gpu="l4")


def test_capacity_factor_refusal_names_a_format_that_has_it():
    plan = _mixtral(capacity_factor=1.25, zero=(1,))
    with pytest.raises(ConfigError) as err:
        export_plan(plan, "torchtitan")
    msg = str(err.value)
    assert re.search(r"^torchtitan has no MoE capacity factor \(its MoE routes dropless\); export this plan to "
                     r"deepspeed, or plan again without it$", msg)  # fmt: skip
    with pytest.raises(ConfigError, match="hf has no MoE capacity factor and no expert parallelism; export this "
                                          "plan to deepspeed,"):  # fmt: skip
        export_plan(plan, "hf")
