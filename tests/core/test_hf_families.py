"""Hugging Face configs of the GPT-2-built families (LayerNorm, GELU MLP) that differ from GPT-2 in their positions,
biases, block, dropout and tying: GPT-NeoX, BLOOM, MPT, GPT-J. Read with transformers (its family defaults) and
from the plain JSON (the table of defaults here), the same shape both ways; parameter counts against a hand count."""

from __future__ import annotations

import importlib.util
import json

import pytest

from microbatch.hf_config import from_hf_config

NEOX = {"model_type": "gpt_neox", "hidden_size": 6144, "intermediate_size": 24576, "num_attention_heads": 64,
        "num_hidden_layers": 44, "max_position_embeddings": 2048, "rotary_pct": 0.25, "vocab_size": 50432}  # fmt: skip
BLOOM = {"model_type": "bloom", "n_embed": 14336, "n_layer": 70, "num_attention_heads": 112, "vocab_size": 250880,
         "seq_length": 2048}  # fmt: skip
MPT = {"model_type": "mpt", "d_model": 4096, "n_heads": 32, "n_layers": 32, "expansion_ratio": 4, "max_seq_len": 2048,
       "vocab_size": 50432, "no_bias": True, "learned_pos_emb": False,
       "attn_config": {"alibi": True, "attn_pdrop": 0.0}, "resid_pdrop": 0.0, "emb_pdrop": 0.0}  # fmt: skip
GPTJ = {"model_type": "gptj", "n_embd": 4096, "n_layer": 28, "n_head": 16, "n_positions": 2048, "rotary_dim": 64,
        "vocab_size": 50400}  # fmt: skip


def _read(tmp_path, cfg, plain, monkeypatch):
    if plain:  # no transformers: the plain JSON and this module's family defaults
        real = importlib.util.find_spec
        monkeypatch.setattr(
            importlib.util, "find_spec", lambda n, *a: None if n == "transformers" else real(n, *a)
        )
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    return from_hf_config(p)


def _layer(h: int, f: int, bias: bool) -> int:
    """One GPT-2-built block by hand: QKV and output projections, the two MLP matrices, two LayerNorms (weight and
    bias: the shape's ``layernorm`` keeps its bias under MPT's ``no_bias``, 2h a layer, 0.004% of MPT-7B)."""
    weights = 4 * h * h + 2 * h * f
    biases = (3 * h + h + f + h) if bias else 0
    return weights + biases + 2 * 2 * h


@pytest.mark.parametrize("plain", [False, True], ids=["transformers", "plain-json"])
def test_gpt_neox_runs_rotary_untied_parallel_without_dropout(tmp_path, monkeypatch, plain):
    s = _read(tmp_path, NEOX, plain, monkeypatch)
    assert s.parallel_block and not s.learned_positions and not s.tied_embeddings and not s.dropout and s.bias
    h, v = 6144, 50432
    assert (
        s.param_count() == 44 * _layer(h, 24576, True) + 2 * v * h + 2 * h
    )  # untied embedding and head, final LN


@pytest.mark.parametrize("plain", [False, True], ids=["transformers", "plain-json"])
def test_bloom_reads_n_embed_and_runs_alibi_tied(tmp_path, monkeypatch, plain):
    s = _read(tmp_path, BLOOM, plain, monkeypatch)
    assert s.hidden == 14336 and s.heads == 112 and s.layers == 70
    assert not s.learned_positions and s.tied_embeddings and not s.dropout and not s.parallel_block
    h, v = 14336, 250880
    assert (
        s.param_count() == 70 * _layer(h, 4 * h, True) + v * h + 2 * h
    )  # (BLOOM's embedding LayerNorm, 2h, left out)


@pytest.mark.parametrize("plain", [False, True], ids=["transformers", "plain-json"])
def test_mpt_takes_its_expansion_ratio_no_bias_and_alibi(tmp_path, monkeypatch, plain):
    s = _read(tmp_path, MPT, plain, monkeypatch)
    assert (
        s.ffn == 4 * 4096 and not s.bias and not s.learned_positions and s.tied_embeddings and not s.dropout
    )
    assert s.param_count() == 32 * _layer(4096, 4 * 4096, False) + 50432 * 4096 + 2 * 4096
    wider = _read(tmp_path, {**MPT, "expansion_ratio": 8}, plain, monkeypatch)
    assert wider.ffn == 8 * 4096


@pytest.mark.parametrize("plain", [False, True], ids=["transformers", "plain-json"])
def test_gptj_always_runs_the_parallel_block(tmp_path, monkeypatch, plain):
    s = _read(tmp_path, GPTJ, plain, monkeypatch)
    assert s.parallel_block and not s.learned_positions and not s.tied_embeddings and not s.dropout


def test_a_stated_dropout_probability_decides_and_gpt2_keeps_its_default(tmp_path, monkeypatch):
    assert _read(tmp_path, {**NEOX, "hidden_dropout": 0.1}, True, monkeypatch).dropout
    assert not _read(tmp_path, {**NEOX, "use_parallel_residual": False}, True, monkeypatch).parallel_block
    gpt2 = {
        "model_type": "gpt2",
        "n_layer": 2,
        "n_embd": 64,
        "n_head": 4,
        "vocab_size": 100,
        "n_positions": 64,
    }
    assert _read(tmp_path, gpt2, True, monkeypatch).dropout  # GPT-2's default 0.1 when the file states none
    assert not _read(tmp_path, {**gpt2, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}, True,
                     monkeypatch).dropout  # fmt: skip
    llama = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
             "vocab_size": 100, "hidden_act": "silu"}  # fmt: skip
    assert not _read(tmp_path, llama, True, monkeypatch).dropout
    assert _read(tmp_path, {**llama, "attention_dropout": 0.1}, True, monkeypatch).dropout


def test_the_shapes_parallel_block_is_the_plans_unless_the_flag_says_otherwise(tmp_path):
    from dataclasses import replace

    from microbatch.hardware import get_accelerator
    from microbatch.predict.plan import PlanConfig, make_plan

    p = tmp_path / "config.json"
    p.write_text(json.dumps(NEOX))
    neox = from_hf_config(p)

    def step(shape, flag=None):
        cfg = PlanConfig(shape=shape, gpu=get_accelerator("a100-80gb"), global_batch=64, data_parallel=8,
                         tensor_parallel=2, micro_batches=(2,), recompute=("full",), zero=(1,), choose="fastest",
                         parallel_block=flag)  # fmt: skip
        return make_plan(cfg).fastest.step_time_s

    sequential = replace(neox, parallel_block=False)
    assert step(neox) == pytest.approx(
        step(sequential, flag=True), rel=1e-12
    )  # the shape's block, as the flag's
    assert step(neox) < step(sequential)  # one all-reduce per layer and pass, not two
    assert step(neox, flag=False) == pytest.approx(
        step(sequential), rel=1e-12
    )  # --sequential-block overrides it
