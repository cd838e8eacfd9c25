"""Mixture-of-experts and multi-head latent attention: the two shape extensions of a block.

:class:`Experts` describes a mixture-of-experts MLP (Shazeer et al. 2017; Mixtral, Jiang et al.
2024, arXiv 2401.04088; DeepSeekMoE / DeepSeek-V3, arXiv 2412.19437 §2.1.2): E routed experts of
inner width F, of which each token visits K, plus S shared experts every token visits, and a
router (one h×E matrix). The first ``dense_layers`` blocks keep a dense MLP (DeepSeek-V3's
``first_k_dense_replace`` = 3).

:class:`LatentAttention` describes DeepSeek's multi-head latent attention (MLA; DeepSeek-V2,
arXiv 2405.04434 §2.1; DeepSeek-V3 §2.1.1): queries and keys/values pass through low-rank
down-projections (ranks d_c' = ``q_lora_rank`` and d_c = ``kv_lora_rank``), each head has a
non-rotary part (``qk_nope_head_dim``) and a decoupled rotary part (``qk_rope_head_dim``) shared by
all heads for the key, and a value width ``v_head_dim``.

Both are frozen values a :class:`microbatch.model.ModelShape` carries; their parameter counts are
pure functions here; :func:`experts_from_hf` and :func:`latent_attention_from_hf` read the
Hugging Face ``config.json`` keys of Mixtral, Qwen2/Qwen3-MoE and DeepSeek-V2/V3.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from microbatch.errors import ConfigError, check_positive_int, plain_numbers
from microbatch.fields import whole_key

__all__ = [
    "Experts",
    "LatentAttention",
    "experts_from_hf",
    "latent_attention_from_hf",
    "as_experts",
    "as_latent_attention",
]


@dataclass(frozen=True, kw_only=True)
class Experts:
    """A mixture-of-experts MLP: E routed experts (top-K per token), S shared experts, a router."""

    experts: int
    """E: routed experts per MoE layer."""
    top_k: int
    """K: routed experts each token visits (Mixtral 2, DeepSeek-V3 8)."""
    expert_ffn_hidden: int
    """F: inner width of one routed expert's MLP (DeepSeek-V3 ``moe_intermediate_size`` 2048)."""
    shared_experts: int = 0
    """S: experts every token visits (DeepSeek-V3 1, Mixtral 0)."""
    shared_ffn_hidden: int | None = None
    """Inner width of one shared expert; None means F (DeepSeek); Qwen2-MoE gives its own."""
    dense_layers: int = 0
    """The first blocks that keep a dense MLP of the model's ``ffn_hidden`` (DeepSeek-V3: 3)."""
    moe_every: int = 1
    """Every k-th block has the MoE MLP, the others a dense one of ``ffn_hidden``: blocks i (from ``dense_layers`` on)
    with i % k == k − 1, as Llama 4's ``interleave_moe_layer_step`` (Maverick: 2) and Qwen2-MoE's
    ``decoder_sparse_step`` place them (transformers' modelling code); 1: every block."""

    def __post_init__(self) -> None:
        plain_numbers(self)
        for f in ("experts", "top_k", "expert_ffn_hidden"):
            check_positive_int(f, getattr(self, f))
        check_positive_int(
            "moe_every", self.moe_every, fix="give 1 for a MoE MLP in every block, k for every k-th"
        )
        if self.shared_experts < 0 or self.dense_layers < 0:
            raise ConfigError(
                f"shared experts {self.shared_experts} and dense layers {self.dense_layers} must be >= 0; "
                "give 0 for none"
            )
        if self.top_k > self.experts:
            raise ConfigError(
                f"top_k {self.top_k} > experts {self.experts}; a token visits at most every expert once; "
                f"use top_k {self.experts} or less",
                params=("top_k", "experts"),
            )
        if self.shared_ffn_hidden is not None:
            check_positive_int("shared_ffn_hidden", self.shared_ffn_hidden)

    @property
    def shared_width(self) -> int:
        """Inner width of one shared expert in effect."""
        return self.shared_ffn_hidden or self.expert_ffn_hidden

    def router_params(self, hidden: int) -> int:
        """The router (gate) weight h×E (Mixtral, Qwen-MoE, DeepSeek; biases and DeepSeek-V3's E-wide
        load-balancing correction bias, which is not trained by gradient, are ignored: E ≪ h·E)."""
        return hidden * self.experts

    def routed_params(self, hidden: int, matrices: int) -> int:
        """All E routed experts: E · matrices · h · F (matrices = 3 for SwiGLU, 2 otherwise; no biases)."""
        return self.experts * matrices * hidden * self.expert_ffn_hidden

    def shared_params(self, hidden: int, matrices: int) -> int:
        """The S shared experts: S · matrices · h · F_shared."""
        return self.shared_experts * matrices * hidden * self.shared_width

    def moe_params(self, hidden: int, matrices: int) -> int:
        """One MoE MLP in total: router + routed experts + shared experts."""
        return (
            self.router_params(hidden)
            + self.routed_params(hidden, matrices)
            + self.shared_params(hidden, matrices)
        )

    def active_moe_params(self, hidden: int, matrices: int) -> int:
        """The MoE MLP parameters one token uses: router + K routed experts + the shared experts
        (the "activated parameters" of Mixtral §2 and DeepSeek-V3 Table 1)."""
        routed = self.top_k * matrices * hidden * self.expert_ffn_hidden
        return self.router_params(hidden) + routed + self.shared_params(hidden, matrices)


