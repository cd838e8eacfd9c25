"""FSDP2 as torch runs it (torch/distributed/fsdp/_fully_shard, read for issue 28): each reduce-scatter's input is
copied in on the compute stream (foreach_reduce_scatter_copy_in), in the reduce dtype (torchtitan: fp32), and every
micro-step's backward ends waiting on its last reduce-scatter (is_last_backward defaults to True)."""

from __future__ import annotations

import pytest

from microbatch.errors import ConfigError
from microbatch.hardware import get_accelerator
from microbatch.model import get_model
from microbatch.predict.collectives import fsdp2_copy_in_s, fsdp2_copy_out_s, fsdp_edges_s
from microbatch.predict.plan import make_plan
from microbatch.predict.plan_config import PlanConfig
from microbatch.predict.state import reduce_bytes, zero3_buffer_bytes


def test_the_terms_by_hand():
    assert fsdp2_copy_in_s(2e9, 4e9, 3e12) == pytest.approx(6e9 / 3e12)  # read bf16, write fp32
    assert fsdp_edges_s(0.8, 0.4, units=4, microsteps=8) == pytest.approx(8 * (0.8 + 0.4) / 4)
    assert reduce_bytes("auto", "fsdp2", 2) == 4 and reduce_bytes("auto", "fsdp1", 2) == 2
    assert reduce_bytes("half", "fsdp2", 4) == 2 and reduce_bytes("fp32", "deepspeed", 2) == 4
    with pytest.raises(ConfigError, match="reduce_dtype 'bf16' is not known"):
        reduce_bytes("bf16", "fsdp2", 2)


def _zero_s(**kw):
    cfg = PlanConfig(shape=get_model("llama-3-8b").with_seq(8192), gpu=get_accelerator("h100-sxm"), global_batch=512,
                     data_parallel=64, zero=(3,), micro_batches=(1,), recompute=("none",), **kw)  # fmt: skip
    c = make_plan(cfg).recommended
    return cfg, c.time["zero_comm_s"], c.step_time_s


def test_fsdp2_pays_its_copies_on_the_compute_stream_and_fsdp1_does_not():
    cfg, fsdp2, _ = _zero_s(zero3_impl="fsdp2", reduce_dtype="half")
    _, fsdp1, _ = _zero_s(zero3_impl="fsdp1", reduce_dtype="half")
    n = get_model("llama-3-8b").param_count()  # every parameter on each GPU's stage (p = 1)
    rate = cfg.gpu.memory_bandwidth_bytes_per_s * cfg.efficiency.memory
    m = 512 // 64
    by_hand = m * (2 * fsdp2_copy_out_s(2 * n, rate) + fsdp2_copy_in_s(2 * n, 2 * n, rate))
    assert fsdp2 - fsdp1 == pytest.approx(by_hand, rel=1e-6)


def test_the_reduce_scatter_in_fp32_costs_what_its_bytes_say():
    _, fp32, step32 = _zero_s(reduce_dtype="auto")
    _, half, step16 = _zero_s(reduce_dtype="half")
    assert (
        fp32 > half and step32 > step16
    )  # torchtitan's fp32 reduction moves twice the bytes and copies in more
    assert (step32 - step16) / step16 < 0.05  # mostly hidden behind the backward at s 8192


def test_zero3_holds_a_units_gradients_and_the_last_reduce_scatter_input_beside_its_two_gathered_units():
    from microbatch.predict.memory import MemoryConfig, estimate_memory
    from microbatch.predict.state import zero3_buffer_bytes

    shape = get_model("llama-2-7b")
    layer = shape.layer_params()
    assert zero3_buffer_bytes(layer, 2, 4) == layer * (
        2 + 2 + 2 + 4
    )  # it held 2 × 2 B: the two gathered units

    def other(**kw):
        return (
            estimate_memory(shape, MemoryConfig(micro_batch=1, data_parallel=8, zero=3, **kw))
            .stages[0]
            .other_bytes
        )

    assert other() == pytest.approx(layer * 10)  # FSDP2 reducing in fp32
    assert other(reduce_dtype="half") == pytest.approx(layer * 8)
    assert other(zero3_impl="fsdp1") == pytest.approx(layer * 8)  # FSDP1 reduces the bf16 it holds


