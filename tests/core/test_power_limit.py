"""Issue 28 (2): a board run under its rated power, and the H100 96 GB (HBM2e) that clusters run at 500 W."""

from __future__ import annotations

from dataclasses import replace

import pytest

from microbatch.errors import ConfigError
from microbatch.hardware import (
    ACCELERATORS,
    HOPPER,
    Accelerator,
    from_device_name,
    get_accelerator,
    match_accelerator,
)
from microbatch.hardware_clocks import (
    FIXED_POWER_SHARE,
    HOPPER_BURST_TO_SUSTAINED,
    MIN_POWER_SHARE,
    power_limited_clock,
)
from microbatch.units import GIB

K = HOPPER_BURST_TO_SUSTAINED  # the Hopper rows' sustained rate over the burst their kernel terms were measured at


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


@pytest.mark.parametrize("watts", [174.9, 140, 100, 0, -5, 701, 1000])
def test_power_limited_clock_refuses_a_limit_outside_the_board(watts):
    """A board accepts limits from 0.25 of its rating (an A100: 100 of 400 W) up to the rating."""
    assert MIN_POWER_SHARE == 0.25
    with pytest.raises(ConfigError, match=rf"power_limit_w {watts:g} W is outside \[175, 700\] W"):
        power_limited_clock(watts, 700, 700)
    assert power_limited_clock(175, 700, 700) == pytest.approx((35 / 560) ** (1 / 3))  # the lowest: 0.397


def test_overriding_the_power_limit_rescales_the_clock_and_an_explicit_fraction_wins():
    sxm = get_accelerator("h100-sxm")
    capped = get_accelerator("h100-sxm", power_limit_w=500)
    assert sxm.sustained_clock_fraction == pytest.approx(K)
    assert capped.sustained_clock_fraction == pytest.approx(K * (360 / 560) ** (1 / 3))
    assert capped.sustained_flops("bf16") == pytest.approx(sxm.flops("bf16") * K * 0.8631, rel=1e-4)
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
    with pytest.raises(
        ConfigError,
        match=r"power_limit_w 750 W is above its rated_power_w 700 W; .*give rated_power_w 750 or more, or power_limit_w 700 or less",
    ):
        get_accelerator("h100-sxm", power_limit_w=750)
    # every row has its rating now: the L4's 72 W and the MI300X's 750 W boards follow the same law
    assert (ACCELERATORS["l4"].rated_power_w, ACCELERATORS["mi300x"].rated_power_w) == (72, 750)
    assert get_accelerator("l4", power_limit_w=60).sustained_clock_fraction == pytest.approx(
        (45.6 / 57.6) ** (1 / 3)
    )


def test_a_new_rating_describes_another_board_and_is_checked_first():
    """With rated_power_w given the board is described anew: no rescaling (give the clock if it is known);
    a limit above the rating, or a rating that is not a finite number, is refused naming the field."""
    row = get_accelerator("h100-96gb")
    both = row.with_overrides(rated_power_w=500, power_limit_w=500)
    assert (both.power_limit_w, both.rated_power_w) == (500, 500)
    assert both.sustained_clock_fraction == row.sustained_clock_fraction  # not rescaled
    with pytest.raises(ConfigError, match=r"power_limit_w 500 W is above its rated_power_w 300 W"):
        row.with_overrides(rated_power_w=300)
    for bad in (float("nan"), float("inf"), -1.0):
        with pytest.raises(ConfigError, match=r"rated_power_w must be a finite number > 0"):
            row.with_overrides(rated_power_w=bad)
    with pytest.raises(ConfigError, match=r"power_limit_w must be a number, got 'abc'"):
        row.with_overrides(power_limit_w="abc")
    assert row.with_overrides(power_limit_w=None).sustained_clock_fraction == row.sustained_clock_fraction
    # an accelerator built with a limit but no rating cannot follow a new limit: refused, naming the fix
    bare = Accelerator(
        name="x", peak_flops={"bf16": 1e12, "fp16": 1e12, "fp32": 1e11}, memory_bytes=1e9,
        memory_bandwidth_bytes_per_s=1e11, intra_node_bytes_per_s=1e10, inter_node_bytes_per_s=1e9,
        power_limit_w=300,
    )  # fmt: skip
    with pytest.raises(ConfigError, match=r"x has no rated power.*give rated_power_w with it"):
        bare.with_overrides(power_limit_w=200)


