"""The optimizer state frameworks really keep: bf16 moments, the fp32 master as a 16-bit remainder or none (NeMo's
distributed Adam, Megatron's precision-aware optimizer, DeepSeek-V3), each against a hand count."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from microbatch.errors import ConfigError
from microbatch.hardware import get_accelerator
from microbatch.model import get_model
from microbatch.predict.gemm import DEFAULT_EFFICIENCY
from microbatch.predict.memory import MemoryConfig, estimate_memory
from microbatch.predict.plan import make_plan
from microbatch.predict.plan_config import PlanConfig
from microbatch.predict.state import bytes_per_param, model_state_bytes
from microbatch.show.export import export_plan

H100 = get_accelerator("h100-sxm")


@pytest.mark.parametrize(
    ("precision", "grad", "optimizer", "moments", "master", "want"),
    [
        ("bf16-mixed", "half", "adamw", "fp32", "fp32", (2, 2, 12)),  # ZeRO's 16 B
        ("bf16-mixed", "fp32", "adamw", "fp32", "fp32", (2, 4, 12)),  # Megatron's 18 B
        (
            "bf16-mixed",
            "fp32",
            "adamw",
            "fp32",
            "remainder",
            (2, 4, 10),
        ),  # NeMo's distributed Adam (apex, store_param_remainders) with fp32 grad_sync
        (
            "bf16-mixed",
            "half",
            "adamw",
            "bf16",
            "none",
            (2, 2, 4),
        ),  # NeMo's Nemotron-4 340B (optim.dtype bf16)
        (
            "fp8",
            "half",
            "adamw",
            "bf16",
            "remainder",
            (2, 2, 6),
        ),  # DeepSeek-V3's recipe (bf16 weights under FP8)
        ("bf16-mixed", "half", "sgd", "bf16", "fp32", (2, 2, 6)),  # one momentum buffer in bf16
        ("fp16-mixed", "half", "adamw", "fp32", "none", (2, 2, 8)),
        ("fp32", "half", "adamw", "bf16", "fp32", (4, 4, 4)),  # no master copy, two bf16 moments
        ("bf16-mixed", "half", "lion", "fp32", "fp32", (2, 2, 8)),  # Lion: fp32 master and one momentum
        ("bf16-mixed", "half", "lion", "bf16", "remainder", (2, 2, 4)),
    ],
)
def test_bytes_per_param_by_hand(precision, grad, optimizer, moments, master, want):
    assert bytes_per_param(precision, grad, optimizer, moments, master) == want


def test_zero_shards_the_smaller_state():
    """ZeRO-1 over d = 8: NeMo 340B's state 2 + 2 + 4/8 B per parameter."""
    state = model_state_bytes(1e9, zero=1, data_parallel=8, moments="bf16", master="none")
    assert state == {"weights": 2e9, "gradients": 2e9, "optimizer": 4e9 / 8}


@pytest.mark.parametrize(
    ("kw", "words"),
    [
        ({"moments": "fp8"}, "moments_dtype 'fp8' is not known"),
        ({"master": "fp16"}, "master_weights 'fp16' is not known"),
        ({"master": "remainder", "precision": "fp16-mixed"}, "fp16 weights share no bits"),
        ({"master": "none", "precision": "fp32"}, "fp32 training keeps no master copy"),
    ],
)
def test_bad_state_settings_refused(kw, words):
    args = {"precision": "bf16-mixed", "moments": "fp32", "master": "fp32"} | kw
    with pytest.raises(ConfigError, match=words):
        bytes_per_param(args["precision"], "half", "adamw", args["moments"], args["master"])


def _plan_cfg(**kw):
    base = dict(shape=get_model("llama-2-7b"), gpu=H100, global_batch=64, data_parallel=8, micro_batches=(1,),
                zero=(1,), recompute=("none",), schedules=("1f1b",))  # fmt: skip
    return PlanConfig(**(base | kw))


