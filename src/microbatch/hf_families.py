"""The family tables :mod:`microbatch.hf_config` reads a config.json by: which families are built as Llama is, which
as GPT-2 is with rotary or ALiBi positions, the keys that spell dropout, rotary positions and parallel blocks, and the
families' defaults. Split from it (a module each: the tables here, the reading there)."""

from __future__ import annotations

from typing import Any

from microbatch.errors import ConfigError

__all__ = [
    "activation_of",
    "norm_fields",
    "check_pad_token",
    "default_activation",
    "_GATED_FAMILIES",
    "_LAYERNORM_LLAMA_LIKE",
    "_LLAMA_LIKE",
    "_NO_POSITION_TABLE",
    "_ROTARY_KEYS",
    "_DROPOUT_KEYS",
    "_PARALLEL_KEYS",
    "_ALWAYS_PARALLEL",
    "_PARALLEL_LLAMA_LIKE",
    "_UNTIED_BY_DEFAULT",
    "_BLOCK_KEYS",
    "_DEFAULT_DROPOUT_OFF",
    "mpt_block_fields",
]

_GATED_FAMILIES = ("gemma", "vaultgemma", "bitnet")
"""Family prefixes built as Llama is (gated MLP, RMSNorm, rotary, no biases) though their activation is not SiLU (Gemma's
GeGLU, spelt ``hidden_activation``: gemma3_text, gemma4_text, vaultgemma; BitNet's gated relu²). RecurrentGemma is refused as a hybrid first."""
_LLAMA_LIKE = {
    "llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "gemma", "gemma2", "olmo2", "phi3",
    "granite",
}  # fmt: skip
"""Families built as Llama is, whether or not their config.json spells ``hidden_act`` (Qwen2-MoE's and Qwen3-MoE's
often do not: read as GPT-2 blocks, 23-32% of the parameters went missing, a review). Others whose file omits it take
transformers' own default for the family (:func:`default_activation`)."""

_QK_NORM = ("qwen3", "olmo2", "olmo3", "gemma3")
"""Family prefixes whose attention runs an RMSNorm over Q and K (``q_norm``, ``k_norm``): Qwen3 and Qwen3-MoE, OLMo 2
and 3, Gemma 3 (read by the eager layers' memory)."""

_NORM_PLACEMENT = {"gemma2": "sandwich", "gemma3": "sandwich", "olmo2": "post", "olmo3": "post"}
"""Family prefixes whose norms are not only before each sublayer: Gemma 2 and 3 norm each sublayer's output too
(``post_attention_layernorm`` and ``post_feedforward_layernorm`` beside the pre-norms); OLMo 2 and 3 only after."""


def norm_fields(model_type: str) -> dict[str, Any]:
    """``qk_norm``, ``norm_placement`` and ``norm_fp32`` of a family (:data:`_QK_NORM`, :data:`_NORM_PLACEMENT`, Gemma's
    norm)."""
    placement = next((v for k, v in _NORM_PLACEMENT.items() if model_type.startswith(k)), "pre")
    return {
        "qk_norm": model_type.startswith(_QK_NORM),
        "norm_placement": placement,
        "norm_fp32": model_type.startswith(
            ("gemma", "vaultgemma")
        ),  # GemmaRMSNorm: x.float() · (1 + w.float())
    }


_LAYERNORM_LLAMA_LIKE = ("stablelm", "olmo")
"""Families built as Llama is (a SiLU-gated MLP, rotary) whose norm is a LayerNorm: StableLM's ``nn.LayerNorm``, OLMo's
(version 1) ``OlmoLayerNorm`` (``F.layer_norm`` without parameters, on an fp32 copy: its 2h a layer counted as a
LayerNorm's weight and bias, 0.002% of a 7B's); not RMSNorm, whose eager copy they do not keep (a review: StableLM's
eager memory read +14.9%, OLMo's +9.3%)."""

_NO_POSITION_TABLE = (
    "gpt_neox",
    "gptj",
    "bloom",
    "falcon",
    "phi",
    "codegen",
    "persimmon",
    "stablelm",
    "starcoder2",
)
"""GPT-2-built families (LayerNorm, GELU MLP of 4h or their own width) with rotary or ALiBi positions, not a learned
table: GPT-NeoX, GPT-J, CodeGen, Persimmon, StableLM, StarCoder2 and Phi (rotary), BLOOM (ALiBi), Falcon (rotary or
ALiBi). MPT
says it itself (``learned_pos_emb``)."""

_ROTARY_KEYS = ("rope_theta", "rope_scaling", "rope_parameters", "rotary_emb_base", "partial_rotary_factor")
"""Keys only a config with rotary positions carries (transformers 4's and 5's spellings): such a model has no
learned position table, whatever block it is built as."""

_DROPOUT_KEYS = ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop", "emb_pdrop",
                 "dropout", "activation_dropout", "hidden_dropout_prob", "attention_probs_dropout_prob")  # fmt: skip
"""The keys families spell a dropout probability with (MPT's ``attn_pdrop`` sits in its ``attn_config``)."""

_PARALLEL_KEYS = {"gpt_neox": "use_parallel_residual", "falcon": "parallel_attn"}
"""Families whose parallel attention + MLP block is a setting (transformers' default: on for both); GPT-J, CodeGen
and Phi always run it (:data:`_ALWAYS_PARALLEL`)."""
_ALWAYS_PARALLEL = ("gptj", "codegen", "phi")

