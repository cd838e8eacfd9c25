"""The accelerator table: every row sourced, lookups, overrides."""

from __future__ import annotations

import pytest

from microbatch.errors import ConfigError
from microbatch.hardware import (
    ACCELERATORS,
    HOPPER,
    from_device_name,
    get_accelerator,
    parse_gpus,
)
from microbatch.hardware_clocks import HOPPER_BURST_TO_SUSTAINED, power_limited_clock
from microbatch.hardware_overrides import parse_overrides
from microbatch.units import GIB


def test_every_issue_accelerator_is_present_with_a_source():
    for name in ("a100-40gb", "a100-80gb", "h100-sxm", "h100-pcie", "h200", "b200", "l4", "mi300x"):
        acc = ACCELERATORS[name]
        assert "datasheet" in acc.source
        # the source states the row's own figures: dense bf16 TFLOP/s and memory bandwidth
        tf, bw = acc.flops("bf16") / 1e12, acc.memory_bandwidth_bytes_per_s
        flops_text = {f"{tf:g} ", f"{tf:,g} ", f"{round(tf):,} ", f"= {tf / 1000:g} dense"}
        bw_text = {f"{bw / 1e9:,g} GB/s", f"{bw / 1e12:g} TB/s", f"{bw / 1e12:.1f} TB/s"}
        assert any(t in acc.source for t in flops_text), (name, tf, acc.source)
        assert any(t in acc.source for t in bw_text), (name, bw, acc.source)
        assert acc.compute_units and acc.compute_units > 0


def test_datasheet_relationships():
    a40, a80, h100, h200 = (get_accelerator(n) for n in ("a100-40gb", "a100-80gb", "h100-sxm", "h200"))
    assert a40.flops("bf16") == a80.flops("bf16") == 312e12
    assert a80.memory_bytes == 2 * a40.memory_bytes == 80 * GIB
    assert h200.flops("bf16") == h100.flops("bf16")  # same die, more and faster memory
    assert h200.memory_bandwidth_bytes_per_s > h100.memory_bandwidth_bytes_per_s
    for acc in ACCELERATORS.values():
        assert acc.flops("fp32") < acc.flops("bf16")  # tensor cores vs SIMT
        assert acc.inter_node_bytes_per_s <= acc.intra_node_bytes_per_s
    # ridge point: A100 80GB 312e12 / 2.039e12 ≈ 153 FLOP/byte
    assert a80.ridge_point() == pytest.approx(153.0, rel=0.01)


def test_unknown_name_lists_known():
    with pytest.raises(ConfigError, match=r"unknown accelerator 'v100'.*a100-40gb.*mi300x"):
        get_accelerator("v100")


def test_aliases_and_overrides():
    assert get_accelerator("H100").name == "h100-sxm"
    slow = get_accelerator("a100-80gb", inter_node_bytes_per_s=12.5e9, bf16=250e12)
    assert slow.inter_node_bytes_per_s == 12.5e9 and slow.flops("bf16") == 250e12
    assert slow.flops("fp16") == 312e12  # the others stay
    with pytest.raises(ConfigError, match="unknown accelerator field 'colour'"):
        get_accelerator("l4", colour="green")
    with pytest.raises(ConfigError, match="must be a finite number > 0, got 0; give the device"):
        get_accelerator("l4", memory_bytes=0)


def test_parse_gpus():
    assert [a.name for a in parse_gpus("a100-40gb, h100-sxm")] == ["a100-40gb", "h100-sxm"]
    with pytest.raises(ConfigError):
        parse_gpus(" , ")