@pytest.mark.parametrize("flags", [[], ["--zero3-impl", "deepspeed"], ["--reduce-dtype", "half"]])
def test_memory_and_plan_agree_on_zero3_for_every_implementation(flags, capsys):
    import json

    from microbatch.cli import main

    common = [
        "--model",
        "llama-3-8b",
        "--seq",
        "8192",
        "-d",
        "8",
        "--zero",
        "3",
        "--recompute",
        "none",
        *flags,
    ]
    assert main(["memory", *common, "-b", "1", "--json"]) == 0
    memory = json.loads(capsys.readouterr().out)["peak_memory_bytes"]
    assert main(["plan", *common, "--gpu", "h100", "-B", "8", "-b", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["recommended"]["peak_memory_bytes"] == pytest.approx(memory)


def test_zero3_buffers_under_expert_parallelism_hold_the_gpus_own_experts():
    """A whole layer's experts were counted: Mixtral at EP 8 held 13.6 GiB of buffers where its GPU gathers ~2 GiB,
    and ZeRO-3 came out above ZeRO-0."""
    from microbatch.predict.experts import expert_params, zero3_unit_params
    from microbatch.predict.memory import MemoryConfig, estimate_memory

    shape = get_model("mixtral-8x7b").with_seq(4096)
    routed = expert_params(shape, 0, 1, moe_blocks=1)
    assert zero3_unit_params(shape, 1, 8) == pytest.approx(shape.layer_params() - routed + routed / 8)

    def peak(zero, **kw):
        cfg = MemoryConfig(micro_batch=1, recompute="full", zero=zero, **kw)
        return estimate_memory(shape, cfg).stages[0]

    s, dispatch = (
        peak(3, data_parallel=16, expert_parallel=8),
        peak(0, data_parallel=16, expert_parallel=8).other_bytes,
    )  # the experts' state shards over d/EP = 2: each GPU gathers its own experts
    assert s.other_bytes - dispatch == pytest.approx(
        zero3_buffer_bytes(zero3_unit_params(shape, 1, 8, 16), 2, 4)
    )
    assert s.other_bytes < 3 * 2**30  # it read 13.6 GiB
    assert (
        peak(3, data_parallel=2, expert_parallel=2).peak_bytes
        < peak(0, data_parallel=2, expert_parallel=2).peak_bytes
    )


def test_zero3_gathers_no_experts_where_expert_parallelism_spans_the_data_parallel_ranks():
    """EP = d leaves each expert on one rank (its state's group d/EP is one), so ZeRO-3 gathers none of them: the unit
    is the dense part alone, and ZeRO-3 sits below ZeRO-1 (a sweep found Mixtral 8x7B at d = EP = 2, t = 4 priced
    89.5 GiB under ZeRO-3 against 88.5 under ZeRO-1: the gather buffer held experts nobody gathers)."""
    from microbatch.predict.experts import expert_params, zero3_unit_params
    from microbatch.predict.memory import MemoryConfig, estimate_memory

    shape = get_model("mixtral-8x7b").with_seq(4096)
    routed = expert_params(shape, 0, 1, moe_blocks=1)
    dense = (shape.layer_params() - routed) / 4
    assert zero3_unit_params(shape, 4, 2, 2) == pytest.approx(dense)
    assert zero3_unit_params(shape, 4, 2, 4) == pytest.approx(dense + routed / 8)  # d/EP = 2: gathered
    assert zero3_unit_params(shape, 4, 2, 4) > 2 * zero3_unit_params(shape, 4, 2, 2)

    def peak(zero):
        cfg = MemoryConfig(
            micro_batch=1, recompute="full", zero=zero, data_parallel=2, expert_parallel=2, tensor_parallel=4,
            sequence_parallel=True,
        )  # fmt: skip
        return estimate_memory(shape, cfg).peak_bytes

    assert peak(3) < peak(2) < peak(1)
    gpu = get_accelerator("h200")
    plans = {
        z: make_plan(
            PlanConfig(
                shape=shape,
                gpu=gpu,
                global_batch=8,
                data_parallel=2,
                expert_parallel=2,
                tensor_parallel=4,
                sequence_parallel=True,
                micro_batches=(1,),
                recompute=("full",),
                zero=(z,),
                schedules=("1f1b",),
            )  # fmt: skip
        )
        .candidates[0]
        .peak_memory_bytes
        for z in (1, 3)
    }
    assert plans[3] < plans[1]
    assert plans[3] == pytest.approx(peak(3), rel=0.02)  # the planner's screen and the memory model agree
