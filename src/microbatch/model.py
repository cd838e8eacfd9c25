"""Transformer shapes: one registry of model names for every command.

A :class:`ModelShape` is the geometry the formulas need (layers L, hidden h, heads a, kv heads,
ffn hidden, vocab V, sequence s) plus the details that change parameter counts (tied
embeddings, gated MLP, biases, norm kind, learned positions) and, for mixture-of-experts models,
the experts and latent attention of :mod:`microbatch.moe`. Parameter counts match the real
models: GPT-2 124,439,808 (tied embeddings), Llama-2-7B 6,738,415,616; Mixtral-8x7B 46.7B total /
12.9B active, DeepSeek-V3 671B / 37B (without its multi-token-prediction module).

The registry's ``tiny`` and ``small`` are the built-in models that ``tune``, ``pipeline`` and
the demo run for real on the CPU (``microbatch.measure.gpt`` builds them in PyTorch).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from microbatch.errors import ConfigError, check_positive_int
from microbatch.hf_config import from_hf_config
from microbatch.moe import Experts, LatentAttention, with_expert_flags
from microbatch.shape import ModelShape

__all__ = [
    "ModelShape",
    "PRESETS",
    "get_model",
    "model_names",
    "from_hf_config",
    "from_flags",
    "resolve_model",
    "check_seq",
    "GEOMETRY",
    "model_differences",
]


def _gpt2(name: str, layers: int, hidden: int, heads: int) -> ModelShape:
    # Radford et al. 2019; Hugging Face gpt2* configs: V=50257, n_positions=1024, tied.
    return ModelShape(
        name=name,
        layers=layers,
        hidden=hidden,
        heads=heads,
        vocab=50257,
        seq=1024,
        max_positions=1024,
        tied_embeddings=True,
        activation="gelu_new",
    )


def _llama(
    name: str,
    layers: int,
    hidden: int,
    heads: int,
    kv: int,
    ffn: int,
    vocab: int,
    seq: int,
    tied: bool = False,
) -> ModelShape:
    return ModelShape(
        name=name,
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv,
        ffn_hidden=ffn,
        vocab=vocab,
        seq=seq,
        gated_mlp=True,
        bias=False,
        norm="rmsnorm",
        learned_positions=False,
        tied_embeddings=tied,
        dropout=False,
        activation="silu",
    )


def _megatron(name: str, layers: int, hidden: int, heads: int, vocab: int = 51200) -> ModelShape:
    # Korthikanti et al. 2022 (arXiv 2205.05198) Table 3; s = 2048, ffn = 4h, V = 51200; the output layer shares the
    # embedding (Megatron-LM's default: --untie-embeddings-and-output-weights off; the papers' 12Lh²(1 + 13/12h +
    # (V + s)/12Lh) counts V·h once)
    return ModelShape(
        name=name, layers=layers, hidden=hidden, heads=heads, vocab=vocab, seq=2048, tied_embeddings=True
    )


PRESETS: dict[str, ModelShape] = {
    # Built-in models that run for real on a CPU (microbatch.measure.gpt builds them).
    "tiny": ModelShape(name="tiny", layers=2, hidden=64, heads=4, vocab=512, seq=64, tied_embeddings=True),
    "small": ModelShape(
        name="small", layers=4, hidden=256, heads=4, vocab=4096, seq=128, tied_embeddings=True
    ),
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
    # Llama 3.1 405B (Llama Team 2024, arXiv 2407.21783, Table 3: 126 layers, width 16,384, FFN 53,248, 128
    # heads, 8 key/value heads; the meta-llama config's vocabulary 128,256).
    "llama-3.1-405b": _llama("llama-3.1-405b", 126, 16384, 128, 8, 53248, 128256, 8192),
    "llama-3.2-1b": _llama("llama-3.2-1b", 16, 2048, 32, 8, 8192, 128256, 2048, tied=True),
    "mistral-7b": _llama("mistral-7b", 32, 4096, 32, 8, 14336, 32000, 8192),
    # GPT-3 175B (Brown et al. 2020, Table 2.1).
    "gpt3-175b": ModelShape(  # GPT-2's block and tied embeddings (Brown et al. 2020 §2.1: "the same model ... as GPT-2")
        name="gpt3-175b", layers=96, hidden=12288, heads=96, vocab=50257, seq=2048, tied_embeddings=True
    ),
    # The four models of Korthikanti et al. 2022.
    "megatron-22b": _megatron("megatron-22b", 48, 6144, 64),
    "megatron-175b": _megatron("megatron-175b", 96, 12288, 96),
    "megatron-530b": _megatron("megatron-530b", 105, 20480, 128),
    "megatron-1t": _megatron("megatron-1t", 128, 25600, 160),
    # Mixture of experts (Hugging Face configs; s = 4096, the pre-training length of DeepSeek-V3 §4.2 and
    # of the Megatron-Bridge Mixtral recipe). DeepSeek-V3 leaves out its multi-token-prediction module
    # (one more block and norms, 14B: the Hugging Face checkpoint's 685B = 671B + 14B).
    "mixtral-8x7b": replace(
        _llama("mixtral-8x7b", 32, 4096, 32, 8, 14336, 32000, 4096),
        moe=Experts(experts=8, top_k=2, expert_ffn_hidden=14336),
    ),
    "deepseek-v3": replace(
        _llama("deepseek-v3", 61, 7168, 128, 128, 18432, 129280, 4096),
        moe=Experts(experts=256, top_k=8, expert_ffn_hidden=2048, shared_experts=1, dense_layers=3),
        mla=LatentAttention(kv_lora_rank=512, q_lora_rank=1536),
    ),
    # HF configs (tests/data/published_runs.json cites them); left out: the parameters of Qwen3's per-head q/k norms
    # (its qk_norm is kept: what its eager layers keep), GPT-OSS's expert biases and attention sinks. s = 4096, as the
    # Megatron-Bridge rows ran them.
    "qwen3-30b-a3b": replace(
        _llama("qwen3-30b-a3b", 48, 2048, 32, 4, 768, 151936, 4096),
        head_size=128,
        qk_norm=True,
        moe=Experts(experts=128, top_k=8, expert_ffn_hidden=768),
    ),
    "gpt-oss-120b": replace(
        _llama("gpt-oss-120b", 36, 2880, 64, 8, 2880, 201088, 4096),
        head_size=64,
        bias=True,
        sliding_window=128,
        sliding_layers=18,
        moe=Experts(experts=128, top_k=4, expert_ffn_hidden=2880),
    ),
}
ALIASES = {
    "22b": "megatron-22b",
    "175b": "megatron-175b",
    "530b": "megatron-530b",
    "1t": "megatron-1t",
    "gpt2-small": "gpt2",
    "gpt3": "gpt3-175b",
    "mixtral": "mixtral-8x7b",
}


def model_names() -> list[str]:
    return list(PRESETS)


def nearest_models(name: str) -> list[str]:
    """Registry names close to ``name``, read as the Hugging Face hub writes one: ``meta-llama/Llama-2-7b-hf`` is
    ``llama-2-7b``, ``mistralai/Mistral-7B-v0.1`` ``mistral-7b`` (the organisation, a ``-hf`` and a version suffix
    dropped); the closest one, if any."""
    import difflib
    import re

    key = name.strip().lower().rsplit("/", 1)[-1].replace("_", "-")
    key = re.sub(r"(-hf|-v\d+(\.\d+)*|-base|-instruct|-chat)+$", "", key)
    return difflib.get_close_matches(key, list(PRESETS) + list(ALIASES), n=1, cutoff=0.75)


SHAPE_FIX = (
    "take a preset with microbatch.model.get_model('llama-3-8b'), read a Hugging Face config.json with "
    "microbatch.hf_config.from_hf_config(path), or build ModelShape(layers=..., hidden=..., heads=..., vocab=..., seq=...)"
)
"""The fix named where a model shape is expected and something else was given."""


def get_model(name: str, *, seq: int | None = None) -> ModelShape:
    """The registry's shape called ``name`` (case-insensitive), optionally at another sequence length."""
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key not in PRESETS:  # llama_2_7b as llama-2-7b, as accelerator names are read
        key = ALIASES.get(key.replace("_", "-"), key.replace("_", "-"))
    if key not in PRESETS:
        near = nearest_models(name)
        raise ConfigError(
            f"unknown model {name!r}"
            + (f" (did you mean {' or '.join(near)}?)" if near else "")
            + f"; known models: {', '.join(PRESETS)} "
            "(or give hf_config, a config.json, or the shape: layers, hidden, heads, vocab and seq)"
            + (
                "; a module:function factory is read by pipeline alone: measure your own nn.Module from Python, "
                "microbatch.tune(model, make_batch, ...)"
                if ":" in name or name.endswith(".py")
                else ""
            ),
            params=_SHAPE_PARAMS,
        )
    shape = PRESETS[key]
    return shape.with_seq(seq) if seq is not None else shape


