"""A head width set apart from hidden/heads (Qwen3, Gemma, GPT-OSS: Hugging Face's ``head_dim``).

Each test fails where the formulas take the query and attention-output width as h: parameters against
transformers' own model built from the same config, FLOPs and activation bytes against a hand count, the
built-in GPT's parameters and forward against the shape.
"""

from __future__ import annotations

import json

import pytest
import torch

from microbatch.errors import ConfigError
from microbatch.measure.gpt import build_model
from microbatch.model import ModelShape, from_hf_config
from microbatch.predict.activations import layer_activation_terms
from microbatch.predict.recompute import op_recompute_gemm_share
from microbatch.predict.roofline import hardware_flops_per_step, layer_forward_flops, model_flops_per_step
from microbatch.run.pipeline.split import model_units, shape_unit_params, unit_param_counts

# Qwen3-0.6B's attention geometry, scaled down: 16 heads of 32 on a 64-wide residual (q width 512 = 8 h).
WIDE = ModelShape(
    name="wide-heads", layers=2, hidden=64, heads=16, head_size=32, kv_heads=4, ffn_hidden=96, vocab=300, seq=32,
    gated_mlp=True, bias=False, norm="rmsnorm", learned_positions=False, dropout=False,
)  # fmt: skip
LLAMA_WIDE_CFG = {
    "model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 16, "head_dim": 32,
    "num_key_value_heads": 4, "intermediate_size": 96, "vocab_size": 300, "max_position_embeddings": 32,
    "hidden_act": "silu", "tie_word_embeddings": False,
}  # fmt: skip


def test_q_and_o_projections_are_a_times_d_wide():
    h, qw, kvd, f = 64, 16 * 32, 4 * 32, 96
    assert WIDE.q_width == qw and WIDE.head_dim == 32
    assert WIDE.attention_params() == h * qw + qw * h + 2 * h * kvd
    assert WIDE.layer_params() == WIDE.attention_params() + 3 * h * f + 2 * h
    # the default is unchanged: d_h = h/a, q and o h × h
    plain = ModelShape(layers=1, hidden=64, heads=4, vocab=10, seq=8)
    assert (
        plain.q_width == 64 and plain.attention_params() == 4 * 64 * 64 + 4 * 64
    )  # four h × h weights, four biases


def test_params_match_transformers_built_from_the_same_config(tmp_path):
    transformers = pytest.importorskip("transformers")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA_WIDE_CFG))
    shape = from_hf_config(path)
    assert shape.head_size == 32 and shape.q_width == 512
    cfg = transformers.AutoConfig.from_pretrained(str(path))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    assert shape.param_count() == sum(p.numel() for p in model.parameters())


def test_a_config_head_dim_equal_to_hidden_over_heads_is_not_kept(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**LLAMA_WIDE_CFG, "head_dim": 4}))  # 64 / 16
    assert from_hf_config(path).head_size is None


def test_the_built_gpt_has_the_shapes_parameters_and_runs():
    model = build_model(WIDE)
    assert sum(p.numel() for p in model.parameters()) == WIDE.param_count()
    assert shape_unit_params(WIDE) == unit_param_counts(model_units(build_model(WIDE, device="meta")))
    logits = model(torch.randint(0, WIDE.vocab, (2, 16)))
    assert logits.shape == (2, 16, WIDE.vocab)


def test_forward_flops_by_hand():
    rows, s = 2 * 32, 32
    h, qw, kvd, f = 64, 512, 128, 96
    gemms = h * (qw + 2 * kvd) + qw * h + 3 * h * f
    assert layer_forward_flops(WIDE, rows, s) == pytest.approx(2 * rows * gemms + 2 * rows * s * 2 * qw)
    assert layer_forward_flops(WIDE, rows, s, tensor_parallel=4) == pytest.approx(
        (2 * rows * gemms + 4 * rows * s * qw) / 4
    )
    model = model_flops_per_step(WIDE, 2, s)
    # selective recompute reruns QKᵀ and ·V: 2·rows·s·(a·d + a·d) per layer
    assert hardware_flops_per_step(WIDE, 2, s, "selective") - model == pytest.approx(2 * 4 * rows * s * qw)


def test_activation_bytes_by_hand():
    terms = layer_activation_terms(WIDE, 2, tensor_parallel=2, dtype_bytes=2)
    sb = 32 * 2
    assert terms["qkv"] == 2 * sb * (512 + 2 * 128) / 2
    assert terms["attention_output"] == 2 * sb * 512 / 2
    op = layer_activation_terms(WIDE, 2, recompute="op", dtype_bytes=2)
    assert op["attention_output"] == 2 * sb * 512


def test_op_recompute_share_weighs_the_wide_projections():
    # the even-numbered matmuls k, o (512 → 64) and w3 over all seven
    share = (64 * 128 + 512 * 64 + 64 * 96) / (64 * 512 + 2 * 64 * 128 + 512 * 64 + 3 * 64 * 96)
    assert op_recompute_gemm_share(WIDE) == pytest.approx(share)


def test_heads_need_not_divide_hidden_when_the_width_is_given():
    ModelShape(layers=1, hidden=2880, heads=64, head_size=64, vocab=10, seq=8)  # GPT-OSS: 2,880 / 64 = 45
    ModelShape(layers=1, hidden=3072, heads=16, head_size=256, vocab=10, seq=8)  # Gemma 7B
    with pytest.raises(ConfigError, match="heads 7 do not divide hidden 64"):
        ModelShape(layers=1, hidden=64, heads=7, vocab=10, seq=8)
    with pytest.raises(ConfigError, match="head_size"):
        ModelShape(layers=1, hidden=64, heads=4, head_size=0, vocab=10, seq=8)


def test_the_hf_backend_builds_the_head_width():
    transformers = pytest.importorskip("transformers")
    from microbatch.measure.hf import hf_config_from_shape

    wide = ModelShape(name="wide", layers=1, hidden=64, heads=16, head_size=32, kv_heads=4, vocab=100, seq=16,
                      gated_mlp=True, bias=False, norm="rmsnorm", learned_positions=False)  # fmt: skip
    cfg = hf_config_from_shape(wide)
    assert cfg.head_dim == 32
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    assert sum(p.numel() for p in model.parameters()) == wide.param_count()
    gpt = ModelShape(name="g", layers=1, hidden=96, heads=5, head_size=32, vocab=100, seq=16)  # GPT-2 layout
    with pytest.raises(ConfigError, match="GPT-2 layout"):
        hf_config_from_shape(gpt)
