"""Issue 28 (2): a board run under its rated power, and the H100 96 GB (HBM2e) that clusters run at 500 W."""

from __future__ import annotations

from dataclasses import replace

import pytest

from microbatch.errors import ConfigError
from microbatch.hardware import ACCELERATORS, HOPPER, from_device_name, get_accelerator, match_accelerator
from microbatch.hardware_clocks import FIXED_POWER_SHARE, power_limited_clock
from microbatch.units import GIB


def test_power_limited_clock_by_hand():
    """f(P)/f(P_ref) = ((P - P0)/(P_ref - P0))^(1/3), P0 = 0.2 x rated: an H100 SXM at 500 of 700 W."""
    assert FIXED_POWER_SHARE == 0.2
    assert power_limited_clock(500, 700, 700) == pytest.approx((360 / 560) ** (1 / 3))
    assert power_limited_clock(500, 700, 700) == pytest.approx(0.8631, abs=1e-4)
    assert power_limited_clock(700, 700, 700) == 1.0
    assert power_limited_clock(700, 500, 700) == pytest.approx(1 / power_limited_clock(500, 700, 700))
    # it composes: 700 -> 600 -> 500 is 700 -> 500
    assert power_limited_clock(600, 700, 700) * power_limited_clock(500, 600, 700) == pytest.approx(
        power_limited_clock(500, 700, 700)
    )
    # monotone, and never below the linear (voltage-floor) loss it bounds
    clocks = [power_limited_clock(w, 700, 700) for w in (200, 300, 400, 500, 600, 700)]
    assert clocks == sorted(clocks)
    for w, f in zip((200, 300, 400, 500, 600, 700), clocks, strict=True):
        assert f >= (w - 140) / (700 - 140) - 1e-12


@pytest.mark.parametrize("watts", [140, 100, 0, -5, 701, 1000])
def test_power_limited_clock_refuses_a_limit_outside_the_board(watts):
    with pytest.raises(ConfigError, match=rf"power_limit_w {watts:g} W is outside \(140, 700\] W"):
        power_limited_clock(watts, 700, 700)


def test_overriding_the_power_limit_rescales_the_clock_and_an_explicit_fraction_wins():
    sxm = get_accelerator("h100-sxm")
    capped = get_accelerator("h100-sxm", power_limit_w=500)
    assert capped.sustained_clock_fraction == pytest.approx(power_limited_clock(500, 700, 700))
    assert capped.sustained_flops("bf16") == pytest.approx(sxm.flops("bf16") * 0.8631, rel=1e-4)
    assert capped.flops("bf16") == sxm.flops("bf16")  # MFU's denominator stays the datasheet's
    # a fraction given with it is the user's reading: kept as given
    assert (
        get_accelerator("h100-sxm", power_limit_w=500, sustained_clock_fraction=0.9).sustained_clock_fraction
        == 0.9
    )
    # overrides compose: 700 -> 600 -> 500 on a row is 700 -> 500
    assert capped.sustained_clock_fraction == pytest.approx(
        sxm.with_overrides(power_limit_w=600).with_overrides(power_limit_w=500).sustained_clock_fraction
    )
    # the A100's 400 W board: 80 W fixed
    assert get_accelerator("a100-80gb", power_limit_w=300).sustained_clock_fraction == pytest.approx(
        (220 / 320) ** (1 / 3)
    )
    with pytest.raises(ConfigError, match=r"at most at its rated 700 W"):
        get_accelerator("h100-sxm", power_limit_w=750)
    # a row with no rated power only records the limit
    assert ACCELERATORS["l4"].rated_power_w is None
    assert get_accelerator("l4", power_limit_w=60).sustained_clock_fraction == 1.0


def test_the_h100_96gb_row():
    """Six HBM2e stacks: 94 GiB at 2.41 TB/s (arXiv 2604.11391); the H100 SXM's compute; run at 500 of 700 W."""
    row, sxm = get_accelerator("h100-96gb"), get_accelerator("h100-sxm")
    assert row.name in HOPPER and row.attention_fraction == sxm.attention_fraction
    assert row.memory_bytes == 94 * GIB and row.memory_bandwidth_bytes_per_s == 2.41e12
    assert row.peak_flops == sxm.peak_flops and row.compute_units == sxm.compute_units == 132
    assert (row.power_limit_w, row.rated_power_w) == (500, 700)
    assert row.sustained_clock_fraction == pytest.approx(power_limited_clock(500, 700, 700))
    assert get_accelerator("h100-96gb", power_limit_w=700).sustained_clock_fraction == pytest.approx(1.0)
    assert "2604.11391" in row.source and "a model, not a reading" in row.source
    assert get_accelerator("h100-hbm2e") == row
    assert match_accelerator("NVIDIA H100 96GB HBM2e") == "h100-96gb"
    assert match_accelerator("NVIDIA H100 80GB HBM3") == "h100-sxm"
    assert from_device_name("NVIDIA H100", 93.6 * GIB).name == "h100-96gb"  # told apart by its memory
    assert from_device_name("NVIDIA H100 80GB HBM3", 79.6 * GIB).name == "h100-sxm"
    assert from_device_name("NVIDIA H100 NVL", 93.0 * GIB).name == "h100-nvl"


def test_a_step_on_the_capped_board_by_hand():
    """With unlimited bandwidth and links and no launch floor every term is compute-bound: the step on the
    500 W row is the 700 W one / 0.863; with real memory the memory-bound terms slow by 3.35 / 2.41 instead."""
    from microbatch.model import get_model
    from microbatch.predict.gemm import DEFAULT_EFFICIENCY
    from microbatch.predict.steptime import predict_step_time_s

    shape = get_model("llama-3-8b")
    bare = replace(  # no launch floor, no fixed per-tile seconds, no row ramp: nothing but rates
        DEFAULT_EFFICIENCY, launch_s_per_kernel=0.0, tile_rows=0, tile_overhead_s=0.0, ramp_rows=0.0
    )
    fast = dict(memory_bandwidth_bytes_per_s=1e30, intra_node_bytes_per_s=1e30, inter_node_bytes_per_s=1e30)
    full, capped = (
        get_accelerator("h100-96gb", power_limit_w=700, **fast),
        get_accelerator("h100-96gb", **fast),
    )
    t700 = predict_step_time_s(shape, 2, full, efficiency=bare)
    t500 = predict_step_time_s(shape, 2, capped, efficiency=bare)
    assert t500 == pytest.approx(t700 / power_limited_clock(500, 700, 700), rel=1e-9)
    # the real rows: slower than the 80 GB H100 SXM (lower clock and bandwidth), by less than the two together
    sxm_t = predict_step_time_s(shape, 2, get_accelerator("h100-sxm"), efficiency=bare)
    row_t = predict_step_time_s(shape, 2, get_accelerator("h100-96gb"), efficiency=bare)
    assert sxm_t / 0.8631 < row_t < sxm_t * 3.35 / 2.41 / 0.8631
