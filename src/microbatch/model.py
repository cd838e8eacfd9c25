"""Transformer shapes: one registry of model names for every command.

A :class:`ModelShape` is the geometry the formulas need (layers L, hidden h, heads a, kv heads,
ffn hidden, vocab V, sequence s) plus the details that change parameter counts (tied
embeddings, gated MLP, biases, norm kind, learned positions). Parameter counts match the real
models: GPT-2 124,439,808 (tied embeddings), Llama-2-7B 6,738,415,616.

The registry's ``tiny`` and ``small`` are the built-in models that ``tune``, ``pipeline`` and
the demo run for real on the CPU (``microbatch.gpt`` builds them in PyTorch).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from .errors import ConfigError, check_positive_int

__all__ = ["ModelShape", "PRESETS", "get_model", "model_names"]


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
    """a: attention heads; must divide ``hidden``."""
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

    def __post_init__(self) -> None:
        for f in ("layers", "hidden", "heads", "vocab", "seq"):
            check_positive_int(f, getattr(self, f))
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
        if self.hidden % self.heads:
            near = sorted({(self.hidden // self.heads) * self.heads, (self.hidden // self.heads + 1) * self.heads})
            raise ConfigError(
                f"heads {self.heads} do not divide hidden {self.hidden}; each head needs hidden/heads "
                f"whole dimensions; use hidden in {', '.join(str(n) for n in near if n > 0)} or heads among "
                + ", ".join(str(d) for d in _divisors(self.hidden) if d <= 4 * self.heads)[:80]
            )
        if self.norm not in ("layernorm", "rmsnorm"):
            raise ConfigError(f"norm {self.norm!r} is not known; use 'layernorm' or 'rmsnorm'")

    # -- derived sizes -------------------------------------------------------------------
    @property
    def kv(self) -> int:
        """Key/value heads in effect."""
        return self.kv_heads or self.heads

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

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

    # -- parameter counts (exact for the GPT-2 and Llama families) -----------------------
    def norm_params(self) -> int:
        return 2 * self.hidden if self.norm == "layernorm" else self.hidden

    def attention_params(self) -> int:
        """q and o projections h×h, k and v projections h×(kv·head_dim), biases if any."""
        h, kvd = self.hidden, self.kv * self.head_dim
        weights = 2 * h * h + 2 * h * kvd
        return weights + ((2 * h + 2 * kvd) if self.bias else 0)

    def mlp_params(self) -> int:
        h, f = self.hidden, self.ffn
        if self.gated_mlp:
            return 3 * h * f + ((2 * f + h) if self.bias else 0)
        return 2 * h * f + ((f + h) if self.bias else 0)

    def layer_params(self) -> int:
        """One transformer block: attention, MLP and two norms."""
        return self.attention_params() + self.mlp_params() + 2 * self.norm_params()

    def embedding_params(self) -> int:
        """Token embedding plus learned positions (if any)."""
        return self.vocab * self.hidden + (self.positions * self.hidden if self.learned_positions else 0)

    def output_params(self) -> int:
        """Final norm plus the output projection (zero extra when tied to the embedding)."""
        return self.norm_params() + (0 if self.tied_embeddings else self.vocab * self.hidden)

    def param_count(self) -> int:
        return self.layers * self.layer_params() + self.embedding_params() + self.output_params()

    def to_dict(self) -> dict:
        d = asdict(self)
        d["param_count"] = self.param_count()
        return d


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _gpt2(name: str, layers: int, hidden: int, heads: int) -> ModelShape:
    # Radford et al. 2019; Hugging Face gpt2* configs: V=50257, n_positions=1024, tied.
    return ModelShape(
        name=name, layers=layers, hidden=hidden, heads=heads, vocab=50257, seq=1024, tied_embeddings=True
    )


def _llama(name: str, layers: int, hidden: int, heads: int, kv: int, ffn: int, vocab: int, seq: int,
           tied: bool = False) -> ModelShape:
    return ModelShape(
        name=name, layers=layers, hidden=hidden, heads=heads, kv_heads=kv, ffn_hidden=ffn, vocab=vocab,
        seq=seq, gated_mlp=True, bias=False, norm="rmsnorm", learned_positions=False, tied_embeddings=tied,
    )


def _megatron(name: str, layers: int, hidden: int, heads: int, vocab: int = 51200) -> ModelShape:
    # Korthikanti et al. 2022 (arXiv 2205.05198) Table 3; s = 2048, ffn = 4h, V = 51200.
    return ModelShape(name=name, layers=layers, hidden=hidden, heads=heads, vocab=vocab, seq=2048)


PRESETS: dict[str, ModelShape] = {
    # Built-in models that run for real on a CPU (microbatch.gpt builds them).
    "tiny": ModelShape(name="tiny", layers=2, hidden=64, heads=4, vocab=512, seq=64, tied_embeddings=True),
    "small": ModelShape(name="small", layers=4, hidden=256, heads=4, vocab=4096, seq=128, tied_embeddings=True),
    # GPT-2 family.
    "gpt2": _gpt2("gpt2", 12, 768, 12),
    "gpt2-medium": _gpt2("gpt2-medium", 24, 1024, 16),
    "gpt2-large": _gpt2("gpt2-large", 36, 1280, 20),
    "gpt2-xl": _gpt2("gpt2-xl", 48, 1600, 25),
    # Llama family (Hugging Face meta-llama configs).
    "llama-2-7b": _llama("llama-2-7b", 32, 4096, 32, 32, 11008, 32000, 4096),
    "llama-2-13b": _llama("llama-2-13b", 40, 5120, 40, 40, 13824, 32000, 4096),
    "llama-2-70b": _llama("llama-2-70b", 80, 8192, 64, 8, 28672, 32000, 4096),
    "llama-3-8b": _llama("llama-3-8b", 32, 4096, 32, 8, 14336, 128256, 8192),
    "llama-3-70b": _llama("llama-3-70b", 80, 8192, 64, 8, 28672, 128256, 8192),
    "llama-3.2-1b": _llama("llama-3.2-1b", 16, 2048, 32, 8, 8192, 128256, 2048, tied=True),
    "mistral-7b": _llama("mistral-7b", 32, 4096, 32, 8, 14336, 32000, 8192),
    # GPT-3 175B (Brown et al. 2020, Table 2.1).
    "gpt3-175b": ModelShape(name="gpt3-175b", layers=96, hidden=12288, heads=96, vocab=50257, seq=2048),
    # The four models of Korthikanti et al. 2022.
    "megatron-22b": _megatron("megatron-22b", 48, 6144, 64),
    "megatron-175b": _megatron("megatron-175b", 96, 12288, 96),
    "megatron-530b": _megatron("megatron-530b", 105, 20480, 128),
    "megatron-1t": _megatron("megatron-1t", 128, 25600, 160),
}
ALIASES = {"22b": "megatron-22b", "175b": "megatron-175b", "530b": "megatron-530b", "1t": "megatron-1t",
           "gpt2-small": "gpt2", "gpt3": "gpt3-175b"}


def model_names() -> list[str]:
    return list(PRESETS)


def get_model(name: str, *, seq: int | None = None) -> ModelShape:
    """The registry's shape called ``name`` (case-insensitive), optionally at another sequence length."""
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key not in PRESETS:
        raise ConfigError(
            f"unknown model {name!r}; known models: {', '.join(PRESETS)} "
            "(or give --hf-config PATH, or the shape flags --layers --hidden --heads --vocab --seq)"
        )
    shape = PRESETS[key]
    return shape.with_seq(seq) if seq is not None else shape