def test_the_h100_96gb_row():
    """Six HBM2e stacks: 94 GiB at 2.41 TB/s (arXiv 2604.11391); the H100 SXM's compute; run at 500 of 700 W."""
    row, sxm = get_accelerator("h100-96gb"), get_accelerator("h100-sxm")
    assert row.name in HOPPER and row.attention_fraction == sxm.attention_fraction
    assert row.memory_bytes == 94 * GIB and row.memory_bandwidth_bytes_per_s == 2.41e12
    assert row.peak_flops == sxm.peak_flops and row.compute_units == sxm.compute_units == 132
    assert (row.power_limit_w, row.rated_power_w) == (500, 700)
    assert row.sustained_clock_fraction == pytest.approx(K * (360 / 560) ** (1 / 3))
    assert get_accelerator("h100-96gb", power_limit_w=700).sustained_clock_fraction == pytest.approx(K)
    assert "2604.11391" in row.source and "a model, not a reading" in row.source
    assert get_accelerator("h100-hbm2e") == row
    assert match_accelerator("NVIDIA H100 96GB HBM2e") == "h100-96gb"
    assert match_accelerator("NVIDIA H100 80GB HBM3") == "h100-sxm"
    # by a name that says HBM2e only: a 94 GiB H100 may be HBM3 (GH200's), and "96" may be a serial number
    assert match_accelerator("NVIDIA H100-SXM5-80GB-2396") == "h100-sxm"
    assert from_device_name("NVIDIA H100 96GB HBM2e", 93.6 * GIB).name == "h100-96gb"
    assert from_device_name("NVIDIA H100", 93.6 * GIB).name == "h100-sxm"
    assert from_device_name("NVIDIA H100 80GB HBM3", 79.6 * GIB).name == "h100-sxm"
    assert from_device_name("NVIDIA H100 NVL", 93.0 * GIB).name == "h100-nvl"
    assert from_device_name("NVIDIA H100 PCIe").name == "h100-pcie"


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
    assert t500 == pytest.approx(t700 / (360 / 560) ** (1 / 3), rel=1e-9)
    # with memory: at 700 W the row differs from the 80 GB H100 SXM by its bandwidth alone, so with everything
    # compute-bound again the two agree; with real bandwidth the HBM2e row is slower, by less than 3.35 / 2.41
    compute = dict(
        intra_node_bytes_per_s=1e30, inter_node_bytes_per_s=1e30, memory_bandwidth_bytes_per_s=1e30
    )
    sxm_c = predict_step_time_s(shape, 2, get_accelerator("h100-sxm", **compute), efficiency=bare)
    assert predict_step_time_s(
        shape, 2, get_accelerator("h100-96gb", power_limit_w=700, **compute), efficiency=bare
    ) == pytest.approx(sxm_c, rel=1e-9)
    sxm_t = predict_step_time_s(shape, 2, get_accelerator("h100-sxm"), efficiency=bare)
    row_t = predict_step_time_s(shape, 2, get_accelerator("h100-96gb", power_limit_w=700), efficiency=bare)
    assert sxm_t < row_t < sxm_t * 3350 / 2410


def test_the_plan_header_says_the_limit_and_the_clock(capsys: pytest.CaptureFixture[str]):
    from microbatch.cli import main

    base = ["plan", "--model", "llama-3-8b", "-B", "256", "-d", "32"]
    assert main([*base, "--gpu", "h100-96gb"]) == 0
    assert f"on 32 × h100-96gb (500 W of 700, sustained clock × {K * (360 / 560) ** (1 / 3):.3f}):" in (
        capsys.readouterr().out
    )
    assert main([*base, "--gpu", "h100-sxm"]) == 0
    # at its rating: the sustained clock the Hopper rows hold under a step's load (issue 28)
    assert f"on 32 × h100-sxm (sustained clock × {K:.3f}): B_global" in capsys.readouterr().out
    assert main([*base, "--gpu", "a100-80gb"]) == 0
    assert "on 32 × a100-80gb: B_global" in capsys.readouterr().out  # at its rating and clock: nothing said
    assert main([*base, "--gpu", "h100-sxm", "--gpu-set", "power_limit_w=600"]) == 0
    assert f"(600 W of 700, sustained clock × {K * (460 / 560) ** (1 / 3):.3f})" in capsys.readouterr().out
