"""What the probes read in a user's batch: the default loss (token ids, a mapping of the model's keyword arguments,
an ``(inputs, targets)`` pair refused with the fix) and the tokens a batch holds (an attention mask's ones beside
the ids; none in an image's or a feature sequence's float tensor). Split from :mod:`microbatch.measure.probes`,
which re-exports :func:`default_loss`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from microbatch.errors import ConfigError

if TYPE_CHECKING:
    import torch

__all__ = ["default_loss"]


def default_loss(model: Any, batch: Any) -> torch.Tensor:
    """Loss of one batch: a tensor of token ids → next-token cross-entropy of ``model(batch)``;
    a mapping (a dict, a tokenizer's ``BatchEncoding``) → ``model(**batch)`` and its ``.loss`` (Hugging Face with
    ``labels``), or the output if a scalar. A tuple or list (inputs and targets) is the loss function's to read:
    :func:`_call_on_sequence` says so when the model does not take it whole."""
    import torch

    from microbatch.measure.gpt import next_token_loss

    if isinstance(batch, Mapping):
        out = model(**batch)
    elif isinstance(batch, (tuple, list)):
        out = _call_on_sequence(model, batch)
    else:
        out = model(batch)
    loss = (
        out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
    )  # a plain dict's key too
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(out, torch.Tensor) and out.dim() == 0:
        return out
    logits = out.get("logits", out) if isinstance(out, Mapping) else getattr(out, "logits", out)
    ids = _token_ids(batch.get("input_ids") if isinstance(batch, Mapping) else batch)
    if (
        ids is not None
        and isinstance(logits, torch.Tensor)
        and logits.dim() == 3
        and logits.shape[:2] == ids.shape
    ):
        return next_token_loss(logits, ids)
    if isinstance(out, torch.Tensor):
        return out.float().mean()
    raise ConfigError(
        "cannot find a loss in the model's output; pass loss_fn=lambda model, batch: <scalar loss tensor>"
    )


def _call_on_sequence(model: Any, batch: tuple[Any, ...] | list[Any]) -> Any:
    """``model(batch)`` for a tuple or list batch, a model that cannot take it whole (an ``(x, y)`` pair: which is
    the input, which the target, is the loss function's to say) refused with the fix."""
    try:
        return model(batch)
    except (TypeError, AttributeError, ValueError, RuntimeError, IndexError) as e:
        raise ConfigError(
            f"the batch is a {type(batch).__name__} of {len(batch)} and the model did not take it whole "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else '-'}); the default loss reads a tensor "
            "of token ids or a dict of the model's keyword arguments: pass loss_fn=lambda model, batch: ..., "
            "e.g. torch.nn.functional.cross_entropy(model(batch[0]), batch[1]) for (inputs, targets)"
        ) from e


def _token_ids(batch: Any) -> Any:
    """``batch`` when it is a ``(b, s)`` tensor of token ids (integers), else None: an image's or a sequence of
    features' float tensor holds no tokens (its channels or steps are not a vocabulary's)."""
    import torch

    if (
        isinstance(batch, torch.Tensor)
        and batch.dim() == 2
        and not (batch.is_floating_point() or batch.is_complex())
    ):
        return batch if batch.dtype != torch.bool else None
    return None


def _tokens_in(batch: Any) -> int | None:
    """Tokens in a batch of token ids ``(b, s)`` or a mapping holding them as ``input_ids`` (a dict, a tokenizer's
    ``BatchEncoding``); None otherwise (throughput is then in samples per second). Beside an ``attention_mask`` of
    their shape the tokens are its nonzero entries: a padded batch's padding is not throughput (Hugging Face's
    mask: 1 for a token, 0 for padding)."""
    mapping = isinstance(batch, Mapping)
    ids = _token_ids(batch.get("input_ids") if mapping else batch)
    if ids is None:
        return None
    mask: Any = batch.get("attention_mask") if mapping else None
    whole = isinstance(mask, type(ids)) and not (mask.is_floating_point() or mask.is_complex())
    real = int(mask.count_nonzero()) if whole and tuple(mask.shape) == tuple(ids.shape) else 0
    return real or int(ids.shape[0] * ids.shape[1])  # a mask of no ones: the padded count, not 0 tokens/s
