"""Mixture-of-experts keys other families write (a sweep of 200 transformers causal-LM configs, 2026-12-07): transformers
5's per-block ``mlp_layer_types`` (GLM-4 MoE Lite priced its dense blocks as MoE: +1.8% at GLM-4.7-Flash size), the
shared experts as ``num_shared_experts`` (EXAONE-MoE, AFMoE, HunYuan) or ``moe_num_shared_experts`` (Aria), and
AFMoE's ``num_dense_layers``."""

from __future__ import annotations

import pytest

from microbatch.errors import ConfigError
from microbatch.moe import experts_from_hf

BASE = {"num_hidden_layers": 6, "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64}


def test_mlp_layer_types_place_the_dense_blocks():
    ex = experts_from_hf({**BASE, "mlp_layer_types": ["dense", "dense"] + ["sparse"] * 4}, 256, "c.json")
    assert ex is not None and (ex.dense_layers, ex.moe_every) == (2, 1)
    assert experts_from_hf({**BASE, "mlp_layer_types": ["dense"] * 6}, 256, "c.json") is None  # a dense model
    ex = experts_from_hf(
        {**BASE, "mlp_layer_types": ["dense"] + ["hash_moe", "moe"] * 2 + ["moe"]}, 256, "c.json"
    )
    assert ex is not None and (ex.dense_layers, ex.moe_every) == (1, 1)  # DeepSeek-V4's kinds of MoE block
    with pytest.raises(ConfigError, match=r"mlp_layer_types \['dense', 5\] must name each block's kind"):
        experts_from_hf({**BASE, "mlp_layer_types": ["dense", 5]}, 256, "c.json")


@pytest.mark.parametrize("key", ["n_shared_experts", "num_shared_experts", "moe_num_shared_experts"])
def test_shared_experts_under_each_spelling(key):
    ex = experts_from_hf({**BASE, key: 2}, 256, "c.json")
    assert ex is not None and ex.shared_experts == 2


def test_afmoes_dense_layers():
    ex = experts_from_hf({**BASE, "num_dense_layers": 3}, 256, "c.json")
    assert ex is not None and ex.dense_layers == 3
