"""Exports: each format keeps B_global = b_m × g × d and loads in the real library where installed."""

from __future__ import annotations

import json
import re
import tomllib  # stdlib: pyproject.toml requires Python >= 3.11

import pytest

from microbatch.cli import main
from microbatch.errors import ConfigError
from microbatch.hardware import get_accelerator
from microbatch.model import get_model
from microbatch.predict.plan import PlanConfig, make_plan
from microbatch.show.export import export_plan


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
    assert (ex.config["trainer"]["devices"], ex.config["trainer"]["num_nodes"]) == (1, 1)
    trainer = lightning.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                enable_model_summary=False, **ex.config["trainer"])  # fmt: skip
    assert trainer.accumulate_grad_batches == 16 and trainer.num_devices == 1
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
                "--zero",
                "1",  # DeepSpeed's pipeline engine takes ZeRO 0 or 1 only
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
    assert re.search(r"--plan .*nope.json. does not exist", capsys.readouterr().err)


# -- from a tune, and what each framework refuses ---------------------------------------------------
def _tune_result(global_batch=64, data_parallel=2, precision="bf16-mixed", ckpt=False):
    """A real TuneResult (knee chosen by recommend) from measured points, without probing."""
    from microbatch.choose.config import ChoiceConfig
    from microbatch.choose.knee import recommend
    from microbatch.choose.result import TuneResult
    from microbatch.choose.tune.search import curve_point
    from microbatch.measure.probes import Measurement

    curve = {1: 100.0, 2: 190.0, 4: 330.0, 8: 360.0, 16: 370.0}
    pts = [Measurement(micro_batch=b, throughput=t, step_time_s=b / t, peak_memory_bytes=10**9 + b * 10**7,
                       checkpointing=ckpt) for b, t in curve.items()]  # fmt: skip
    choice = ChoiceConfig(global_batch=global_batch, data_parallel=data_parallel, reference="measured")
    rec = recommend([curve_point(p) for p in pts], choice)
    return TuneResult(points=pts, recommendation=rec, model="gpt2", seq=128, mode="train", device="cuda",
                      device_name="NVIDIA H200", precision=precision, checkpointing="off", torch_version="x",
                      memory_budget_bytes=None, memory_method="cuda", stop_reason="flat", skipped=[],
                      interrupted=False, oom_events=0, probes=5, cached=0, wall_time_s=1.0)  # fmt: skip


def test_tune_exports_keep_the_knee_and_global_batch(tmp_path):
    from microbatch.envelope import envelope
    from microbatch.show.export import export_result, export_tune

    res = _tune_result()
    data = envelope(res.to_dict(), "tune")  # as result.json holds it
    b = res.recommendation.knee.micro_batch
    assert b == 4  # 330 is within 15% of 370; 2 is not
    ds = export_result(data, "deepspeed").config
    assert (
        ds["train_micro_batch_size_per_gpu"],
        ds["gradient_accumulation_steps"],
        ds["train_batch_size"],
    ) == (4, 8, 64)
    _check_deepspeed(ds, world=2)
    titan = tomllib.loads(export_tune(data, "torchtitan").text())
    assert titan["training"]["local_batch_size"] == 4 and titan["training"]["seq_len"] == 128
    lt = export_tune(res, "lightning")  # a TuneResult works too
    assert lt.config["trainer"]["devices"] * lt.config["trainer"]["num_nodes"] == 2
    assert any("NVIDIA H200" in n for n in lt.notes)
    transformers = pytest.importorskip("transformers")
    cfg = export_tune(_tune_result(data_parallel=1, precision="fp32", ckpt=True), "hf").config
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", **cfg)
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (4, 16)
    from microbatch.integrations.hf import checkpointing_setting

    assert checkpointing_setting(args) is True and args.bf16 is False


def test_a_tune_without_global_batch_is_refused():
    from microbatch.show.export import export_tune

    res = _tune_result()
    d = res.to_dict()
    d["global_batch"], d["grad_accum"] = None, None
    with pytest.raises(ConfigError, match=r"without a global batch.*tune again with global_batch$") as err:
        export_tune(d, "hf")
    assert err.value.params == ("global_batch",)