# -- Hugging Face config.json ---------------------------------------------------------------
# Key names per field, in the order they are tried: the generic PretrainedConfig names first,
_SHAPE_PARAMS = ("hf_config", "layers", "hidden", "heads", "vocab", "seq")
"""The parameters a message that asks for a model shape names (the CLI writes them as flags)."""
_EXPERT_FLAGS = ("experts", "top_k", "expert_ffn_hidden", "shared_experts")
_SHAPE_FLAGS = (
    "layers",
    "hidden",
    "heads",
    "head_size",
    "kv_heads",
    "ffn_hidden",
    "vocab",
    "seq",
    *_EXPERT_FLAGS,
)


def from_flags(
    *,
    layers: int | None = None,
    hidden: int | None = None,
    heads: int | None = None,
    kv_heads: int | None = None,
    ffn_hidden: int | None = None,
    vocab: int | None = None,
    seq: int | None = None,
    name: str = "custom",
    head_size: int | None = None,
) -> ModelShape:
    """A GPT-2-like shape from explicit sizes (``layers hidden heads vocab seq``)."""
    if layers is None or hidden is None or heads is None or vocab is None or seq is None:
        given = dict(layers=layers, hidden=hidden, heads=heads, vocab=vocab, seq=seq)
        missing = [k for k, v in given.items() if v is None]
        raise ConfigError(
            "the shape lacks "
            + ", ".join(missing)
            + "; give model (a registry name), hf_config (a config.json), or all of layers, hidden, heads, "
            "vocab and seq",
            params=("model", *_SHAPE_PARAMS),
        )
    return ModelShape(
        name=name,
        layers=layers,
        hidden=hidden,
        heads=heads,
        head_size=head_size,
        kv_heads=kv_heads,
        ffn_hidden=ffn_hidden,
        vocab=vocab,
        seq=seq,
    )


