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

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from microbatch.errors import ConfigError, check_positive_int
from microbatch.hf_attention import own_head_size, sliding_window_of
from microbatch.moe import (
    Experts,
    LatentAttention,
    experts_from_hf,
    latent_attention_from_hf,
    with_expert_flags,
)
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
    )


def _megatron(name: str, layers: int, hidden: int, heads: int, vocab: int = 51200) -> ModelShape:
    # Korthikanti et al. 2022 (arXiv 2205.05198) Table 3; s = 2048, ffn = 4h, V = 51200.
    return ModelShape(name=name, layers=layers, hidden=hidden, heads=heads, vocab=vocab, seq=2048)


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
    "gpt3-175b": ModelShape(name="gpt3-175b", layers=96, hidden=12288, heads=96, vocab=50257, seq=2048),
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
    # HF configs (tests/data/published_runs.json cites them); left out: Qwen3's per-head q/k norms, GPT-OSS's
    # expert biases and attention sinks. s = 4096, as the Megatron-Bridge rows ran them.
    "qwen3-30b-a3b": replace(
        _llama("qwen3-30b-a3b", 48, 2048, 32, 4, 768, 151936, 4096),
        head_size=128,
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


def get_model(name: str, *, seq: int | None = None) -> ModelShape:
    """The registry's shape called ``name`` (case-insensitive), optionally at another sequence length."""
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key not in PRESETS:  # llama_2_7b as llama-2-7b, as accelerator names are read
        key = ALIASES.get(key.replace("_", "-"), key.replace("_", "-"))
    if key not in PRESETS:
        raise ConfigError(
            f"unknown model {name!r}; known models: {', '.join(PRESETS)} "
            "(or give hf_config, a config.json, or the shape: layers, hidden, heads, vocab and seq)",
            params=_SHAPE_PARAMS,
        )
    shape = PRESETS[key]
    return shape.with_seq(seq) if seq is not None else shape


# -- Hugging Face config.json ---------------------------------------------------------------
# Key names per field, in the order they are tried: the generic PretrainedConfig names first,
# then GPT-2's (n_layer, n_embd, ...), then older families' (GPT-J/NeoX, OPT, BLOOM).
_HF_KEYS: dict[str, tuple[str, ...]] = {
    "layers": ("num_hidden_layers", "n_layer", "num_layers", "n_layers"),
    "hidden": ("hidden_size", "n_embd", "d_model", "dim"),
    "heads": ("num_attention_heads", "n_head", "n_heads"),
    "kv_heads": ("num_key_value_heads", "n_kv_heads", "num_kv_heads"),
    "head_size": ("head_dim",),
    "ffn_hidden": ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size"),
    "vocab": ("vocab_size",),
    "seq": ("max_position_embeddings", "n_positions", "seq_length", "max_seq_len", "n_ctx"),
}
# Families whose blocks are Llama-like: RMSNorm, rotary positions, gated (SwiGLU) MLP, no biases.
_LLAMA_LIKE = {"llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "olmo2", "phi3", "granite"}


def _hf_lookup(raw: dict[str, Any], field: str) -> Any:
    for key in _HF_KEYS[field]:
        if raw.get(key) is not None:
            return raw[key]
    return None


_HF_REQUIRED = ("layers", "hidden", "heads", "vocab")
"""Fields a config.json must state itself (transformers' family defaults are not taken for them)."""


def _check_hf_fields(raw: dict[str, Any], file: Path) -> None:
    """Refuse, naming the file and the key, a size field of the config that is not a whole number >= 1
    (a string, a fraction, a negative, a boolean), an encoder (:func:`_check_decoder_only`), or a
    required field (:data:`_HF_REQUIRED`) that is missing: checked on the file's JSON, before
    transformers is imported."""
    where = f"hf_config {str(file)!r}"
    for field, keys in _HF_KEYS.items():
        for key in keys:
            v = raw.get(key)
            if v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
                continue
            if isinstance(v, str) and v.strip().isdigit():
                fix = f'write it as a JSON number: "{key}": {int(v)}'
            else:
                fix = f"give {key} the model's {field} as a whole number >= 1"
            raise ConfigError(
                f"{where}: {key} ({field}) is {v!r}, not a whole number >= 1; {fix}", params=_HF
            )
    _check_decoder_only(raw, file)  # an encoder's keys differ: say what it is, not what it lacks
    missing = [f for f in _HF_REQUIRED if all(raw.get(k) is None for k in _HF_KEYS[f])]
    if missing:
        raise ConfigError(
            f"{where} lacks {', '.join(missing)} (looked for "
            + "; ".join(f"{f}: {'/'.join(_HF_KEYS[f])}" for f in missing)
            + f'); add {"them" if len(missing) > 1 else "it"} to the file (e.g. "{_HF_KEYS[missing[0]][0]}": ...), '
            "or give the shape alone (its layers, hidden, heads, vocab and seq) without hf_config",
            params=_HF,
        )


def _read_hf_dict(path: Path) -> dict[str, Any]:
    """The config as a dict: through transformers' AutoConfig where installed, plain JSON otherwise.

    AutoConfig fills in the family's defaults for keys a config.json omits (GPT-2's n_inner=None,
    tie_word_embeddings=True); plain JSON reads only what the file says.
    """
    import importlib.util

    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ConfigError(
            f"hf_config {str(path)!r} is not a file or a folder holding config.json; "
            "give the path of a Hugging Face config.json",
            params=_HF,
        )
    try:
        raw = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(
            f"hf_config {str(file)!r} is not readable JSON ({e}); give a config.json", params=_HF
        ) from None
    if not isinstance(raw, dict):
        raise ConfigError(
            f"hf_config {str(file)!r} holds {type(raw).__name__}, not a JSON object", params=_HF
        )
    _check_hf_fields(raw, file)  # before transformers is imported (seconds): the file's own numbers
    if raw.get("model_type") and importlib.util.find_spec("transformers") is not None:
        try:
            from transformers import AutoConfig

            cfg = AutoConfig.from_pretrained(str(file))
        except Exception:  # an unknown model_type or a transformers quirk: fall back to the JSON
            return raw
        merged = dict(raw)
        for keys in _HF_KEYS.values():
            for key in keys:
                value = getattr(cfg, key, None)
                if value is not None and merged.get(keys[0]) is None:
                    merged[keys[0]] = value
                    break
        merged["tie_word_embeddings"] = getattr(cfg, "tie_word_embeddings", raw.get("tie_word_embeddings"))
        return merged
    return raw


# Families that are not one stack of causal decoder layers: encoders (masked LM) and encoder-decoders.
_ENCODERS = {"bert", "roberta", "xlm-roberta", "distilbert", "albert", "electra", "deberta", "deberta-v2",
             "camembert", "mpnet", "ernie", "modernbert"}  # fmt: skip
_ENCODER_DECODERS = {"t5", "mt5", "umt5", "bart", "mbart", "pegasus", "marian", "whisper", "longt5",
                     "led", "prophetnet", "blenderbot", "m2m_100", "nllb-moe", "switch_transformers"}  # fmt: skip


def _check_decoder_only(raw: dict[str, Any], path: Path) -> None:
    """ConfigError for an encoder or encoder-decoder config: the formulas and probes are decoder-only."""
    model_type = str(raw.get("model_type", "")).lower()
    if raw.get("is_encoder_decoder") or model_type in _ENCODER_DECODERS:
        kind = "an encoder-decoder"
    elif model_type in _ENCODERS:
        kind = "an encoder (masked language model)"
    else:
        return
    raise ConfigError(
        f"hf_config {str(path)!r} is {kind} model ({model_type or 'unknown type'}); microbatch supports "
        "decoder-only causal language models (gpt2, llama, mistral, qwen2, gemma, phi3, ...): its memory "
        "formulas count one stack of causal decoder layers and its probes build AutoModelForCausalLM; "
        "give a decoder-only config, or the shape of a comparable decoder",
        params=_HF,
    )


def from_hf_config(path: str | Path, *, seq: int | None = None, name: str | None = None) -> ModelShape:
    """A :class:`ModelShape` from a Hugging Face ``config.json`` (a file or the folder holding it).

    Reads layers, hidden, heads, kv heads, ffn hidden, vocab and max positions; the family
    (``model_type``) decides the block details (Llama-like: RMSNorm, rotary, SwiGLU, no biases;
    otherwise GPT-2-like). Experts (Mixtral, Qwen-MoE, DeepSeek) and DeepSeek's latent attention are
    read by :func:`microbatch.moe.experts_from_hf` and :func:`microbatch.moe.latent_attention_from_hf`.
    A ``head_dim`` that differs from hidden/heads (Qwen3, Gemma, GPT-OSS) is kept as ``head_size``, under
    DeepSeek's latent attention its own head widths rule; the sliding window and the layers using it are read
    by :func:`microbatch.hf_attention.sliding_window_of`. Ignores per-family oddities (Qwen2's q/k/v
    biases on an otherwise bias-free block), which change parameter counts slightly.
    """
    path = Path(path)
    raw = _read_hf_dict(path)
    _check_decoder_only(raw, path)
    vals = {f: _hf_lookup(raw, f) for f in _HF_KEYS}
    missing = [f for f in ("layers", "hidden", "heads", "vocab") if vals[f] is None]
    if missing:
        raise ConfigError(
            f"hf_config {str(path)!r} lacks {', '.join(missing)} (looked for "
            + "; ".join(f"{f}: {'/'.join(_HF_KEYS[f])}" for f in missing)
            + "); give the shape itself instead",
            params=_HF,
        )
    model_type = str(raw.get("model_type", "")).lower()
    llama_like = model_type in _LLAMA_LIKE or (
        model_type not in ("gpt2",) and str(raw.get("hidden_act", "")).lower() in ("silu", "swiglu")
    )
    tied = raw.get("tie_word_embeddings")
    positions = vals["seq"]
    fields = dict(
        name=name or raw.get("_name_or_path") or model_type or path.stem,
        layers=vals["layers"],
        hidden=vals["hidden"],
        heads=vals["heads"],
        head_size=own_head_size(vals["head_size"], vals["hidden"], vals["heads"]),
        kv_heads=vals["kv_heads"],
        ffn_hidden=vals["ffn_hidden"],
        vocab=vals["vocab"],
        seq=seq or positions or 2048,
    )
    if llama_like:
        fields.update(
            gated_mlp=True,
            bias=bool(raw.get("attention_bias", False) or raw.get("mlp_bias", False)),
            norm="rmsnorm",
            learned_positions=False,
            tied_embeddings=bool(tied) if tied is not None else False,
            dropout=bool(raw.get("attention_dropout", 0.0)),
        )
    else:
        fields.update(
            max_positions=positions,
            # GPT-2's config default is tied (PretrainedConfig.tie_word_embeddings=True).
            tied_embeddings=bool(tied) if tied is not None else True,
        )
    for f in ("layers", "hidden", "heads", "vocab"):
        if not isinstance(fields[f], int) or isinstance(fields[f], bool):
            raise ConfigError(
                f"hf_config {str(path)!r}: {f} is {fields[f]!r}, not a whole number", params=_HF
            )
    source = f"hf_config {str(path)!r}"
    fields.update(
        moe=experts_from_hf(raw, vals["ffn_hidden"], source), mla=latent_attention_from_hf(raw, source)
    )
    if fields["mla"] is not None:  # transformers' DeepSeek configs set head_dim to the rotary slice
        fields["head_size"] = None
    if isinstance(vals["layers"], int):
        fields["sliding_window"], fields["sliding_layers"] = sliding_window_of(raw, vals["layers"], positions)
    try:
        return ModelShape(**fields)
    except ConfigError as e:  # a rule between fields (heads divide hidden): name the file
        raise ConfigError(f"{source}: {e}", params=_HF) from None


_HF = ("hf_config",)
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
    shape = _resolve_dense(model, hf_config, given)
    moe = with_expert_flags(shape.moe, shape.ffn, expert_flags)
    return shape if moe is shape.moe else replace(shape, moe=moe)


def _resolve_dense(model: str | None, hf_config: str | Path | None, given: dict[str, int]) -> ModelShape:
    """The shape of ``model``, ``hf_config`` or the sizes, with the sizes given applied."""
    if model is not None:
        base = get_model(model)
    elif hf_config is not None:
        base = from_hf_config(hf_config)
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
