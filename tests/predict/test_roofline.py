"""Roofline times and FLOP counts against the published formulas and the roofline's shape."""

from __future__ import annotations

import pytest

from microbatch.hardware import get_accelerator
from microbatch.model import get_model
from microbatch.predict.roofline import (
    RooflineEfficiency,
    allgather_time_s,
    allreduce_time_s,
    arithmetic_intensity,
    gemm_time_s,
    group_bandwidth,
    hardware_flops_per_step,
    layer_forward,
    model_flops_per_step,
    wave_efficiency,
)

A100 = get_accelerator("a100-80gb")
PURE = RooflineEfficiency(gemm_max=1.0, memory=1.0, tile_rows=0, tile_cols=0)


@pytest.mark.parametrize("name", ["megatron-22b", "megatron-175b", "megatron-530b", "megatron-1t"])
def test_flops_formulas_of_narayanan_2021(name):
    sh = get_model(name)
    B, s, L, h, V = 512, sh.seq, sh.layers, sh.hidden, sh.vocab
    assert model_flops_per_step(sh, B) == pytest.approx(
        72 * B * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h))
    )
    assert hardware_flops_per_step(sh, B, recompute="full") == pytest.approx(
        96 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))
    )
    # parameter formula 12·L·h²·(1 + 13/(12h) + (V+s)/(12·L·h)): our count adds only the final norm (2h)
    # and the untied output layer (V·h)
    formula = 12 * L * h * h * (1 + 13 / (12 * h) + (V + s) / (12 * L * h))
    assert sh.param_count() == pytest.approx(formula + 2 * h + V * h, rel=1e-12)


def test_gemm_crosses_the_ridge_point():
    k = n = 4096
    ridge = A100.ridge_point()
    small, large = arithmetic_intensity(8, k, n), arithmetic_intensity(8192, k, n)
    assert small < ridge < large
    # memory-bound: doubling rows barely changes time; compute-bound: time doubles
    t8, t16 = gemm_time_s(8, k, n, A100, efficiency=PURE), gemm_time_s(16, k, n, A100, efficiency=PURE)
    t8k, t16k = (
        gemm_time_s(8192, k, n, A100, efficiency=PURE),
        gemm_time_s(16384, k, n, A100, efficiency=PURE),
    )
    assert t16 / t8 < 1.05
    assert t16k / t8k == pytest.approx(2.0)
    assert t8k == pytest.approx(2 * 8192 * k * n / 312e12)


def test_throughput_rises_then_plateaus_with_micro_batch():
    shape = get_model("gpt2")
    rates = []
    for b in (1, 2, 4, 8, 16, 32, 64):
        lt = layer_forward(shape, b, A100, seq=16, efficiency=PURE)
        rates.append(lt.flops / lt.total_s)
    assert all(b >= a * 0.999 for a, b in zip(rates, rates[1:], strict=False))  # never falls
    assert rates[2] / rates[0] > 2  # steep at first (memory-bound)
    assert rates[-1] / rates[-2] < 1.1  # flat at the end


def test_wave_quantisation():
    assert wave_efficiency(128 * 108, 128, 108) == 1.0  # one full wave
    assert wave_efficiency(128 * 109, 128, 108) == pytest.approx(109 / 216)  # one tile spills into wave 2
    assert wave_efficiency(100, 100, None) == 1.0


def test_efficiency_scales_compute_time():
    half = RooflineEfficiency(gemm_max=0.5, memory=1.0, tile_rows=0, tile_cols=0)
    assert gemm_time_s(8192, 4096, 4096, A100, efficiency=half) == pytest.approx(
        2 * gemm_time_s(8192, 4096, 4096, A100, efficiency=PURE)
    )


def test_tensor_parallel_splits_compute_and_adds_comm():
    shape = get_model("megatron-22b")
    one = layer_forward(shape, 1, A100, efficiency=PURE)
    eight = layer_forward(shape, 1, A100, tensor_parallel=8, efficiency=PURE)
    assert eight.gemm_s == pytest.approx(one.gemm_s / 8, rel=0.05)
    assert one.tp_comm_s == 0 and eight.tp_comm_s == pytest.approx(
        2 * allreduce_time_s(2 * 2048 * 6144, 8, A100.intra_node_bytes_per_s)
    )


def test_collectives_and_groups():
    assert allreduce_time_s(1e9, 1, 1e9) == 0
    assert allreduce_time_s(1e9, 4, 1e9) == pytest.approx(1.5)  # 2·(n−1)/n
    assert allgather_time_s(1e9, 4, 1e9) == pytest.approx(0.75)
    assert group_bandwidth(A100, 8, 1) == A100.intra_node_bytes_per_s
    assert group_bandwidth(A100, 8, 2) == A100.inter_node_bytes_per_s
