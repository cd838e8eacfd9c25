"""Hugging Face models for the probes: config → model with random weights, and decoding over them.

A registry shape becomes a transformers config (:func:`hf_config_from_shape`: GPT-2 layout for
learned positions, Llama otherwise); a local ``config.json`` is read by
:func:`load_hf_config` (nothing is downloaded); :func:`hf_model` builds the causal LM on the
device it will run on; :class:`HFDecoder` gives it the ``prefill`` / ``decode_step`` pair of
the built-in GPT. ``transformers`` is an optional dependency, imported inside the functions.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from microbatch._json import loads
from microbatch.errors import ConfigError
from microbatch.model import ModelShape

if TYPE_CHECKING:
    import torch

__all__ = [
    "require_transformers",
    "hf_config_from_shape",
    "load_hf_config",
    "check_hf_buildable",
    "hf_model",
    "HFDecoder",
]


def require_transformers(what: str = "a Hugging Face model", *, params: tuple[str, ...] = ()) -> None:
    """ConfigError naming the extra to install when the optional ``transformers`` is missing; ``params``
    are the parameter names ``what`` speaks of (:attr:`~microbatch.errors.ConfigError.params`)."""
    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        raise ConfigError(
            f"{what} needs the optional package transformers, which is not installed; "
            "install it with: pip install 'microbatch[hf]'",
            params=params,
        )


def hf_config_from_shape(shape: ModelShape) -> Any:
    """A transformers config of a registry shape (GPT-2 layout for learned positions, Llama otherwise). The GPT-2
    layout trains with the shape's dropout (GPT-2's 0.1 on the embeddings, residuals and attention, or none); the
    Llama layout has no residual dropout and runs none."""
    require_transformers("backend hf", params=("backend",))
    if shape.learned_positions:
        from transformers import GPT2Config

        if shape.head_size is not None and shape.head_size * shape.heads != shape.hidden:
            raise ConfigError(
                f"model {shape.name}: head_size {shape.head_size} × {shape.heads} heads is not hidden {shape.hidden}, "
                "which transformers' GPT-2 layout (learned positions) cannot build; use backend builtin, or a "
                "config.json whose family has head_dim (hf_config)",
                params=("backend", "hf_config"),
            )

        p = 0.1 if shape.dropout else 0.0  # GPT2Config's own default, or off
        return GPT2Config(
            resid_pdrop=p,
            embd_pdrop=p,
            attn_pdrop=p,
            n_layer=shape.layers,
            n_embd=shape.hidden,
            n_head=shape.heads,
            vocab_size=shape.vocab,
            n_positions=shape.positions,
            n_inner=shape.ffn_hidden,
            tie_word_embeddings=shape.tied_embeddings,
            bos_token_id=0,
            eos_token_id=0,
        )
    from transformers import LlamaConfig

    return LlamaConfig(
        num_hidden_layers=shape.layers,
        hidden_size=shape.hidden,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv,
        head_dim=shape.head_dim,
        intermediate_size=shape.ffn,
        vocab_size=shape.vocab,
        max_position_embeddings=max(shape.positions, shape.seq),
        tie_word_embeddings=shape.tied_embeddings,
        bos_token_id=0,
        eos_token_id=0,
    )


_HF = ("hf_config",)


def load_hf_config(path: str) -> Any:
    """A transformers config from ``config.json`` or its folder (local files only)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ConfigError(
            f"hf_config {path!r}: no such file; give a Hugging Face config.json or its folder", params=_HF
        )
    try:
        data = loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"hf_config {path!r} is not valid JSON ({e.msg}); give a Hugging Face config.json", params=_HF
        ) from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise ConfigError(
            f"hf_config {path!r} has no 'model_type'; give a Hugging Face config.json", params=_HF
        )
    require_transformers("hf_config", params=_HF)
    from transformers import AutoConfig

    try:
        return AutoConfig.for_model(**data)
    except Exception as e:  # ValueError, KeyError, huggingface_hub's strict-field errors: the file's fault
        raise ConfigError(
            f"hf_config {path!r}: transformers cannot read it ({_short(e)}); fix that field in the file",
            params=_HF,
        ) from None


HF_ERROR_CHARS = 300
"""The most of a transformers error a message quotes: an unknown model_type lists every one it knows (12 kB)."""


def _short(e: BaseException) -> str:
    """``e`` on one line (a strict-field error names the field on its first line and the rule on the next), cut
    at :data:`HF_ERROR_CHARS`."""
    text = " ".join(f"{type(e).__name__}: {e}".split())
    return text if len(text) <= HF_ERROR_CHARS else text[: HF_ERROR_CHARS - 1] + "…"


def check_hf_buildable(path: str) -> None:
    """ConfigError unless transformers reads ``path`` and builds its causal LM: on the meta device (no memory, no
    weights), in this process, before any probe starts (a field of the wrong type or an unknown activation
    otherwise fails in the child, seconds in). An error of the meta device itself (a model whose init reads a
    tensor's value) is left for the probe to meet."""
    import torch
    from transformers import AutoModelForCausalLM

    config = load_hf_config(path)
    auto: Any = AutoModelForCausalLM
    try:
        with torch.device("meta"):
            auto.from_config(config)
    except (TypeError, ValueError, KeyError, AttributeError, IndexError, ZeroDivisionError) as e:
        raise ConfigError(
            f"hf_config {path!r}: transformers cannot build its model ({_short(e)}); check the file's fields "
            "against the model family's config (types, activation names, sizes)",
            params=_HF,
        ) from None
    except Exception:  # noqa: BLE001 - the meta device's own limits: the probe builds it for real
        return


def hf_model(config: Any, dtype: torch.dtype, device: torch.device, seed: int) -> Any:
    """A causal LM of ``config`` with random weights (seeded), initialised on ``device``, in ``dtype``."""
    import torch
    from transformers import AutoModelForCausalLM

    auto: Any = AutoModelForCausalLM  # transformers' factory methods carry no annotations
    torch.manual_seed(seed)
    with torch.device(device):  # initialise where it will run (large models are slow to initialise on a CPU)
        model = auto.from_config(config)
    return model.to(dtype=dtype)


class HFDecoder:
    """prefill/decode_step over a Hugging Face causal LM's ``past_key_values``."""

    def __init__(self, model: Any) -> None:
        self.model = model
        """The transformers causal LM."""

    def prefill(self, tokens: torch.Tensor, *, capacity: int | None = None) -> tuple[torch.Tensor, Any]:
        """Logits of the prompt's last position and the cache (``capacity`` is unused: HF caches grow)."""
        import torch

        with torch.no_grad():
            try:
                out = self.model(input_ids=tokens, use_cache=True, logits_to_keep=1)
            except TypeError:
                out = self.model(input_ids=tokens, use_cache=True)
        return out.logits[:, -1], out.past_key_values

    def decode_step(self, token: torch.Tensor, cache: Any) -> tuple[torch.Tensor, Any]:
        """Logits after one more token per sequence, and the grown cache."""
        import torch

        with torch.no_grad(), warnings.catch_warnings():
            # transformers >= 5.2x renames past_key_values to cache (with a FutureWarning); older
            # releases (a GPU machine's) only know past_key_values
            warnings.simplefilter("ignore", FutureWarning)
            out = self.model(input_ids=token.view(-1, 1), past_key_values=cache, use_cache=True)
        return out.logits[:, -1], out.past_key_values
