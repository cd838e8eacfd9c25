"""The accelerator table: every row sourced, lookups, overrides."""

from __future__ import annotations

import pytest

from microbatch.errors import ConfigError
from microbatch.hardware import ACCELERATORS, from_device_name, get_accelerator, parse_gpus, parse_overrides
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
    from microbatch.hardware import from_device_name, parse_overrides

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
    with pytest.raises(ConfigError, match=r"intra_node_achievable must be in \(0, 1\]"):
        a100.with_overrides(intra_node_achievable=1.5)
    with pytest.raises(ConfigError, match=r"inter_node_achievable must be in \(0, 1\]"):
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
    assert get_accelerator("a100-80gb").attention_fraction is None  # no causal kernel evidence read
    assert "attention" in sxm.source
    assert (
        get_accelerator("h100-sxm", **parse_overrides(["attention_fraction=0.5"])).attention_fraction == 0.5
    )
    with pytest.raises(ConfigError, match=r"attention_fraction must be in \(0, 1\], got 1.5"):
        sxm.with_overrides(attention_fraction=1.5)
