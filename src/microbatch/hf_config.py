"""Model shapes from Hugging Face ``config.json`` files: the keys each family spells its sizes with, the checks made
on the file before transformers is imported, and the refusals (encoders, encoder-decoders, sizes set per layer).
:func:`microbatch.model.resolve_model` calls :func:`from_hf_config`.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from microbatch._json import loads
from microbatch.errors import ConfigError
from microbatch.fields import whole_key
from microbatch.hf_attention import chunked_attention_of, own_head_size, sliding_window_of
from microbatch.hf_families import (
    _ALWAYS_PARALLEL,
    _BLOCK_KEYS,
    _DEFAULT_DROPOUT_OFF,
    _DROPOUT_KEYS,
    _GATED_FAMILIES,
    _LAYERNORM_LLAMA_LIKE,
    _LLAMA_LIKE,
    _NO_POSITION_TABLE,
    _PARALLEL_KEYS,
    _PARALLEL_LLAMA_LIKE,
    _ROTARY_KEYS,
    _UNTIED_BY_DEFAULT,
    activation_of,
    check_pad_token,
    default_activation,
    mpt_block_fields,
    norm_fields,
)
from microbatch.moe import experts_from_hf, latent_attention_from_hf
from microbatch.shape import ModelShape

__all__ = ["config_facts", "from_hf_config", "per_layer_sizes"]

_HF = ("hf_config",)

# then GPT-2's (n_layer, n_embd, ...), then older families' (GPT-J/NeoX, OPT, BLOOM).
_HF_KEYS: dict[str, tuple[str, ...]] = {
    "layers": ("num_hidden_layers", "n_layer", "num_layers", "n_layers"),
    "hidden": ("hidden_size", "n_embd", "n_embed", "d_model", "dim"),
    "heads": ("num_attention_heads", "n_head", "n_heads", "num_heads"),
    "kv_heads": ("num_key_value_heads", "n_kv_heads", "num_kv_heads"),
    "head_size": ("head_dim",),
    "ffn_hidden": ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size"),
    "vocab": ("vocab_size",),
    "seq": ("max_position_embeddings", "n_positions", "seq_length", "max_seq_len", "n_ctx"),
}


# Families whose blocks are Llama-like: RMSNorm, rotary positions, gated (SwiGLU) MLP, no biases.
def _dropout_of(raw: dict[str, Any], model_type: str, default: bool | None = None) -> bool:
    """Whether training runs dropout: any probability the config states above 0, or, when it states none (absent or
    null), ``default`` or the family's (:data:`_DEFAULT_DROPOUT_OFF`; otherwise GPT-2's 0.1: on)."""
    attn = raw.get("attn_config")
    found = [raw.get(k) for k in _DROPOUT_KEYS] + [attn.get("attn_pdrop") if isinstance(attn, dict) else None]
    probs = [p for p in found if isinstance(p, int | float) and not isinstance(p, bool)]
    if probs:
        return any(p > 0 for p in probs)
    return model_type not in _DEFAULT_DROPOUT_OFF if default is None else default


def _gpt2_built(raw: dict[str, Any], model_type: str, positions: Any, tied: Any) -> dict[str, Any]:
    """The block fields of a family built as GPT-2 is (LayerNorm, a GELU MLP): its positions (a learned table or
    not: :data:`_NO_POSITION_TABLE`; MPT's where its ``learned_pos_emb`` says so without ALiBi), biases (MPT's ``no_bias``, Falcon's ``bias``), the
    parallel block (:data:`_PARALLEL_KEYS`), dropout (:func:`_dropout_of`), MPT's ``expansion_ratio`` as its MLP
    width, and tied embeddings by the config (GPT-2's default: tied)."""
    # rotary where the file sets it (Nemotron, BitNet, Apertus: GPT-2-built by their activation, no position table)
    rotary = any(raw.get(k) is not None for k in _ROTARY_KEYS)
    table = not (model_type.startswith(_NO_POSITION_TABLE) or rotary)
    if (
        model_type == "mpt"
    ):  # with ALiBi no table (transformers' MptModel has none, whatever learned_pos_emb says)
        attn = raw.get("attn_config")
        alibi = isinstance(attn, dict) and bool(attn.get("alibi", False))
        table = bool(raw.get("learned_pos_emb", True)) and not alibi
    # MPT's no_bias (default False), Falcon's bias (FalconConfig's default: False), others biased
    bias = (
        not raw.get("no_bias", False)
        if model_type == "mpt"
        else bool(raw.get("bias", model_type != "falcon"))
    )
    if model_type != "mpt" and "bias" not in raw and ("attention_bias" in raw or "mlp_bias" in raw):
        bias = bool(raw.get("attention_bias") or raw.get("mlp_bias"))  # as the Llama-built families spell it
    key = _PARALLEL_KEYS.get(model_type)
    parallel = model_type.startswith(_ALWAYS_PARALLEL) or (key is not None and bool(raw.get(key, True)))
    fields: dict[str, Any] = {
        "max_positions": positions if table else None,
        "learned_positions": table,
        "tied_embeddings": bool(tied) if tied is not None else not model_type.startswith(_UNTIED_BY_DEFAULT),
        "bias": bias,
        "parallel_block": parallel,
        "dropout": _dropout_of(raw, model_type),
    }
    ratio = raw.get("expansion_ratio")
    if model_type == "mpt" and _hf_lookup(raw, "ffn_hidden") is None and isinstance(ratio, int | float):
        fields["ffn_hidden"] = int(ratio * _hf_lookup(raw, "hidden"))
    return {**fields, **mpt_block_fields(raw)} if model_type == "mpt" else fields


def _hf_lookup(raw: dict[str, Any], field: str) -> Any:
    for key in _HF_KEYS[field]:
        if raw.get(key) is not None:
            return raw[key]
    return None


_HF_REQUIRED = ("layers", "hidden", "heads", "vocab")
"""Fields a config.json must state itself (transformers' family defaults are not taken for them)."""


def _check_hf_fields(raw: dict[str, Any], file: Path) -> None:
    """Refuse, naming the file and the key, a size field of the config that is not a whole number >= 1 (a string, a
    fraction, a negative, a boolean), an encoder (:func:`_check_decoder_only`), a pad token past the vocabulary, or a
    required field (:data:`_HF_REQUIRED`) that is missing: checked on the file's JSON, before transformers loads."""
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
    check_pad_token(raw, _hf_lookup(raw, "vocab"), where, _HF)
    missing = [f for f in _HF_REQUIRED if all(raw.get(k) is None for k in _HF_KEYS[f])]
    if missing:
        raise ConfigError(
            f"{where} lacks {', '.join(missing)} (looked for "
            + "; ".join(f"{f}: {'/'.join(_HF_KEYS[f])}" for f in missing)
            + f'); add {"them" if len(missing) > 1 else "it"} to the file (e.g. "{_HF_KEYS[missing[0]][0]}": ...), '
            "or give the shape alone (its layers, hidden, heads, vocab and seq) without hf_config",
            params=_HF,
        )


def config_facts(path: str | Path) -> tuple[str, Any]:
    """(``model_type``, longest context) of a config file as :func:`from_hf_config` reads it ("" and None where it
    gives none): what an answer built from it took from the file rather than from the user."""
    raw = _read_hf_dict(Path(path))
    return str(raw.get("model_type") or ""), _hf_lookup(raw, "seq")


def _read_hf_dict(path: Path) -> dict[str, Any]:
    """The config as a dict: through transformers' AutoConfig where installed, plain JSON otherwise.

    AutoConfig fills in the family's defaults for keys a config.json omits (GPT-2's n_inner=None,
    tie_word_embeddings=True); plain JSON reads only what the file says. A multimodal config (no layer count of its
    own, a ``text_config``) is read as its language model's config.
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
        raw = loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(
            f"hf_config {str(file)!r} is not readable JSON ({e}); give a config.json", params=_HF
        ) from None
    if not isinstance(raw, dict):
        raise ConfigError(
            f"hf_config {str(file)!r} holds {type(raw).__name__}, not a JSON object", params=_HF
        )
    text = raw.get("text_config")
    inner = isinstance(text, dict) and all(raw.get(k) is None for k in _HF_KEYS["layers"])
    if inner and isinstance(
        text, dict
    ):  # a multimodal config (Gemma 3, Llama 4, Mistral 3): its language model
        raw = {**text, "model_type": text.get("model_type") or raw.get("model_type"),
               "_name_or_path": raw.get("_name_or_path")}  # fmt: skip
    legacy = str(raw.get("model_type", "")).lower() in _FALCON_LEGACY
    raw = _as_falcon(raw) if legacy else raw
    _check_hf_fields(raw, file)  # before transformers is imported (seconds): the file's own numbers
    if raw.get("model_type") and importlib.util.find_spec("transformers") is not None:
        try:
            from transformers import AutoConfig

            known = {k: v for k, v in raw.items() if k != "model_type"}
            cfg = (
                AutoConfig.for_model(raw["model_type"], **known)
                if inner or legacy
                else AutoConfig.from_pretrained(
                    str(file), trust_remote_code=False
                )  # never asks on a terminal
            )
        except Exception:  # an unknown model_type or a transformers quirk: fall back to the JSON
            return raw
        merged = dict(raw)
        for keys in _HF_KEYS.values():
            for key in keys:
                value = _config_value(cfg, key)
                if value is not None and merged.get(keys[0]) is None:
                    merged[keys[0]] = value
                    break
        merged["tie_word_embeddings"] = getattr(cfg, "tie_word_embeddings", raw.get("tie_word_embeddings"))
        for key in (
            *_DROPOUT_KEYS,
            *_PARALLEL_KEYS.values(),
            *_BLOCK_KEYS,
        ):  # the family's defaults the file omits
            value = _config_value(cfg, key)
            if key not in raw and isinstance(value, bool | int | float):
                merged[key] = value
        types = getattr(
            cfg, "layer_types", None
        )  # the sliding layers transformers derives (Gemma 3's pattern of 6)
        if "layer_types" not in raw and isinstance(types, list | tuple):
            merged["layer_types"] = list(types)
        return merged
    return raw


_FALCON_LEGACY = {"refinedwebmodel": False, "refinedweb": True}
"""Falcon's first model types (tiiuae's Falcon-7B and Falcon-40B files, kept by many fine-tunes), which transformers no
longer reads, and whether each is the new decoder architecture (40B's: grouped K/V heads, two norms)."""


def _as_falcon(raw: dict[str, Any]) -> dict[str, Any]:
    """A legacy Falcon file in transformers' ``falcon`` keys: ``n_head``, ``n_layer`` and ``n_head_kv`` renamed, the
    architecture its type names (``RefinedWeb``: the new decoder), the rest (``multi_query``, ``parallel_attn``,
    ``bias``, ``alibi``) as they are."""
    names = {"n_head": "num_attention_heads", "n_layer": "num_hidden_layers", "n_head_kv": "num_kv_heads"}
    out = {names.get(k, k): v for k, v in raw.items()}
    out["new_decoder_architecture"] = _FALCON_LEGACY[str(raw["model_type"]).lower()]
    out["model_type"] = "falcon"
    return out


def _config_value(cfg: Any, key: str) -> Any:
    """``cfg.key``, or None where transformers will not say: a missing key, or one a heterogeneous config sets per
    layer (transformers 5's ``per_layer_config``, which refuses the global read; :func:`per_layer_sizes` reads those
    from the file)."""
    try:
        return getattr(cfg, key, None)
    except Exception:  # transformers' AmbiguousGlobalPerLayerAttributeError (not an AttributeError)
        return None


def per_layer_sizes(raw: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The size fields a heterogeneous config sets per layer, field -> {layer: value} for the layers whose value
    differs from the config's own (transformers 5's ``per_layer_config``: Gemma 4's full-attention layers at
    ``head_dim`` 512 beside the sliding layers' 256). Empty for a config of identical layers."""
    per_layer = raw.get("per_layer_config")
    if not isinstance(per_layer, dict):
        return {}
    out: dict[str, dict[str, Any]] = {}
    for layer, overrides in per_layer.items():
        if not isinstance(overrides, dict):
            continue
        for field, keys in _HF_KEYS.items():
            for key in keys:
                if key in overrides and overrides[key] != raw.get(key):
                    out.setdefault(field, {})[str(layer)] = overrides[key]
    return out


def _check_identical_layers(raw: dict[str, Any], path: Path, given: Collection[str]) -> None:
    """ConfigError when the config sets a size per layer (:func:`per_layer_sizes`) that the caller does not give
    itself: the formulas price identical layers, so the user picks the value, the largest bounding from above."""
    varying = {f: v for f, v in per_layer_sizes(raw).items() if f not in given}
    if not varying:
        return
    field, layers = next(iter(varying.items()))
    own = _hf_lookup(raw, field)
    total = _hf_lookup(raw, "layers")
    shown = ", ".join(f"{v!r} in layer {k}" for k, v in list(layers.items())[:6]) + (
        ", ..." if len(layers) > 6 else ""
    )
    others = f"the other {total - len(layers)}" if isinstance(total, int) else "the others"
    values = [v for v in (*layers.values(), own) if isinstance(v, int) and not isinstance(v, bool)]
    bound = f" (the largest, {max(values)}, bounds memory and time from above)" if values else ""
    also = [f for f in varying if f != field]
    raise ConfigError(
        f"hf_config {str(path)!r} sets {field} per layer ({shown}; {own!r} in {others}); microbatch prices "
        f"identical layers: give {field} to price every layer at one value{bound}"
        + (f"; {', '.join(also)} also vary per layer" if also else ""),
        params=(*_HF, *varying),
    )


# Families that are not one stack of causal decoder layers: encoders (masked LM) and encoder-decoders.
_ENCODERS = {"bert", "roberta", "xlm-roberta", "distilbert", "albert", "electra", "deberta", "deberta-v2",
             "camembert", "mpnet", "ernie", "modernbert"}  # fmt: skip
_ENCODER_DECODERS = {"t5", "mt5", "umt5", "bart", "mbart", "pegasus", "marian", "whisper", "longt5",
                     "led", "prophetnet", "blenderbot", "m2m_100", "nllb-moe", "switch_transformers"}  # fmt: skip


_ATTENTION_LAYERS = {
    "full_attention",
    "sliding_attention",
    "chunked_attention",
    "attention",
    "mlp",
    "moe",
    "dense",
}
"""Layer kinds a ``layer_types``-style list may name that are still attention decoder layers (or their MLP halves)."""
_LAYER_LISTS = ("layer_types", "layers_block_type", "block_types")
_STATE_SPACE_KEYS = ("mamba", "ssm_state", "lru_width", "recurrent", "conv_l_cache")
"""Key fragments only state-space, recurrent or convolution layers have (Mamba's ``mamba_d_state``, ``ssm_state_size``,
Griffin's ``lru_width``, a looped model's ``n_recurrent_layers``, LFM2's short convolutions' ``conv_L_cache``)."""


_NOT_ATTENTION = ("linear", "mamba", "ssm", "recurrent", "conv", "rwkv", "lstm", "hybrid", "delta")
"""Fragments of layer kinds that are not softmax attention (linear attention, Mamba, recurrent, convolution, hybrid
blocks, gated DeltaNet). Other ``*attention`` kinds (DeepSeek-V3.2's ``indexed_attention``, window or compressed sparse
attention) are attention layers, priced as dense attention (an upper bound)."""


def _not_attention(kind: str) -> bool:
    k = kind.lower()
    return any(f in k for f in _NOT_ATTENTION) or "attention" not in k


def _non_attention_layers(raw: dict[str, Any]) -> str | None:
    """What in the config is not an attention decoder layer (Mamba, linear attention, recurrent, convolution
    blocks: Jamba, Zamba, Bamba, Falcon-H1, Qwen3-Next, RecurrentGemma, LFM2), in words; None for a transformer."""
    for key in _LAYER_LISTS:
        kinds = raw.get(key)
        if key == "layer_types" and isinstance(kinds, list) and not all(isinstance(k, str) for k in kinds):
            continue  # not a list of names: its reader refuses it as such (hf_attention)
        if isinstance(kinds, list):
            other = sorted(k for k in {str(k) for k in kinds} - _ATTENTION_LAYERS if _not_attention(k))
            if other:
                return f"{key} names {', '.join(other)} layers"
    keys = sorted(k for k in raw if any(f in k.lower() for f in _STATE_SPACE_KEYS))
    return f"it sets {', '.join(keys[:3])}" if keys else None


def _check_decoder_only(raw: dict[str, Any], path: Path) -> None:
    """ConfigError for an encoder or encoder-decoder config, or one with state-space, linear-attention or recurrent
    layers (:func:`_non_attention_layers`): the formulas and probes are for stacks of attention decoder layers."""
    model_type = str(raw.get("model_type", "")).lower()
    if raw.get("is_encoder_decoder") or model_type in _ENCODER_DECODERS:
        kind = "an encoder-decoder"
    elif model_type in _ENCODERS:
        kind = "an encoder (masked language model)"
    elif (other := _non_attention_layers(raw)) is not None:
        raise ConfigError(
            f"hf_config {str(path)!r} is a hybrid model ({model_type or 'unknown type'}: {other}); microbatch "
            "prices stacks of attention decoder layers, whose FLOPs, activations and KV caches its formulas count, "
            "not state-space, linear-attention or recurrent layers; give the shape of its attention layers alone "
            "(layers, hidden, heads, vocab, seq) for an estimate of those",
            params=_HF,
        )
    else:
        return
    raise ConfigError(
        f"hf_config {str(path)!r} is {kind} model ({model_type or 'unknown type'}); microbatch supports "
        "decoder-only causal language models (gpt2, llama, mistral, qwen2, gemma, phi3, ...): its memory "
        "formulas count one stack of causal decoder layers and its probes build AutoModelForCausalLM; "
        "give a decoder-only config, or the shape of a comparable decoder",
        params=_HF,
    )


def _family_fields(raw: dict[str, Any], model_type: str, positions: Any) -> dict[str, Any]:
    """The block's build (:func:`_block_fields`), its activation and its norms' kind and places (what eager layers
    keep: :func:`~microbatch.hf_families.activation_of`, :func:`~microbatch.hf_families.norm_fields`)."""
    return {
        **_block_fields(raw, model_type, positions),
        "activation": activation_of(raw, model_type),
        **norm_fields(model_type),
    }


def _block_fields(raw: dict[str, Any], model_type: str, positions: Any) -> dict[str, Any]:
    """The block's build by family: Llama-like (gated MLP, RMSNorm, rotary, no biases unless the config says, untied
    unless it says) for :data:`_LLAMA_LIKE`, :data:`_GATED_FAMILIES` and any SiLU/SwiGLU model but GPT-2; otherwise
    GPT-2's (learned positions up to ``positions``, tied by GPT-2's config default)."""
    tied = raw.get("tie_word_embeddings")
    llama_like = (
        model_type in _LLAMA_LIKE
        or model_type.startswith(_GATED_FAMILIES)
        or (
            model_type not in ("gpt2",)
            and str(raw.get("hidden_act") or default_activation(model_type)).lower() in ("silu", "swiglu")
        )
    )
    if not llama_like:  # GPT-2's config default is tied (PretrainedConfig.tie_word_embeddings=True)
        return _gpt2_built(raw, model_type, positions, tied)
    return {
        "gated_mlp": True,
        "bias": bool(raw.get("attention_bias", False) or raw.get("mlp_bias", False)),
        "norm": "layernorm" if model_type in _LAYERNORM_LLAMA_LIKE else "rmsnorm",
        "learned_positions": False,
        # Gemma's config.json omits it (transformers' Gemma default: tied); Llama's default: untied
        "tied_embeddings": bool(tied) if tied is not None else model_type.startswith(_GATED_FAMILIES),
        "dropout": _dropout_of(raw, model_type, default=False),  # Llama's families train without it
        # Cohere always; StableLM where it says so (transformers' StableLmDecoderLayer: use_parallel_residual)
        "parallel_block": model_type.startswith(_PARALLEL_LLAMA_LIKE)
        or bool(raw.get("use_parallel_residual")),
    }


def _dense_width(raw: dict[str, Any], path: Path) -> int | None:
    """Llama 4's ``intermediate_size_mlp`` (its dense blocks' width), checked as the file's other sizes are."""
    v = raw.get("intermediate_size_mlp")
    return (
        None if v is None else whole_key(f"hf_config {str(path)!r}", "intermediate_size_mlp", v, params=_HF)
    )


def from_hf_config(
    path: str | Path,
    *,
    seq: int | None = None,
    name: str | None = None,
    given: Mapping[str, int] | None = None,
) -> ModelShape:
    """A :class:`ModelShape` from a Hugging Face ``config.json`` (a file or the folder holding it).

    Reads layers, hidden, heads, kv heads, ffn hidden, vocab and max positions; the family
    (``model_type``) decides the block details (Llama-like: RMSNorm, rotary, SwiGLU, no biases;
    otherwise GPT-2-like). Experts (Mixtral, Qwen-MoE, DeepSeek) and DeepSeek's latent attention are
    read by :func:`microbatch.moe.experts_from_hf` and :func:`microbatch.moe.latent_attention_from_hf`.
    A ``head_dim`` that differs from hidden/heads (Qwen3, Gemma, GPT-OSS) is kept as ``head_size``, under
    DeepSeek's latent attention its own head widths rule; the sliding window and the layers using it are read
    by :func:`microbatch.hf_attention.sliding_window_of`. ``given``: the sizes the caller gives itself (it overrides
    them after): a size set per layer (:func:`per_layer_sizes`) is refused unless given, an expert size the file
    lacks (``top_k``, ``expert_ffn_hidden``) is taken from there. Ignores per-family oddities (Qwen2's q/k/v
    biases on an otherwise bias-free block), which change parameter counts slightly.
    """
    path = Path(path)
    raw = _read_hf_dict(path)
    _check_decoder_only(raw, path)
    given = given or {}
    _check_identical_layers(raw, path, given)
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
    positions = vals["seq"]
    fields = dict(
        name=name or raw.get("_name_or_path") or model_type or path.stem,
        layers=vals["layers"],
        hidden=vals["hidden"],
        heads=vals["heads"],
        head_size=own_head_size(vals["head_size"], vals["hidden"], vals["heads"]),
        kv_heads=vals["kv_heads"],
        ffn_hidden=_dense_width(raw, path) or vals["ffn_hidden"],  # Llama 4's dense blocks: their own width
        vocab=vals["vocab"],
        seq=seq or positions or 2048,
    )
    fields.update(_family_fields(raw, model_type, positions))
    fields.update({k: v for k, v in given.items() if k in fields})  # the sizes given win before the rules run
    for f in ("layers", "hidden", "heads", "vocab"):
        if not isinstance(fields[f], int) or isinstance(fields[f], bool):
            raise ConfigError(
                f"hf_config {str(path)!r}: {f} is {fields[f]!r}, not a whole number", params=_HF
            )
    source = f"hf_config {str(path)!r}"
    fields.update(
        moe=experts_from_hf(raw, vals["ffn_hidden"], source, given), mla=latent_attention_from_hf(raw, source)
    )
    if (
        fields["mla"] is not None and "head_size" not in given
    ):  # DeepSeek's configs: head_dim the rotary slice
        # hidden/heads then, or, where heads do not divide hidden (GLM-4.7-Flash: 20 on 2,048), a query head's width
        h, a = fields["hidden"], fields["heads"]
        whole = isinstance(h, int) and isinstance(a, int) and a > 0 and h % a == 0
        fields["head_size"] = None if whole else fields["mla"].qk_head_dim
    if isinstance(layers := fields["layers"], int):  # the count given, if any: the windowed share is of it
        fields["sliding_window"], fields["sliding_layers"] = sliding_window_of(raw, layers, positions, source)
        if fields["sliding_window"] is None:  # Llama 4: a chunk of its own for three layers in four
            chunk, count = chunked_attention_of(raw, layers, source)
            if chunk is not None:
                fields.update(sliding_window=chunk, sliding_layers=count, local_attention="chunked")
    try:
        return ModelShape(**fields)
    except (
        ConfigError
    ) as e:  # a rule between fields (heads divide hidden): name the file, and the sizes given
        mine = tuple(k for k in getattr(e, "params", ()) if k in given)  # a flag in the rule: it names itself
        with_given = f" with {', '.join(f'{k} {given[k]}' for k in mine)} given" if mine else ""
        raise ConfigError(f"{source}{with_given}: {e}", params=(*_HF, *mine)) from None
