"""Exports: each format keeps B_global = b_m × g × d and loads in the real library where installed."""

from __future__ import annotations

import json

import pytest

from microbatch.cli import main
from microbatch.errors import ConfigError
from microbatch.hardware import get_accelerator
from microbatch.model import get_model
from microbatch.predict.plan import PlanConfig, make_plan
from microbatch.show.export import export_plan

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11


@pytest.fixture(scope="module")
def pipe_plan():
    # p = 4, d = 2, B = 128: per replica 64
    cfg = PlanConfig(shape=get_model("gpt2"), gpu=get_accelerator("a100-80gb"), global_batch=128, data_parallel=2,
                     pipeline_parallel=4, schedules=("1f1b",), micro_batches=(2,), zero=(1,))  # fmt: skip
    return make_plan(cfg)


@pytest.fixture(scope="module")
def flat_plan():
    cfg = PlanConfig(shape=get_model("gpt2"), gpu=get_accelerator("a100-80gb"), global_batch=64,
                     micro_batches=(4,), recompute=("full",))  # fmt: skip
    return make_plan(cfg)


def test_deepspeed_gradient_accumulation_is_m(pipe_plan):
    ex = export_plan(pipe_plan.to_dict(), "deepspeed")
    c = ex.config
    assert (c["train_batch_size"], c["train_micro_batch_size_per_gpu"], c["gradient_accumulation_steps"]) == (
        128,
        2,
        32,
    )
    assert c["train_batch_size"] == c["train_micro_batch_size_per_gpu"] * c["gradient_accumulation_steps"] * 2
    assert c["zero_optimization"]["stage"] == 1 and c["bf16"]["enabled"] is True
    assert any("m = 32" in n for n in ex.notes)
    assert json.loads(ex.text()) == c


def test_hf_training_arguments_built_for_real(flat_plan, tmp_path):
    transformers = pytest.importorskip("transformers")
    ex = export_plan(flat_plan, "hf")  # a Plan object works too
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to="none", **ex.config
    )
    assert args.per_device_train_batch_size == 4
    assert args.gradient_accumulation_steps == 16
    key = next(k for k in ex.config if k.endswith("_checkpointing"))
    assert getattr(args, key) is True and args.bf16 is True


def test_lightning_trainer_built_for_real(flat_plan):
    lightning = pytest.importorskip("lightning")
    ex = export_plan(flat_plan.recommended, "lightning")  # a Candidate works too
    trainer = lightning.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False, **ex.config["trainer"])  # fmt: skip
    assert trainer.accumulate_grad_batches == 16
    assert ex.config["dataloader"]["batch_size"] == 4


def test_torchtitan_toml(pipe_plan):
    ex = export_plan(pipe_plan.to_dict(), "torchtitan")
    cfg = tomllib.loads(ex.text())
    tr, par = cfg["training"], cfg["parallelism"]
    # torchtitan splits local_batch_size into micro-batches of pipeline_parallel_microbatch_size
    assert tr["local_batch_size"] // par["pipeline_parallel_microbatch_size"] == 32
    assert par["pipeline_parallel_microbatch_size"] == 2 and par["pipeline_parallel_schedule"] == "1F1B"
    assert tr["global_batch_size"] == 128
    assert (
        tr["local_batch_size"] * par["data_parallel_shard_degree"] * par["data_parallel_replicate_degree"]
        == 128
    )
    assert cfg["activation_checkpoint"]["mode"] == pipe_plan.recommended.recompute


def test_torchtitan_without_pipeline_accumulates(flat_plan):
    cfg = tomllib.loads(export_plan(flat_plan.to_dict(), "torchtitan").text())
    # torchtitan's accumulation steps = global / (local × dp) = g
    assert cfg["training"]["global_batch_size"] // cfg["training"]["local_batch_size"] == 16
    assert "pipeline_parallel_schedule" not in cfg["parallelism"]


def test_refuses_a_changed_global_batch(pipe_plan):
    d = pipe_plan.to_dict()
    d["recommended"]["grad_accum"] = 16
    with pytest.raises(ConfigError, match=r"2 × 16 × 2 = 64 != 128"):
        export_plan(d, "hf")
    with pytest.raises(ConfigError, match="format 'yaml' is not known"):
        export_plan(pipe_plan.to_dict(), "yaml")
    with pytest.raises(ConfigError, match="lacks"):
        export_plan({"micro_batch": 2}, "hf")
    d["recommended"] = None
    with pytest.raises(ConfigError, match="no recommendation"):
        export_plan(d, "deepspeed")


def test_cli_plan_then_export(tmp_path, capsys):
    assert (
        main(
            [
                "plan",
                "--model",
                "gpt2",
                "--gpu",
                "a100-80gb,h100-sxm",
                "-B",
                "64",
                "-d",
                "2",
                "-p",
                "2",
                "--json",
            ]
        )
        == 0
    )
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(capsys.readouterr().out)
    assert main(["export", "--plan", str(plan_file), "--format", "deepspeed", "--gpu", "h100-sxm"]) == 0
    cfg = json.loads(capsys.readouterr().out)
    assert cfg["train_batch_size"] == 64
    assert cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"] * 2 == 64
    assert main(["export", "--plan", str(tmp_path / "nope.json"), "--format", "hf"]) == 2
    assert "cannot read --plan" in capsys.readouterr().err
