"""The flags that size a training step's state per parameter: precision, gradient type, optimizer, its moments and
its master weights (:mod:`microbatch.predict.state`), and the logits the loss keeps, shared by ``plan`` and
``memory``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

from microbatch.precision import LAYER_KERNELS, LOSS_DTYPES, LOSS_KERNELS, PRECISIONS
from microbatch.predict.state import GRAD_DTYPES, MASTER_WEIGHTS, MOMENT_DTYPES, OPTIMIZERS

__all__ = [
    "check_layer_kernels_flag",
    "check_zero3_flags",
    "dropout_option",
    "precision_options",
    "state_settings",
]

F = TypeVar("F", bound=Callable[..., Any])


def precision_options(f: F) -> F:
    """``--precision``, ``--grad-dtype``, ``--optimizer``, ``--moments-dtype`` and ``--master-weights``: the bytes of
    training state per parameter (:mod:`microbatch.predict.state`); ``--loss-dtype``: the logits' bytes;
    ``--loss-kernel``: the copies of them the loss's backward adds."""
    opts = [
        click.option(
            "--precision",
            type=click.Choice(list(PRECISIONS)),
            default="bf16-mixed",
            show_default=True,
        ),
        click.option(
            "--grad-dtype",
            type=click.Choice(list(GRAD_DTYPES)),
            default="half",
            show_default=True,
            help="half: 16 B/param with Adam (ZeRO paper); fp32: 18 B/param (Megatron); bf16+fp32: 20 B/param, "
            "bf16 gradients beside an fp32 buffer each micro-batch's are added into (DeepSpeed's bf16 optimizer: "
            "bf16 with grad_accum_dtype fp32 at ZeRO 1; its all-reduce in fp32, after the backward).",
        ),
        click.option(
            "--optimizer", type=click.Choice(list(OPTIMIZERS)), default="adamw", show_default=True,
            help="adamw keeps two moments; sgd (with momentum) and lion one; sgd-plain (torch.optim.SGD's default, "
            "momentum 0) none. Unfused, each is timed by the passes its kernels make.",
        ),  # fmt: skip
        click.option(
            "--moments-dtype", type=click.Choice(list(MOMENT_DTYPES)), default="fp32", show_default=True,
            help="The optimizer's moments: bf16 halves them (DeepSeek-V3; Megatron's precision-aware optimizer "
            "--exp-avg-dtype bf16; NeMo optim.dtype bf16).",
        ),
        click.option(
            "--master-weights", type=click.Choice(list(MASTER_WEIGHTS)), default="fp32", show_default=True,
            help="Mixed precision's master copy: fp32 (4 B), remainder (2 B: the fp32 bits under bf16 weights, "
            "NeMo's distributed Adam; Megatron's precision-aware optimizer under bf16, non-FP8 or delayed-scaling runs) or "
            "none (bf16 weights updated in place).",
        ),
        click.option(
            "--loss-dtype", type=click.Choice(list(LOSS_DTYPES)), default="fp32", show_default=True,
            help="The logits the loss reads and keeps: fp32 (upcast: Megatron's, torchtitan's, Hugging Face's and "
            "autocast's default) or half (Megatron's --fp16-lm-cross-entropy; a bf16 model's loss without autocast).",
        ),
        click.option(
            "--loss-kernel", type=click.Choice(list(LOSS_KERNELS)), default=None,
            help="How the cross-entropy runs: fused (in place: Megatron's vocabulary-parallel loss) or eager "
            "(PyTorch's F.cross_entropy: the Hugging Face Trainer, Lightning and plain loops), whose backward holds "
            "two more copies of the logits at the peak (2 × the logits' bytes: 2·4 B·s·b_m·V/t in fp32). Default: a "
            "--calibration's (tune measures "
            "an eager loss), else fused.",
        ),
        click.option(
            "--layer-kernels", type=click.Choice(list(LAYER_KERNELS)), default="fused", show_default=True,
            help="What a layer keeps for its backward: fused (Megatron's, Transformer Engine's or torch.compile'd "
            "layers: Korthikanti et al.'s count) or eager (Hugging Face transformers' layers run op by op: RMSNorm's "
            "fp32 copy, 4 B an element, and an activation written out, GPT-2's gelu_new 3 tensors of the MLP's "
            "width: measured, 1.47x the count on a Llama layer, 1.75x on GPT-2's), for a model held in its training "
            "dtype; autocast over fp32 weights (the Trainer's bf16=True on an fp32 model) keeps more, not priced: "
            "calibrate. Not with --calibration: its activation line measured your layers.",
        ),
    ]  # fmt: skip
    for opt in reversed(opts):
        f = opt(f)
    return f