def test_plan_memory_and_update_follow_the_state_bytes():
    """The same plan with NeMo 340B's state (2 + 2 + 4 B) against ZeRO's (2 + 2 + 12 B): the optimizer bytes a third,
    the rest of memory the same, and the update — torch's unfused AdamW passes over what the GPU owns — half as
    long: 4 passes of the parameters and 2 of the gradients (fp32 under a master copy, else the bf16 ones held) and 14
    of the moments and temporaries (4 B, or 2 B in bf16): 80 B against 40."""
    full = make_plan(_plan_cfg(grad_clip=False)).candidates[
        0
    ]  # the update alone (the clip reads only gradients)
    lean = make_plan(_plan_cfg(moments_dtype="bf16", master_weights="none", grad_clip=False)).candidates[0]
    assert lean.memory["optimizer"] == pytest.approx(full.memory["optimizer"] / 3)
    for key in ("weights", "gradients", "activations"):
        assert lean.memory[key] == full.memory[key]
    assert lean.time["optimizer_s"] == pytest.approx(
        full.time["optimizer_s"] * (4 * 2 + 2 * 2 + 14 * 2) / (4 * 4 + 2 * 4 + 14 * 4)
    )
    assert full.peak_memory_bytes - lean.peak_memory_bytes == pytest.approx(
        full.memory["optimizer"] - lean.memory["optimizer"]
    )


def test_memory_command_config_agrees_with_the_plan():
    shape = get_model("llama-2-7b")
    kw = dict(micro_batch=1, data_parallel=8, zero=1, moments_dtype="bf16", master_weights="remainder")
    est = estimate_memory(shape, MemoryConfig(**kw))
    plan = make_plan(_plan_cfg(moments_dtype="bf16", master_weights="remainder")).candidates[0]
    assert est.stages[0].optimizer_bytes == pytest.approx(plan.memory["optimizer"])
    assert est.stages[0].optimizer_bytes == pytest.approx(shape.param_count() * 6 / 8, rel=1e-9)
    with pytest.raises(ConfigError, match="fp16 weights share no bits"):
        MemoryConfig(micro_batch=1, precision="fp16-mixed", master_weights="remainder")