def _check_deepspeed(cfg, world):
    """DeepSpeed's documented rules (docs: config-json): the real DeepSpeedConfig when installed."""
    try:
        from deepspeed.runtime.config import DeepSpeedConfig
    except ImportError:
        DeepSpeedConfig = None  # noqa: N806
    if DeepSpeedConfig is not None:  # pragma: no cover - deepspeed is not a dev dependency
        ds = DeepSpeedConfig(cfg, world_size=world)
        assert ds.train_batch_size == cfg["train_batch_size"]
        return
    # train_batch_size = train_micro_batch_size_per_gpu × gradient_accumulation_steps × data-parallel world size
    assert (
        cfg["train_batch_size"]
        == cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"] * world
    )
    assert cfg["zero_optimization"]["stage"] in (0, 1, 2, 3)
    assert not (cfg.get("bf16", {}).get("enabled") and cfg.get("fp16", {}).get("enabled"))


def test_deepspeed_pipeline_with_zero_2_is_refused(pipe_plan):
    d = pipe_plan.to_dict()
    _check_deepspeed(export_plan(d, "deepspeed").config, world=2)
    d["recommended"]["zero"] = 2
    with pytest.raises(
        ConfigError, match=r"pipeline engine refuses ZeRO stage 2 .*p = 4.*plan again with zero 1"
    ) as err:
        export_plan(d, "deepspeed")
    assert "--" not in str(err.value) and err.value.params == ("zero",)


def test_lightning_refuses_tensor_parallelism_and_builds_a_ddp_trainer(flat_plan):
    lightning = pytest.importorskip("lightning")
    d = flat_plan.to_dict()
    d["recommended"].update(data_parallel=2, grad_accum=8, tensor_parallel=2, zero=3)
    with pytest.raises(
        ConfigError, match=r"ModelParallelStrategy\(data_parallel_size=2, tensor_parallel_size=2\)"
    ):
        export_plan(d, "lightning")  # not silently FSDP, nor DDP over d·t replicas
    d["recommended"].update(tensor_parallel=1, zero=0)
    ex = export_plan(d, "lightning", gpus_per_node=1)
    assert ex.config["trainer"] == {"accumulate_grad_batches": 8, "precision": "bf16-mixed", "devices": 1,
                                    "num_nodes": 2, "strategy": "ddp", "gradient_clip_val": 1.0,
                                    "gradient_clip_algorithm": "norm"}  # fmt: skip
    kw = dict(ex.config["trainer"], num_nodes=1, devices=2, precision="32-true")  # what runs on this CPU
    trainer = lightning.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, **kw)
    assert trainer.accumulate_grad_batches == 8 and trainer.num_devices == 2
    # fewer processes than a node holds: one node, devices = d (was refused: "do not fill nodes of 3")
    assert export_plan(d, "lightning", gpus_per_node=3).config["trainer"]["devices"] == 2
    d["data_parallel"] = 4  # 4 processes on nodes of 3: not whole nodes
    d["recommended"].update(data_parallel=4, grad_accum=4)
    with pytest.raises(ConfigError, match=r"4 processes .* do not fill nodes of 3"):
        export_plan(d, "lightning", gpus_per_node=3)