def test_overrides_from_strings_and_device_names():
    from microbatch.hardware import from_device_name

    assert parse_overrides(["inter_node_bytes_per_s=25e9", "gpus_per_node=4"]) == {
        "inter_node_bytes_per_s": 25e9,
        "gpus_per_node": 4,
    }
    with pytest.raises(ConfigError, match="must be KEY=VALUE"):
        parse_overrides(["fast"])
    with pytest.raises(ConfigError, match="is not a number"):
        parse_overrides(["bf16=lots"])
    assert from_device_name("NVIDIA A100-SXM4-40GB", 42_298_834_944).name == "a100-40gb"
    a80 = from_device_name("NVIDIA A100-SXM4-80GB", 85_174_583_296)
    assert a80.name == "a100-80gb" and a80.memory_bytes == 85_174_583_296
    assert from_device_name("NVIDIA H100 PCIe").name == "h100-pcie"
    assert from_device_name("NVIDIA H100 80GB HBM3").name == "h100-sxm"
    assert from_device_name("Tesla T4") is None


def test_achievable_link_fractions_are_cited_and_checked():
    from microbatch.hardware import Accelerator

    a100 = get_accelerator("a100-80gb")
    # NCCL's ~20% NVLink protocol overhead (370 of 450 GB/s) and 48 of 50 GB/s per NDR NIC
    assert (a100.intra_node_achievable, a100.inter_node_achievable) == (0.82, 0.96)
    assert a100.intra_node_bytes_per_s * a100.intra_node_achievable == pytest.approx(246e9)
    assert get_accelerator("l4").intra_node_achievable == 1.0  # no figure for PCIe: line rate
    doc = Accelerator.__doc__ or ""
    assert "Accelerator" in repr(a100) and doc
    with pytest.raises(ConfigError, match=r"intra_node_achievable must be in \[0.001, 1\]"):
        a100.with_overrides(intra_node_achievable=1.5)
    with pytest.raises(ConfigError, match=r"inter_node_achievable must be in \[0.001, 1\]"):
        a100.with_overrides(inter_node_achievable=0)


def test_issue28_rows_and_the_flash_ceiling():
    """H100 NVL and H800 rows (issue 28), matched from device names; the flash ceiling is checked and overridable."""
    nvl, h800, sxm = get_accelerator("h100-nvl"), get_accelerator("h800"), get_accelerator("h100-sxm")
    assert nvl.flops("bf16") == pytest.approx(1671e12 / 2)  # the datasheet's sparse figure halved
    assert nvl.memory_bandwidth_bytes_per_s == pytest.approx(3.9e12)
    assert h800.flops("bf16") == sxm.flops("bf16")  # the H100 SXM's compute ...
    assert h800.intra_node_bytes_per_s == pytest.approx(
        sxm.intra_node_bytes_per_s * 400 / 900
    )  # ... NVLink cut
    assert from_device_name("NVIDIA H800").name == "h800"
    assert from_device_name("NVIDIA H100 NVL").name == "h100-nvl"
    assert from_device_name("NVIDIA H100 80GB HBM3").name == "h100-sxm"
    # the Hopper ceiling reproduces the H200's measured 0.348 at s = 2,048 through the causal ramp (s0 404)
    assert sxm.attention_fraction == pytest.approx(0.3477 * (2048 + 404) / 2048, abs=1e-3)
    # the A100 rows: FlashAttention-2's own A100 figures (tests/predict/test_attention.py checks the fit)
    assert (
        get_accelerator("a100-80gb").attention_fraction
        == get_accelerator("a100-40gb").attention_fraction
        == 0.694
    )
    assert "FlashAttention-2's A100" in get_accelerator("a100-80gb").source
    assert "attention" in sxm.source
    assert (
        get_accelerator("h100-sxm", **parse_overrides(["attention_fraction=0.5"])).attention_fraction == 0.5
    )
    with pytest.raises(ConfigError, match=r"attention_fraction must be in \[0.001, 1\], got 1.5"):
        sxm.with_overrides(attention_fraction=1.5)


# -- issue 28 (2): clocks as the parts are sold and run ------------------------------------------------
CLOCKED = ("a100-40gb", "a100-80gb", "h100-sxm", "h100-pcie", "h100-nvl", "h800", "h200", "b200", "h100-96gb")