_PARALLEL_LLAMA_LIKE = ("cohere",)
"""Llama-like families whose block runs attention and the MLP side by side on one norm's output (Cohere's Command-R
and Command-R7B: transformers' ``CohereDecoderLayer`` adds both to the residual)."""

_UNTIED_BY_DEFAULT = ("gpt_neox", "gptj", "phi", "codegen")
"""Families whose transformers config defaults ``tie_word_embeddings`` to False (GPT-2's, BLOOM's, OPT's, Falcon's and
MPT's tie): the default a config.json read without transformers takes."""

_BLOCK_KEYS = ("no_bias", "bias", "learned_pos_emb", "expansion_ratio")
"""MPT's and Falcon's block settings, read by :func:`_gpt2_built`."""

_DEFAULT_DROPOUT_OFF = ("gpt_neox", "gptj", "bloom", "falcon", "phi", "mpt", "codegen")
"""Families whose transformers config defaults every dropout probability to 0 (GPT-2's and OPT's default to 0.1):
the default where a config.json states none."""


def mpt_block_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """What an MPT config.json says in its ``attn_config`` and ``ffn_config`` (llm-foundry's ``MPTConfig``,
    llmfoundry/models/mpt/configuration_mpt.py; a review found them dropped): grouped-query attention
    (``kv_n_heads``), rotary positions in place of the learned table (``rope``), the gated MLP (``ffn_type``
    ``mptglu``) and its width (``ffn_hidden_size``, else ``expansion_ratio`` × hidden as :mod:`microbatch.hf_config`
    reads it), and an RMSNorm (``norm_type``). Only what the file states. Not ``attn_impl``: the Hub's MPT files say ``torch`` (inference's
    default), where training runs flash (llm-foundry's yamls); ``flash_attention=False`` states an eager run."""
    attn, ffn = ({} if not isinstance(v := raw.get(k), dict) else v for k in ("attn_config", "ffn_config"))
    out: dict[str, Any] = {}
    kv = attn.get("kv_n_heads", 1 if attn.get("attn_type") == "multiquery_attention" else None)
    if isinstance(kv, int) and not isinstance(kv, bool) and kv != raw.get("n_heads"):
        out["kv_heads"] = kv
    if attn.get("rope") is True:
        out.update(learned_positions=False, max_positions=None)
    if ffn.get("ffn_type") == "mptglu":
        out["gated_mlp"] = True
    if str(raw.get("norm_type", "")).endswith("rmsnorm"):  # rmsnorm, low_precision_rmsnorm
        out["norm"] = "rmsnorm"
    width = ffn.get("ffn_hidden_size")
    if isinstance(width, int) and not isinstance(width, bool) and width > 0:
        out["ffn_hidden"] = width
    return out


_ACTIVATION_KEYS = ("hidden_act", "activation_function", "hidden_activation")
"""The keys a config.json spells its MLP's activation by (Llama's, GPT-2's, Gemma 3's)."""


def activation_of(raw: dict[str, Any], model_type: str) -> str:
    """The MLP's activation a config builds, as transformers names it (``ACT2FN``): the file's
    (:data:`_ACTIVATION_KEYS`), else its config class's default (GPT-2's ``gelu_new``), else ``gelu``; only what an
    eager layer keeps reads it (:mod:`microbatch.predict.eager_memory`)."""
    for key in _ACTIVATION_KEYS:
        if isinstance(raw.get(key), str) and raw[key]:
            return str(raw[key]).lower()
    return next((d.lower() for k in _ACTIVATION_KEYS if (d := default_activation(model_type, k))), "gelu")


def default_activation(model_type: str, key: str = "hidden_act") -> str:
    """transformers' default ``key`` (``hidden_act``) for ``model_type``'s config class (what it builds when a
    config.json says none: OLMoE's, DeepSeek-V3's, PhiMoE's ``silu``); "" where transformers is not installed or has
    no such family."""
    import inspect

    try:
        from transformers import CONFIG_MAPPING

        cls = CONFIG_MAPPING[model_type]
    except Exception:  # noqa: BLE001 - not installed, an unknown family, or a transformers that fails to import
        return ""
    param = inspect.signature(cls.__init__).parameters.get(key)
    value = param.default if param is not None else getattr(cls, key, "")
    return value if isinstance(value, str) else ""


def check_pad_token(raw: dict[str, Any], vocab: Any, where: str, params: tuple[str, ...]) -> None:
    """ConfigError for a ``pad_token_id`` at or past the vocabulary (Phi-3's 32000 left over after the vocabulary was
    shrunk) in a family whose embedding takes it as ``padding_idx`` (the Llama-like ones, :data:`_LLAMA_LIKE`):
    transformers' embedding asserts ``padding_idx < num_embeddings``, and the probe failed in its setup. GPT-2's and
    GPT-NeoX's embeddings take none: their configs build whatever the pad token says."""
    pad = raw.get("pad_token_id")
    if str(raw.get("model_type", "")) not in _LLAMA_LIKE:
        return
    if isinstance(vocab, int) and isinstance(pad, int) and not isinstance(pad, bool) and pad >= vocab:
        raise ConfigError(
            f"{where}: pad_token_id {pad} is not below the vocabulary of {vocab} (transformers' embedding asserts "
            f'padding_idx < num_embeddings); give "pad_token_id": 0 (or any id below {vocab}), or a larger vocab_size',
            params=params,
        )
