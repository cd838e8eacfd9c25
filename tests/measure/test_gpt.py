"""The built-in decoder: exact parameter counts, causality, cache decoding, checkpointing."""

from __future__ import annotations

import pytest
import torch

from microbatch.measure.gpt import build_model, next_token_loss
from microbatch.model import ModelShape, get_model

# A Llama-like shape: rotary positions, RMSNorm, SwiGLU, grouped-query attention, no biases.
LLAMA_TINY = ModelShape(
    name="llama-tiny",
    layers=2,
    hidden=64,
    heads=4,
    kv_heads=2,
    ffn_hidden=96,
    vocab=300,
    seq=32,
    gated_mlp=True,
    bias=False,
    norm="rmsnorm",
    learned_positions=False,
)


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())  # shared (tied) tensors counted once


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_param_count_real(name):
    shape = get_model(name)
    assert n_params(build_model(shape)) == shape.param_count()


@pytest.mark.parametrize(
    "name,expected",
    [
        ("gpt2", 124_439_808),
        ("llama-2-7b", 6_738_415_616),
        ("llama-3.2-1b", None),
        ("gpt2-large", None),
        ("llama-2-70b", None),
    ],
)
def test_param_count_meta(name, expected):
    shape = get_model(name)
    model = build_model(shape, device="meta")
    assert all(p.device.type == "meta" for p in model.parameters())
    assert n_params(model) == shape.param_count()
    if expected is not None:
        assert n_params(model) == expected


def test_param_count_untied_gqa():
    assert n_params(build_model(LLAMA_TINY)) == LLAMA_TINY.param_count()


def test_tied_embedding_shares_storage():
    m = build_model(get_model("tiny"))
    assert m.head.proj.weight is m.embed.tok.weight
    m2 = build_model(LLAMA_TINY)
    assert m2.head.proj.weight is not m2.embed.tok.weight


@pytest.mark.parametrize("shape", [get_model("tiny"), LLAMA_TINY], ids=["gpt", "llama"])
def test_causal_and_shapes(shape):
    m = build_model(shape).eval()
    t = torch.randint(0, shape.vocab, (2, 16))
    logits = m(t)
    assert logits.shape == (2, 16, shape.vocab)
    t2 = t.clone()
    t2[:, 10:] = (t2[:, 10:] + 1) % shape.vocab  # change the future only
    logits2 = m(t2)
    torch.testing.assert_close(logits[:, :10], logits2[:, :10])
    assert (logits[:, 10:] - logits2[:, 10:]).abs().max() > 1e-4


@pytest.mark.parametrize("shape", [get_model("tiny"), LLAMA_TINY], ids=["gpt", "llama"])
def test_decode_matches_full_forward(shape):
    m = build_model(shape).eval()
    t = torch.randint(0, shape.vocab, (3, 20))
    with torch.no_grad():
        full = m(t)
    logits, cache = m.prefill(t[:, :12], capacity=20)
    torch.testing.assert_close(logits, full[:, 11], atol=1e-5, rtol=1e-4)
    for i in range(12, 20):
        logits, cache = m.decode_step(t[:, i], cache)
        torch.testing.assert_close(logits, full[:, i], atol=1e-5, rtol=1e-4)
    assert cache.length == 20
    # 2 (k, v) × L × b × kv × capacity × head_dim × 4 bytes
    assert cache.nbytes() == 2 * shape.layers * 3 * shape.kv * 20 * shape.head_dim * 4
    with pytest.raises(ValueError, match="full"):
        m.decode_step(t[:, 0], cache)


@pytest.mark.parametrize("shape", [get_model("tiny"), LLAMA_TINY], ids=["gpt", "llama"])
def test_under_bf16_autocast_the_cache_holds_bf16_as_the_projections_give_it(shape):
    """``--precision bf16-mixed`` decodes under autocast with fp32 weights: the cache held K and V at the weights'
    fp32, twice Hugging Face's bf16 cache and twice the bytes a bf16 decode holds; it holds autocast's dtype now, and
    the decode still follows the (bf16) full forward."""
    m = build_model(shape).eval()
    t = torch.randint(0, shape.vocab, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        full = m(t)
        logits, cache = m.prefill(t[:, :10], capacity=16)
        for i in range(10, 16):
            logits, cache = m.decode_step(t[:, i], cache)
    assert {k.dtype for k in cache.keys + cache.values} == {torch.bfloat16}
    assert cache.nbytes() == 2 * shape.layers * 2 * shape.kv * 16 * shape.head_dim * 2
    torch.testing.assert_close(logits.float(), full[:, 15].float(), atol=0.1, rtol=0.05)
    assert m.new_cache(1, 4).keys[0].dtype == torch.float32  # outside autocast: the weights' dtype


def test_checkpointing_same_gradients():
    shape = get_model("tiny")
    t = torch.randint(0, shape.vocab, (2, 32))
    grads = []
    for ckpt in (False, True):
        m = build_model(shape, seed=3)
        m.checkpointing = ckpt
        m.loss(t).backward()
        grads.append([p.grad.clone() for p in m.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b)


def test_seeded_and_dtype():
    a, b = build_model(get_model("tiny"), seed=1), build_model(get_model("tiny"), seed=1)
    c = build_model(get_model("tiny"), seed=2)
    assert torch.equal(a.layers[0].attn.qkv.weight, b.layers[0].attn.qkv.weight)
    assert not torch.equal(a.layers[0].attn.qkv.weight, c.layers[0].attn.qkv.weight)
    assert build_model(get_model("tiny"), dtype=torch.bfloat16).embed.tok.weight.dtype == torch.bfloat16


def test_loss_near_log_vocab_and_trains():
    shape = get_model("tiny")
    m = build_model(shape)
    t = torch.randint(0, shape.vocab, (4, 32))
    loss0 = m.loss(t)
    # random init: the prediction is near uniform, so the loss is near ln V
    assert abs(loss0.item() - torch.log(torch.tensor(float(shape.vocab))).item()) < 0.5
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    for _ in range(10):
        opt.zero_grad()
        m.loss(t).backward()
        opt.step()
    assert m.loss(t).item() < loss0.item() - 0.5
    assert next_token_loss(m(t), t).item() == pytest.approx(m.loss(t).item())


def test_pipeline_split_composes():
    shape = get_model("tiny")
    m = build_model(shape).eval()
    t = torch.randint(0, shape.vocab, (2, 8))
    x = m.embed(t)
    for block in m.layers:
        x = block(x)
    torch.testing.assert_close(m.head(x), m(t))


def test_block_alone_uses_rotary():
    m = build_model(LLAMA_TINY).eval()
    t = torch.randint(0, LLAMA_TINY.vocab, (2, 8))
    x = m.embed(t)
    for block in m.layers:
        x = block(x)
    torch.testing.assert_close(m.head(x), m(t))
    assert m.layers[0].attn.rope_cos.dtype == torch.float32
