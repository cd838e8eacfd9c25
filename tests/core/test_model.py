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
    with pytest.raises(ConfigError, match="lacks --vocab, --seq"):
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
    assert "heads 12 do not divide hidden 770" in err and "Traceback" not in err


def test_cli_hf_config_and_override(tmp_path, capsys):
    path = _write(tmp_path, LLAMA_CFG)
    assert main(["memory", "--hf-config", str(path), "--seq", "1024", "-b", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model_shape"]["param_count"] == 6_738_415_616 and out["config"]["seq"] == 1024