def test_cli_gpu_rules_and_output_paths(tmp_path, capsys):
    assert main(["plan", "--model", "gpt2", "--gpu", "a100-80gb,h100-sxm", "-B", "64", "--json"]) == 0
    cmp_file = tmp_path / "cmp.json"
    cmp_file.write_text(capsys.readouterr().out)
    # a multi-GPU plan needs --gpu
    assert main(["export", "--plan", str(cmp_file), "--format", "hf"]) == 2
    assert re.search(r"compares 2 accelerators \(a100-80gb, h100-sxm\).*--gpu", capsys.readouterr().err)
    assert main(["plan", "--model", "gpt2", "--gpu", "a100-80gb", "-B", "64", "--json"]) == 0
    one = tmp_path / "one.json"
    one.write_text(capsys.readouterr().out)
    # --gpu that does not match a single-GPU plan is an error; one that matches is fine
    assert main(["export", "--plan", str(one), "--format", "hf", "--gpu", "h100-sxm"]) == 2
    assert "does not match the plan, which is for 'a100-80gb'" in capsys.readouterr().err
    # -o into a missing folder: made, checked before the work
    out = tmp_path / "missing_dir" / "x.json"
    assert main(["export", "--plan", str(one), "--format", "hf", "--gpu", "a100-80gb", "-o", str(out)]) == 0
    assert json.loads(out.read_text())["per_device_train_batch_size"] >= 1
    capsys.readouterr()
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    assert main(["export", "--plan", str(one), "--format", "hf", "-o", str(blocker / "x.json")]) == 2
    err = capsys.readouterr().err
    assert "--output" in err and "cannot be written" in err and "Traceback" not in err
    # a tune result: --tune DIR reads DIR/result.json
    run = tmp_path / "run"
    _tune_result().save(run)
    assert main(["export", "--tune", str(run), "--format", "deepspeed", "--json"]) == 0
    env = json.loads(capsys.readouterr().out)
    assert env["command"] == "export" and env["config"]["train_batch_size"] == 64
    assert main(["export", "--tune", str(run), "--plan", str(one), "--format", "hf"]) == 2
    assert "exactly one of --plan" in capsys.readouterr().err


def test_torchtitan_stages_hold_the_planned_layers_and_chunks(pipe_plan):
    """torchtitan's layers per (virtual) stage is L/(p·v) with no layer taken off the first and last stages
    (its default takes one off each): the split the plan timed, v stages per rank with interleaving."""
    par = tomllib.loads(export_plan(pipe_plan.to_dict(), "torchtitan").text())["parallelism"]
    assert par["pipeline_parallel_layers_per_stage"] == 12 // 4  # gpt2: 12 layers over p = 4, v = 1
    assert par["pipeline_parallel_first_stage_less_layers"] == 0
    assert par["pipeline_parallel_last_stage_less_layers"] == 0
    cfg = PlanConfig(shape=get_model("gpt2"), gpu=get_accelerator("a100-80gb"), global_batch=128, data_parallel=2,
                     pipeline_parallel=2, schedules=("interleaved-1f1b",), virtuals=(3,), micro_batches=(2,),
                     zero=(1,))  # fmt: skip
    inter = make_plan(cfg).to_dict()
    ex = export_plan(inter, "torchtitan")
    par = tomllib.loads(ex.text())["parallelism"]
    assert par["pipeline_parallel_schedule"] == "Interleaved1F1B"
    assert par["pipeline_parallel_layers_per_stage"] == 12 // (2 * 3)  # 2 layers a stage, 3 stages a rank
    # a candidate without the model's layers: said, not guessed
    cand = dict(inter["recommended"], global_batch=128, data_parallel=2, pipeline_parallel=2)
    bare = export_plan(cand, "torchtitan")
    assert "pipeline_parallel_layers_per_stage" not in bare.config["parallelism"]
    assert any("holds 3 stage(s)" in n for n in bare.notes)


def test_torchtitan_export_of_an_uneven_split_says_so_rather_than_writing_an_even_one():
    cfg = PlanConfig(shape=get_model("gpt2"), gpu=get_accelerator("a100-80gb"), global_batch=128, data_parallel=2,
                     pipeline_parallel=4, layers_per_stage=(2, 4, 4, 2), schedules=("1f1b",), micro_batches=(2,),
                     zero=(1,))  # fmt: skip
    d = make_plan(cfg).to_dict()
    assert d["layers_per_stage"] == [2, 4, 4, 2]
    ex = export_plan(d, "torchtitan")
    assert "pipeline_parallel_layers_per_stage" not in ex.config["parallelism"]
    # written as torchtitan's per-stage module lists (its one count per stage cannot say 2, 4, 4, 2)
    parts = ex.config["parallelism"]["module_fqns_per_model_part"]
    assert [sum(m.startswith("layers.") for m in part) for part in parts] == [2, 4, 4, 2]
    assert any("module_fqns_per_model_part" in n and "[2, 4, 4, 2]" in n for n in ex.notes)


