"""A config.json's attention and expert keys checked as its sizes are (a CLI sweep's findings): a key of the wrong
kind — a quoted number, a negative, a fraction, NaN, past 2^53, a step of 0 transformers cannot build, a per-layer list
of the wrong length or entries — is refused naming the key, not read as full attention, every block MoE or the
dense width (each of these was priced silently before). Where transformers itself derives a layout from a value
(Qwen2's max_window_layers -28: every layer slides in its layer_types), that layout is what is priced."""

from __future__ import annotations

import json

import pytest

from microbatch.errors import ConfigError
from microbatch.hf_config import from_hf_config

LLAMA4 = {
    "model_type": "llama4_text", "num_hidden_layers": 48, "hidden_size": 5120, "num_attention_heads": 40,
    "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 8192, "intermediate_size_mlp": 16384,
    "vocab_size": 202048, "max_position_embeddings": 131072, "attention_chunk_size": 8192,
    "num_local_experts": 128, "num_experts_per_tok": 1, "interleave_moe_layer_step": 2,
}  # fmt: skip
QWEN3_MOE = {
    "model_type": "qwen3_moe", "num_hidden_layers": 48, "hidden_size": 2048, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144, "moe_intermediate_size": 768,
    "num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1, "vocab_size": 151936,
    "max_position_embeddings": 40960,
}  # fmt: skip
QWEN2 = {
    "model_type": "qwen2", "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
    "num_key_value_heads": 8, "intermediate_size": 11008, "vocab_size": 152064, "max_position_embeddings": 32768,
    "sliding_window": 4096, "use_sliding_window": True, "max_window_layers": 28,
}  # fmt: skip
GEMMA3 = {
    "model_type": "gemma3_text", "num_hidden_layers": 26, "hidden_size": 1152, "num_attention_heads": 4,
    "num_key_value_heads": 1, "head_dim": 256, "intermediate_size": 6912, "vocab_size": 262144,
    "max_position_embeddings": 32768, "sliding_window": 512, "sliding_window_pattern": 6,
}  # fmt: skip


def _read(tmp_path, base, **change):
    cfg = {**base, **change}
    for k in [k for k, v in change.items() if v is _DROP]:
        cfg.pop(k)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return from_hf_config(path)


_DROP = object()


@pytest.mark.parametrize(
    "base,key,value",
    [
        (LLAMA4, "attention_chunk_size", "8192"),
        (LLAMA4, "attention_chunk_size", -5),
        (LLAMA4, "attention_chunk_size", 8192.5),
        (LLAMA4, "attention_chunk_size", 10**30),
        (LLAMA4, "intermediate_size_mlp", "16384"),
        (LLAMA4, "intermediate_size_mlp", -16384),
        (LLAMA4, "interleave_moe_layer_step", 0),
        (LLAMA4, "num_experts_per_tok", 0),
        (LLAMA4, "num_local_experts", 10**20),
        (QWEN3_MOE, "decoder_sparse_step", 0),
        (QWEN3_MOE, "moe_intermediate_size", 0),
        (QWEN3_MOE, "num_experts_per_tok", 200),
        (QWEN3_MOE, "num_experts", "128"),
        (QWEN2, "sliding_window", "4096"),
        (QWEN2, "sliding_window", -4096),
        (QWEN2, "sliding_window", 4096.0),
        (QWEN2, "use_sliding_window", "false"),
        (QWEN2, "max_window_layers", "28"),
        (QWEN2, "layer_types", ["sliding_attention", "full_attention"]),
        (GEMMA3, "sliding_window_pattern", 0),
        (GEMMA3, "sliding_window_pattern", "6"),
    ],
)
def test_a_key_of_the_wrong_kind_is_refused_by_name(tmp_path, base, key, value):
    with pytest.raises(ConfigError, match=key):
        _read(tmp_path, base, **{key: value})


def test_the_same_files_with_good_keys_read_as_transformers_builds_them(tmp_path):
    llama4 = _read(tmp_path, LLAMA4)
    assert (llama4.sliding_window, llama4.sliding_layers, llama4.local_attention) == (8192, 36, "chunked")
    assert llama4.moe.moe_every == 2 and llama4.ffn == 16384  # the dense blocks at their own width
    qwen = _read(tmp_path, QWEN3_MOE)
    assert qwen.moe.moe_every == 1 and qwen.moe.expert_ffn_hidden == 768 and qwen.moe.top_k == 8
    qwen2 = _read(tmp_path, QWEN2)
    assert (qwen2.sliding_window, qwen2.sliding_layers) == (4096, 4)  # layers 28..31 slide
    assert _read(tmp_path, QWEN2, use_sliding_window=False).sliding_window is None
    gemma = _read(tmp_path, GEMMA3)
    assert (gemma.sliding_window, gemma.sliding_layers) == (512, 26 - 26 // 6)
    # a pattern of 1 makes every layer global (transformers: sliding where (i + 1) % pattern != 0): none slide
    assert _read(tmp_path, GEMMA3, sliding_window_pattern=1, layer_types=_DROP).sliding_window is None
    long = ["sliding_attention"] * 40  # a longer list is read for the file's layers
    assert _read(tmp_path, QWEN2, layer_types=long).sliding_layers == 32


def test_a_hybrids_block_list_with_an_odd_entry_is_still_a_hybrid(tmp_path):
    """A review's finding: the check that skips layer_types lists of non-names (refused by their reader) skipped
    Mamba's layers_block_type and Griffin's block_types too, which nothing else reads: priced as a plain decoder."""
    for key, kinds in (
        ("layers_block_type", ["mamba", "mamba", "hybrid", None]),
        ("block_types", ["recurrent", 1]),
    ):
        with pytest.raises(ConfigError, match=r"is a hybrid model"):
            _read(tmp_path, QWEN2, **{key: kinds})


def test_exaone_writes_its_pattern_in_letters(tmp_path):
    """EXAONE 4: sliding_window_pattern "LLLG" (L local, G global) over the layers, without layer_types (vLLM's and
    sglang's fixtures); it was read as every layer sliding, then refused as not a number."""
    exaone = dict(QWEN2, model_type="exaone4", sliding_window_pattern="LLLG")
    for key in ("use_sliding_window", "max_window_layers"):
        exaone.pop(key)
    shape = _read(tmp_path, exaone)
    assert (shape.sliding_window, shape.sliding_layers) == (4096, 24)  # 3 of every 4 of 32 layers
    with pytest.raises(ConfigError, match="sliding_window_pattern"):
        _read(tmp_path, exaone, sliding_window_pattern="LLXG")
