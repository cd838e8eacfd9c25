"""Model shapes: the registry, Hugging Face configs, shape flags, validation."""

from __future__ import annotations

import json

import pytest

from microbatch.cli import main
from microbatch.errors import ConfigError
from microbatch.model import PRESETS, ModelShape, from_flags, from_hf_config, get_model, resolve_model


def test_exact_param_counts_of_real_models():
    assert get_model("gpt2").param_count() == 124_439_808
    assert get_model("llama-2-7b").param_count() == 6_738_415_616
    # Hugging Face model cards: Llama-3-8B 8,030,261,248; Mistral-7B 7,241,732,096; gpt2-xl 1,557,611,200
    assert get_model("llama-3-8b").param_count() == 8_030_261_248
    assert get_model("mistral-7b").param_count() == 7_241_732_096
    assert get_model("gpt2-xl").param_count() == 1_557_611_200
    # Llama 3.1 405B: 126·(2·16384² + 2·16384·1024 + 3·16384·53248 + 2·16384) + 2·128256·16384 + 16384
    per_layer = 2 * 16384**2 + 2 * 16384 * 1024 + 3 * 16384 * 53248 + 2 * 16384
    assert get_model("llama-3.1-405b").param_count() == 126 * per_layer + 2 * 128256 * 16384 + 16384
    assert get_model("llama-3.1-405b").param_count() / 1e9 == pytest.approx(405.9, abs=0.1)


def test_registry_has_every_issue_model():
    for name in ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "llama-2-7b", "llama-2-13b", "llama-2-70b",
                 "llama-3-8b", "llama-3-70b", "mistral-7b", "gpt3-175b", "megatron-22b", "megatron-175b",
                 "megatron-530b", "megatron-1t", "tiny", "small"):  # fmt: skip
        assert name in PRESETS
    assert get_model("530B") is PRESETS["megatron-530b"]


def test_seq_override_keeps_learned_position_table():
    assert get_model("gpt2", seq=128).param_count() == get_model("gpt2").param_count()
    assert get_model("gpt2", seq=128).seq == 128


def test_unknown_model_lists_known_ones():
    with pytest.raises(ConfigError, match=r"unknown model 'gpt5'.*gpt2.*llama-2-7b"):
        get_model("gpt5")


def _write(tmp_path, cfg: dict):
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    return p


GPT2_CFG = {
    "model_type": "gpt2",
    "n_layer": 12,
    "n_embd": 768,
    "n_head": 12,
    "vocab_size": 50257,
    "n_positions": 1024,
}
LLAMA_CFG = {
    "model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
    "num_key_value_heads": 32, "intermediate_size": 11008, "vocab_size": 32000, "max_position_embeddings": 4096,
    "hidden_act": "silu", "tie_word_embeddings": False,
}  # fmt: skip


def test_hf_config_gpt2_matches_registry(tmp_path):
    shape = from_hf_config(_write(tmp_path, GPT2_CFG))
    assert shape.param_count() == 124_439_808
    assert shape.tied_embeddings  # the GPT-2 default when the file omits it


def test_hf_config_llama_matches_registry_through_folder(tmp_path):
    _write(tmp_path, LLAMA_CFG)
    shape = from_hf_config(tmp_path)  # a folder holding config.json
    assert shape.param_count() == 6_738_415_616
    assert shape.gated_mlp and shape.norm == "rmsnorm" and not shape.learned_positions


def test_hf_config_plain_json_fallback(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "transformers" else real(n, *a)
    )
    shape = from_hf_config(_write(tmp_path, LLAMA_CFG))
    assert shape.param_count() == 6_738_415_616


