"""What a Hugging Face ``config.json`` says of its attention beyond the head counts: the head width and the
sliding window (read by :func:`microbatch.model.from_hf_config`).

- ``head_dim`` where it is not hidden/heads (Qwen3, Gemma, GPT-OSS): :attr:`ModelShape.head_size`.
- ``sliding_window`` and which layers use it (:attr:`ModelShape.sliding_window`, ``sliding_layers``): the
  ``layer_types`` list where the config has one (transformers ≥ 4.53 writes it for GPT-OSS, Gemma 2/3, Qwen2 and
  others: the "sliding_attention" entries); else none where ``use_sliding_window`` is false (Qwen2's default), the
  layers from ``max_window_layers`` on where it is true (Qwen2);
  else Gemma 2's every other layer (its modelling code: layers 0, 2, 4, … slide) and Gemma 3's
  ``sliding_window_pattern`` (every k-th layer global, the others local); else every layer (Mistral 7B v0.1,
  Phi-3). A window no shorter than the positions the model holds changes nothing and is dropped.
- Llama 4's chunked attention (:func:`chunked_attention_of`, ``ModelShape.local_attention`` "chunked"):
  ``attention_chunk_size`` on the ``layer_types`` entries "chunked_attention" where the config has them (transformers
  writes them), else on the layers ``no_rope_layers`` marks 1 (those with rotary positions), else on all but every
  ``no_rope_layer_interval``-th (default 4: three in four), as transformers' Llama4TextConfig derives them.
"""

from __future__ import annotations

from typing import Any

__all__ = ["chunked_attention_of", "own_head_size", "sliding_window_of"]


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


def chunked_attention_of(raw: dict[str, Any], layers: int) -> tuple[int | None, int | None]:
    """(chunk, layers that attend inside their chunk) of a Llama 4 config (module docstring); (None, None) for none."""
    llama4 = str(raw.get("model_type", "")).startswith("llama4")
    if "attention_chunk_size" in raw:
        chunk = raw["attention_chunk_size"]  # null: no chunked layer (transformers writes them all full)
    else:
        chunk = 8192 if llama4 else None  # transformers' Llama4TextConfig default
    types = raw.get("layer_types")
    if chunk is None or (not llama4 and not (isinstance(types, list) and "chunked_attention" in types)):
        return None, None
    if isinstance(types, list) and types:
        count = sum(1 for x in types[:layers] if x == "chunked_attention")  # one entry a block; no more
    else:
        marks = raw.get("no_rope_layers")
        if isinstance(marks, list) and marks:
            count = sum(1 for x in marks[:layers] if x)
        else:
            every = raw.get("no_rope_layer_interval") or 4
            count = layers - layers // every if isinstance(every, int) and every > 0 else layers
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1 or not count:
        return None, None
    return chunk, count


def sliding_window_of(
    raw: dict[str, Any], layers: int, positions: int | None
) -> tuple[int | None, int | None]:
    """(window, layers that use it) from a config (module docstring); (None, None) for full attention."""
    window = raw.get("sliding_window")
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        return None, None
    if positions is not None and window >= positions:
        return None, None
    types = raw.get("layer_types")
    if isinstance(types, list) and types:
        count = sum(1 for x in types if x == "sliding_attention")
        return (window, count) if count else (None, None)
    if raw.get("use_sliding_window") is False:
        return None, None
    top = raw.get("max_window_layers")  # Qwen2: layers from this index on slide (its modelling code)
    if isinstance(top, int) and not isinstance(top, bool) and raw.get("use_sliding_window"):
        count = max(0, layers - top)
        return (window, count) if count else (None, None)
    model_type = str(raw.get("model_type", "")).lower()
    if model_type == "gemma2":
        return window, (layers + 1) // 2
    pattern = raw.get("sliding_window_pattern")
    if pattern is None and model_type.startswith("gemma3"):
        pattern = 6  # transformers' Gemma3TextConfig default: five local layers to one global
    if isinstance(pattern, int) and pattern > 1:
        return window, layers - layers // pattern
    return window, None