def test_torchtitan_export_of_an_uneven_interleaved_split_writes_every_virtual_stage():
    """Under interleaving the uneven split was only noted, and torchtitan then ran 2 stages per rank of its own split
    where the plan timed v: now each of the p·v stages is written, as the planner places them (stage s on rank
    s mod p, rank r's layers spread over its v chunks)."""
    from microbatch.predict.stages import virtual_stage_layers

    cfg = PlanConfig(shape=get_model("gpt2"), gpu=get_accelerator("a100-80gb"), global_batch=128, data_parallel=2,
                     pipeline_parallel=2, layers_per_stage=(5, 7), schedules=("interleaved-1f1b",), virtuals=(2,),
                     micro_batches=(2,), zero=(1,))  # fmt: skip
    d = make_plan(cfg).to_dict()
    assert d["recommended"]["virtual"] == 2
    parts = export_plan(d, "torchtitan").config["parallelism"]["module_fqns_per_model_part"]
    sizes = [sum(m.startswith("layers.") for m in part) for part in parts]
    assert sizes == [3, 4, 2, 3] == list(virtual_stage_layers((5, 7), 2, "loop"))
    assert sum(sizes[0::2]) == 5 and sum(sizes[1::2]) == 7  # rank r holds stages r, r + p: its own layers
    assert parts[0][0] == "tok_embeddings" and parts[-1][-2:] == ["norm", "output"]
    assert [m for part in parts for m in part if m.startswith("layers.")] == [
        f"layers.{i}" for i in range(12)
    ]


def test_torchtitan_refuses_a_16_bit_reduction():
    from microbatch.errors import ConfigError

    cfg = PlanConfig(shape=get_model("gpt2"), gpu=get_accelerator("a100-80gb"), global_batch=16, data_parallel=8,
                     zero=(3,), reduce_dtype="half", micro_batches=(2,))  # fmt: skip
    with pytest.raises(ConfigError, match=r"float32 only .*Literal\['float32'\]"):
        export_plan(make_plan(cfg).to_dict(), "torchtitan")
    fp32 = export_plan(
        make_plan(PlanConfig(**{**cfg.__dict__, "reduce_dtype": "auto"})).to_dict(), "torchtitan"
    )
    assert "mixed_precision_reduce" not in fp32.config["training"]  # torchtitan's own default, float32


def test_exports_write_the_gradient_clip_the_plan_priced():
    """The plan prices the global-norm clip (default) or not (``grad_clip`` False); each export writes it, so the run
    does what was priced: DeepSpeed's gradient_clipping (0 was its default), the Trainer's max_grad_norm (1.0 its
    default), Lightning's gradient_clip_val (none its default) and torchtitan's max_norm (1.0 its default)."""
    from microbatch.hardware import get_accelerator
    from microbatch.model import get_model
    from microbatch.predict.plan import make_plan
    from microbatch.predict.plan_config import PlanConfig

    base = dict(shape=get_model("gpt2"), gpu=get_accelerator("a100-80gb"), global_batch=16, data_parallel=2,
                micro_batches=(2,), zero=(0,), schedules=("1f1b",))  # fmt: skip
    for clip, want in ((True, 1.0), (False, 0.0)):
        plan = make_plan(PlanConfig(**base, grad_clip=clip)).to_dict()
        assert export_plan(plan, "deepspeed").config["gradient_clipping"] == want
        assert export_plan(plan, "hf").config["max_grad_norm"] == want
        # torchtitan clips every step (no "> 0" guard, v0.2.2 train.py): a limit of 0 zeroes the gradients, inf is off
        titan = export_plan(plan, "torchtitan")
        assert titan.config["training"]["max_norm"] == (want or float("inf"))
        assert "max_norm = inf" in titan.text() if not clip else "max_norm = 1.0" in titan.text()
        trainer = export_plan(plan, "lightning", gpus_per_node=2).config["trainer"]
        assert trainer.get("gradient_clip_val") == (want or None)
    # a tune's knee says nothing of the clip: the user's loop decides
    tuned = {"micro_batch": 2, "grad_accum": 4, "data_parallel": 2, "global_batch": 16}
    assert "gradient_clipping" not in export_plan(tuned, "deepspeed").config