@dataclass(frozen=True, kw_only=True)
class LatentAttention:
    """DeepSeek's multi-head latent attention (MLA): low-rank q and kv projections, decoupled RoPE."""

    kv_lora_rank: int
    """d_c: the compressed key/value latent width (DeepSeek-V3: 512)."""
    q_lora_rank: int | None = None
    """d_c': the compressed query width (DeepSeek-V3: 1536); None means a full-rank query projection."""
    qk_nope_head_dim: int = 128
    """d_h: the non-rotary query/key width per head."""
    qk_rope_head_dim: int = 64
    """d_h^R: the decoupled rotary query/key width per head (the key's is shared by all heads)."""
    v_head_dim: int = 128
    """The value (and attention output) width per head."""

    def __post_init__(self) -> None:
        plain_numbers(self)
        for f in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            check_positive_int(f, getattr(self, f))
        if self.q_lora_rank is not None:
            check_positive_int("q_lora_rank", self.q_lora_rank)

    @property
    def qk_head_dim(self) -> int:
        """Query/key width per head: d_h + d_h^R (DeepSeek-V3: 192)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def params(self, hidden: int, heads: int) -> int:
        """MLA's weights (DeepSeek-V2 §2.1.2–2.1.3, equations 9–14 and 37–47; no biases), n_h = heads:

        q: h·d_c' + d_c' (norm) + d_c'·n_h·(d_h + d_h^R), or h·n_h·(d_h + d_h^R) without q LoRA;
        kv: h·(d_c + d_h^R) + d_c (norm) + d_c·n_h·(d_h + d_v); output: n_h·d_v·h.
        """
        qk = heads * self.qk_head_dim
        if self.q_lora_rank is None:
            q = hidden * qk
        else:
            q = hidden * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * qk
        kv = hidden * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
        kv += self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)
        return q + kv + heads * self.v_head_dim * hidden

    def flops_per_token(self, hidden: int, heads: int) -> int:
        """Forward GEMM FLOPs per token of MLA's projections: 2 × its weights (norms are not GEMMs,
        their few parameters are counted anyway: d_c + d_c' ≪ the rest)."""
        return 2 * self.params(hidden, heads)