def test_hf_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="not a file"):
        from_hf_config(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not readable JSON"):
        from_hf_config(bad)
    with pytest.raises(ConfigError, match="lacks layers"):
        from_hf_config(_write(tmp_path, {"hidden_size": 64, "num_attention_heads": 4, "vocab_size": 10}))


def test_flags_and_overrides():
    s = from_flags(layers=2, hidden=64, heads=4, vocab=100, seq=32)
    assert s.param_count() == 2 * s.layer_params() + s.embedding_params() + s.output_params()
    with pytest.raises(ConfigError, match="lacks vocab, seq; give model"):
        from_flags(layers=2, hidden=64, heads=4)
    assert resolve_model("gpt2", seq=256).seq == 256
    assert resolve_model(None, None, layers=2, hidden=64, heads=4, vocab=100, seq=32).layers == 2
    with pytest.raises(ConfigError, match="no model given"):
        resolve_model()
    with pytest.raises(ConfigError, match="must be a whole number >= 1"):
        resolve_model("gpt2", seq=-5)


def test_shape_validation_messages():
    with pytest.raises(ConfigError, match=r"heads 12 do not divide hidden 770.*use hidden in 768, 780"):
        ModelShape(layers=2, hidden=770, heads=12, vocab=10, seq=8)
    with pytest.raises(ConfigError, match="kv heads 3 do not divide heads 8"):
        ModelShape(layers=2, hidden=64, heads=8, kv_heads=3, vocab=10, seq=8)


def test_cli_shape_flags_bad_input_exit_2(capsys):
    rc = main(
        [
            "memory",
            "--layers",
            "2",
            "--hidden",
            "770",
            "--heads",
            "12",
            "--vocab",
            "10",
            "--seq",
            "8",
            "-b",
            "1",
        ]
    )
    assert rc == 2
    err = capsys.readouterr().err
    # the flags the user typed (the library's message names the fields: test_shape_validation_messages)
    assert "--heads 12 do not divide --hidden 770" in err and "use --hidden in 768, 780" in err
    assert "hidden/heads" in err and "Traceback" not in err


def test_cli_hf_config_and_override(tmp_path, capsys):
    path = _write(tmp_path, LLAMA_CFG)
    assert main(["memory", "--hf-config", str(path), "--seq", "1024", "-b", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model_shape"]["param_count"] == 6_738_415_616 and out["config"]["seq"] == 1024


# -- mixture of experts and latent attention ------------------------------------------------------------
MIXTRAL_CFG = {
    "model_type": "mixtral", "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
    "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 32000, "max_position_embeddings": 32768,
    "hidden_act": "silu", "tie_word_embeddings": False, "num_local_experts": 8, "num_experts_per_tok": 2,
}  # fmt: skip
DEEPSEEK_V3_CFG = {
    "model_type": "deepseek_v3", "num_hidden_layers": 61, "hidden_size": 7168, "num_attention_heads": 128,
    "num_key_value_heads": 128, "intermediate_size": 18432, "moe_intermediate_size": 2048, "vocab_size": 129280,
    "max_position_embeddings": 163840, "hidden_act": "silu", "tie_word_embeddings": False,
    "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "num_nextn_predict_layers": 1,
}  # fmt: skip


def test_moe_param_counts_match_the_published_totals():
    # Mixtral paper (Jiang et al. 2024) §2: 46.7B total (sparse), 12.9B active — within 0.5%.
    mix = get_model("mixtral-8x7b")
    assert mix.param_count() == pytest.approx(46.7e9, rel=0.005)
    assert mix.active_param_count() == pytest.approx(12.9e9, rel=0.005)
    # DeepSeek-V3 report (arXiv 2412.19437) §1 and Table 1: 671B total, 37B activated per token, without the
    # 14B multi-token-prediction module. Total within 0.5%, active within 2% (the report rounds 37.5B to 37B).
    ds = get_model("deepseek-v3")
    assert ds.param_count() == pytest.approx(671e9, rel=0.005)
    assert ds.active_param_count() == pytest.approx(37e9, rel=0.02)
    # A dense model's active count is its total.
    assert get_model("llama-2-7b").active_param_count() == 6_738_415_616


def test_moe_terms_each_count():
    """Dropping any term (router, shared experts, dense first layers, MLA) moves the totals."""
    from dataclasses import replace

    ds = get_model("deepseek-v3")
    h, mats = ds.hidden, 3
    moe = ds.moe
    assert moe is not None and ds.mla is not None
    # One MoE block = attention + router + E experts + S shared + 2 norms; a dense block has the 18432 MLP.
    assert ds.layer_params() - ds.layer_params(0) == (
        h * 256 + 256 * mats * h * 2048 + 1 * mats * h * 2048 - mats * h * 18432
    )
    no_shared = replace(ds, moe=replace(moe, shared_experts=0))
    assert ds.param_count() - no_shared.param_count() == 58 * mats * h * 2048
    no_dense = replace(ds, moe=replace(moe, dense_layers=0))
    assert no_dense.param_count() - ds.param_count() == 3 * (ds.layer_params() - ds.layer_params(0))
    # MLA (DeepSeek-V2 §2.1): q LoRA 7168·1536 + 1536 + 1536·128·192; kv 7168·576 + 512 + 512·128·256; o 128·128·7168.
    mla = 7168 * 1536 + 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 + 512 * 128 * 256 + 128 * 128 * 7168
    assert ds.attention_params() == mla
    # Active: K = 8 routed experts of 256.
    assert ds.layer_params() - ds.layer_params(active=True) == (256 - 8) * mats * h * 2048


def test_hf_moe_configs_match_the_registry(tmp_path):
    mix = from_hf_config(_write(tmp_path, MIXTRAL_CFG))
    assert mix.param_count() == get_model("mixtral-8x7b").param_count()
    assert mix.active_param_count() == get_model("mixtral-8x7b").active_param_count()
    ds = from_hf_config(_write(tmp_path, DEEPSEEK_V3_CFG))
    assert ds.moe == get_model("deepseek-v3").moe and ds.mla == get_model("deepseek-v3").mla
    assert ds.param_count() == get_model("deepseek-v3").param_count()
    # Qwen2-MoE: num_experts, one shared expert of shared_expert_intermediate_size.
    qwen = from_hf_config(_write(tmp_path, {**LLAMA_CFG, "model_type": "qwen2_moe", "num_experts": 60,
                                            "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
                                            "shared_expert_intermediate_size": 5632}))  # fmt: skip
    assert qwen.moe is not None and (qwen.moe.experts, qwen.moe.top_k, qwen.moe.shared_experts) == (60, 4, 1)
    assert qwen.moe.shared_width == 5632 and qwen.moe.expert_ffn_hidden == 1408
    with pytest.raises(ConfigError, match="num_experts_per_tok; give top_k "):
        from_hf_config(_write(tmp_path, {**MIXTRAL_CFG, "num_experts_per_tok": None}))
    assert from_hf_config(_write(tmp_path, LLAMA_CFG)).moe is None


def test_expert_flags_and_round_trip():
    from dataclasses import asdict

    s = resolve_model("llama-2-7b", experts=8, top_k=2)
    assert s.moe is not None and s.moe.expert_ffn_hidden == 11008  # F defaults to the model's ffn
    assert s.param_count() > 7 * get_model("llama-2-7b").param_count() // 2
    s2 = resolve_model("deepseek-v3", top_k=4, shared_experts=0)
    assert s2.moe is not None and (s2.moe.top_k, s2.moe.shared_experts, s2.moe.experts) == (4, 0, 256)
    with pytest.raises(ConfigError, match="both experts E and top_k K"):
        resolve_model("llama-2-7b", experts=8)
    with pytest.raises(ConfigError, match="top_k 9 > experts 8; .*use top_k 8 or less"):
        resolve_model("mixtral-8x7b", top_k=9)
    ds = get_model("deepseek-v3")
    back = ModelShape(**{k: v for k, v in asdict(ds).items()})  # a shape read back from JSON dicts
    assert back == ds and back.param_count() == ds.param_count()
    assert ds.to_dict()["active_param_count"] == ds.active_param_count()


# -- heterogeneous configs: sizes set per layer (transformers 5's per_layer_config) ---------------------------------
GEMMA4_CFG = {
    "model_type": "gemma4_text", "num_hidden_layers": 30, "hidden_size": 2304, "num_attention_heads": 8,
    "num_key_value_heads": 4, "head_dim": 256, "intermediate_size": 9216, "vocab_size": 262144,
    "max_position_embeddings": 131072, "hidden_activation": "gelu_pytorch_tanh",
    "per_layer_config": {"05": {"head_dim": 512}, "11": {"head_dim": 512}, "17": {"head_dim": 512}},
}  # fmt: skip


def test_per_layer_sizes_are_refused_with_the_values_and_the_fix(tmp_path):
    # transformers refuses the global read of a per-layer key (not an AttributeError): this crashed before
    with pytest.raises(ConfigError) as e:
        from_hf_config(_write(tmp_path, GEMMA4_CFG))
    msg = str(e.value)
    assert "head_size per layer" in msg and "512 in layer 05" in msg and "256 in the other 27" in msg
    assert "the largest, 512" in msg and "hf_config" in e.value.params and "head_size" in e.value.params


def test_a_per_layer_size_the_user_gives_prices_every_layer_at_it(tmp_path):
    path = _write(tmp_path, GEMMA4_CFG)
    wide = resolve_model(hf_config=path, head_size=512)
    narrow = resolve_model(hf_config=path, head_size=256)
    assert wide.head_size == 512 and narrow.head_size == 256
    # the q/k/v/o projections grow with the head width: 30 layers x 2·h·(a + kv)·Δd more parameters
    assert wide.param_count() - narrow.param_count() == 30 * 2 * 2304 * (8 + 4) * 256


def test_per_layer_values_equal_to_the_configs_own_are_not_heterogeneous(tmp_path):
    from microbatch.hf_config import per_layer_sizes

    same = {**GEMMA4_CFG, "per_layer_config": {"05": {"head_dim": 256}, "06": "not a mapping"}}
    assert per_layer_sizes(same) == {}
    assert from_hf_config(_write(tmp_path, same)).head_size == 256
    two = {**GEMMA4_CFG, "per_layer_config": {"02": {"num_attention_heads": 16, "num_key_value_heads": 8}}}
    assert per_layer_sizes(two) == {"heads": {"02": 16}, "kv_heads": {"02": 8}}
    with pytest.raises(ConfigError, match="heads per layer .* kv_heads also vary per layer"):
        from_hf_config(_write(tmp_path, two))


def test_cli_refuses_a_per_layer_config_in_one_line_and_takes_the_flag(tmp_path, capsys):
    path = str(_write(tmp_path, GEMMA4_CFG))
    args = ["plan", "--hf-config", path, "--gpu", "h100-sxm", "-B", "8", "--seq", "1024"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "--head-size per layer" in err and "Traceback" not in err
    assert main([*args, "--head-size", "512", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model_shape"]["head_size"] == 512


@pytest.mark.parametrize(
    "extra,says",
    [
        (
            {"layer_types": ["linear_attention", "linear_attention", "full_attention"]},
            "layer_types names linear_attention",
        ),
        ({"layers_block_type": ["mamba", "attention"]}, "layers_block_type names mamba"),
        ({"mamba_d_state": 128, "mamba_expand": 2}, "it sets mamba_d_state, mamba_expand"),
        (
            {"block_types": ["recurrent", "recurrent", "attention"], "lru_width": 2560},
            "block_types names recurrent",
        ),
        ({"conv_L_cache": 3}, "it sets conv_L_cache"),
    ],
)
def test_hybrid_models_are_refused_with_what_is_not_attention(tmp_path, extra, says):
    # Mamba, linear-attention, recurrent or convolution layers: the formulas price attention decoder layers only
    cfg = {**LLAMA_CFG, "model_type": "some_hybrid", "num_hidden_layers": 3, **extra}
    with pytest.raises(ConfigError, match="hybrid model") as e:
        from_hf_config(_write(tmp_path, cfg))
    assert says in str(e.value) and "give the shape of its attention layers" in str(e.value)


def test_attention_layer_kinds_are_not_hybrid(tmp_path):
    kinds = ["sliding_attention", "full_attention", "chunked_attention"]
    cfg = {**LLAMA_CFG, "num_hidden_layers": 3, "layer_types": kinds, "sliding_window": 512}
    assert from_hf_config(_write(tmp_path, cfg)).param_count() > 0


def test_gemma_families_are_built_as_llama_is(tmp_path):
    # Gemma 3/4 and VaultGemma spell their GeGLU activation hidden_activation: read as GPT-2 blocks they lost the
    # gate (-9.5% and -20% of the parameters transformers builds); the counts below are transformers 5.25's on meta
    gemma3 = {"model_type": "gemma3_text", "num_hidden_layers": 26, "hidden_size": 2304, "num_attention_heads": 8,
              "num_key_value_heads": 4, "head_dim": 256, "intermediate_size": 9216, "vocab_size": 262208,
              "max_position_embeddings": 131072, "hidden_activation": "gelu_pytorch_tanh"}  # fmt: skip
    shape = from_hf_config(_write(tmp_path, gemma3))
    assert shape.gated_mlp and shape.norm == "rmsnorm" and not shape.learned_positions and not shape.bias
    # transformers' count (2,628,658,432) adds Gemma's q/k norms (2 x 256) and its two extra sandwich norms
    # (2 x 2,304) per layer, which the shape leaves out: within 0.005%
    assert shape.param_count() == 2_628_658_432 - 26 * (2 * 256 + 2 * 2304)


def test_a_missing_top_k_is_taken_from_the_flag_the_error_names(tmp_path, capsys):
    # DeepSeek-V2 as transformers writes its default leaves num_experts_per_tok None: the error said "give top_k",
    # and giving it failed the same way (the file was read before the flag applied)
    cfg = {**DEEPSEEK_V3_CFG, "num_experts_per_tok": None, "n_routed_experts": 64}
    path = _write(tmp_path, cfg)
    with pytest.raises(ConfigError, match="no num_experts_per_tok; give top_k"):
        resolve_model(hf_config=path)
    shape = resolve_model(hf_config=path, top_k=6)
    assert shape.moe.top_k == 6 and shape.moe.experts == 64
    assert (
        main(["memory", "--hf-config", str(path), "--top-k", "6", "-b", "1", "--seq", "512", "--json"]) == 0
    )
    assert json.loads(capsys.readouterr().out)["model_shape"]["moe"]["top_k"] == 6


@pytest.mark.parametrize("key", ["moe_topk", "moe_k"])
def test_top_k_spellings_of_other_families(tmp_path, key):
    # Aria and LongCat-Flash write moe_topk, ERNIE 4.5 moe_k
    cfg = {**MIXTRAL_CFG, key: 3}
    del cfg["num_experts_per_tok"]
    assert from_hf_config(_write(tmp_path, cfg)).moe.top_k == 3


def test_sparse_attention_kinds_are_attention_not_hybrid(tmp_path):
    # DeepSeek-V3.2's indexed_attention layers are softmax attention (priced dense, an upper bound)
    cfg = {**DEEPSEEK_V3_CFG, "num_hidden_layers": 4, "first_k_dense_replace": 1,
           "layer_types": ["indexed_attention"] * 4}  # fmt: skip
    assert from_hf_config(_write(tmp_path, cfg)).mla is not None


def test_latent_attention_whose_heads_do_not_divide_hidden(tmp_path):
    # GLM-4.7-Flash: 20 latent-attention heads on a 2,048 residual; each query head is 192 + 64 wide
    cfg = {**DEEPSEEK_V3_CFG, "hidden_size": 2048, "num_attention_heads": 20, "num_key_value_heads": 20,
           "q_lora_rank": 768, "qk_nope_head_dim": 192, "v_head_dim": 256}  # fmt: skip
    shape = from_hf_config(_write(tmp_path, cfg))
    assert shape.head_size == 256 and shape.mla.qk_head_dim == 256
    assert from_hf_config(_write(tmp_path, DEEPSEEK_V3_CFG)).head_size is None  # 128 heads divide 7,168


def test_gemma_configs_without_transformers_are_tied_as_transformers_builds_them(tmp_path, monkeypatch):
    # Gemma's config.json omits tie_word_embeddings (its default: tied); without transformers the plain-JSON path
    # took Llama's default (untied): +604M parameters, 23% (a reviewer's finding)
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "transformers" else real(n, *a)
    )
    cfg = {"model_type": "gemma3_text", "num_hidden_layers": 26, "hidden_size": 2304, "num_attention_heads": 8,
           "num_key_value_heads": 4, "head_dim": 256, "intermediate_size": 9216, "vocab_size": 262208}  # fmt: skip
    shape = from_hf_config(_write(tmp_path, cfg))
    assert shape.tied_embeddings and shape.param_count() == 2_628_658_432 - 26 * (2 * 256 + 2 * 2304)


def test_a_multimodal_config_is_read_as_its_language_model(tmp_path):
    # Gemma 3, Llama 4, Mistral 3 keep the decoder's sizes under text_config: refused as "lacks layers, hidden, ..."
    cfg = {"model_type": "mistral3", "_name_or_path": "x", "vision_config": {"hidden_size": 1024},
           "text_config": {**LLAMA_CFG, "model_type": "mistral"}}  # fmt: skip
    shape = from_hf_config(_write(tmp_path, cfg))
    assert shape.param_count() == 6_738_415_616 and shape.gated_mlp and shape.layers == 32
    # a config with its own sizes keeps them, text_config or not
    own = {**LLAMA_CFG, "text_config": {**LLAMA_CFG, "num_hidden_layers": 2}}
    assert from_hf_config(_write(tmp_path, own)).layers == 32
