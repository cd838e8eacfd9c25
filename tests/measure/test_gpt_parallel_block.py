"""The probe model builds the shape's parallel block (GPT-NeoX's parallel residual) as the planner counts it."""

from __future__ import annotations

from dataclasses import replace

import torch

from microbatch.measure.gpt import Block, build_model
from microbatch.model import get_model


def test_a_parallel_block_adds_attention_and_mlp_of_the_same_input():
    shape = replace(get_model("tiny"), parallel_block=True, dropout=False)
    torch.manual_seed(0)
    block = Block(shape)
    x = torch.randn(2, 8, shape.hidden)
    expected = x + block.attn(block.norm1(x)) + block.mlp(block.norm2(x))
    assert torch.allclose(block(x), expected, atol=1e-6)
    sequential = Block(replace(shape, parallel_block=False))
    sequential.load_state_dict(block.state_dict())
    assert not torch.allclose(
        sequential(x), expected, atol=1e-4
    )  # the sequential block feeds the MLP attn's sum


def test_the_parallel_model_has_the_parameters_the_shape_counts():
    shape = replace(get_model("tiny"), parallel_block=True)
    model = build_model(shape)
    assert sum(p.numel() for p in model.parameters()) == shape.param_count()