@pytest.mark.parametrize(
    "name, sms, per_clock, mhz",
    [("a100-80gb", 108, 2048, 1410), ("h100-sxm", 132, 4096, 1830), ("h100-pcie", 114, 4096, 1620),
     ("h100-nvl", 132, 4096, 1545), ("h200", 132, 4096, 1830), ("h100-96gb", 132, 4096, 1830)],
)  # fmt: skip
def test_each_peak_is_sms_times_flop_per_clock_times_the_clock_its_row_names(name, sms, per_clock, mhz):
    """By hand: the dense bf16 peak = SMs × FLOP/clock/SM × the clock the row's source names."""
    acc = get_accelerator(name)
    assert acc.compute_units == sms
    assert acc.flops("bf16") == pytest.approx(sms * per_clock * mhz * 1e6, rel=2e-3)
    assert f"{mhz:,} MHz" in acc.source


def test_each_row_states_its_clock_power_limit_and_sustained_clock_evidence():
    watts = {"a100-40gb": 400, "a100-80gb": 400, "h100-sxm": 700, "h100-pcie": 350, "h100-nvl": 400,
             "h800": 700, "h200": 700, "b200": 1000, "h100-96gb": 500}  # fmt: skip
    for name in CLOCKED:
        acc = ACCELERATORS[name]
        assert acc.power_limit_w == watts[name] and "TDP" in acc.source and "clock: " in acc.source
        if acc.sustained_clock_fraction == 1.0:  # no figure: the row says so rather than invent one
            assert "no cited reading" in acc.source, name
        if name in HOPPER:  # kernel terms measured in bursts on an H200: the sustained rate, cited
            assert "DeepGEMM issue 120" in acc.source and "flashinfer PR 2899" in acc.source, name
            base = HOPPER_BURST_TO_SUSTAINED
            cap = power_limited_clock(acc.power_limit_w, acc.rated_power_w, acc.rated_power_w)
            assert acc.sustained_clock_fraction == pytest.approx(base * cap), name
    # 1 − (14.7/19.6)·(1 − 1,575/1,980): the rate falls 0.75 of the clock's fall, the clock 1,980 → 1,575 MHz
    assert (
        HOPPER_BURST_TO_SUSTAINED == pytest.approx(1 - 0.75 * (405 / 1980)) == pytest.approx(0.847, abs=5e-4)
    )
    h200 = ACCELERATORS["h200"]
    assert "TileOPs issue 1587" in h200.source and "in bursts" in h200.source
    for name in ("a100-80gb", "l4"):  # kernel terms carried, not a burst of theirs: the default
        assert ACCELERATORS[name].sustained_clock_fraction == 1.0
    # the B200 read on itself: FlashAttention-4 held 1,237 TFLOP/s back to back of the 1,425-1,450 of its first calls
    b200 = ACCELERATORS["b200"]
    assert b200.sustained_clock_fraction == pytest.approx(1237 / 1437.5) == pytest.approx(0.861, abs=5e-4)
    assert "flashinfer PR 2899" in b200.source and "no cited reading" not in b200.source


def test_sustained_flops_and_at_sustained_clock():
    h200 = get_accelerator("h200", sustained_clock_fraction=1500 / 1830)  # as --gpu-set would give it
    f = 1500 / 1830
    assert h200.flops("bf16") == pytest.approx(989.4e12)  # the datasheet peak stays (MFU's denominator)
    assert h200.sustained_flops("bf16") == pytest.approx(989.4e12 * f)
    run = h200.at_sustained_clock()
    assert run.sustained_clock_fraction == 1.0
    assert run.peak_flops == pytest.approx({k: v * f for k, v in h200.peak_flops.items()})
    a100 = get_accelerator("a100-80gb")
    assert a100.at_sustained_clock() is a100  # fraction 1: the same object, nothing rebuilt


