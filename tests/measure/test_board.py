"""The board a GPU benchmark ran on, read from the driver: power limit and the SM clock under load.

No GPU here: the driver is a fake ``nvidia-smi`` (a script on PATH, or a runner function) that answers as the
real one does (``--format=csv,noheader,nounits``), so each check has an exact answer."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest

from microbatch.errors import ConfigError
from microbatch.hardware import get_accelerator
from microbatch.measure.board import MIN_SAMPLES, BoardReading, _run, clock_under_load, read_board
from microbatch.microbench_record import MicrobenchResult
from microbatch.predict.kernel_calibration import kernel_terms
from microbatch.show.answers import render_microbench


def test_read_board_parses_the_drivers_csv_and_asks_for_that_gpu():
    asked: list[list[str]] = []

    def run(cmd: list[str]) -> str:
        asked.append(cmd)
        return "700.00, 1755, 1980\n"

    r = read_board("GPU-1234", run)
    assert r == BoardReading(power_limit_w=700.0, sm_clock_mhz=1755.0, max_sm_clock_mhz=1980.0)
    assert asked == [["nvidia-smi", "--query-gpu=enforced.power.limit,clocks.sm,clocks.max.sm",
                      "--format=csv,noheader,nounits", "--id=GPU-1234"]]  # fmt: skip


@pytest.mark.parametrize(
    "out, want",
    [
        (None, None),  # the tool did not run
        ("", None),
        ("[N/A], [N/A], [N/A]\n", None),  # nothing usable
        ("700.00, 1755\n", None),  # not the three fields asked for
        (
            "[N/A], 1410, 1410\n",
            BoardReading(power_limit_w=None, sm_clock_mhz=1410.0, max_sm_clock_mhz=1410.0),
        ),
        ("400.00, 0, 1410\n", BoardReading(power_limit_w=400.0, sm_clock_mhz=None, max_sm_clock_mhz=1410.0)),
    ],
)
def test_read_board_says_none_or_what_it_could_read(out, want):
    assert read_board("0", lambda cmd: out) == want


def test_clock_under_load_is_the_median_after_the_clock_settles():
    """The clock falls from 1,980 to 1,500 MHz once the load starts (as a power-limited board does): the
    first quarter of the samples is left out and the median of the rest is the held clock."""
    t0 = time.perf_counter()

    def run(cmd: list[str]) -> str:
        clock = 1980 if time.perf_counter() - t0 < 0.05 else 1500
        return f"700.00, {clock}, 1980\n"

    calls = []
    r = clock_under_load(lambda: (calls.append(1), time.sleep(0.005)), 0.6, "0", run, every_s=0.02)
    assert r is not None and r.sm_clock_mhz == 1500.0 and r.power_limit_w == 700.0
    assert r.max_sm_clock_mhz == 1980.0 and len(calls) > 10  # the work ran the whole time
    assert clock_under_load(lambda: None, 0.1, "0", lambda cmd: None, every_s=0.02) is None


def test_a_reading_after_the_load_or_too_few_readings_give_no_clock():
    """A slow driver (0.3 s a call) over a 0.5 s load: the reading that returns after the load ended (the idle
    clock, 345 MHz) is dropped, and the one or two left are fewer than MIN_SAMPLES: no clock, not a wrong one."""
    assert MIN_SAMPLES == 3
    loaded = [True]

    def slow(cmd: list[str]) -> str:
        time.sleep(0.3)
        return "700.00, 1500, 1980\n" if loaded[0] else "700.00, 345, 1980\n"

    def work() -> None:
        time.sleep(0.01)

    r = clock_under_load(work, 0.5, "0", slow, every_s=0.0)
    loaded[0] = False
    assert r is None


def test_a_missing_or_failing_tool_reads_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    assert _run(["microbatch-no-such-tool", "--x"]) is None
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho '500.00, 1305, 1980'\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert read_board("0") == BoardReading(power_limit_w=500.0, sm_clock_mhz=1305.0, max_sm_clock_mhz=1980.0)
    fake.write_text("#!/bin/sh\necho 'No devices were found' >&2\nexit 6\n")
    assert read_board("0") is None


def _result(**board: float) -> MicrobenchResult:
    """A result whose kernels were timed after a soak (at the sustained clock: no burst factor on top)."""
    return MicrobenchResult(
        device="cuda", device_name="NVIDIA H100 80GB HBM3", accelerator="h100-sxm", torch_version="2.11",
        dtype="bf16", timer="CUDA events", soak_s=0.1, **board,
    )  # fmt: skip


def test_the_reading_is_kept_shown_and_read_back():
    r = _result(power_limit_w=500.0, sm_clock_mhz=1305.0, max_sm_clock_mhz=1980.0)
    back = MicrobenchResult.from_json(r.to_json())
    assert (back.power_limit_w, back.sm_clock_mhz, back.max_sm_clock_mhz) == (500.0, 1305.0, 1980.0)
    text = render_microbench(r.to_dict())
    assert "board: power limit 500 W; SM clock under a long GEMM 1,305 MHz of 1,980 maximum" in text
    old = r.to_dict()
    for k in ("power_limit_w", "sm_clock_mhz", "max_sm_clock_mhz"):
        old.pop(k)
    assert MicrobenchResult.from_dict(old).power_limit_w is None  # a file written before: still read
    assert "board:" not in render_microbench(old)


def test_a_reading_outside_the_boards_range_is_taken_at_its_edge():
    """A limit read below 0.25 of the rating (150 W of 700) or above it (800 W): no error the user could not act
    on; the scaling starts from the edge of the board's range, and the source says so."""
    sxm = get_accelerator("h100-sxm")
    low = kernel_terms(_result(power_limit_w=150.0), sxm.with_overrides(power_limit_w=200))
    assert low.clock_scale == pytest.approx((60 / 35) ** (1 / 3))
    assert "taken as 175 W, the edge of the board's range" in low.sources["clock"]
    # stretched past x 1.25 (175 -> 700 W would be x 2.52): refused, naming what to do
    with pytest.raises(ConfigError, match=r"past the 1.25 the clock law is trusted for; run bench-gpu at"):
        kernel_terms(_result(power_limit_w=150.0), sxm)
    high = kernel_terms(_result(power_limit_w=800.0), sxm)
    assert high.clock_scale == pytest.approx(1.0)
    assert "taken as 700 W" in high.sources["clock"]


def test_a_calibration_scales_from_the_limit_the_driver_read():
    """Measured at 500 W (read), planned at the row's 700 W: the clock × ((700-140)/(500-140))^(1/3); read at
    700 W it stays 1; an older file without the reading assumes the row's limit and says so."""
    sxm = get_accelerator("h100-sxm")
    up = kernel_terms(_result(power_limit_w=500.0), sxm)
    assert up.clock_scale == pytest.approx((560 / 360) ** (1 / 3))
    assert up.accelerator.sustained_clock_fraction == sxm.sustained_clock_fraction  # the plan's own, kept
    assert "measured at 500 W (read)" in up.sources["clock"]
    same = kernel_terms(_result(power_limit_w=700.0), sxm)
    assert same.clock_scale == 1.0 and "clock" not in same.sources
    old = kernel_terms(_result(), sxm.with_overrides(power_limit_w=500))
    assert old.clock_scale == pytest.approx((360 / 560) ** (1 / 3))
    assert "the row's, assumed" in old.sources["clock"]
