"""FSDP2's copy-out (issue 28, item 3): ``fully_shard`` copies each gathered layer out of its all-gather buffer
on the compute stream; FSDP1, DeepSpeed and Megatron-core's FSDP compute from the buffer. By hand, then the
planner and the CLI."""

from __future__ import annotations

import pytest
from _helpers import plan_json

from microbatch.errors import ConfigError
from microbatch.hardware import get_accelerator
from microbatch.model import get_model
from microbatch.predict.collectives import fsdp2_copy_out_s
from microbatch.predict.plan import make_plan
from microbatch.predict.plan_config import PlanConfig

H100 = get_accelerator("h100-sxm")
LLAMA = get_model("llama-3-8b")


def test_copy_out_reads_and_writes_the_unit_once():
    # a 1 GB unit at 2 TB/s: 1 GB read + 1 GB written = 1 ms
    assert fsdp2_copy_out_s(1e9, 2e12) == pytest.approx(1e-3)
    assert fsdp2_copy_out_s(0.0, 2e12) == 0.0


def _step(z: int, impl: str, **kw) -> tuple[float, dict]:
    cfg = PlanConfig(shape=LLAMA, gpu=H100, global_batch=64, data_parallel=16, micro_batches=(1,), zero=(z,),
                     recompute=("full",), zero3_impl=impl, **kw)  # fmt: skip
    c = make_plan(cfg).candidates[0]
    return c.step_time_s, c.to_dict()


def test_fsdp2_adds_two_copy_outs_per_micro_step_by_hand():
    fsdp1, d1 = _step(3, "fsdp1")
    fsdp2, d2 = _step(3, "fsdp2", reduce_dtype="half")  # FSDP2 reducing bf16, as FSDP1 does: the copies alone
    m = d2["microbatches"]
    assert m == 64 // 16
    # every parameter gathered for the forward and again for the backward, bf16 weights (2 B), copied at
    # the streaming rate (bandwidth × efficiency.memory = 0.8); each backward's gradients copied into the
    # reduce-scatter buffer (read 2 B, write 2 B)
    rate = H100.memory_bandwidth_bytes_per_s * 0.8
    copy, copy_in = 2 * 2 * LLAMA.param_count() / rate, (2 + 2) * LLAMA.param_count() / rate
    assert fsdp2 - fsdp1 == pytest.approx(m * (2 * copy + copy_in), rel=1e-9)
    assert d2["time"]["zero_comm_s"] - d1["time"]["zero_comm_s"] == pytest.approx(
        m * (2 * copy + copy_in), rel=1e-9
    )
    assert (
        0.01 < (fsdp2 - fsdp1) / fsdp1 < 0.05
    )  # a few per cent of an 8B step at one sequence per micro-step
    # DeepSpeed and Megatron's FSDP compute from the gathered buffer, as FSDP1 does
    assert _step(3, "deepspeed")[0] == fsdp1 and _step(3, "megatron")[0] == fsdp1


@pytest.mark.parametrize("z", [0, 1, 2])
def test_only_zero3_gathers_layers(z):
    assert _step(z, "fsdp2")[0] == _step(z, "fsdp1")[0]


def test_default_is_fsdp2_and_unknown_is_refused():
    assert PlanConfig(shape=LLAMA, gpu=H100, global_batch=8).zero3_impl == "fsdp2"
    with pytest.raises(ConfigError, match=r"zero3_impl 'fsdp3' .* fsdp2, fsdp1, deepspeed, megatron"):
        PlanConfig(shape=LLAMA, gpu=H100, global_batch=8, zero3_impl="fsdp3")


def test_cli_flag(capsys):
    from microbatch.cli import main

    args = ["plan", "--model", "llama-3-8b", "--gpu", "h100-sxm", "-B", "64", "-d", "16", "-b", "1",
            "--zero", "3", "--recompute", "full", "--json"]  # fmt: skip
    steps = {}
    for impl in ("fsdp2", "deepspeed"):
        plan = plan_json([*args, "--zero3-impl", impl], capsys)
        assert plan["zero3_impl"] == impl
        steps[impl] = plan["recommended"]["step_time_s"]
    assert steps["fsdp2"] > steps["deepspeed"]
    assert main([*args, "--zero3-impl", "fsdp3"]) == 2