def test_cli_states_it_and_exports_refuse_it(capsys):
    from microbatch.cli import main

    args = ["plan", "--model", "llama-2-7b", "--gpu", "h100-sxm", "-B", "64", "-d", "8", "--json"]
    assert main([*args, "--moments-dtype", "bf16", "--master-weights", "none"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["moments_dtype"] == "bf16" and out["master_weights"] == "none"
    assert main([*args, "--precision", "fp32", "--master-weights", "remainder"]) == 2
    err = capsys.readouterr().err
    assert "--master-weights remainder with --precision fp32" in err
    plan = make_plan(_plan_cfg(moments_dtype="bf16")).to_dict()
    for fmt in ("deepspeed", "hf", "lightning", "torchtitan"):
        with pytest.raises(ConfigError, match=f"{fmt} has no optimizer state of bf16 moments"):
            export_plan(plan, fmt)
    export_plan(make_plan(_plan_cfg()).to_dict(), "deepspeed")  # the default state exports


@pytest.mark.parametrize(("zero", "d"), [(0, 8), (1, 8), (1, 1)])
def test_gradient_clip_adds_three_passes_over_the_updated_gradients(zero, d):
    """The global-norm clip: a norm pass and a scaling read and write over the gradients the rank updates — all of
    them under plain data parallelism, the shard (n/d) under ZeRO ≥ 1 — at the streaming rate, by hand."""
    from microbatch.predict.dp_comm import CLIP_PASSES

    cfg = _plan_cfg(data_parallel=d, global_batch=8 * d, zero=(zero,), grad_dtype="fp32")
    on = make_plan(cfg).candidates[0]
    off = make_plan(replace(cfg, grad_clip=False)).candidates[0]
    params = on.total_params  # one stage: every parameter on this GPU
    owned = params / d if zero else params
    want = CLIP_PASSES * 4 * owned / (H100.memory_bandwidth_bytes_per_s * DEFAULT_EFFICIENCY.memory)
    assert CLIP_PASSES == 3.0
    assert on.time["optimizer_s"] - off.time["optimizer_s"] == pytest.approx(want, rel=1e-9)
    assert on.step_time_s - off.step_time_s == pytest.approx(want, rel=1e-6)
    assert on.memory == off.memory


def test_cli_grad_clip_flag(capsys):
    from microbatch.cli import main

    args = ["plan", "--model", "llama-2-7b", "--gpu", "h100-sxm", "-B", "64", "-d", "8", "-b", "1", "--json"]
    steps = []
    for flag in ("--grad-clip", "--no-grad-clip"):
        assert main([*args, flag]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["grad_clip"] is (flag == "--grad-clip")
        steps.append(out["candidates"][0]["time"]["optimizer_s"])
    assert steps[0] > steps[1] > 0


def test_a_candidate_carries_its_state_to_the_export_and_memory_refuses_bad_state(capsys):
    """Exporting the recommended Candidate itself (or its dict) refuses bf16 moments as the plan's JSON does; the
    ``memory`` command refuses a remainder under fp16 with its flags named."""
    from microbatch.cli import main

    cand = make_plan(_plan_cfg(moments_dtype="bf16", grad_clip=False)).candidates[0]
    assert (cand.moments_dtype, cand.master_weights, cand.grad_clip) == ("bf16", "fp32", False)
    for given in (cand, cand.to_dict()):
        with pytest.raises(ConfigError, match="deepspeed has no optimizer state of bf16 moments"):
            export_plan(given, "deepspeed")
    args = ["memory", "--model", "llama-2-7b", "--micro-batch", "1", "--precision", "fp16-mixed"]
    assert main([*args, "--master-weights", "remainder"]) == 2
    assert "--master-weights remainder completes bf16 weights" in capsys.readouterr().err


def test_the_update_and_clip_of_experts_run_on_their_expert_data_parallel_shard():
    """Under ZeRO-1 with EP 8 over d = 8, a GPU holds 1/8 of the routed experts, and their state is sharded over
    d/EP = 1 rank: it updates (and clips) all of its experts and 1/8 of the dense parameters, by hand."""
    from microbatch.predict.dp_comm import CLIP_PASSES
    from microbatch.predict.experts import expert_params

    shape = get_model("mixtral-8x7b").with_seq(1024)
    cfg = PlanConfig(shape=shape, gpu=H100, global_batch=8, data_parallel=8, expert_parallel=8, micro_batches=(1,),
                     zero=(1,), recompute=("full",), schedules=("1f1b",))  # fmt: skip
    on = make_plan(cfg).candidates[0]
    off = make_plan(replace(cfg, grad_clip=False)).candidates[0]
    experts = expert_params(shape, 0, shape.layers) / 8  # this GPU's 1/EP of the routed experts
    dense = on.total_params - expert_params(shape, 0, shape.layers)
    owned = dense / 8 + experts / 1
    want = CLIP_PASSES * 2 * owned / (H100.memory_bandwidth_bytes_per_s * DEFAULT_EFFICIENCY.memory)
    assert on.time["optimizer_s"] - off.time["optimizer_s"] == pytest.approx(want, rel=1e-6)


def test_eager_update_bytes_count_each_optimizers_kernels():
    """torch's foreach AdamW moves 80 B per fp32 parameter (the microbenchmark's step: 268M parameters in 5.96 ms is
    0.751 of an H200's 4.8 TB/s at that count); SGD with momentum 8 passes, plain SGD 3, llm-foundry's Lion 13. The
    plan's update time follows the count: plain SGD under pure bf16 (2-byte weights, gradients) is 6 B a parameter."""
    from microbatch.predict.state import EAGER_PASSES, eager_update_bytes

    assert eager_update_bytes("adamw", 4, 4, 4) == 80
    assert 80 * 268435456 / 0.0059552 / 4.8e12 == pytest.approx(0.751, abs=5e-4)
    assert {k: sum(v) for k, v in EAGER_PASSES.items()} == {"adamw": 20, "sgd": 8, "sgd-plain": 3, "lion": 13}
    assert eager_update_bytes("sgd-plain", 2, 2, 2) == 6
    assert bytes_per_param("bf16-mixed", "half", "sgd-plain", "fp32", "none") == (2, 2, 0)

    def update_s(optimizer: str) -> float:
        cfg = _plan_cfg(optimizer=optimizer, master_weights="none", grad_clip=False)
        return float(make_plan(cfg).candidates[0].time["optimizer_s"])

    # master none, fp32 buffers: adamw 4·2 + 2·2 + 14·4, sgd 2·2 + 1·2 + 5·4, sgd-plain 2·2 + 1·2
    times = {o: update_s(o) for o in ("adamw", "sgd", "sgd-plain")}
    assert times["sgd"] / times["adamw"] == pytest.approx(26 / 68)
    assert times["sgd-plain"] / times["adamw"] == pytest.approx(6 / 68)
