"""An MPT config.json's ``attn_config`` and ``ffn_config`` as llm-foundry's MPTConfig reads them: grouped-query
attention, rotary positions, the gated MLP and its width, RMSNorm (a read of llm-foundry's source, 2026-12-07: all
were dropped, 6.66B counted for a 5.84B GQA model). Counts checked by the difference each makes, by hand."""

from __future__ import annotations

import json

from microbatch.hf_config import from_hf_config

BASE = {"model_type": "mpt", "d_model": 4096, "n_heads": 32, "n_layers": 32, "expansion_ratio": 4,
        "max_seq_len": 2048, "vocab_size": 50368, "no_bias": True, "attn_config": {"alibi": True}}  # fmt: skip
L, H = 32, 4096


def shape(tmp_path, **changes):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**BASE, **changes}), encoding="utf-8")
    return from_hf_config(path)


def test_grouped_query_attention_and_rotary_positions(tmp_path):
    base = shape(tmp_path)
    gqa = shape(tmp_path, attn_config={"attn_impl": "flash", "kv_n_heads": 8, "rope": True})
    assert gqa.kv_heads == 8 and not gqa.learned_positions
    # k and v each 4,096 × 1,024 in place of 4,096 × 4,096, in every layer
    assert base.param_count() - gqa.param_count() == L * 2 * H * (H - 1024)
    assert gqa.param_count() == 5_843_984_384  # llm-foundry's own count of this model
    assert shape(tmp_path, attn_config={"attn_type": "multiquery_attention"}).kv_heads == 1  # one K/V head


def test_the_gated_mlp_at_its_own_width(tmp_path):
    glu = shape(tmp_path, ffn_config={"ffn_type": "mptglu", "ffn_hidden_size": 14336})
    plain = shape(tmp_path, ffn_config={"ffn_type": "mptmlp", "ffn_hidden_size": 14336})
    assert glu.gated_mlp and not plain.gated_mlp and glu.ffn_hidden == plain.ffn_hidden == 14336
    assert glu.param_count() - plain.param_count() == L * H * 14336  # the gate's matrix
    assert shape(tmp_path).ffn_hidden == 4 * H  # no ffn_config: expansion_ratio × d_model, as before


def test_rmsnorm_and_what_is_not_read(tmp_path):
    assert shape(tmp_path, norm_type="low_precision_rmsnorm").norm == "rmsnorm"
    assert shape(tmp_path).norm == "layernorm"
    # the Hub's files say attn_impl torch (inference's default); training runs flash: not read from the file
    assert shape(tmp_path, attn_config={"alibi": True, "attn_impl": "torch"}).flash_attention