dropout_option = click.option(
    "--dropout/--no-dropout", "dropout", default=None, help="Training with dropout (default: the model's)."
)
"""``--dropout/--no-dropout``: the model's dropout on or off (its masks are kept activations, its kernels streamed),
shared by ``plan`` and ``memory`` so the two answer for the same step."""


def state_settings(
    precision: str, grad_dtype: str, optimizer: str, moments_dtype: str, master_weights: str, loss_dtype: str,
    loss_kernel: str | None, layer_kernels: str,
) -> dict[str, Any]:  # fmt: skip
    """The :func:`precision_options` flags as the state settings of ``PlanConfig`` and ``MemoryConfig``
    (:class:`microbatch.predict.state.StateSettings`), the loss fused where none was given."""
    return dict(
        precision=precision, grad_dtype=grad_dtype, optimizer=optimizer, moments_dtype=moments_dtype,
        master_weights=master_weights, loss_dtype=loss_dtype, loss_kernel=loss_kernel or "fused",
        layer_kernels=layer_kernels,
    )  # fmt: skip


def check_layer_kernels_flag(
    layer_kernels: str, calibration: str | None, kernels_flag: str | None = None
) -> None:
    """A ConfigError for ``--layer-kernels eager`` with ``--calibration`` (the calibration's activation line was
    fitted to what the measured layers kept, eager or not, so the eager terms would count the excess twice) or with
    ``kernels_flag`` (``--compile`` or ``--fused-kernels``: layers that keep the fused count)."""
    from microbatch.errors import ConfigError

    if layer_kernels == "eager" and kernels_flag:
        raise ConfigError(
            f"layer_kernels eager with {kernels_flag}: compiled or fused layers keep the fused count (within 5% of "
            "torch.compile on a Hugging Face layer); drop layer_kernels, or drop "
            f"{kernels_flag} to plan transformers' eager layers",
            params=("layer_kernels", kernels_flag.removeprefix("--").replace("-", "_")),
        )
    if layer_kernels == "eager" and calibration:
        raise ConfigError(
            "layer_kernels eager with a calibration: the calibration's activation line was measured on your layers "
            "and already holds what they keep (eager or fused), so the eager terms would count it twice; drop "
            "layer_kernels, or drop the calibration to price transformers' eager layers from the formula",
            params=("layer_kernels", "calibration"),
        )


def check_zero3_flags(zero3_impl: str, zero: str, stages: int = 1) -> None:
    """``plan``'s: a ConfigError when ``--reduce-dtype`` or ``--zero3-impl`` was given where it would change nothing
    (``--zero`` below what they shape, or ``--zero3-impl`` under a pipeline: FSDP2 whatever it says)."""
    from microbatch.commands._common import parse_zero
    from microbatch.commands._schedule_inputs import user_gave
    from microbatch.errors import ConfigError

    if user_gave("reduce_dtype") and zero != "auto" and parse_zero(zero) < (2 if stages > 1 else 3):
        raise ConfigError(
            f"reduce_dtype is what FSDP's reduce-scatter moves (ZeRO 3, or ZeRO 2 under a pipeline), and zero is {zero} "
            "(it would change nothing); give zero 3 (or auto) with it, or drop reduce_dtype",
            params=("reduce_dtype", "zero"),
        )
    if user_gave("zero3_impl") and stages > 1:  # as memory says it
        raise ConfigError(
            f"zero3_impl {zero3_impl} says who runs ZeRO 3, and pipeline_parallel is {stages}: under a pipeline ZeRO "
            "2/3 is FSDP2 under torch's pipelining whatever it says (it would change nothing); drop zero3_impl",
            params=("zero3_impl", "pipeline_parallel"),
        )
    if user_gave("zero3_impl") and zero != "auto" and parse_zero(zero) < 3:
        raise ConfigError(
            f"zero3_impl {zero3_impl} says who runs ZeRO 3, and zero is {zero} (nothing gathered per layer: it would "
            "change nothing); give zero 3 (or auto) with it, or drop zero3_impl",
            params=("zero3_impl", "zero"),
        )
