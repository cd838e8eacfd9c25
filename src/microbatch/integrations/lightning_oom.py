"""Lightning: :class:`SplitOnOOM`, a callback that keeps training through out-of-memory, exactly.

From ``on_train_start`` to the end of fit it replaces ``training_step`` on the module instance with
one that runs the batch through :func:`microbatch.run.accumulate.accumulate` with a controller and
hands Lightning's backward the whole batch's gradient, so every ``.grad`` the hooks, the clipping
and the optimizer see equals one backward of the whole batch. How it fits Lightning's closure, what
the loss must be, what is refused and what it costs: ``docs/integrations.md`` (Lightning: SplitOnOOM).
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from microbatch.errors import ConfigError
from microbatch.integrations.lightning_logged import LoggedState, piece_logging
from microbatch.run.accumulate.controller import MicroBatchController

__all__ = ["SplitOnOOM", "CallbackBase", "loss_of"]

if TYPE_CHECKING:
    from lightning.pytorch.callbacks import Callback as CallbackBase
else:
    try:  # the callbacks are real Lightning Callbacks when Lightning is installed
        from lightning.pytorch.callbacks import Callback as CallbackBase
    except ImportError:  # pragma: no cover - Lightning is optional
        CallbackBase = object

REDUCTIONS = ("mean", "sum")


def _check_trainer(trainer: Any, pl_module: Any) -> None:
    """ConfigError for the setups where Lightning's step is not one ``backward`` of the loss returned."""
    if not pl_module.automatic_optimization:
        raise ConfigError(
            "SplitOnOOM wraps Lightning's automatic optimization; this module sets automatic_optimization = False. "
            "With manual optimization, call microbatch.accumulate(self, batch, loss_fn, controller="
            "MicroBatchController(initial=b_m)) in training_step and then step the optimizer yourself (the "
            "README's 'Keep training through out-of-memory')"
        )
    strategy = trainer.strategy
    names = {c.__name__ for c in type(strategy).__mro__}
    if "SingleDeviceStrategy" not in names or "XLA" in type(strategy).__name__:
        raise ConfigError(
            f"SplitOnOOM runs under a single-device strategy only, got {type(strategy).__name__}: under DDP "
            "Lightning calls training_step inside DDP's forward and the backward outside it, and FSDP and "
            "DeepSpeed run their own backward, so the pieces' backward cannot be placed exactly; train on one "
            "device (devices=1), or across several with a loop of your own calling microbatch.accumulate(ddp_model, "
            "..., controller=...) (ranks agree on every split)"
        )
    if getattr(trainer.precision_plugin, "scaler", None) is not None:
        raise ConfigError(
            f"SplitOnOOM cannot split under precision={trainer.precision!r}: fp16 with a gradient scaler scales "
            "the loss in its backward and skips steps with inf gradients, which pieces run outside its backward "
            "would not match; use precision='bf16-mixed' or '32-true'"
        )


def loss_of(out: Any, caller: str, where: str = "") -> Any:
    """The loss tensor a LightningModule's ``training_step`` returned (the tensor, or a dict's ``"loss"``);
    a ConfigError naming ``caller`` when there is none (automatic optimization needs one to back-propagate)."""
    loss = out.get("loss") if isinstance(out, Mapping) else out
    if loss is None:
        raise ConfigError(
            f"training_step returned no loss (None, or a dict without 'loss'){where}; {caller} needs the loss "
            "tensor that Lightning's automatic optimization would back-propagate (skipping a batch is not supported)"
        )
    return loss