def resolve_model(
    model: str | None = None,
    hf_config: str | Path | None = None,
    **flags: int | None,
) -> ModelShape:
    """One shape from ``model`` (a registry name), ``hf_config`` (a config.json) or the shape sizes.

    With a name or a config, any size given overrides that field (``model="gpt2", seq=512``); the
    expert sizes (``experts top_k expert_ffn_hidden shared_experts``) set or override the experts
    (:func:`microbatch.moe.with_expert_flags`).
    """
    unknown = set(flags) - set(_SHAPE_FLAGS)
    if unknown:
        raise ConfigError(f"unknown shape parameters {sorted(unknown)}; known: {', '.join(_SHAPE_FLAGS)}")
    if model is not None and hf_config is not None:
        raise ConfigError("give either model or hf_config, not both", params=("model", "hf_config"))
    expert_flags = {k: flags.pop(k, None) for k in _EXPERT_FLAGS}
    given = {k: v for k, v in flags.items() if v is not None}
    for k, v in given.items():
        check_positive_int(k, v, fix="sizes are whole numbers >= 1")
    experts_given = {k: v for k, v in expert_flags.items() if v is not None}
    shape = _resolve_dense(model, hf_config, given, experts_given)
    moe = with_expert_flags(shape.moe, shape.ffn, expert_flags)
    return shape if moe is shape.moe else replace(shape, moe=moe)


def _resolve_dense(
    model: str | None, hf_config: str | Path | None, given: dict[str, int], experts_given: Mapping[str, int]
) -> ModelShape:
    """The shape of ``model``, ``hf_config`` or the sizes, with the sizes given applied (a config may lack an expert
    size the user gives: ``experts_given`` fills it before :func:`~microbatch.moe.with_expert_flags` applies it)."""
    if model is not None:
        base = get_model(model)
    elif hf_config is not None:
        base = from_hf_config(hf_config, given={**given, **experts_given})
    elif not given:
        raise ConfigError(
            "no model given; give a registry name (" + ", ".join(PRESETS) + "), hf_config (a config.json), "
            "or the shape: layers, hidden, heads, vocab and seq",
            params=_SHAPE_PARAMS,
        )
    else:
        return from_flags(
            layers=given.get("layers"),
            hidden=given.get("hidden"),
            heads=given.get("heads"),
            kv_heads=given.get("kv_heads"),
            head_size=given.get("head_size"),
            ffn_hidden=given.get("ffn_hidden"),
            vocab=given.get("vocab"),
            seq=given.get("seq"),
        )
    overrides: dict[str, Any] = given  # shape flags: ModelShape field -> whole number (checked above)
    seq = given.get("seq")
    if seq is not None:
        check_seq(base, seq)
    return replace(base, **overrides) if overrides else base


def check_seq(shape: ModelShape, seq: int) -> None:
    """ConfigError when ``seq`` is longer than the model's learned position table (the one check of
    it: ``resolve_model``, ``tune_model``'s preflight and the pipeline run's call it)."""
    if shape.learned_positions and shape.max_positions is not None and seq > shape.max_positions:
        raise ConfigError(
            f"seq {seq} is longer than model {shape.name}'s {shape.max_positions} learned positions; "
            f"use seq {shape.max_positions} or less (or a model with rotary positions)",
            params=("seq",),
        )


GEOMETRY = (
    "layers", "hidden", "heads", "head_dim", "kv", "ffn", "vocab", "gated_mlp", "tied_embeddings", "bias", "norm",
    "learned_positions", "moe", "mla", "sliding_window", "sliding_layers", "local_attention",
)  # fmt: skip
"""Fields that make two shapes the same model (name, seq, positions and training flags aside)."""


def model_differences(a: ModelShape, b: ModelShape) -> list[str]:
    """The :data:`GEOMETRY` fields where two shapes differ (none: the same model)."""
    return [f for f in GEOMETRY if getattr(a, f) != getattr(b, f)]
