"""The shape of a decoder-only transformer and its exact parameter counts.

A :class:`ModelShape` is the geometry the formulas need (layers L, hidden h, heads a, kv heads,
ffn hidden, vocab V, sequence s) plus the details that change parameter counts (tied
embeddings, gated MLP, biases, norm kind, learned positions) and, for mixture-of-experts models,
the experts and latent attention of :mod:`microbatch.moe`. :mod:`microbatch.model` holds the
registry of named shapes and the readers (Hugging Face configs, shape flags).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from microbatch.batch import divisors
from microbatch.errors import ConfigError, check_positive_int, plain_numbers
from microbatch.moe import Experts, LatentAttention, as_experts, as_latent_attention

__all__ = ["MAX_LAYERS", "MAX_SEQ", "MAX_VOCAB", "MAX_WIDTH", "ModelShape", "check_tensor_parallel"]

MAX_LAYERS = 100_000
"""The most layers a shape may have: 500× today's deepest (Llama 3.1 405B's 126, GPT-3's 96); past it a typo."""
MAX_WIDTH = 2**20
"""The most a width or head count may be (1,048,576): 40× today's widest hidden size (PaLM's 18,432, Llama 3.1 405B's
16,384) and MLP (53,248); past it a typo (a new user's hidden 10^9 planned 4.8·10^19 parameters without a word)."""
MAX_VOCAB = 2**24
"""The most a vocabulary may be (16.8M): 64× today's largest (Gemma's 262,144)."""
MAX_SEQ = 2**30
"""The most a sequence may be (1.07·10^9): 100× the longest context trained; the divisor searches over a shape stay
milliseconds under it."""


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """The shape of a decoder-only transformer."""

    name: str = "custom"
    """A label for reports and caches."""
    layers: int
    """L: transformer blocks."""
    hidden: int
    """h: model (residual stream) width."""
    heads: int
    """a: attention heads; must divide ``hidden`` unless ``head_size`` is given."""
    head_size: int | None = None
    """d_h, the width of one head, where the model sets it apart from hidden/heads (Hugging Face's
    ``head_dim``: Qwen3-30B-A3B 32 × 128 = 4,096 on a 2,048 residual, Gemma 7B 16 × 256 on 3,072, GPT-OSS
    64 × 64 on 2,880); None means hidden/heads. The query and attention-output width is a·d_h."""
    kv_heads: int | None = None
    """Key/value heads (grouped-query attention); None means ``heads`` (multi-head attention)."""
    ffn_hidden: int | None = None
    """MLP inner width; None means 4·h."""
    vocab: int
    """V: vocabulary size."""
    seq: int
    """s: sequence length used by default (the longest the data holds)."""
    max_positions: int | None = None
    """Learned position-embedding table size; None means ``seq``. Ignored with rotary positions."""
    tied_embeddings: bool = False
    """Output layer shares the input embedding matrix (GPT-2)."""
    gated_mlp: bool = False
    """SwiGLU-style MLP with three matrices (Llama, Mistral) instead of two."""
    bias: bool = True
    """Linear layers and norms carry biases (GPT-2: yes; Llama: no)."""
    norm: str = "layernorm"
    """``layernorm`` (weight and bias) or ``rmsnorm`` (weight only)."""
    learned_positions: bool = True
    """A learned position-embedding table (GPT-2) rather than rotary embeddings (Llama)."""
    flash_attention: bool = True
    """Attention kernels that never store the s×s score matrix (drops the 5·a·s/h activation term)."""
    sliding_window: int | None = None
    """w: keys a query of a local-attention layer sees (itself and the w − 1 before it: Mistral 7B v0.1 4,096 on
    every layer, GPT-OSS 128 and Gemma 2 4,096 on every other one, Gemma 3 1,024 on five of six); None: none."""
    sliding_layers: int | None = None
    """How many of the layers attend through ``sliding_window``; None means all of them when it is given."""
    local_attention: str = "sliding"
    """How a local layer's ``sliding_window`` keys are chosen: ``sliding`` (the w up to the query) or ``chunked``
    (the query's own w-token chunk, causal inside it: Llama 4's ``attention_chunk_size`` 8,192 on three layers in
    four)."""
    activation: str = "gelu"
    """The MLP's activation as transformers names it (``hidden_act``/``activation_function``: GPT-2's ``gelu_new``,
    Llama's ``silu``): what an eager layer keeps for its backward depends on how many operations it is written as
    (:data:`microbatch.predict.eager_memory.EAGER_ACTIVATION_SAVES`); nothing else reads it."""
    qk_norm: bool = False
    """An RMSNorm over the queries and keys before attention (Qwen3's and Gemma 3's per head, OLMo 2's over all heads);
    read by the eager layers' memory only (:mod:`microbatch.predict.eager_memory`)."""
    norm_fp32: bool = False
    """The RMSNorm scales in fp32 before casting back (Gemma's ``x.float()`` · (1 + w)), so its eager form keeps the
    normalised tensor in fp32; read by the eager layers' memory only."""
    norm_placement: str = "pre"
    """Where a block's norms sit: ``pre`` (before attention and the MLP: Llama, GPT-2), ``sandwich`` (before and after
    each: Gemma 2 and 3), ``post`` (after each only, on the sublayer's output: OLMo 2); read by the eager layers' memory
    only."""
    dropout: bool = True
    """Training uses dropout (GPT-2, the Megatron models): its 1-byte masks count as activations.
    Llama-family training runs without dropout."""
    parallel_block: bool = False
    """Attention and MLP read the same input and their outputs are added to it together, x + attn(norm₁(x)) +
    mlp(norm₂(x)) (GPT-J, GPT-NeoX's ``use_parallel_residual``, Falcon's ``parallel_attn``, Phi, PaLM): under tensor
    parallelism one all-reduce per layer and pass where the sequential block needs two (``plan --parallel-block``
    sets it for any model)."""
    moe: Experts | None = None
    """Mixture-of-experts MLPs (E, K, F, S, dense first layers); None means every MLP is dense."""
    mla: LatentAttention | None = None
    """DeepSeek's multi-head latent attention in place of (grouped-query) attention; None means none."""

    def __post_init__(self) -> None:
        plain_numbers(self)
        object.__setattr__(self, "moe", as_experts(self.moe))  # a shape read back from JSON
        object.__setattr__(self, "mla", as_latent_attention(self.mla))
        if self.moe is not None and self.moe.dense_layers > self.layers:
            raise ConfigError(
                f"dense layers {self.moe.dense_layers} > layers {self.layers}; use at most {self.layers}"
            )
        if self.moe is not None and isinstance(self.layers, int) and not self.moe_layer_count(0, self.layers):
            raise ConfigError(
                f"no block of {self.layers} has the experts (dense_layers {self.moe.dense_layers}, moe_every "
                f"{self.moe.moe_every}): a dense model; drop the experts or give moe_every <= layers",
                params=("moe_every",),
            )
        for f in ("layers", "hidden", "heads", "vocab", "seq"):
            check_positive_int(f, getattr(self, f))
        for f in (
            "layers",
            "hidden",
            "heads",
            "kv_heads",
            "ffn_hidden",
            "head_size",
            "vocab",
            "seq",
            "max_positions",
        ):
            v = getattr(self, f)
            cap = {"layers": MAX_LAYERS, "vocab": MAX_VOCAB, "seq": MAX_SEQ, "max_positions": MAX_SEQ}.get(
                f, MAX_WIDTH
            )
            if isinstance(v, int) and v > cap:  # the searches over a shape's divisors would run for hours
                raise ConfigError(f"{f} {v:,} is past {cap:,}, beyond any model this tool plans (the deepest stack "
                                  "~200, the widest are ~10^5 wide, the longest contexts ~10^7 tokens); check it",
                                  params=(f,))  # fmt: skip
        if self.kv_heads is not None:
            check_positive_int("kv_heads", self.kv_heads)
            if self.heads % self.kv_heads:
                raise ConfigError(
                    f"kv heads {self.kv_heads} do not divide heads {self.heads}; grouped-query attention "
                    "needs heads % kv_heads == 0; choose kv heads among "
                    + ", ".join(str(d) for d in range(1, self.heads + 1) if self.heads % d == 0)
                )
        if self.ffn_hidden is not None:
            check_positive_int("ffn_hidden", self.ffn_hidden)
        if self.max_positions is not None:
            check_positive_int("max_positions", self.max_positions,
                               fix="give the learned position table's rows, or None for seq's")  # fmt: skip
        if self.sliding_window is not None or self.sliding_layers is not None:
            self._check_window()
        if self.norm_placement not in ("pre", "sandwich", "post"):
            raise ConfigError(
                f"norm_placement {self.norm_placement!r} is not known; use 'pre', 'sandwich' or 'post'",
                params=("norm_placement",),
            )
        if self.local_attention not in ("sliding", "chunked"):
            raise ConfigError(
                f"local_attention {self.local_attention!r} is not known; use 'sliding' (a window up to the query) "
                "or 'chunked' (the query's own chunk of sliding_window tokens)",
                params=("local_attention",),
            )
        if self.head_size is not None:
            check_positive_int("head_size", self.head_size, fix="give the width of one attention head")
        elif self.hidden % self.heads:
            near = sorted(
                {(self.hidden // self.heads) * self.heads, (self.hidden // self.heads + 1) * self.heads}
            )
            raise ConfigError(
                f"heads {self.heads} do not divide hidden {self.hidden}; each head needs hidden/heads "
                f"whole dimensions; use hidden in {', '.join(str(n) for n in near if n > 0)} or heads among "
                + ", ".join(str(d) for d in divisors(self.hidden) if d <= 4 * self.heads)[:80]
                + "; or give head_size, the width of one head, where it is not hidden/heads",
                params=("heads", "hidden", "head_size"),
            )
        if self.norm not in ("layernorm", "rmsnorm"):
            raise ConfigError(f"norm {self.norm!r} is not known; use 'layernorm' or 'rmsnorm'")

    def _check_window(self) -> None:
        if self.sliding_window is None:
            raise ConfigError(
                f"sliding_layers {self.sliding_layers} without sliding_window; give the window's keys too",
                params=("sliding_layers", "sliding_window"),
            )
        check_positive_int(
            "sliding_window", self.sliding_window, fix="give the keys a local layer's query sees"
        )
        if self.sliding_layers is not None and (
            isinstance(self.sliding_layers, bool)
            or not isinstance(self.sliding_layers, int)
            or not 0 <= self.sliding_layers <= self.layers
        ):
            raise ConfigError(
                f"sliding_layers {self.sliding_layers!r} is not a whole number in 0..{self.layers} (the layers); give how many "
                "layers attend through the window",
                params=("sliding_layers",),
            )

    # -- derived sizes -------------------------------------------------------------------
    @property
    def sliding_share(self) -> float:
        """The share of layers that attend through ``sliding_window`` (0 without one)."""
        if self.sliding_window is None:
            return 0.0
        n = self.layers if self.sliding_layers is None else self.sliding_layers
        return n / self.layers

    @property
    def kv(self) -> int:
        """Key/value heads in effect."""
        return self.kv_heads or self.heads

    @property
    def head_dim(self) -> int:
        """d_h: ``head_size`` when given, else hidden/heads."""
        return self.head_size or self.hidden // self.heads

    @property
    def q_width(self) -> int:
        """a·d_h: the width of the queries and of the attention output (h unless ``head_size`` sets d_h)."""
        return self.heads * self.head_dim

    @property
    def ffn(self) -> int:
        """MLP inner width in effect."""
        return self.ffn_hidden or 4 * self.hidden

    @property
    def positions(self) -> int:
        return self.max_positions or self.seq

    def with_seq(self, seq: int) -> ModelShape:
        check_positive_int("seq", seq, fix="give the longest sequence the data holds")
        return replace(self, seq=seq)

    def dense_block(self) -> ModelShape:
        """The shape whose block is this model's dense block: a mixture-of-experts model's dense MLP (its ``ffn``, as
        :meth:`layer_params` counts a dense block), no experts; this shape itself when it has none."""
        return self if self.moe is None else replace(self, moe=None)

    # -- parameter counts (exact for the GPT-2 and Llama families) -----------------------
    def norm_params(self) -> int:
        return 2 * self.hidden if self.norm == "layernorm" else self.hidden

    def attention_params(self) -> int:
        """q and o projections h×(a·d_h) and (a·d_h)×h, k and v projections h×(kv·d_h), biases if any (or
        MLA's). At d_h = h/a: 2h² + 2h·kv·d_h."""
        if self.mla is not None:
            return self.mla.params(self.hidden, self.heads)
        h, qw, kvd = self.hidden, self.q_width, self.kv * self.head_dim
        weights = 2 * h * qw + 2 * h * kvd
        return weights + ((qw + h + 2 * kvd) if self.bias else 0)

    def mlp_params(self) -> int:
        h, f = self.hidden, self.ffn
        if self.gated_mlp:
            return 3 * h * f + ((2 * f + h) if self.bias else 0)
        return 2 * h * f + ((f + h) if self.bias else 0)

    def is_moe_layer(self, index: int) -> bool:
        """Block ``index`` (0-based) has a mixture-of-experts MLP: past the dense first blocks, every
        ``moe_every``-th (:class:`~microbatch.moe.Experts`)."""
        moe = self.moe
        return moe is not None and index >= moe.dense_layers and index % moe.moe_every == moe.moe_every - 1

    def moe_layer_count(self, first: int, count: int) -> int:
        """How many of blocks ``first`` … ``first + count − 1`` have a mixture-of-experts MLP."""
        if self.moe is None:
            return 0
        if self.moe.moe_every == 1:
            return max(0, first + count - max(first, self.moe.dense_layers))
        return sum(1 for i in range(first, first + count) if self.is_moe_layer(i))

    def layer_params(self, index: int | None = None, *, active: bool = False) -> int:
        """One transformer block: attention, MLP (dense or MoE) and two norms. ``index`` None means
        the largest block (a MoE block when there are experts); ``active`` counts the parameters one
        token uses (K routed experts, not E); -1 a dense block."""
        moe = self.moe is not None if index is None else index >= 0 and self.is_moe_layer(index)
        if self.moe is None or not moe:
            mlp = self.mlp_params()
        else:
            mats = 3 if self.gated_mlp else 2
            f = self.moe.active_moe_params if active else self.moe.moe_params
            mlp = f(self.hidden, mats)
        return self.attention_params() + mlp + 2 * self.norm_params()

    def layers_params(self, first: int, count: int, *, active: bool = False) -> int:
        """Blocks ``first`` … ``first + count − 1`` together (dense first layers counted as dense)."""
        if self.moe is None:
            return count * self.layer_params()
        return self.blocks_params(count, self.moe_layer_count(first, count), active=active)

    def blocks_params(self, count: int, moe_blocks: int, *, active: bool = False) -> int:
        """``count`` blocks of which ``moe_blocks`` have the experts (a rank's, wherever its placement puts them)."""
        if self.moe is None:
            return count * self.layer_params()
        dense = (count - moe_blocks) * self.layer_params(-1, active=active)
        return dense + moe_blocks * self.layer_params(active=active)

    def embedding_params(self) -> int:
        """Token embedding plus learned positions (if any)."""
        return self.vocab * self.hidden + (self.positions * self.hidden if self.learned_positions else 0)

    def output_params(self) -> int:
        """Final norm plus the output projection (zero extra when tied to the embedding)."""
        return self.norm_params() + (0 if self.tied_embeddings else self.vocab * self.hidden)

    def param_count(self) -> int:
        """Total parameters (every expert)."""
        return self.layers_params(0, self.layers) + self.embedding_params() + self.output_params()

    def active_param_count(self) -> int:
        """Parameters one token uses: K routed experts per MoE block, embeddings included (Mixtral's
        12.9B and DeepSeek-V3's 37B count them); equal to :meth:`param_count` for a dense model."""
        return (
            self.layers_params(0, self.layers, active=True) + self.embedding_params() + self.output_params()
        )

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["param_count"] = self.param_count()
        d["active_param_count"] = self.active_param_count()
        return d


def check_tensor_parallel(shape: ModelShape, t: int) -> None:
    """ConfigError unless ``t`` tensor ranks can split ``shape``'s attention: t divides the query heads (whole heads per
    rank) and t and the kv heads divide one or the other (kv heads split or replicated); the values offered pass both
    rules, so none fails next (Megatron's and torchtitan's rules)."""
    if shape.heads % t == 0 and not (shape.kv % t and t % shape.kv):
        return
    ok = [
        d
        for d in range(1, min(shape.heads, 64) + 1)
        if shape.heads % d == 0 and not (shape.kv % d and d % shape.kv)
    ]
    use = f"use tensor-parallel among {', '.join(map(str, ok))}"
    if shape.heads % t:
        raise ConfigError(
            f"tensor-parallel {t} does not divide heads {shape.heads}; each rank needs whole heads; {use}"
        )
    raise ConfigError(
        f"tensor-parallel {t} and kv heads {shape.kv} neither divide the other; kv heads are split or replicated "
        f"across tensor ranks; {use}"
    )