# -- Hugging Face config.json keys ------------------------------------------------------------------------
_EXPERT_KEYS = ("num_local_experts", "n_routed_experts", "num_experts", "moe_num_experts")
_TOPK_KEYS = ("num_experts_per_tok", "moe_top_k", "moe_topk", "moe_k", "top_k")
"""K's spellings: Mixtral/DeepSeek/Qwen, ``moe_topk`` (Aria, LongCat-Flash), ``moe_k`` (ERNIE 4.5)."""
_EXPERT_FFN_KEYS = ("moe_intermediate_size", "expert_ffn_hidden_size")
"""F's spellings: ``moe_intermediate_size``, ``expert_ffn_hidden_size`` (LongCat-Flash)."""


def _first(raw: dict[str, Any], keys: tuple[str, ...]) -> Any:
    for key in keys:
        if raw.get(key) is not None:
            return raw[key]
    return None


_HF = ("hf_config",)
"""The parameter a config file's ``source`` names (``hf_config '/path'``)."""


def _whole(raw: dict[str, Any], key: str, value: Any, source: str, minimum: int = 0) -> int:
    """The file's ``key`` as a whole number from ``minimum`` to 2^53 (:func:`microbatch.fields.whole_key`)."""
    return whole_key(source, key, value, minimum=minimum, params=_HF)


_ONE_SHARED = ("llama4",)
"""Families whose MoE MLP always adds one shared expert of the routed experts' width, unnamed in the config (Llama 4:
transformers' ``Llama4TextMoe`` builds ``shared_expert`` from ``intermediate_size``)."""


