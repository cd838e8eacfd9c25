"""Hugging Face configs of families the HF sweep of 2026-12-06 found misread, each against the model transformers
builds from the same file (on the meta device: shapes, no memory): Llama 4 (every other block MoE, a shared expert,
its dense blocks at ``intermediate_size_mlp``), StarCoder2 (rotary: no position table), Cohere (the parallel block),
Gemma 3 (five sliding layers to one global when the file says nothing), and a config with ``auto_map`` that must not
ask on a terminal whether to run its code."""

from __future__ import annotations

import json

import pytest

from microbatch.hf_config import from_hf_config
from microbatch.moe import Experts
from microbatch.shape import ModelShape

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

LLAMA4 = {"model_type": "llama4_text", "hidden_act": "silu", "num_hidden_layers": 4, "hidden_size": 512,
          "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 256,
          "intermediate_size_mlp": 1024, "num_local_experts": 16, "num_experts_per_tok": 1, "vocab_size": 1000,
          "max_position_embeddings": 4096, "tie_word_embeddings": False}  # fmt: skip
STARCODER2 = {"model_type": "starcoder2", "hidden_act": "gelu_pytorch_tanh", "num_hidden_layers": 2,
              "hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 2, "intermediate_size": 1024,
              "vocab_size": 1000, "max_position_embeddings": 4096, "use_bias": True}  # fmt: skip
COHERE = {"model_type": "cohere", "hidden_act": "silu", "num_hidden_layers": 2, "hidden_size": 256,
          "num_attention_heads": 8, "num_key_value_heads": 8, "intermediate_size": 704, "vocab_size": 1000,
          "max_position_embeddings": 4096, "tie_word_embeddings": True}  # fmt: skip
GEMMA3 = {"model_type": "gemma3_text", "num_hidden_layers": 62, "hidden_size": 5376, "num_attention_heads": 32,
          "num_key_value_heads": 16, "head_dim": 128, "intermediate_size": 21504, "vocab_size": 262208,
          "max_position_embeddings": 131072, "sliding_window": 1024}  # fmt: skip


def _write(tmp_path, cfg, name="config.json"):
    p = tmp_path / name
    p.write_text(json.dumps(cfg))
    return p


def _real_params(cfg: dict) -> int:
    config = transformers.AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("step", [1, 2])
def test_llama4_counts_its_shared_expert_and_its_dense_blocks_as_transformers_builds_them(tmp_path, step):
    cfg = {**LLAMA4, "interleave_moe_layer_step": step}
    shape = from_hf_config(_write(tmp_path, cfg))
    assert shape.moe is not None and (shape.moe.moe_every, shape.moe.shared_experts) == (step, 1)
    assert [shape.is_moe_layer(i) for i in range(4)] == (
        [True] * 4 if step == 1 else [False, True, False, True]
    )
    assert shape.ffn_hidden == 1024 and shape.moe.expert_ffn_hidden == 256
    assert shape.param_count() == _real_params(cfg)


def test_starcoder2_is_rotary_without_a_position_table_and_takes_a_longer_seq(tmp_path):
    shape = from_hf_config(_write(tmp_path, STARCODER2))
    assert not shape.learned_positions and shape.param_count() == _real_params(STARCODER2)
    assert (
        from_hf_config(_write(tmp_path, STARCODER2), seq=32768).seq == 32768
    )  # was refused past 4,096 positions


def test_cohere_runs_the_parallel_block(tmp_path):
    assert from_hf_config(_write(tmp_path, COHERE)).parallel_block is True
    assert from_hf_config(_write(tmp_path, {**COHERE, "model_type": "llama"})).parallel_block is False


def test_gemma3_without_a_pattern_slides_five_layers_in_six_as_transformers_does(tmp_path):
    shape = from_hf_config(_write(tmp_path, GEMMA3))
    real = transformers.AutoConfig.for_model(**GEMMA3).layer_types
    assert shape.sliding_layers == sum(t == "sliding_attention" for t in real) == 52  # 62 − ⌊62/6⌋


