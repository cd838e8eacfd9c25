"""validate's CPU figures in their own units, and an empty GPU name (a fuzzer's runs, 2026-12-07): 2e12 given as
GFLOP/s was taken as 2·10²¹ FLOP/s and gave "errors" of -83%; a tiny one was refused in the wrong unit; ``gpu=''``
read as no GPU."""

from __future__ import annotations

import pytest

from microbatch.errors import ConfigError
from microbatch.predict import validation
from tests.predict.test_validation import _cpu_result


@pytest.mark.parametrize(
    ("kw", "words"),
    [
        (
            {"cpu_peak_gflops": 2.0e12, "cpu_bandwidth_gbs": 20},
            r"cpu_peak_gflops 2e\+12 is outside .* GFLOP/s",
        ),
        (
            {"cpu_peak_gflops": 1e-10, "cpu_bandwidth_gbs": 20},
            r"cpu_peak_gflops 1e-10 is outside .*e\.g\. 200",
        ),
        ({"cpu_peak_gflops": 50, "cpu_bandwidth_gbs": 1e-12}, r"cpu_bandwidth_gbs 1e-12 is outside .* GB/s"),
        (
            {"cpu_peak_gflops": 50, "cpu_bandwidth_gbs": float("nan")},
            r"cpu_bandwidth_gbs must be a finite number",
        ),
        ({"cpu_peak_gflops": 50, "cpu_bandwidth_gbs": 10, "gpu": ""}, r"gpu '' names no accelerator"),
    ],
)
def test_figures_out_of_their_units_range_are_refused_in_their_units(kw, words):
    with pytest.raises(ConfigError, match=words):
        validation.validate_result(_cpu_result(), **kw)


def test_the_bounds_take_real_cpus():
    # a Sapphire Rapids AMX peak and a Xeon Max's HBM: taken (the errors are then large, as they should be)
    d = validation.validate_result(_cpu_result(), cpu_peak_gflops=115_000, cpu_bandwidth_gbs=1_000)
    assert d["accelerator"]["peak_flops"]["fp32"] == pytest.approx(115e12)
