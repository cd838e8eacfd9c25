"""The flash-attention core on its own curve (issue 28): each term against a hand computation."""

from __future__ import annotations

import pytest

from microbatch.hardware import get_accelerator
from microbatch.model import ModelShape
from microbatch.predict.attention import (
    FLASH_SEQ_HALF,
    causal_flash_flops,
    flash_attention_times_s,
    flash_backward_flops,
    flash_rate_fraction,
)
from microbatch.predict.roofline import layer_forward


def test_terms_by_hand() -> None:
    assert causal_flash_flops(8e12) == 4e12
    assert flash_backward_flops(4e12) == 10e12  # 5 matmuls against 2
    # 0.389 x 2048 / (2048 + 241) = 0.34803...: the H200's measured 0.348 at s = 2,048 comes back
    assert flash_rate_fraction(2048, 0.389) == pytest.approx(0.389 * 2048 / 2289)
    assert flash_rate_fraction(2048, 0.389) == pytest.approx(0.3477, abs=5e-4)
    assert flash_rate_fraction(0, 0.5) == 0.0
    assert FLASH_SEQ_HALF == 241.0


def test_ramp_reproduces_the_h100_kernel_benchmark() -> None:
    """The s0 = 241 ramp through tritonbench's FA2 (Triton) points: within 1.5% at every listed length."""
    fa2 = {512: 329, 1024: 390, 2048: 434, 4096: 458, 8192: 471, 16384: 477}
    ceiling = 477 / flash_rate_fraction(16384, 1.0)
    for s, tflops in fa2.items():
        assert ceiling * flash_rate_fraction(s, 1.0) == pytest.approx(tflops, rel=0.015)


def test_times_by_hand() -> None:
    full, peak = 1e12, 989.4e12
    fwd, bwd = flash_attention_times_s(full, 8192, peak, 0.389)
    rate = peak * 0.389 * 8192 / (8192 + 241)
    assert fwd == pytest.approx(0.5e12 / rate)
    assert bwd == pytest.approx(2.5 * fwd)


def test_layer_uses_the_flash_curve_only_with_flash_and_a_ceiling() -> None:
    shape = ModelShape(name="l", layers=1, hidden=4096, heads=32, vocab=32000, seq=8192)
    h100 = get_accelerator("h100-sxm")
    lt = layer_forward(shape, 1, h100, flash_attention=True)
    full = 2.0 * 8192 * 8192 * (4096 + 4096)  # 2 rows s (d_qk + d_v) a, rows = s
    fwd, bwd = flash_attention_times_s(full, 8192, h100.flops("bf16"), 0.389)
    assert lt.attention_s == pytest.approx(fwd)
    assert lt.attention_backward_s == pytest.approx(bwd)
    # the old rule (full FLOPs at the GEMM efficiency 0.8, backward 2 x): forward and backward 1.38 F/peak
    # and 2.78 F/peak ms-for-ms; the curve: (1/2 + 5/4) F / (0.378 peak), 23% slower in all
    old_total = 3 * full / (h100.flops("bf16") * 0.8)
    assert (fwd + bwd) / old_total == pytest.approx(1.75 / (0.389 * 8192 / 8433) / 3.75, rel=1e-6)
    assert (lt.attention_s + (lt.attention_backward_s or 0.0)) / old_total > 1.2
    # without a ceiling (an accelerator with no kernel evidence): the GEMM-efficiency rule as before
    bare = h100.with_overrides(attention_fraction=None)
    old = layer_forward(shape, 1, bare, flash_attention=True)
    assert old.attention_s == pytest.approx(full / (h100.flops("bf16") * 0.8))
    # without flash: the score passes through memory, untouched by the flash curve
    assert layer_forward(shape, 1, h100, flash_attention=False).attention_s == pytest.approx(
        layer_forward(shape, 1, bare, flash_attention=False).attention_s
    )


def test_fa3_ceiling_reproduces_its_kernel_benchmark() -> None:
    """FA3_HOPPER_CEILING x peak through the ramp: tritonbench's FA3 points on an H100 within 1.5%."""
    from microbatch.predict.attention import FA3_HOPPER_CEILING

    peak = get_accelerator("h100-sxm").flops("bf16") / 1e12
    fa3 = {512: 430, 1024: 517, 2048: 566, 4096: 590, 8192: 614, 16384: 621}
    for s, tflops in fa3.items():
        assert peak * flash_rate_fraction(s, FA3_HOPPER_CEILING) == pytest.approx(tflops, rel=0.015)
