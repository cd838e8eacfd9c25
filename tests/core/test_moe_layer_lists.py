"""A config's own lists of MoE blocks (Qwen2/3-MoE's ``mlp_only_layers``, Llama 4's ``moe_layers``): taken where
the placement rule (first k blocks dense, then every k-th MoE) gives them, counted as transformers builds the
model from the same file (meta device), and refused, naming the blocks, where it cannot (they were ignored)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from microbatch.errors import ConfigError
from microbatch.hf_config import from_hf_config

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

QWEN2_MOE = {"model_type": "qwen2_moe", "hidden_act": "silu", "num_hidden_layers": 6, "hidden_size": 256,
             "num_attention_heads": 8, "num_key_value_heads": 4, "intermediate_size": 512,
             "moe_intermediate_size": 128, "shared_expert_intermediate_size": 256, "num_experts": 8,
             "num_experts_per_tok": 2, "decoder_sparse_step": 1, "vocab_size": 1000,
             "max_position_embeddings": 4096, "tie_word_embeddings": False}  # fmt: skip
LLAMA4 = {"model_type": "llama4_text", "hidden_act": "silu", "num_hidden_layers": 6, "hidden_size": 512,
          "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 256,
          "intermediate_size_mlp": 1024, "num_local_experts": 16, "num_experts_per_tok": 1, "vocab_size": 1000,
          "max_position_embeddings": 4096, "tie_word_embeddings": False, "interleave_moe_layer_step": 2}  # fmt: skip


def _shape(tmp_path, cfg):
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    return from_hf_config(p)


def _real(cfg: dict) -> tuple[int, list[bool]]:
    """transformers' parameter count and which blocks hold experts, from the same config."""
    config = transformers.AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    moe = [any("expert" in n for n, _ in layer.named_parameters()) for layer in model.model.layers]
    return sum(p.numel() for p in model.parameters()), moe


def test_qwen_mlp_only_first_blocks_are_its_dense_first_blocks(tmp_path):
    cfg = {**QWEN2_MOE, "mlp_only_layers": [0, 1]}
    shape = _shape(tmp_path, cfg)
    params, moe = _real(cfg)
    assert moe == [False, False, True, True, True, True]  # what transformers builds
    assert shape.moe is not None and shape.moe.dense_layers == 2
    assert [shape.is_moe_layer(i) for i in range(6)] == moe
    # within Qwen2's q/k/v biases and shared-expert gate, not counted (4,096 here); before: all six blocks MoE
    assert abs(shape.param_count() - params) <= 4096
    all_moe = replace(shape, moe=replace(shape.moe, dense_layers=0))
    assert abs(all_moe.param_count() - params) > 100_000  # what ignoring the list cost: the test can fail


def test_llama4_moe_layers_as_the_rule_places_them_are_taken(tmp_path):
    cfg = {**LLAMA4, "moe_layers": [1, 3, 5]}  # what transformers fills in from interleave_moe_layer_step 2
    shape = _shape(tmp_path, cfg)
    params, moe = _real(cfg)
    assert [shape.is_moe_layer(i) for i in range(6)] == moe == [False, True] * 3
    assert shape.param_count() == params


@pytest.mark.parametrize(
    ("cfg", "said"),
    [
        ({**LLAMA4, "moe_layers": [0, 4, 5]}, r"its moe_layers make blocks 0, 4-5 \(of 6\) the MoE blocks"),
        (
            {**QWEN2_MOE, "mlp_only_layers": [3]},
            r"its mlp_only_layers make blocks 0-2, 4-5 \(of 6\) the MoE blocks",
        ),
        ({**QWEN2_MOE, "mlp_only_layers": "0,1"}, r"mlp_only_layers '0,1' must be a list of block indices"),
    ],
)
def test_a_list_the_rule_cannot_place_is_refused_naming_its_blocks(tmp_path, cfg, said):
    with pytest.raises(ConfigError, match=said) as e:
        _shape(tmp_path, cfg)
    if isinstance(cfg.get("mlp_only_layers", cfg.get("moe_layers")), list):
        assert "first_k_dense_replace" in str(e.value)  # the fix
        _, moe = _real(cfg)  # transformers builds exactly the blocks the message names
        named = [int(x) for part in str(e.value).split("make blocks ")[1].split(" (of")[0].split(", ")
                 for x in (range(int(part.split("-")[0]), int(part.split("-")[-1]) + 1))]  # fmt: skip
        assert [i in named for i in range(6)] == moe


QWEN8 = {**QWEN2_MOE, "num_hidden_layers": 8}
LLAMA4_8 = {**LLAMA4, "num_hidden_layers": 8}


@pytest.mark.parametrize(
    ("cfg", "placed"),
    [
        ({**QWEN8, "mlp_only_layers": [0, 100]}, (1, 1)),  # indices past the blocks are ignored, as there
        ({**QWEN8, "mlp_only_layers": [-1, 0]}, (1, 1)),
        ({**QWEN8, "decoder_sparse_step": 2, "mlp_only_layers": [1]}, (2, 2)),  # blocks 3, 5, 7
        ({**QWEN8, "decoder_sparse_step": 2, "mlp_only_layers": [0, 1]}, (2, 2)),
        (
            {**QWEN8, "first_k_dense_replace": 2, "mlp_only_layers": [0, 1, 2]},
            (3, 1),
        ),  # Qwen ignores that key
        ({**LLAMA4_8, "moe_layers": [3, 5, 7]}, (2, 2)),
        (
            {
                **{k: v for k, v in LLAMA4_8.items() if k != "interleave_moe_layer_step"},
                "moe_layers": [1, 3, 5, 7],
            },
            (0, 2),
        ),
        ({**LLAMA4_8, "moe_layers": [1, 3, 5, 7, 9, -1]}, (0, 2)),
    ],
)
def test_lists_the_rule_can_place_are_placed_as_transformers_builds_them(tmp_path, cfg, placed):
    shape = _shape(tmp_path, cfg)
    _, moe = _real(cfg)
    assert shape.moe is not None and (shape.moe.dense_layers, shape.moe.moe_every) == placed
    assert [shape.is_moe_layer(i) for i in range(8)] == moe


@pytest.mark.parametrize(
    "cfg", [{**LLAMA4_8, "moe_layers": []}, {**QWEN8, "mlp_only_layers": list(range(8))}]
)
def test_lists_that_leave_no_moe_block_make_a_dense_model(tmp_path, cfg):
    shape = _shape(tmp_path, cfg)
    _, moe = _real(cfg)
    assert moe == [False] * 8 and shape.moe is None
