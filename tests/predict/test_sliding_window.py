"""Sliding-window attention layers (Mistral 7B v0.1, GPT-OSS, Gemma 2/3): the keys a query sees, the core's
time under flash attention, the model FLOPs, and a Hugging Face config's window read as the model runs it."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from microbatch.errors import ConfigError
from microbatch.hardware import get_accelerator
from microbatch.hf_attention import sliding_window_of
from microbatch.model import ModelShape, from_hf_config, get_model
from microbatch.predict.attention import flash_attention_times_s
from microbatch.predict.attention_core import attention_core_s, attention_span, window_span
from microbatch.predict.gemm import DEFAULT_EFFICIENCY
from microbatch.predict.roofline import layer_forward, layer_forward_flops

H100 = get_accelerator("h100-sxm")
LLAMA = get_model("llama-3-8b", seq=8192)


def test_window_span_counts_the_causal_pairs():
    # s = 8, w = 3: pairs 1 + 2 + 3·6 = 21 against 36 with no window; σ = 8 · 21/36
    assert window_span(8, 3) == pytest.approx(8 * 21 / 36)
    assert window_span(8, 8) == window_span(8, 100) == window_span(8, None) == 8.0
    s, w = 131072, 128  # long sequences: σ → 2w (a causal layer of 2w has w keys per query on average)
    assert window_span(s, w) == pytest.approx(2 * w, rel=1e-3)


def test_attention_span_averages_full_and_windowed_layers():
    half = replace(LLAMA, sliding_window=1024, sliding_layers=16)  # 16 of 32 layers
    assert half.sliding_share == 0.5
    assert attention_span(half, 8192) == pytest.approx(0.5 * 8192 + 0.5 * window_span(8192, 1024))
    assert attention_span(LLAMA, 8192) == 8192
    rows = 8192.0
    qk = LLAMA.q_width
    delta = layer_forward_flops(LLAMA, rows, 8192) - layer_forward_flops(half, rows, 8192)
    assert delta == pytest.approx(2 * rows * (8192 - attention_span(half, 8192)) * 2 * qk)


def test_the_core_of_a_windowed_layer_is_a_shorter_causal_layer_under_flash():
    every = replace(LLAMA, sliding_window=1024)  # every layer windowed
    rows, s = 8192.0, 8192
    full = attention_core_s(LLAMA, rows, s, 1, 1, True, H100, "bf16", DEFAULT_EFFICIENCY)
    win = attention_core_s(every, rows, s, 1, 1, True, H100, "bf16", DEFAULT_EFFICIENCY)
    span = window_span(s, 1024)
    flops = 2.0 * rows * s * 2 * LLAMA.q_width
    expect = flash_attention_times_s(flops * span / s, span, H100.flops("bf16"), H100.attention_fraction,
                                     head_dim=LLAMA.head_dim)  # fmt: skip
    assert win == pytest.approx(expect) and win[0] < full[0] / 3
    half = replace(LLAMA, sliding_window=1024, sliding_layers=16)
    mixed = attention_core_s(half, rows, s, 1, 1, True, H100, "bf16", DEFAULT_EFFICIENCY)
    assert mixed == pytest.approx(((full[0] + win[0]) / 2, (full[1] + win[1]) / 2))
    # eager attention computes the whole masked matrix; under context parallelism the window is not applied
    assert attention_core_s(every, rows, s, 1, 1, False, H100, "bf16", DEFAULT_EFFICIENCY) == attention_core_s(
        LLAMA, rows, s, 1, 1, False, H100, "bf16", DEFAULT_EFFICIENCY)  # fmt: skip
    assert attention_core_s(every, rows / 4, s, 4, 1, True, H100, "bf16", DEFAULT_EFFICIENCY) == attention_core_s(
        LLAMA, rows / 4, s, 4, 1, True, H100, "bf16", DEFAULT_EFFICIENCY)  # fmt: skip


def test_a_smaller_window_never_makes_a_layer_slower():
    lts = [
        layer_forward(replace(LLAMA, sliding_window=w), 1, H100, seq=32768)
        for w in (32768, 16384, 4096, 1024, 128)
    ]
    times = [lt.total_s for lt in lts]
    assert all(a >= b for a, b in zip(times, times[1:], strict=False))
    assert lts[-1].attention_s < lts[0].attention_s / 20 and lts[-1].gemm_s == lts[0].gemm_s  # the GEMMs stay


def _config(tmp_path, **kw):
    cfg = {"model_type": "mistral", "num_hidden_layers": 12, "hidden_size": 64, "num_attention_heads": 4,
           "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 100, "max_position_embeddings": 32768,
           "hidden_act": "silu", **kw}  # fmt: skip
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return from_hf_config(path)


def test_a_configs_window_is_read_as_the_model_runs_it(tmp_path):
    s = _config(tmp_path, sliding_window=4096)  # Mistral 7B v0.1: every layer
    assert (s.sliding_window, s.sliding_layers, s.sliding_share) == (4096, None, 1.0)
    types = ["sliding_attention", "full_attention"] * 6  # GPT-OSS
    s = _config(tmp_path, model_type="gpt_oss", sliding_window=128, layer_types=types)
    assert (s.sliding_window, s.sliding_layers) == (128, 6)
    s = _config(tmp_path, model_type="qwen2", sliding_window=4096, use_sliding_window=False)
    assert s.sliding_window is None
    assert _config(tmp_path, model_type="gemma2", sliding_window=4096).sliding_layers == 6
    assert (
        _config(
            tmp_path, model_type="gemma3_text", sliding_window=1024, sliding_window_pattern=6
        ).sliding_layers
        == 10
    )
    assert _config(tmp_path, sliding_window=32768).sliding_window is None  # no shorter than the positions
    assert sliding_window_of({"sliding_window": None}, 12, 100) == (None, None)


def test_bad_windows_are_refused():
    with pytest.raises(ConfigError, match="sliding_layers 3 without sliding_window"):
        ModelShape(layers=4, hidden=64, heads=4, vocab=10, seq=8, sliding_layers=3)
    with pytest.raises(ConfigError, match=r"sliding_layers 5 is not a whole number in 0\.\.4"):
        ModelShape(layers=4, hidden=64, heads=4, vocab=10, seq=8, sliding_window=4, sliding_layers=5)
    with pytest.raises(ConfigError, match="sliding_window must be"):
        ModelShape(layers=4, hidden=64, heads=4, vocab=10, seq=8, sliding_window=0)


def test_qwen2s_window_covers_the_layers_from_max_window_layers(tmp_path):
    s = _config(
        tmp_path, model_type="qwen2", sliding_window=4096, use_sliding_window=True, max_window_layers=8
    )
    assert (s.sliding_window, s.sliding_layers) == (4096, 4)  # layers 8..11 of 12
    assert _config(tmp_path, model_type="qwen2", sliding_window=4096, use_sliding_window=True,
                   max_window_layers=12).sliding_window is None  # fmt: skip
    with pytest.raises(ConfigError, match="not a whole number"):
        ModelShape(layers=4, hidden=64, heads=4, vocab=10, seq=8, sliding_window=4, sliding_layers=True)
