"""What a Hugging Face ``config.json`` says of its attention beyond the head counts: the head width and the
sliding window (read by :func:`microbatch.model.from_hf_config`).

- ``head_dim`` where it is not hidden/heads (Qwen3, Gemma, GPT-OSS): :attr:`ModelShape.head_size`.
- ``sliding_window`` and which layers use it (:attr:`ModelShape.sliding_window`, ``sliding_layers``): the
  ``layer_types`` list where the config has one (transformers ≥ 4.53 writes it for GPT-OSS, Gemma 2/3, Qwen2 and
  others: the "sliding_attention" entries); else none where ``use_sliding_window`` is false (Qwen2's default), the
  layers from ``max_window_layers`` on where it is true (Qwen2);
  else Gemma 2's every other layer (its modelling code: layers 0, 2, 4, … slide) and Gemma 3's
  ``sliding_window_pattern`` (every k-th layer global, the others local; EXAONE 4 writes it as letters, "LLLG":
  L local, G global, repeated over the layers); else every layer (Mistral 7B v0.1,
  Phi-3). A window no shorter than the positions the model holds changes nothing and is dropped.
- Llama 4's chunked attention (:func:`chunked_attention_of`, ``ModelShape.local_attention`` "chunked"):
  ``attention_chunk_size`` on the ``layer_types`` entries "chunked_attention" where the config has them (transformers
  writes them), else on the layers ``no_rope_layers`` marks 1 (those with rotary positions), else on all but every
  ``no_rope_layer_interval``-th (default 4: three in four), as transformers' Llama4TextConfig derives them.
"""

from __future__ import annotations

from typing import Any

from microbatch.errors import ConfigError
from microbatch.fields import whole_key

__all__ = ["chunked_attention_of", "own_head_size", "sliding_window_of"]

_HF = ("hf_config",)


def _optional_whole(raw: dict[str, Any], key: str, source: str, minimum: int = 1) -> int | None:
    """The file's ``key``: None where absent or null, else a whole number from ``minimum`` (a ConfigError naming it)."""
    v = raw.get(key)
    return None if v is None else whole_key(source, key, v, minimum=minimum, params=_HF)


def _layer_list(
    raw: dict[str, Any], key: str, layers: int, source: str, kinds: tuple[type, ...]
) -> list[Any] | None:
    """The file's per-layer list ``key`` (None where absent or empty): entries of ``kinds``, at least one a layer (the
    first ``layers`` read, as transformers builds one block per entry), else a ConfigError naming it."""
    v = raw.get(key)
    if v is None or v == []:
        return None
    if not isinstance(v, list) or not all(isinstance(x, kinds) for x in v):
        names = " or ".join(k.__name__ for k in kinds)
        raise ConfigError(
            f"{source}: {key} must be a list of {names}, one a layer; got {v!r:.120}", params=_HF
        )
    if len(v) < layers:
        raise ConfigError(
            f"{source}: {key} has {len(v)} entries for its {layers} layers (num_hidden_layers); give one a layer",
            params=_HF,
        )
    return v[:layers]


def own_head_size(head_dim: Any, hidden: Any, heads: Any) -> int | None:
    """A config's ``head_dim`` where it is not hidden/heads (None where it is, or absent)."""
    if head_dim is None or (
        isinstance(hidden, int)
        and isinstance(heads, int)
        and heads
        and hidden % heads == 0
        and head_dim == hidden // heads
    ):
        return None
    return int(head_dim)


def chunked_attention_of(
    raw: dict[str, Any], layers: int, source: str = "hf_config"
) -> tuple[int | None, int | None]:
    """(chunk, layers that attend inside their chunk) of a Llama 4 config (module docstring); (None, None) for none.
    A key of the wrong kind (a chunk that is not a whole number >= 1, a list that is not one entry a layer) is
    refused, naming it, rather than read as full attention."""
    llama4 = str(raw.get("model_type", "")).startswith("llama4")
    if "attention_chunk_size" in raw:  # null: no chunked layer (transformers writes them all full)
        chunk = _optional_whole(raw, "attention_chunk_size", source)
    else:
        chunk = 8192 if llama4 else None  # transformers' Llama4TextConfig default
    types = _layer_list(raw, "layer_types", layers, source, (str,))
    if chunk is None or (not llama4 and not (types and "chunked_attention" in types)):
        return None, None
    if types:
        count = sum(1 for x in types if x == "chunked_attention")
    else:
        marks = _layer_list(
            raw, "no_rope_layers", layers, source, (int,)
        )  # 1: rotary, chunked (bools are ints)
        if marks:
            count = sum(1 for x in marks if x)
        else:
            every = _optional_whole(raw, "no_rope_layer_interval", source) or 4
            count = layers - layers // every
    return (chunk, count) if count else (None, None)


def sliding_window_of(
    raw: dict[str, Any], layers: int, positions: int | None, source: str = "hf_config"
) -> tuple[int | None, int | None]:
    """(window, layers that use it) from a config (module docstring); (None, None) for full attention. A key of the
    wrong kind (a window that is not a whole number, a switch that is not true or false, a list that is not one entry
    a layer) is refused, naming it, rather than read as another layout."""
    window = _optional_whole(raw, "sliding_window", source, minimum=0)  # null or 0: none
    if not window or (positions is not None and window >= positions):
        return None, None
    types = _layer_list(raw, "layer_types", layers, source, (str,))
    if types:
        count = sum(1 for x in types if x == "sliding_attention")
        return (window, count) if count else (None, None)
    use = raw.get("use_sliding_window")
    if use is not None and not isinstance(use, bool):
        raise ConfigError(
            f"{source}: use_sliding_window is {use!r}; write true or false (JSON, unquoted)", params=_HF
        )
    if use is False:
        return None, None
    top = _optional_whole(
        raw, "max_window_layers", source, minimum=0
    )  # Qwen2: layers from this index on slide
    if top is not None and use:
        count = max(0, layers - top)
        return (window, count) if count else (None, None)
    model_type = str(raw.get("model_type", "")).lower()
    if model_type == "gemma2":
        return window, (layers + 1) // 2
    letters = raw.get("sliding_window_pattern")
    if (
        isinstance(letters, str) and letters and set(letters) <= {"L", "G"}
    ):  # EXAONE 4: "LLLG", L local, G global
        count = sum(1 for i in range(layers) if letters[i % len(letters)] == "L")
        return (window, count) if count else (None, None)
    pattern = _optional_whole(raw, "sliding_window_pattern", source)  # every k-th layer global
    if pattern is None and model_type.startswith("gemma3"):
        pattern = 6  # transformers' Gemma3TextConfig default: five local layers to one global
    if pattern == 1:  # every layer global
        return None, None
    if pattern is not None:
        return window, layers - layers // pattern
    return window, None