class SplitOnOOM(CallbackBase):
    """Redo a training step that runs out of memory with smaller pieces of its batch, same gradient.

    ``controller``: a :class:`~microbatch.run.accumulate.controller.MicroBatchController` to keep across fits
    (its ``step_counter`` is set to ``trainer.global_step`` if it has none); None (the default)
    makes one at the first batch, starting at the batch's rows (whole batches until the first
    out-of-memory), growing back after ``grow_after`` clean optimizer steps (None: never).
    ``count_fn(batch) -> items``: what the loss is a mean over (default: the rows). ``reduction``:
    ``"mean"`` (the default) or ``"sum"``, how ``training_step``'s loss reduces over the batch.

    After fit starts: :attr:`controller` (``controller.summary()`` is JSON-ready for logging).
    """

    def __init__(
        self,
        controller: MicroBatchController | None = None,
        *,
        grow_after: int | None = None,
        count_fn: Callable[[Any], Any] | None = None,
        reduction: str = "mean",
    ) -> None:
        if controller is not None and not isinstance(controller, MicroBatchController):
            raise ConfigError(
                f"controller must be a MicroBatchController or None, got {type(controller).__name__}; make one "
                "with microbatch.MicroBatchController(initial=b_m), or leave it out"
            )
        if controller is not None and grow_after is not None:
            raise ConfigError(
                f"grow_after={grow_after!r} with a controller: the controller holds it; give "
                "MicroBatchController(initial, grow_after=...) or no controller"
            )
        if grow_after is not None:
            MicroBatchController(1, grow_after=grow_after)  # the controller's own check of the value
        if count_fn is not None and not callable(count_fn):
            raise ConfigError(f"count_fn must be callable (batch -> items), got {type(count_fn).__name__}")
        if reduction not in REDUCTIONS:
            raise ConfigError(
                f"reduction must be one of {', '.join(map(repr, REDUCTIONS))}, got {reduction!r}"
            )
        self.controller = controller
        """The controller (made at the first batch when none was given)."""
        self.grow_after = grow_after
        self.count_fn = count_fn
        self.reduction = reduction
        self._module: Any = None
        self._counts_for: Any = None  # the trainer whose global_step this callback gave the controller
        self._before: Any = None  # what the module's __dict__ held as training_step before the wrap
        self._warned = False  # the per-token warning, once per callback

    def setup(self, trainer: Any, pl_module: Any, stage: str | None = None) -> None:
        """Check everything that can be checked before training."""
        if stage in (None, "fit"):
            _check_trainer(trainer, pl_module)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        """Replace ``training_step`` on the module instance (after other callbacks' ``on_fit_start`` probes)."""
        _check_trainer(trainer, pl_module)
        self._unwrap()
        ctrl = self.controller
        if ctrl is not None and (ctrl.step_counter is None or self._counts_for is not None):
            ctrl.step_counter = lambda: int(trainer.global_step)  # this fit's trainer (a new fit, a new one)
            self._counts_for = trainer
        original = pl_module.training_step
        callback = self

        def training_step(module: Any, *args: Any, **kwargs: Any) -> Any:
            return callback._step(trainer, module, original, args, kwargs)

        sig = inspect.signature(original)  # Lightning reads it to decide whether to pass batch_idx
        self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
        training_step.__signature__ = sig.replace(parameters=[self_param, *sig.parameters.values()])  # type: ignore[attr-defined]
        self._module, self._before = pl_module, pl_module.__dict__.get("training_step")
        pl_module.training_step = types.MethodType(training_step, pl_module)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        """Put the module's own ``training_step`` back."""
        self._unwrap()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        """Put the module's own ``training_step`` back."""
        self._unwrap()

    def teardown(self, trainer: Any, pl_module: Any, stage: str | None = None) -> None:
        """Put the module's own ``training_step`` back."""
        self._unwrap()

    def _unwrap(self) -> None:
        module, self._module = self._module, None
        if module is None:
            return
        if self._before is None:
            module.__dict__.pop("training_step", None)
        else:
            module.training_step = self._before
        self._before = None

    def _step(
        self, trainer: Any, module: Any, original: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        import torch

        from microbatch.run.accumulate import accumulate
        from microbatch.run.accumulate.microbatches import batch_rows

        if not args:
            raise ConfigError(
                "training_step was called without a batch; SplitOnOOM splits the first argument"
            )
        batch, rest = args[0], args[1:]
        rows = batch_rows(batch)  # ConfigError for a batch it cannot split, before any forward
        count, total = _counted(self.count_fn, batch, rows)
        if self.controller is None:
            self.controller = MicroBatchController(
                rows, grow_after=self.grow_after, step_counter=lambda: int(trainer.global_step)
            )
            self._counts_for = trainer
        mean = self.reduction == "mean"
        extra: dict[str, Any] = {}
        dict_out = False
        params = [p for p in module.parameters() if p.requires_grad]
        like = params[0] if params else torch.zeros(())  # the stand-in zero loss's dtype and device

        def share(mb: Any) -> float:
            return float(count(mb)) / total

        logged, splits = LoggedState.take(trainer, module), self.controller.splits

        def loss_fn(_: Any, mb: Any) -> tuple[Any, float]:
            nonlocal dict_out, splits
            if (
                self.controller is not None and self.controller.splits != splits
            ):  # a redo: the failed attempt's
                splits = self.controller.splits  # logs and metric updates go (lightning_logged)
                logged.restore()
            w = share(mb)
            if w > 0.0:
                extra.clear()  # a failed piece's outputs go before the next forward, not after it
            # a piece with no items still runs, as the unsplit step ran its rows: its dropout draws keep the random
            # stream where the unsplit step leaves it, and a loss's terms that are not per item count under "sum"
            weight = None if self.count_fn is None else rows * w  # the piece's size for an epoch mean
            with piece_logging(trainer, mb, weight, module):
                out = original(mb, *rest, **kwargs)
            loss = loss_of(out, "SplitOnOOM", " for a piece of the batch")
            if w == 0.0 and (mean or not bool(torch.isfinite(loss.detach()).all())):
                # weighted by no items (or a mean over none, nan): it adds nothing to the gradient
                return torch.zeros((), dtype=like.dtype, device=like.device, requires_grad=True), 0.0
            if isinstance(out, Mapping):
                dict_out = True
                # detached, as Lightning keeps a step's extra outputs: no piece's graph outlives its backward
                extra.update((k, _detached(v)) for k, v in out.items() if k != "loss")
            # accumulate returns Σ loss_sum / Σ w with Σ w = 1: the weighted mean, or the plain sum
            return (loss * w if mean else loss), w

        before = [p.grad for p in params]
        for p in params:
            p.grad = None
        try:
            value = accumulate(module, batch, loss_fn, count_fn=share, controller=self.controller)
            grads: list[Any] = [p.grad for p in params]
        except BaseException:
            logged.restore()  # a step given up logs nothing, as the gradient it leaves
            raise
        finally:
            for p, g in zip(params, before, strict=True):
                p.grad = g
        if self.count_fn is None and mean and self.controller.micro_batch_size < rows and not self._warned:
            self._warned = _warn_per_token_labels(batch)
        leaf = value.detach().clone().requires_grad_(True)
        leaf.register_hook(_GradientAdder(params, grads))  # type: ignore[no-untyped-call]  # untyped in torch's stubs
        return {"loss": leaf, **extra} if dict_out else leaf


def _counted(count_fn: Any, batch: Any, rows: int) -> tuple[Any, float]:
    """(the count the pieces are weighted by, the batch's): ``count_fn``'s, or the rows without one or where it finds
    no items at all (a batch of prompts, every label masked: the unsplit step's mean over none is what the loss makes
    it, and the pieces add up to it by rows)."""
    from microbatch.run.accumulate.microbatches import batch_rows

    if count_fn is not None:
        total = float(count_fn(batch))
        if total > 0:
            return count_fn, total
    return batch_rows, float(rows)


def _warn_per_token_labels(batch: Any) -> bool:
    """Warn, and say so, when a split step's batch has per-token labels (:func:`_per_token_labels`) and no count_fn."""
    if not _per_token_labels(batch):
        return False
    import warnings

    warnings.warn(
        "SplitOnOOM split a step whose batch has per-token labels, weighting each piece by its rows "
        "(no count_fn); a loss that is a mean over tokens then gets another gradient than the unsplit "
        "step's; say what it averages over, e.g. SplitOnOOM(count_fn=lambda batch: "
        "(batch['labels'] != -100).sum()) (batch[1] for an (x, y) batch), or labels[..., 1:] for a causal LM that shifts them",
        RuntimeWarning,
        stacklevel=4,
    )
    return True


def _per_token_labels(batch: Any) -> bool:
    """Whether ``batch`` carries labels per token, whose mean loss is over tokens rather than rows: a mapping whose
    ``labels`` has a sequence dimension (the Hugging Face convention), or a tuple or list (Lightning's ``(x, y)``)
    holding an integer tensor with a sequence dimension and the ignored label -100 in it (labels, not inputs)."""
    import torch

    if isinstance(batch, Mapping):
        return getattr(batch.get("labels"), "ndim", 0) >= 2
    if isinstance(batch, (tuple, list)):
        return any(
            isinstance(t, torch.Tensor)
            and t.ndim >= 2
            and not t.is_floating_point()
            and bool((t == -100).any())
            for t in batch
        )
    return False


def _detached(value: Any) -> Any:
    """``value`` with every tensor in it (through dicts, lists and tuples) detached from its graph."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, Mapping):
        return {k: _detached(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_detached(v) for v in value)
    return value


class _GradientAdder:
    """The hook on the returned leaf: adds the batch's gradient × ∂(closure loss)/∂leaf into ``.grad``, once."""

    def __init__(self, params: list[Any], grads: list[Any]) -> None:
        self.params: list[Any] | None = params
        self.grads: list[Any] | None = grads

    def __call__(self, grad: Any) -> None:
        params, grads = self.params, self.grads
        self.params = self.grads = None  # once; and the buffers go with the step
        if params is None or grads is None:
            return
        factor = float(grad)  # 1 / accumulate_grad_batches: Lightning's division of the loss
        for p, g in zip(params, grads, strict=True):
            if g is None:
                continue
            if factor != 1.0:
                g.mul_(factor)
            if p.grad is None:
                p.grad = g
            else:
                p.grad.add_(g)