def test_a_config_with_auto_map_is_read_without_asking_to_run_its_code(tmp_path, monkeypatch):
    asked = []
    real = transformers.AutoConfig.from_pretrained

    def spy(*args, **kwargs):
        asked.append(kwargs.get("trust_remote_code"))
        return real(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", spy)
    cfg = {**COHERE, "model_type": "llama", "auto_map": {"AutoConfig": "configuration_x.XConfig"}}
    shape = from_hf_config(_write(tmp_path, cfg))
    assert asked == [False] and shape.layers == 2  # None made transformers ask on a terminal (15 s, then no)


def test_interleaved_experts_split_params_by_block():
    moe = Experts(experts=4, top_k=1, expert_ffn_hidden=64, shared_experts=1, moe_every=2, dense_layers=0)
    shape = ModelShape(name="x", layers=5, hidden=32, heads=4, vocab=100, seq=16, gated_mlp=True, bias=False, moe=moe,
                       ffn_hidden=128)  # fmt: skip
    assert [shape.is_moe_layer(i) for i in range(5)] == [False, True, False, True, False]
    assert shape.moe_layer_count(0, 5) == 2 and shape.moe_layer_count(1, 2) == 1
    dense, sparse = shape.layer_params(0), shape.layer_params(1)
    assert (
        dense - sparse == 3 * 32 * 128 - (4 + 1) * 3 * 32 * 64 - 32 * 4
    )  # MLP 3hF against 5 experts + router
    assert shape.layers_params(0, 5) == 3 * dense + 2 * sparse
    with pytest.raises(Exception, match="moe_every"):
        Experts(experts=4, top_k=1, expert_ffn_hidden=64, moe_every=0)


STABLELM = {"model_type": "stablelm", "hidden_act": "silu", "num_hidden_layers": 2, "hidden_size": 256,
            "num_attention_heads": 8, "num_key_value_heads": 2, "intermediate_size": 704, "vocab_size": 1000,
            "max_position_embeddings": 4096}  # fmt: skip
GPT_NEO = {"model_type": "gpt_neo", "num_layers": 2, "hidden_size": 256, "num_heads": 8, "vocab_size": 1000,
           "max_position_embeddings": 2048, "attention_types": [[["global", "local"], 1]], "window_size": 256}  # fmt: skip


@pytest.mark.parametrize("parallel", [True, False])
def test_stablelm_runs_the_parallel_block_where_its_config_says(tmp_path, parallel):
    """StableLM 2 12B sets use_parallel_residual (transformers' StableLmDecoderLayer then adds attention and the MLP,
    each on the input norm's output, to one residual); it was read as a sequential block (2 TP all-reduces a layer)."""
    cfg = {**STABLELM, "use_parallel_residual": parallel}
    shape = from_hf_config(_write(tmp_path, cfg))
    assert shape.parallel_block is parallel
    assert shape.param_count() == pytest.approx(_real_params(cfg), rel=2e-3)  # its LayerNorm biases aside


def test_gpt_neo_names_its_heads_num_heads(tmp_path):
    """GPT-Neo's config spells the heads num_heads: it was refused as lacking heads."""
    shape = from_hf_config(_write(tmp_path, GPT_NEO))
    assert shape.heads == 8 and shape.param_count() == pytest.approx(_real_params(GPT_NEO), rel=2e-3)


@pytest.mark.parametrize(("legacy", "new"), [
    ({"model_type": "RefinedWebModel", "n_head": 8, "n_layer": 2, "hidden_size": 256, "multi_query": True,
      "parallel_attn": True, "bias": False, "vocab_size": 1000, "alibi": False},
     {"model_type": "falcon", "num_attention_heads": 8, "num_hidden_layers": 2, "hidden_size": 256,
      "multi_query": True, "parallel_attn": True, "bias": False, "vocab_size": 1000, "alibi": False}),
    ({"model_type": "RefinedWeb", "n_head": 8, "n_head_kv": 2, "n_layer": 2, "hidden_size": 256,
      "parallel_attn": True, "bias": False, "vocab_size": 1000, "alibi": False},
     {"model_type": "falcon", "num_attention_heads": 8, "num_kv_heads": 2, "num_hidden_layers": 2,
      "hidden_size": 256, "parallel_attn": True, "bias": False, "vocab_size": 1000, "alibi": False,
      "new_decoder_architecture": True}),
])  # fmt: skip
def test_falcons_first_model_types_are_read_as_falcon(tmp_path, legacy, new):
    """tiiuae's first Falcon files (RefinedWebModel: 7B, RefinedWeb: 40B), which transformers no longer reads, were
    read by GPT-2's rules: multi-head K/V, a sequential block, a position table (+19% parameters)."""
    old = from_hf_config(_write(tmp_path, legacy, "old.json"))
    assert old == from_hf_config(_write(tmp_path, new, "new.json"))
    assert old.parallel_block and not old.learned_positions  # within the 7B block's one shared norm:
    assert old.param_count() == pytest.approx(_real_params(new), rel=1e-3)


def test_mpt_has_a_position_table_only_where_its_config_asks(tmp_path):
    """transformers' MptConfig (ALiBi, learned_pos_emb true by default) builds no position table; it was counted
    (+0.13% on MPT-7B, +0.2% on 30B). Without ALiBi, learned_pos_emb gets its table."""
    cfg = transformers.MptConfig(d_model=256, n_heads=8, n_layers=2, expansion_ratio=4, max_seq_len=512,
                                 vocab_size=1000, no_bias=True).to_dict()  # fmt: skip
    shape = from_hf_config(_write(tmp_path, cfg))
    assert not shape.learned_positions and shape.param_count() == pytest.approx(_real_params(cfg), rel=1e-3)
    no_alibi = {**cfg, "learned_pos_emb": True, "attn_config": {**cfg["attn_config"], "alibi": False}}
    with_table = from_hf_config(_write(tmp_path, no_alibi, "table.json"))
    assert with_table.learned_positions and with_table.param_count() - shape.param_count() == 512 * 256


MOE_NO_ACT = {
    "qwen2_moe": {"model_type": "qwen2_moe", "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 8,
                  "num_key_value_heads": 2, "intermediate_size": 512, "moe_intermediate_size": 128,
                  "shared_expert_intermediate_size": 256, "num_experts": 8, "num_experts_per_tok": 2,
                  "vocab_size": 2000, "max_position_embeddings": 512},
    "qwen3_moe": {"model_type": "qwen3_moe", "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 8,
                  "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 512, "moe_intermediate_size": 128,
                  "num_experts": 8, "num_experts_per_tok": 2, "vocab_size": 2000, "max_position_embeddings": 512},
    "olmoe": {"model_type": "olmoe", "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 8,
              "num_key_value_heads": 8, "intermediate_size": 128, "num_experts": 8, "num_experts_per_tok": 2,
              "vocab_size": 2000, "max_position_embeddings": 512},
}  # fmt: skip


@pytest.mark.parametrize("family", sorted(MOE_NO_ACT))
def test_a_config_without_hidden_act_is_built_as_its_family_is(tmp_path, family):
    """Qwen2-MoE and Qwen3-MoE files often omit ``hidden_act`` (transformers' default: silu) and were read as GPT-2
    blocks (LayerNorm, biases, a plain 4h MLP): 23-32% of the parameters went missing (a review; Qwen3-30B-A3B's
    shape 20.9B for 30.5B). Both are Llama-built now; another family (OLMoE) takes transformers' default."""
    cfg = MOE_NO_ACT[family]
    shape = from_hf_config(_write(tmp_path, cfg))
    assert shape.gated_mlp and shape.norm == "rmsnorm"
    real = _real_params(cfg)
    assert shape.param_count() == pytest.approx(
        real, rel=0.002
    )  # Qwen2-MoE's q/k/v biases and shared gate: 0.05%
