"""Llama 4's chunked attention: a query sees the keys of its own chunk up to itself (transformers'
``chunked_attention`` layers), priced as the shorter causal layer it is, and read from a config as transformers
derives it (it was priced as full attention)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from microbatch.errors import ConfigError
from microbatch.hardware import get_accelerator
from microbatch.model import from_hf_config, get_model
from microbatch.predict.attention import flash_attention_times_s
from microbatch.predict.attention_core import attention_core_s, attention_span, window_span
from microbatch.predict.gemm import DEFAULT_EFFICIENCY

H100 = get_accelerator("h100-sxm")
LLAMA = get_model("llama-3-8b", seq=32768)


def _pairs(s: int, w: int) -> int:
    """(query, key) pairs by the mask's definition: key ≤ query and key // w == query // w."""
    return sum(i - (i // w) * w + 1 for i in range(s))


@pytest.mark.parametrize(("s", "w"), [(10, 4), (12, 4), (8, 3), (1000, 64), (5, 5), (5, 9)])
def test_chunk_span_counts_the_pairs_of_the_mask(s, w):
    # σ is the length of a full causal layer with the same pairs: σ(σ + 1)/2 ≈ pairs, in the s/(s + 1) convention
    assert window_span(s, w, chunked=True) == pytest.approx(2 * _pairs(s, w) / (s + 1))
    # by hand, s = 10, w = 4: chunks of 4, 4, 2 → 10 + 10 + 3 = 23 pairs
    assert _pairs(10, 4) == 23


def test_a_chunk_sees_fewer_keys_than_a_window_of_its_size_and_never_more_than_full():
    for s in (8192, 32768, 131072):
        chunked, sliding = window_span(s, 8192, chunked=True), window_span(s, 8192)
        assert chunked <= sliding <= s
    assert window_span(8192, 8192, chunked=True) == 8192.0  # one chunk: full causal attention
    assert window_span(131072, 8192, chunked=True) == pytest.approx(8193 * 131072 / 131073)  # ≈ w + 1


def test_the_core_of_a_chunked_layer_is_one_chunks_causal_kernel_under_flash():
    every = replace(LLAMA, sliding_window=8192, local_attention="chunked")
    rows, s = 32768.0, 32768
    span = window_span(s, 8192, chunked=True)
    flops = 2.0 * rows * s * 2 * LLAMA.q_width
    expect = flash_attention_times_s(flops * span / s, span / H100.attention_ramp, H100.flops("bf16"),
                                     H100.attention_fraction, head_dim=LLAMA.head_dim)  # fmt: skip
    got = attention_core_s(every, rows, s, 1, 1, True, H100, "bf16", DEFAULT_EFFICIENCY)
    full = attention_core_s(LLAMA, rows, s, 1, 1, True, H100, "bf16", DEFAULT_EFFICIENCY)
    assert got == pytest.approx(expect) and got[0] < full[0] / 3
    assert attention_span(every, s) == pytest.approx(span)
    with pytest.raises(ConfigError, match="local_attention 'banded' is not known"):
        replace(LLAMA, sliding_window=8192, local_attention="banded")


LLAMA4 = {"model_type": "llama4_text", "hidden_act": "silu", "num_hidden_layers": 8, "hidden_size": 512,
          "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 256,
          "intermediate_size_mlp": 1024, "num_local_experts": 4, "num_experts_per_tok": 1, "vocab_size": 1000,
          "max_position_embeddings": 262144, "tie_word_embeddings": False}  # fmt: skip


@pytest.mark.parametrize(
    ("extra", "chunk", "count"),
    [
        ({}, 8192, 6),  # transformers' defaults: 8,192-token chunks, every 4th layer global (NoPE)
        ({"attention_chunk_size": 4096}, 4096, 6),
        ({"no_rope_layers": [1, 1, 0, 1, 1, 1, 1, 0]}, 8192, 6),
        ({"no_rope_layer_interval": 2}, 8192, 4),
    ],
)
def test_a_llama4_config_is_chunked_on_the_layers_transformers_makes_chunked(tmp_path, extra, chunk, count):
    transformers = pytest.importorskip("transformers")
    cfg = {**LLAMA4, **extra}
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    shape = from_hf_config(p)
    real = transformers.AutoConfig.for_model(**cfg)
    assert sum(x == "chunked_attention" for x in real.layer_types) == count  # what transformers runs
    assert (shape.sliding_window, shape.sliding_layers, shape.local_attention) == (chunk, count, "chunked")


def test_the_llama4_rule_without_transformers_layer_types():
    from microbatch.hf_attention import chunked_attention_of

    base = {"model_type": "llama4_text"}
    assert chunked_attention_of(base, 48) == (8192, 36)  # Scout/Maverick: 48 layers, 12 global
    assert chunked_attention_of({**base, "attention_chunk_size": None}, 48) == (None, None)
    assert chunked_attention_of({**base, "no_rope_layers": [1, 0] * 24}, 48) == (8192, 24)
    assert chunked_attention_of({"model_type": "llama", "attention_chunk_size": 4096}, 32) == (None, None)
    types = ["chunked_attention"] * 3 + ["full_attention"]
    assert chunked_attention_of(
        {"model_type": "x", "attention_chunk_size": 4096, "layer_types": types}, 4
    ) == (4096, 3)


def test_lists_longer_than_the_blocks_count_the_blocks_only():
    from microbatch.hf_attention import chunked_attention_of

    assert chunked_attention_of({"model_type": "llama4_text", "no_rope_layers": [1] * 10}, 8) == (8192, 8)
