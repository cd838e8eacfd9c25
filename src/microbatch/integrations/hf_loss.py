"""How a Hugging Face Trainer's loss is normalised: a share of the step (divided by ``num_items_in_batch``: the
pieces of a split step add up) or a per-batch mean (weighted by its items), read from the Trainer's settings and the
model's source, or measured once for a ``compute_loss`` of the user's own. Split from
:mod:`microbatch.integrations.hf`, whose :func:`~microbatch.integrations.hf.split_on_oom` and
:func:`~microbatch.integrations.hf.tune_trainer` ask it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = [
    "forward_normalises",
    "items_of",
    "loss_identity",
    "loss_is_scaled",
    "mean_taken_as_share",
    "own_compute_loss",
    "own_copy",
    "own_loss_is_mean",
]


def _added_undivided(trainer: Any) -> bool:
    """Whether transformers adds the micro-batches' losses undivided by the accumulation steps, taking each as
    normalised by ``num_items_in_batch``: the model takes loss kwargs, and no ``loss_is_scaled_for_ga`` or
    ``compute_loss_func`` says otherwise (the rule :func:`mean_taken_as_share` and :func:`own_loss_is_mean` share)."""
    return (
        getattr(trainer, "loss_is_scaled_for_ga", None) is None
        and bool(getattr(trainer, "model_accepts_loss_kwargs", False))
        and getattr(trainer, "compute_loss_func", None) is None
    )


def mean_taken_as_share(trainer: Any) -> bool:
    """Whether transformers would take the model's per-batch mean for a loss normalised by ``num_items_in_batch``
    and leave it undivided by the accumulation steps (its rule: the forward has ``**kwargs``), though the forward
    does not hand them to its loss (:func:`forward_normalises` False: BERT's heads, T5, the generic classification
    heads), with no ``loss_is_scaled_for_ga``, ``compute_loss_func``, label smoothing or ``compute_loss`` of the
    user's own to say otherwise."""
    return (
        _added_undivided(trainer)
        and getattr(trainer, "label_smoother", None) is None
        and not own_compute_loss(trainer)
        and forward_normalises(trainer.model) is False
    )


def own_loss_is_mean(trainer: Any, make_inputs: Callable[[], Any]) -> bool:
    """Whether a ``compute_loss`` of the user's own returns a per-batch mean (it does not move with
    ``num_items_in_batch``: :func:`_normalised_by_items`) where transformers would take it as normalised and add the
    micro-batches' losses undivided (``model_accepts_loss_kwargs``, no ``loss_is_scaled_for_ga`` or
    ``compute_loss_func`` to say otherwise); measured once per Trainer, as a split step reads it, on the batch
    ``make_inputs()`` gives, made only then and under the random state it leaves as it found (a DataLoader's iterator
    draws its seed from it: the training after would differ)."""
    import torch

    if not (own_compute_loss(trainer) and _added_undivided(trainer)):
        return False
    if not hasattr(trainer, "_microbatch_normalised"):
        try:
            with torch.random.fork_rng(devices=[]):
                inputs = make_inputs()
            if not (hasattr(inputs, "keys") and "labels" in inputs):
                return False  # no labels: transformers passes num_items_in_batch None and divides the loss by g itself
            trainer._microbatch_normalised = _normalised_by_items(
                trainer, trainer.model, inputs, torch.tensor(64)
            )
        except Exception:  # noqa: BLE001 - the user's loss on one row (a BatchNorm, a device): unknown, left as it is
            return False
    return trainer._microbatch_normalised is False


def own_copy(inputs: Any) -> Any:
    """A shallow copy of a batch mapping (a dict, transformers' ``BatchEncoding``) for one ``compute_loss`` call: the
    Trainer hands each step a fresh batch, and a ``compute_loss`` that pops from it (``labels = inputs.pop("labels")``,
    transformers' own documented pattern) found the key gone on the probe's second call of the same batch (a review,
    2026-12-08); anything else as it is."""
    copy = getattr(inputs, "copy", None)
    return copy() if callable(copy) and hasattr(inputs, "keys") else inputs


def loss_identity(trainer: Any) -> str:
    """What decides a Trainer's loss beyond the probe's own code, for the tune cache's key: its class's
    ``compute_loss``, its ``compute_loss_func`` and its label smoothing (a review: every Trainer's probe is the same
    closure, and a subclass whose loss ran three more forwards was given the plain Trainer's cached curve)."""
    from microbatch.choose.tune.cache import callable_identity

    smoother = getattr(trainer, "label_smoother", None)
    return " | ".join((
        callable_identity(getattr(type(trainer), "compute_loss", None)) or "",
        callable_identity(getattr(trainer, "compute_loss_func", None)) or "",
        f"{type(smoother).__name__}({getattr(smoother, 'epsilon', '')})" if smoother is not None else "",
    ))  # fmt: skip