def test_sustained_clock_fraction_and_power_limit_are_validated():
    a100 = get_accelerator("a100-80gb")
    for bad in (0, -0.5, 1.3, float("nan"), True, "fast"):
        with pytest.raises(ConfigError, match=r"sustained_clock_fraction must be in \[0\.1, 1\.25\]"):
            a100.with_overrides(sustained_clock_fraction=bad)
    with pytest.raises(ConfigError, match=r"power_limit_w must be a finite number > 0"):
        a100.with_overrides(power_limit_w=0.0)
    with pytest.raises(ConfigError, match=r"power_limit_w 90 W is outside \[100, 400\] W"):
        a100.with_overrides(power_limit_w=90.0)  # under the 100 W an A100 accepts
    with pytest.raises(ConfigError, match=r"rated_power_w must be a finite number > 0"):
        a100.with_overrides(rated_power_w=0.0)
    assert a100.with_overrides(sustained_clock_fraction=1.05).sustained_clock_fraction == 1.05


def test_gpu_set_overrides_the_clock_fraction_and_power_limit():
    over = parse_overrides(["sustained_clock_fraction=0.9", "power_limit_w=500"])
    assert over == {"sustained_clock_fraction": 0.9, "power_limit_w": 500.0}
    acc = get_accelerator("h100-sxm", **over)
    assert acc.sustained_clock_fraction == 0.9 and acc.power_limit_w == 500.0
    assert acc.sustained_flops("bf16") == pytest.approx(0.9 * 989.4e12)
    assert get_accelerator("h200", sustained_clock_fraction=1.0).sustained_flops("bf16") == pytest.approx(
        989.4e12
    )


def test_the_roofline_runs_its_gemms_at_the_sustained_clock_by_hand():
    """A compute-bound GEMM (the output layer) by hand: 2·rows·h·V / (peak · f · gemm_max), the loss's
    memory passes unchanged; with the memory terms and launch gaps removed the whole step scales as 1/f."""
    from dataclasses import replace

    from microbatch.model import get_model
    from microbatch.predict.gemm import DEFAULT_EFFICIENCY
    from microbatch.predict.plan import PlanConfig, make_plan
    from microbatch.predict.roofline import logits_forward
    from microbatch.predict.steptime import predict_step_time_s

    shape = get_model("gpt2")
    eff = replace(DEFAULT_EFFICIENCY, tile_rows=0, tile_overhead_s=0.0, ramp_rows=0.0, half_rows=0.0)
    f = 0.8
    acc = get_accelerator("a100-80gb", sustained_clock_fraction=f)
    rows = 8 * shape.seq
    t, _ = logits_forward(shape, 8, acc, efficiency=eff)
    soft = eff.score_fractions(True)[0]
    loss = 4 * rows * shape.vocab * (1 / eff.memory + 2 / soft) / acc.memory_bandwidth_bytes_per_s
    gemm = 2 * rows * shape.hidden * shape.vocab / (312e12 * f * eff.gemm_max)
    assert gemm > 2 * rows * shape.hidden * 2 / (
        acc.memory_bandwidth_bytes_per_s * eff.memory
    )  # compute-bound
    assert t == pytest.approx(gemm + loss, rel=1e-9)
    # everything compute-bound: infinite bandwidth and links, no launch gaps -> time ∝ 1/f exactly
    fast = dict(memory_bandwidth_bytes_per_s=1e30, intra_node_bytes_per_s=1e30, inter_node_bytes_per_s=1e30)
    bare = replace(eff, launch_s_per_kernel=0.0)
    one = get_accelerator("a100-80gb", **fast)
    slow = one.with_overrides(sustained_clock_fraction=f)
    assert predict_step_time_s(shape, 4, slow, efficiency=bare) == pytest.approx(
        predict_step_time_s(shape, 4, one, efficiency=bare) / f, rel=1e-9
    )
    plans = [
        make_plan(PlanConfig(shape=shape, gpu=g, global_batch=32, pipeline_parallel=1, efficiency=bare))
        for g in (one, slow)
    ]
    steps = [{c.micro_batch: c.step_time_s for c in p.candidates} for p in plans]
    assert steps[0] and steps[0].keys() == steps[1].keys()
    for b in steps[0]:
        assert steps[1][b] == pytest.approx(steps[0][b] / f, rel=1e-9), b