def experts_from_hf(
    raw: dict[str, Any], ffn_hidden: int | None, source: str, given: Mapping[str, int] | None = None
) -> Experts | None:
    """The :class:`Experts` of a config dict, or None for a dense model (no expert count, or 0/1 experts).

    Keys: E from ``num_local_experts`` (Mixtral), ``n_routed_experts`` (DeepSeek), ``num_experts``
    (Qwen-MoE); K from ``num_experts_per_tok``; F from ``moe_intermediate_size`` or, as in
    Mixtral, ``intermediate_size``; S from ``n_shared_experts`` (DeepSeek, width F) or one shared
    expert of ``shared_expert_intermediate_size`` (Qwen2-MoE); dense first blocks from
    ``first_k_dense_replace`` (AFMoE's ``num_dense_layers``; transformers 5's ``mlp_layer_types``, "dense"/"sparse"
    per block, any kind but "dense" an MoE block (DeepSeek-V4's "hash_moe"); shared experts also as ``num_shared_experts`` or ``moe_num_shared_experts``); every k-th block MoE from ``interleave_moe_layer_step`` (Llama 4) or
    ``decoder_sparse_step`` (Qwen2-MoE), the others dense at ``intermediate_size_mlp`` where the config has it (Llama 4);
    Llama 4's one shared expert (:data:`_ONE_SHARED`). Ignores DeepSeek-V2's ``moe_layer_freq`` (1 in every
    published config). K or F the file
    lacks (DeepSeek-V2's transformers default leaves K None) comes from ``given`` (``top_k``, ``expert_ffn_hidden``:
    the flags the user gives, which override the file's anyway), else a ConfigError names the flag.
    """
    given = given or {}
    e_key = next((key for key in _EXPERT_KEYS if raw.get(key) is not None), None)
    e = None if e_key is None else raw[e_key]
    if e is None or (e in (0, 1) and not isinstance(e, bool)):
        return None
    e = _whole(raw, e_key or "num_experts", e, source, minimum=2)
    k_key = next((key for key in _TOPK_KEYS if raw.get(key) is not None), None)
    k = raw[k_key] if k_key else given.get("top_k")
    if k is None:
        raise ConfigError(
            f"{source} has {e} experts but no num_experts_per_tok; give top_k (Mixtral 2, DeepSeek-V3 8)",
            params=(*_HF, "top_k"),
        )
    k = _whole(raw, k_key or "num_experts_per_tok", k, source, minimum=1)
    if k > e:
        raise ConfigError(
            f"{source}: {k_key or 'top_k'} {k} routes each token to more experts than the {e} of {e_key}; a token goes "
            "to at most every expert: fix the file",
            params=_HF,
        )
    f_key = next((key for key in _EXPERT_FFN_KEYS if raw.get(key) is not None), None)
    f = raw[f_key] if f_key else given.get("expert_ffn_hidden") or ffn_hidden
    if f is None:
        raise ConfigError(
            f"{source} has experts but no moe_intermediate_size; give expert_ffn_hidden",
            params=(*_HF, "expert_ffn_hidden"),
        )
    shared_key = next(  # DeepSeek's spelling, then EXAONE-MoE's / AFMoE's / HunYuan's, then Aria's
        (k for k in ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts") if raw.get(k)),
        "n_shared_experts",
    )
    shared = raw.get(shared_key) or 0
    shared_width = None
    if not shared and raw.get("shared_expert_intermediate_size"):
        shared, shared_width = 1, _whole(raw, "shared_expert_intermediate_size", raw["shared_expert_intermediate_size"], source, 1)  # fmt: skip
    if not shared and str(raw.get("model_type", "")).startswith(_ONE_SHARED):
        shared = 1  # Llama 4's shared expert, as wide as a routed one (Llama4TextMoe.shared_expert)
    step_key = next(
        (key for key in ("interleave_moe_layer_step", "decoder_sparse_step") if raw.get(key) is not None),
        None,
    )
    every = raw[step_key] if step_key else 1
    dense_key = (
        "num_dense_layers" if raw.get("num_dense_layers") is not None else "first_k_dense_replace"
    )  # AFMoE's
    dense = _whole(raw, dense_key, raw.get(dense_key) or 0, source)
    # transformers divides by the step (Qwen2-MoE) or steps a range by it (Llama 4): 0 builds no model
    every = _whole(raw, step_key or "interleave_moe_layer_step", every, source, minimum=1)
    placed = _listed_layers(raw, dense, every, source)
    if placed is None:  # its lists leave every block dense, as transformers builds it
        return None
    dense, every = placed
    return Experts(
        experts=e,
        top_k=k,
        expert_ffn_hidden=_whole(raw, f_key or "moe_intermediate_size", f, source, minimum=1),
        shared_experts=_whole(raw, shared_key, shared, source),
        shared_ffn_hidden=shared_width,
        dense_layers=dense,
        moe_every=every,
    )


def _listed_layers(raw: dict[str, Any], dense: int, every: int, source: str) -> tuple[int, int] | None:
    """(dense first blocks, every k-th block MoE) with the config's own lists of blocks read, as transformers
    builds the model: Llama 4's ``moe_layers`` are the MoE blocks (``layer_idx in moe_layers``; transformers fills
    it from ``interleave_moe_layer_step`` when the file has none), Qwen2/3-MoE's blocks are MoE unless in
    ``mlp_only_layers`` and where ``(layer_idx + 1) % decoder_sparse_step == 0``; indices outside the blocks
    are ignored, as there. The blocks they make are placed by the rule (the first ``dense`` blocks dense, then
    blocks i with i % k = k − 1 MoE), the config's step tried first; None where they leave no MoE block (a
    dense model); a set no rule gives is refused, naming it, rather than priced at other blocks."""
    n = raw.get("num_hidden_layers")
    only, listed = raw.get("mlp_only_layers") or [], raw.get("moe_layers")
    kinds = raw.get(
        "mlp_layer_types"
    )  # transformers 5's kind of each block: "dense", or "sparse"/"moe"/"hash_moe"
    if isinstance(kinds, list) and isinstance(n, int) and listed is None:
        if not all(isinstance(k, str) for k in kinds):
            raise ConfigError(
                f"{source}: mlp_layer_types {kinds!r} must name each block's kind ('dense', 'sparse', ...)",
                params=_HF,
            )
        listed = [i for i, k in enumerate(kinds) if k != "dense"]  # every kind but dense routes to experts
    if not isinstance(n, int) or n <= 0 or (not only and listed is None):
        return dense, every
    for key, value in (("mlp_only_layers", only), ("moe_layers", listed)):
        if value is not None and not (
            isinstance(value, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in value)
        ):
            raise ConfigError(f"{source}: {key} {value!r} must be a list of block indices", params=_HF)
    if listed is not None:
        key, target = "moe_layers", {i for i in listed if 0 <= i < n}
    else:
        dense_only = set(only)
        key, target = "mlp_only_layers", {i for i in range(n) if i not in dense_only and (i + 1) % every == 0}
    if not target:
        return None
    ordered = sorted(target)
    first = ordered[0]
    # consecutive MoE blocks of a rule are k apart; a lone one (i % k = k − 1) has k dividing i + 1
    steps = (
        (ordered[1] - first,)
        if len(ordered) > 1
        else tuple(k for k in range(1, first + 2) if (first + 1) % k == 0)
    )
    for k in (every, *steps):
        rule = [i for i in range(n) if i % k == k - 1]
        below = [i for i in rule if i < first]
        d = below[-1] + 1 if below else 0
        if {i for i in rule if i >= d} == target:
            return d, k
    shown = sorted(target)
    raise ConfigError(
        f"{source}: its {key} make blocks {_ranges(shown)} (of {n}) the MoE blocks; microbatch places MoE blocks "
        f"as the first k blocks dense, then every k-th block (first_k_dense_replace, interleave_moe_layer_step or "
        f"decoder_sparse_step) and cannot price this set; give a config whose MoE blocks follow that rule "
        f"(the same count: first_k_dense_replace {n - len(shown)}, every block after it MoE)",
        params=_HF,
    )


def _ranges(blocks: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``0-2, 5``."""
    out: list[str] = []
    for i in blocks:
        if out and out[-1].split("-")[-1] == str(i - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{i}"
        else:
            out.append(str(i))
    return ", ".join(out)


def latent_attention_from_hf(raw: dict[str, Any], source: str) -> LatentAttention | None:
    """The :class:`LatentAttention` of a DeepSeek-V2/V3 config dict (``kv_lora_rank`` present), else None."""
    if raw.get("kv_lora_rank") is None:
        return None
    dims = {
        k: _whole(raw, k, raw[k], source)
        for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        if raw.get(k) is not None
    }
    q = raw.get("q_lora_rank")
    try:
        return LatentAttention(
            q_lora_rank=None if q is None else _whole(raw, "q_lora_rank", q, source), **dims
        )
    except ConfigError as e:  # a key of the file, not a flag: name the file (its params are the file's)
        raise ConfigError(f"{source}: {e}", params=("hf_config",)) from None


def as_experts(value: Experts | dict[str, Any] | None) -> Experts | None:
    """An :class:`Experts` from itself or its dict (a shape read back from JSON); ConfigError for anything else."""
    if value is not None and not isinstance(value, dict | Experts):
        raise ConfigError(
            f"moe must be an Experts(experts=E, top_k=K, ...) or its dict, got {value!r}; for a built-in MoE model "
            "use get_model('mixtral-8x7b')",
            params=("moe",),
        )
    return Experts(**value) if isinstance(value, dict) else value


def as_latent_attention(value: LatentAttention | dict[str, Any] | None) -> LatentAttention | None:
    """A :class:`LatentAttention` from itself or its dict (a shape read back from JSON)."""
    return LatentAttention(**value) if isinstance(value, dict) else value


def with_expert_flags(base: Experts | None, ffn_hidden: int, flags: dict[str, int | None]) -> Experts | None:
    """``base`` with the expert sizes given (``experts top_k expert_ffn_hidden shared_experts``).

    Without a base (a dense model), ``experts`` and ``top_k`` are both needed; F defaults to the
    model's ffn hidden. No size given returns ``base`` unchanged.
    """
    given = {k: v for k, v in flags.items() if v is not None}
    if not given:
        return base
    if base is None:
        if "experts" not in given or "top_k" not in given:
            raise ConfigError(
                "a dense model becomes mixture-of-experts with both experts E and top_k K "
                f"(given: {', '.join(given)}); add the missing one",
                params=("experts", "top_k", *given),
            )
        given.setdefault("expert_ffn_hidden", ffn_hidden)
        return Experts(**given)
    return replace(base, **given)