def loss_is_scaled(trainer: Any, num_items_in_batch: Any, model: Any, inputs: Any) -> tuple[bool, bool, bool]:
    """``(shares, divided, assumed)``: whether the Trainer's loss is each piece's share of the step (normalised by
    ``num_items_in_batch``: the pieces' losses add up) rather than a per-piece mean (weighted by its items); whether
    the step divides it by the gradient-accumulation steps, as the unsplit ``training_step`` would; and whether the
    first is only assumed.

    The Trainer's ``loss_is_scaled_for_ga`` when set decides both (transformers 5.x: a subclass computing its own
    loss says so). Otherwise the Trainer divides by the accumulation steps unless transformers' rule holds — the model
    takes loss kwargs and the Trainer passes ``num_items_in_batch``, or a ``compute_loss_func`` is given — and the
    split does as the Trainer does, so a split step's gradient is the unsplit step's. Where the rule says shares, or
    under a ``compute_loss`` of the user's own (a subclass overriding it), the loss is measured once
    (:func:`_normalised_by_items`): a share where it halves when ``num_items_in_batch`` doubles (a causal LM's
    ``loss_function``, a wrapper of ``super()``, TRL's), a per-piece mean where it does not move (weighted by
    ``count_fn``'s items, or the labels'): transformers takes every model whose ``forward`` has ``**kwargs`` as taking
    the loss kwargs, yet BERT's and RoBERTa's heads, T5 and a hundred more average with their own
    ``CrossEntropyLoss`` (added as shares, two pieces gave twice the gradient). Where the measurement cannot tell,
    ``count_fn`` given declares a mean; without it the rule is taken, ``assumed`` under a ``compute_loss`` of the user's
    own (a split step warns once: a per-batch mean taken as a share is counted once per piece)."""
    given = getattr(trainer, "loss_is_scaled_for_ga", None)
    if given is not None:
        return bool(given), not given, False
    rule = bool(
        (getattr(trainer, "model_accepts_loss_kwargs", False) and num_items_in_batch is not None)
        or getattr(trainer, "compute_loss_func", None) is not None
    )  # the test transformers 5.x's training_step makes (no such attributes before 4.46)
    custom = own_compute_loss(trainer)
    if (
        not custom
        and num_items_in_batch is not None
        and (share := _trainer_loss_is_share(trainer, inputs)) is not None
    ):
        return (
            share,
            not rule,
            False,
        )  # label smoothing or compute_loss_func: the Trainer's loss, not the model's
    if not custom and not rule:
        return False, True, False  # the model's own mean per piece, divided by the accumulation steps
    if num_items_in_batch is not None:
        if not hasattr(trainer, "_microbatch_normalised"):  # read or measured once per Trainer
            trainer._microbatch_normalised = (
                _normalised_by_items(trainer, model, inputs, num_items_in_batch)
                if custom
                else forward_normalises(trainer.model)
            )
        if trainer._microbatch_normalised is not None:
            return bool(trainer._microbatch_normalised), not rule, False
    if getattr(trainer, "microbatch_count_fn", None) is not None:
        return False, not rule, False
    return rule, not rule, rule and custom


def _normalised_by_items(trainer: Any, model: Any, inputs: Any, num_items_in_batch: Any) -> bool | None:
    """Whether the Trainer's own ``compute_loss`` divides by ``num_items_in_batch``: run twice without gradients on
    one row, the same random numbers each time (dropout), at N and 2N items. True where the loss halves (a share of
    the step), False where it does not move (a mean of its own), None where it is neither; a row whose loss is not
    finite or 0 (no labels) tells nothing: the next is tried (the first 8 rows). Two one-row forwards a row tried, once
    per Trainer; a ``compute_loss`` that logs as it goes (TRL's token counts) logs them too."""
    import math

    import torch

    from microbatch.run.accumulate.microbatches import split

    cuda = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    for piece in split(inputs, 1)[:8]:
        losses = []
        for times in (1, 2):
            with torch.no_grad(), torch.random.fork_rng(devices=cuda), trainer.compute_loss_context_manager():
                loss = trainer.compute_loss(
                    model, own_copy(piece), num_items_in_batch=num_items_in_batch * times
                )
            losses.append(float(loss.detach().float()) if isinstance(loss, torch.Tensor) else float("nan"))
        a, b = losses
        if math.isfinite(a) and math.isfinite(b) and b != 0:
            ratio = a / b
            return True if abs(ratio - 2.0) < 0.01 else False if abs(ratio - 1.0) < 0.01 else None
    return None


def unwrapped(model: Any) -> Any:
    """The model a wrapper runs: DDP's and FSDP1's ``.module``, ``torch.compile``'s ``._orig_mod``, PEFT's base model
    (``get_base_model()``; transformers unwraps it too, ``unwrap_peft_model``), as deep as they nest. A PEFT model's
    own forward holds no loss: read through it, a generic head was taken as unknown and its pieces added as shares."""
    for _ in range(8):
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if inner is None and callable(getattr(model, "get_base_model", None)):
            inner = model.get_base_model()
        if inner is None or inner is model:
            return model
        model = inner
    return model


