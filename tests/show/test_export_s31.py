"""A pipeline whose layers do not split evenly: the plan puts the extra layers on the last stages (the first holds
the most micro-batches in flight); DeepSpeed's partitions (``partition_uniform``/``partition_balanced``) put them on
the first, and torchtitan's default split takes a layer off its first and last stages. The exports say so, and the
torchtitan one writes the plan's split by module name (a helper's review, 2026-12-07: the DeepSpeed split of a
llama-2-7b at p = 5 on a 40 GB A100 peaks past the card by the planner's own memory)."""

from __future__ import annotations

import json
import re

from microbatch.hardware import get_accelerator
from microbatch.model import get_model
from microbatch.predict.plan import make_plan
from microbatch.predict.plan_config import PlanConfig
from microbatch.show.export import export_plan


def _plan(p: int, **kw):
    cfg = PlanConfig(shape=get_model("llama-2-7b"), gpu=get_accelerator("a100-80gb"), global_batch=40, data_parallel=1,
                     pipeline_parallel=p, micro_batches=(1,), **{"zero": (0,), **kw})  # fmt: skip
    plan = make_plan(cfg).to_dict()
    assert plan["recommended"] is not None
    return plan


def test_deepspeed_is_told_the_plan_s_split_when_layers_do_not_divide():
    # ZeRO 1: DeepSpeed's pipeline engine runs a bf16 model at stage 0 through its bf16 optimizer (refused there)
    notes = " ".join(export_plan(_plan(5, zero=(1,)), "deepspeed").notes)
    assert "first stages ([7, 7, 6, 6, 6])" in notes and "the plan timed [6, 6, 6, 7, 7]" in notes
    assert "_partition_layers" in notes
    assert "do not split evenly" not in " ".join(
        export_plan(_plan(4, zero=(1,)), "deepspeed").notes
    )  # 32 = 4 × 8


def test_torchtitan_gets_the_plan_s_split_by_module_name():
    exp = export_plan(_plan(5), "torchtitan")
    parts = exp.config["parallelism"]["module_fqns_per_model_part"]
    layers = [
        int(m.group(1)) for part in parts for name in part if (m := re.fullmatch(r"layers\.(\d+)", name))
    ]
    assert layers == list(range(32))  # every layer once, in order
    assert [len([n for n in part if n.startswith("layers.")]) for part in parts] == [6, 6, 6, 7, 7]
    assert parts[0][0] == "tok_embeddings" and parts[-1][-2:] == ["norm", "output"]
    assert "pipeline_parallel_layers_per_stage" not in exp.config["parallelism"]
    even = export_plan(_plan(4), "torchtitan").config["parallelism"]  # 32 = 4 × 8: one count for every stage
    assert even["pipeline_parallel_layers_per_stage"] == 8 and "module_fqns_per_model_part" not in even


def test_lightning_takes_fewer_processes_than_a_node_holds():
    plan = make_plan(PlanConfig(shape=get_model("gpt2"), gpu=get_accelerator("a100-80gb"), global_batch=60,
                                data_parallel=5, micro_batches=(2,))).to_dict()  # fmt: skip
    trainer = export_plan(plan, "lightning", gpus_per_node=8).config["trainer"]  # was refused: "do not fill"
    assert (trainer["devices"], trainer["num_nodes"]) == (5, 1)


def test_torchtitan_0_2_0_s_expert_by_context_rule_is_said(tmp_path, capsys):
    from microbatch.cli import main

    plan = tmp_path / "plan.json"
    args = ["plan", "--model", "llama-2-7b", "--experts", "8", "--top-k", "2", "--gpu", "h100-80gb", "-B", "64",
            "-d", "4", "-c", "4", "--zero", "3", "--seq", "8192", "--json"]  # fmt: skip
    for ep, said in (("2", True), ("4", False)):  # 2 % 4 != 0: 0.2.0 asserts; 4 % 4 == 0
        assert main([*args, "-e", ep]) == 0
        plan.write_text(capsys.readouterr().out)
        assert main(["export", "--plan", str(plan), "--format", "torchtitan"]) == 0
        assert ("torchtitan 0.2.0 refuses expert_parallel" in capsys.readouterr().err) is said


def test_torchtitan_runs_fp8_experts_through_its_grouped_gemm_converter(tmp_path, capsys):
    """torchtitan's GroupedExperts are parameters, not nn.Linear: the linear converter left them in bf16 where the
    plan priced FP8 (a helper's review, 2026-12-07)."""
    from microbatch.cli import main

    plan = tmp_path / "plan.json"
    base = [
        "plan",
        "--model",
        "gpt2",
        "--gpu",
        "h100-80gb",
        "-B",
        "64",
        "--zero",
        "3",
        "--precision",
        "fp8",
        "--json",
    ]
    moe = ["--experts", "8", "--top-k", "2", "-e", "4"]
    for extra, grouped in (
        (["-d", "8", *moe], True),
        (["-d", "4", "-p", "2", *moe], False),
        (["-d", "8"], None),
    ):
        assert main([*base, *extra]) == 0
        plan.write_text(capsys.readouterr().out)
        assert main(["export", "--plan", str(plan), "--format", "torchtitan", "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        converters = out["config"]["model"]["converters"]
        notes = " ".join(out["notes"])
        assert ("quantize.grouped_mm.float8" in converters) is bool(grouped)
        if grouped:
            assert out["config"]["quantize.grouped_mm.float8"] == {"fqns": ["experts"]}
        if grouped is False:
            assert "its experts run in bf16" in notes
        if grouped is None:  # a dense model: no word of experts
            assert "experts" not in notes


def test_lightning_s_deepspeed_stage_1_is_told_of_the_bf16_optimizer():
    plan = make_plan(PlanConfig(shape=get_model("gpt2"), gpu=get_accelerator("a100-80gb"), global_batch=64,
                                data_parallel=4, micro_batches=(2,), zero=(1,), grad_dtype="fp32")).to_dict()  # fmt: skip
    exp = export_plan(plan, "lightning", gpus_per_node=8)
    assert exp.config["trainer"]["strategy"] == "deepspeed_stage_1"
    notes = " ".join(exp.notes)
    assert "runs its bf16 optimizer" in notes and "grad_dtype bf16+fp32" in notes
    assert "(4 of the node's 8 accelerators)" in notes


def test_an_hf_export_of_zero_3_says_what_the_trainers_fsdp_would_run():
    """'this config runs fsdp1' under an hf export whose dict holds no fsdp key read as a claim about the dict (a
    walk-through); it names the Trainer's fsdp= now."""
    from microbatch.show.export_common import _zero3_runner_notes

    notes = _zero3_runner_notes({"zero": 3, "zero3_impl": "fsdp2"}, "hf")
    assert notes and "the Trainer's fsdp=" in notes[0] and "this config runs" not in notes[0]
    assert "this config runs fsdp1" in _zero3_runner_notes({"zero": 3, "zero3_impl": "fsdp2"}, "lightning")[0]
