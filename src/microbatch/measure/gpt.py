"""The built-in decoder: a pure-PyTorch GPT built from a :class:`~microbatch.model.ModelShape`.

``build_model(shape)`` returns a :class:`GPT` whose parameter count equals
``shape.param_count()`` exactly (GPT-2 124,439,808 with tied embeddings). It supports what the
registry describes: LayerNorm or RMSNorm, a GELU or SwiGLU (gated) MLP, grouped-query attention,
learned or rotary positions, tied or separate output embeddings, with or without biases. It applies no
dropout whatever the shape's ``dropout`` says (a step is then a function of its batch alone, as the exactness
tests of accumulation need): ``tune`` records the shape it measured with dropout off.

The module is split for pipelining: ``embed`` (tokens ``(b, s)`` → hidden ``(b, s, h)``),
``layers`` (an ``nn.ModuleList`` of blocks, each hidden → hidden, each usable alone: rotary
tables live in every block) and ``head`` (final norm and output projection → logits
``(b, s, V)``). Attention is ``F.scaled_dot_product_attention(is_causal=True)``, so the s×s
score matrix is never stored where the backend has a fused kernel.

Decoding uses a key/value cache allocated once for the whole sequence (``prefill`` then
``decode_step``), so a decode step's memory holds the cache at its final size from the start.
With ``model.checkpointing = True`` each block is recomputed in the backward pass
(``torch.utils.checkpoint``, non-reentrant): about one extra forward per step, and only each
block's input (b·s·h values) is kept instead of all of its activations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from microbatch.model import ModelShape

__all__ = ["GPT", "Block", "Embed", "Head", "KVCache", "build_model", "next_token_loss", "rotary_tables"]

INIT_STD = 0.02
"""Standard deviation of the normal initialisation (GPT-2's ``initializer_range``)."""

ROPE_THETA = 10000.0
"""Rotary base (Su et al. 2021; Llama-2's ``rope_theta``)."""


def _norm(shape: ModelShape) -> nn.Module:
    if shape.norm == "rmsnorm":
        return nn.RMSNorm(shape.hidden, eps=1e-5)
    return nn.LayerNorm(shape.hidden, eps=1e-5)


def rotary_tables(
    head_dim: int, positions: int, *, theta: float = ROPE_THETA, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables ``(positions, head_dim)`` of rotary embeddings.

    Angle of position p and pair i: p·θ^(−2i/d) (Su et al. 2021, RoFormer), the two halves of
    the head dimension rotated together (the ``rotate_half`` layout of Llama's reference code).
    """
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    pos = torch.arange(positions, dtype=torch.float32, device=device)
    ang = torch.outer(pos, inv)
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos(), ang.sin()


def _apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x·cos + rotate_half(x)·sin with x ``(b, heads, s, d)`` and tables ``(s, d)``."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rot * sin


@dataclass
class KVCache:
    """Keys and values of every layer, allocated once at ``capacity`` positions."""

    keys: list[torch.Tensor]
    """One ``(b, kv_heads, capacity, head_dim)`` tensor per layer."""
    values: list[torch.Tensor]
    """One ``(b, kv_heads, capacity, head_dim)`` tensor per layer."""
    length: int
    """Positions filled so far."""

    @property
    def capacity(self) -> int:
        """Positions the cache can hold."""
        return int(self.keys[0].shape[2]) if self.keys else 0

    def nbytes(self) -> int:
        """Bytes held by the cache: 2·L·b·kv·capacity·head_dim·element size."""
        return sum(int(t.numel()) * t.element_size() for t in self.keys + self.values)


class Attention(nn.Module):
    """Causal self-attention with grouped-query heads (kv_heads divides heads)."""

    rope_cos: torch.Tensor
    """Rotary cos table ``(positions, head_dim)`` (a non-persistent buffer; rotary shapes only)."""
    rope_sin: torch.Tensor
    """Rotary sin table ``(positions, head_dim)``."""

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.heads, self.kv, self.head_dim = shape.heads, shape.kv, shape.head_dim
        kvd = self.kv * self.head_dim
        self.qkv = nn.Linear(shape.hidden, shape.q_width + 2 * kvd, bias=shape.bias)
        self.out = nn.Linear(shape.q_width, shape.hidden, bias=shape.bias)
        self.rotary = not shape.learned_positions
        if self.rotary:
            self._set_rope(max(shape.positions, shape.seq))

    def _set_rope(self, positions: int) -> None:
        device = self.qkv.weight.device
        cos, sin = rotary_tables(self.head_dim, positions, device=None if device.type == "meta" else device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def _rope(self, needed: int) -> tuple[torch.Tensor, torch.Tensor]:
        if needed > self.rope_cos.shape[0]:
            self._set_rope(max(needed, 2 * self.rope_cos.shape[0]))
        return self.rope_cos, self.rope_sin

    def forward(
        self, x: torch.Tensor, cache: KVCache | None = None, layer: int = 0, start: int = 0
    ) -> torch.Tensor:
        b, s, _ = x.shape
        kvd = self.kv * self.head_dim
        q, k, v = self.qkv(x).split([self.heads * self.head_dim, kvd, kvd], dim=-1)
        q = q.view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(b, s, self.kv, self.head_dim).transpose(1, 2)
        v = v.view(b, s, self.kv, self.head_dim).transpose(1, 2)
        if self.rotary:
            cos, sin = self._rope(start + s)
            cos, sin = cos[start : start + s].to(q.dtype), sin[start : start + s].to(q.dtype)
            q, k = _apply_rotary(q, cos, sin), _apply_rotary(k, cos, sin)
        if cache is not None:
            if start > 0 and s > 1:
                raise ValueError("decode with a cache takes one token at a time after prefill")
            cache.keys[layer][:, :, start : start + s] = k
            cache.values[layer][:, :, start : start + s] = v
            if start > 0:
                k = cache.keys[layer][:, :, : start + s]
                v = cache.values[layer][:, :, : start + s]
        rep = self.heads // self.kv  # explicit repeat rather than SDPA's enable_gqa (torch >= 2.5 only)
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=start == 0 and s > 1)
        out: torch.Tensor = self.out(y.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))
        return out


class MLP(nn.Module):
    """GELU MLP (h → f → h) or SwiGLU (silu(x·W_gate) ⊙ x·W_up → W_down)."""

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.gated = shape.gated_mlp
        f = shape.ffn
        self.up = nn.Linear(shape.hidden, (2 if self.gated else 1) * f, bias=shape.bias)
        self.down = nn.Linear(f, shape.hidden, bias=shape.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            gate, up = self.up(x).chunk(2, dim=-1)
            hidden = F.silu(gate) * up
        else:
            hidden = F.gelu(self.up(x), approximate="tanh")
        out: torch.Tensor = self.down(hidden)
        return out


class Block(nn.Module):
    """A pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x)); with the shape's ``parallel_block``
    both read x: x + attn(norm₁(x)) + mlp(norm₂(x)) (GPT-NeoX's parallel residual)."""

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.norm1, self.attn = _norm(shape), Attention(shape)
        self.norm2, self.mlp = _norm(shape), MLP(shape)
        self.parallel = shape.parallel_block

    def forward(
        self, x: torch.Tensor, cache: KVCache | None = None, layer: int = 0, start: int = 0
    ) -> torch.Tensor:
        if self.parallel:
            both: torch.Tensor = x + self.attn(self.norm1(x), cache, layer, start) + self.mlp(self.norm2(x))
            return both
        x = x + self.attn(self.norm1(x), cache, layer, start)
        out: torch.Tensor = x + self.mlp(self.norm2(x))
        return out


class Embed(nn.Module):
    """Token embedding plus, for learned positions, a position embedding: ``(b, s)`` → ``(b, s, h)``."""

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.tok = nn.Embedding(shape.vocab, shape.hidden)
        self.pos = nn.Embedding(shape.positions, shape.hidden) if shape.learned_positions else None

    def forward(self, tokens: torch.Tensor, start: int = 0) -> torch.Tensor:
        x: torch.Tensor = self.tok(tokens)
        if self.pos is not None:
            s = tokens.shape[1]
            x = x + self.pos(torch.arange(start, start + s, device=tokens.device))
        return x


class Head(nn.Module):
    """Final norm and output projection: ``(b, s, h)`` → logits ``(b, s, V)``."""

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.norm = _norm(shape)
        self.proj = nn.Linear(shape.hidden, shape.vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.proj(self.norm(x))
        return out


class GPT(nn.Module):
    """A decoder-only transformer: ``embed`` → ``layers`` → ``head``."""

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.shape = shape
        self.embed = Embed(shape)
        self.layers = nn.ModuleList(Block(shape) for _ in range(shape.layers))
        self.head = Head(shape)
        if shape.tied_embeddings:
            self.head.proj.weight = self.embed.tok.weight
        self.checkpointing = False
        """Recompute each block in the backward pass (activation checkpointing)."""

    def blocks(self) -> list[Block]:
        """The transformer blocks, typed (``layers`` is an ``nn.ModuleList``)."""
        return [block for block in self.layers if isinstance(block, Block)]

    def _blocks(self, x: torch.Tensor, cache: KVCache | None = None, start: int = 0) -> torch.Tensor:
        for i, block in enumerate(self.layers):
            if self.checkpointing and cache is None and torch.is_grad_enabled():
                from torch.utils.checkpoint import checkpoint

                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x, cache, i, start)
        return x

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits ``(b, s, V)`` for tokens ``(b, s)``."""
        logits: torch.Tensor = self.head(self._blocks(self.embed(tokens)))
        return logits

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy of ``tokens`` (predict token t+1 from tokens ≤ t)."""
        return next_token_loss(self(tokens), tokens)

    # -- decoding with a key/value cache ----------------------------------------------
    def new_cache(self, batch: int, capacity: int) -> KVCache:
        """An empty cache for ``batch`` sequences of up to ``capacity`` positions, in the dtype the projections give
        K and V: autocast's where it is on for the weights' device (bf16 under ``bf16-mixed``, as Hugging Face's
        cache holds them; the weights' fp32 held it at twice the bytes), else the weights'."""
        w = self.embed.tok.weight
        kind = w.device.type
        dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else w.dtype
        dims = (batch, self.shape.kv, capacity, self.shape.head_dim)
        keys = [torch.zeros(dims, dtype=dtype, device=w.device) for _ in self.layers]
        values = [torch.zeros(dims, dtype=dtype, device=w.device) for _ in self.layers]
        return KVCache(keys=keys, values=values, length=0)

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor, *, capacity: int | None = None) -> tuple[torch.Tensor, KVCache]:
        """Run the prompt ``(b, s)``; return logits of its last position ``(b, V)`` and the cache.

        ``capacity`` (default: the larger of the position table and s) sets how many positions
        the cache holds; decoding past it raises ``ValueError``.
        """
        b, s = tokens.shape
        capacity = capacity or max(self.shape.positions, s)
        if capacity < s:
            raise ValueError(f"cache capacity {capacity} is shorter than the prompt {s}")
        cache = self.new_cache(b, capacity)
        x = self._blocks(self.embed(tokens), cache, 0)
        cache.length = s
        return self.head(x[:, -1:])[:, 0], cache

    @torch.no_grad()
    def decode_step(self, token: torch.Tensor, cache: KVCache) -> tuple[torch.Tensor, KVCache]:
        """One new token per sequence ``(b,)`` or ``(b, 1)``; return logits ``(b, V)`` and the cache."""
        if token.dim() == 1:
            token = token[:, None]
        start = cache.length
        if start >= cache.capacity:
            raise ValueError(
                f"the cache is full ({cache.capacity} positions); prefill with a larger capacity"
            )
        x = self._blocks(self.embed(token, start), cache, start)
        cache.length = start + 1
        return self.head(x)[:, 0], cache


def next_token_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of predicting ``tokens[:, 1:]`` from ``logits[:, :-1]`` (in fp32)."""
    v = logits.shape[-1]
    return F.cross_entropy(logits[:, :-1].reshape(-1, v).float(), tokens[:, 1:].reshape(-1))


def _init(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=INIT_STD)
        bias = getattr(module, "bias", None)
        if isinstance(bias, torch.Tensor):
            nn.init.zeros_(bias)


def build_model(
    shape: ModelShape,
    *,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> GPT:
    """A :class:`GPT` of ``shape`` with weights drawn from N(0, 0.02²) (seeded), on ``device``.

    ``device="meta"`` builds the structure without allocating (to count the parameters of big
    shapes). Residual output projections are scaled by 1/√(2L) (GPT-2's initialisation).
    Rotary tables stay in fp32 whatever ``dtype`` is.
    """
    device = torch.device(device)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with device:
            model = GPT(shape)
        if device.type != "meta":
            model.apply(_init)
            with torch.no_grad():
                for block in model.blocks():
                    block.attn.out.weight.mul_(1.0 / math.sqrt(2 * shape.layers))
                    block.mlp.down.weight.mul_(1.0 / math.sqrt(2 * shape.layers))
    if dtype != torch.float32:
        for p in model.parameters():  # tied weights appear once
            p.data = p.data.to(dtype)
    return model