def forward_normalises(model: Any) -> bool | None:
    """Whether a Hugging Face model's own ``forward`` hands its loss to ``self.loss_function`` (transformers' loss
    functions divide by ``num_items_in_batch`` when given: a share), read from its source, the same on every rank with
    no forward run (a measurement's forwards would differ between ranks under FSDP); False where it computes a loss of
    its own (BERT's and RoBERTa's heads, T5: ``CrossEntropyLoss()``, a mean); None where the source cannot be read."""
    import inspect

    forward = getattr(type(unwrapped(model)), "forward", None)
    try:
        source = inspect.getsource(forward) if forward is not None else ""
    except (OSError, TypeError):
        return None
    calls = _call_arguments(source, "self.loss_function(")
    if calls:  # a share only where the call passes the Trainer's num_items_in_batch on (**kwargs, or by name)
        return any("**" in args or "num_items_in_batch" in args for args in calls)
    return False if "loss" in source else None


def _call_arguments(source: str, call: str) -> list[str]:
    """The argument text of each ``call`` in ``source`` (to its balanced closing parenthesis). transformers' causal
    LMs pass ``**kwargs`` (num_items_in_batch among them); its generic sequence- and token-classification heads
    (Llama's, Qwen's, Mistral's: ``modeling_layers.py``) and GPT-NeoX's call ``self.loss_function(logits=...,
    labels=..., config=...)`` alone: a per-batch mean."""
    out, at = [], source.find(call)
    while at >= 0:
        depth, i = 1, at + len(call)
        while i < len(source) and depth:
            depth += {"(": 1, ")": -1}.get(source[i], 0)
            i += 1
        out.append(source[at + len(call) : i - 1])
        at = source.find(call, i)
    return out


def _trainer_loss_is_share(trainer: Any, inputs: Any) -> bool | None:
    """Where the Trainer computes the loss itself from the model's outputs: True under a ``compute_loss_func``
    (called with ``num_items_in_batch``: transformers takes its loss as normalised), and under label smoothing of a
    batch with labels where ``LabelSmoother`` takes ``num_items_in_batch`` (transformers 5.x divides by it: a share;
    before, a per-piece mean: False); None where the model's own loss is used."""
    import inspect

    if getattr(trainer, "compute_loss_func", None) is not None:
        return True
    smoother = getattr(trainer, "label_smoother", None)
    if smoother is None or not isinstance(inputs, dict) or "labels" not in inputs:
        return None
    return "num_items_in_batch" in inspect.signature(type(smoother).__call__).parameters


def own_compute_loss(trainer: Any) -> bool:
    """Whether ``trainer``'s class overrides ``transformers.Trainer.compute_loss`` (a loss of the user's own)."""
    from transformers import Trainer

    return getattr(type(trainer), "compute_loss", None) is not Trainer.compute_loss


def items_of(trainer: Any, inputs: Any) -> tuple[Any, bool]:
    """``(count, known)``: what the Trainer's unscaled loss averages over per piece, and whether that is known.

    ``shift_labels`` (given by the collator), or the Trainer's own ``_loss_shifts_labels`` (5.x; True for a
    ``loss_type`` that maps to ``ForCausalLMLoss``) or a ``…ForCausalLM`` class (the shift), or an encoder-decoder or
    a ``…ForTokenClassification`` head (labels aligned, unshifted): known. Otherwise per-token labels are counted
    after the shift every Hugging Face causal LM makes (``labels[..., 1:]``), unknown for a custom loss: a split
    step warns once.
    """
    import torch

    from microbatch.run.accumulate.microbatches import batch_rows

    user = getattr(trainer, "microbatch_count_fn", None)
    if user is not None:
        return user, True
    if "shift_labels" in inputs:
        return (lambda mb: mb["shift_labels"].ne(-100).sum()), True
    labels = inputs.get("labels") if hasattr(inputs, "get") else None
    if not isinstance(labels, torch.Tensor) or labels.dim() < 2:
        return batch_rows, True  # one label per row (or none): a mean over rows
    head = type(
        getattr(trainer.model, "module", trainer.model)
    ).__name__  # DDP's wrapper: the model's own class
    if getattr(getattr(trainer.model, "config", None), "is_encoder_decoder", False) or head.endswith(
        ("ForTokenClassification", "ForMaskedLM")
    ):
        return (lambda mb: mb["labels"].ne(-100).sum()), True
    return (lambda mb: mb["labels"][..., 1:].ne(-100).sum()), bool(
        getattr(trainer, "_loss_shifts_labels", False) or head.endswith("ForCausalLM")
    )
