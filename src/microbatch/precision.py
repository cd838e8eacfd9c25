"""The one table of training precisions: every layer reads its names and rules here.

A precision names the numerics of a training step: half-precision compute with fp32 master
weights (``bf16-mixed``, ``fp16-mixed``; Micikevicius et al. 2018, "Mixed Precision
Training") or fp32 throughout. Byte counts per parameter follow ZeRO §3.1 (Rajbhandari et al.
2020: 2 + 2 + 12 = 16 B with Adam under mixed precision).

``fp8`` runs the linear layers' GEMMs in FP8 (E4M3 forward, E5M2 or E4M3 gradients) with dynamic
scaling, everything else in bf16, as torchao's ``float8`` training (the converter torchtitan uses) and
Transformer Engine do: the weights, gradients, fp32 master weights and Adam state stay as under
``bf16-mixed`` (torchao keeps the high-precision weights and casts per GEMM; the activations saved for
the backward are the bf16 inputs). The scaling recipe (:data:`FP8_RECIPES`) sets the casting
overhead and the GEMM kernel: ``tensorwise`` (one scale per tensor) or ``rowwise`` (one per row), torchao's;
``te-delayed`` and ``te-current``, Transformer Engine's (Megatron-core, NeMo, Megatron-Bridge): casts fused with
their transposes, and the FP8 weights cast once per step and cached over its micro-batches.
Transformer Engine's cached FP8 weights and their transposes (2 B a layer parameter, :func:`weight_cache_bytes`)
are held beside the bf16 ones; FP8 all-gathers are not modelled.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from microbatch.errors import ConfigError

__all__ = [
    "check_gemm_dtype",
    "Precision", "PRECISIONS", "MEASURABLE", "get_precision", "check_precision", "Fp8Recipe", "FP8_RECIPES",
    "get_fp8_recipe", "saves_fp8_inputs", "weight_cache_bytes", "LOSS_DTYPES", "loss_bytes", "LOSS_KERNELS",
    "check_loss_kernel", "LAYER_KERNELS", "check_layer_kernels",
]  # fmt: skip

LOSS_DTYPES = {"fp32": 4, "half": 2}
"""Bytes per logit the loss reads and writes. ``fp32``: the logits upcast before the softmax — Megatron's default
(its vocabulary-parallel cross-entropy runs in fp32 unless ``--fp16-lm-cross-entropy``), torchtitan's loss
(``pred.float()``), Hugging Face's ``ForCausalLMLoss`` (``logits.float()``), and any loss under autocast, which runs
``log_softmax`` and ``nll_loss`` in fp32. ``half``: the model's half logits taken as they are — Megatron's
``--fp16-lm-cross-entropy``, or a loop without autocast whose model is in bf16 (cudnn-frontend's Llama benchmark)."""


def loss_bytes(loss_dtype: str, precision: str = "bf16-mixed") -> int:
    """Bytes per logit of ``loss_dtype`` (:data:`LOSS_DTYPES`); ConfigError for an unknown one, or ``half`` under fp32
    training (its logits are fp32: no half copy exists to take the loss over)."""
    if loss_dtype not in LOSS_DTYPES:
        raise ConfigError(
            f"loss_dtype {loss_dtype!r} is not known; use fp32 (the logits upcast for the loss: Megatron's, "
            "torchtitan's, Hugging Face's and autocast's default) or half (Megatron's fp16_lm_cross_entropy)",
            params=("loss_dtype",),
        )
    if loss_dtype == "half" and get_precision(precision).compute_dtype == "fp32":
        raise ConfigError(
            f"loss_dtype half with precision {precision}: fp32 training's logits are fp32; use loss_dtype fp32 or a "
            "half precision (bf16-mixed, fp16-mixed)",
            params=("loss_dtype", "precision"),
        )
    return LOSS_DTYPES[loss_dtype]


LOSS_KERNELS = {
    "fused": "the loss works in place (Megatron's vocabulary-parallel cross-entropy): the kept logits are its "
    "only copy",
    "eager": "PyTorch's F.cross_entropy (Hugging Face's ForCausalLMLoss, plain loops, torchtitan without a "
    "compiled loss): its backward holds two more copies of the kept logits at the step's peak",
}
"""How the cross-entropy over the vocabulary runs, which sets the memory its backward adds at the step's peak
(:func:`microbatch.predict.activations.loss_backward_bytes`)."""


def _check_kernels(value: str, name: str, known: dict[str, str]) -> str:
    """``value`` when ``known`` has it, else ConfigError naming ``name`` and each choice with what it means."""
    if value not in known:
        raise ConfigError(
            f"{name} {value!r} is not known; use " + "; or ".join(f"{k} ({why})" for k, why in known.items()),
            params=(name,),
        )
    return value


def check_loss_kernel(loss_kernel: str) -> str:
    """``loss_kernel`` when :data:`LOSS_KERNELS` knows it, else ConfigError naming the choices."""
    return _check_kernels(loss_kernel, "loss_kernel", LOSS_KERNELS)


LAYER_KERNELS = {
    "fused": "fused or compiled layers (Megatron's, Transformer Engine's, torch.compile's): Korthikanti et al.'s "
    "count",
    "eager": "Hugging Face transformers' layers run op by op: RMSNorm's fp32 copy and the activation as written keep "
    "more (GPT-2's block 1.75x, Llama's 1.47x the fused count; a ReLU MLP less, its input not kept)",
}
"""What a layer keeps for its backward (:mod:`microbatch.predict.eager_memory`)."""


def check_layer_kernels(layer_kernels: str) -> str:
    """``layer_kernels`` when :data:`LAYER_KERNELS` knows it, else ConfigError naming the choices."""
    return _check_kernels(layer_kernels, "layer_kernels", LAYER_KERNELS)


@dataclass(frozen=True, kw_only=True)
class Precision:
    """One training precision."""

    name: str
    """The name used by every command and config (``bf16-mixed``)."""
    compute_dtype: str
    """The dtype the GEMMs run in, as the roofline and the accelerator table name it."""
    weight_bytes: int
    """Bytes per parameter of the weights used in compute (2 for half, 4 for fp32)."""
    master_copy: bool
    """Whether an fp32 master copy of the weights is kept (mixed precision)."""
    measurable: bool
    """Whether the probes can run it on this code path (torch autocast on CPU and CUDA)."""
    description: str
    """One line for ``--help``."""
    gemm_dtype: str | None = None
    """The dtype the linear layers' GEMMs run in when it differs from ``compute_dtype`` (``fp8``)."""


PRECISIONS: dict[str, Precision] = {
    p.name: p
    for p in (
        Precision(
            name="bf16-mixed",
            compute_dtype="bf16",
            weight_bytes=2,
            master_copy=True,
            measurable=True,
            description="bfloat16 compute, fp32 master weights",
        ),
        Precision(
            name="fp16-mixed",
            compute_dtype="fp16",
            weight_bytes=2,
            master_copy=True,
            measurable=False,
            description="float16 compute with loss scaling, fp32 master weights",
        ),
        Precision(
            name="fp32",
            compute_dtype="fp32",
            weight_bytes=4,
            master_copy=False,
            measurable=True,
            description="fp32 throughout",
        ),
        Precision(
            name="fp8",
            compute_dtype="bf16",
            gemm_dtype="fp8",
            weight_bytes=2,
            master_copy=True,
            measurable=False,
            description="FP8 linear GEMMs (torchao float8 / Transformer Engine), bf16 elsewhere, fp32 master weights",
        ),
    )
}
"""Every precision the planner knows, by name."""

MEASURABLE: tuple[str, ...] = tuple(n for n, p in PRECISIONS.items() if p.measurable)
"""The precisions a probe can measure (``tune``, ``validate``)."""


def get_precision(name: str, *, measurable: bool = False, what: str = "precision") -> Precision:
    """The precision called ``name``; ``measurable=True`` also requires that probes can run it.

    Raises :class:`ConfigError` naming the value and the choices.
    """
    allowed = MEASURABLE if measurable else tuple(PRECISIONS)
    if name not in allowed:
        extra = f" ({name} is planned but not measured)" if measurable and name in PRECISIONS else ""
        raise ConfigError(f"{what} {name!r} is not known{extra}; use one of {', '.join(allowed)}")
    return PRECISIONS[name]


def check_precision(name: str, *, measurable: bool = False, what: str = "precision") -> str:
    """``name`` if it is a known (and, with ``measurable``, measurable) precision; else ConfigError."""
    return get_precision(name, measurable=measurable, what=what).name


@dataclass(frozen=True, kw_only=True)
class Fp8Recipe:
    """One FP8 scaling recipe: what its casts cost and how fast its GEMM kernel runs."""

    name: str
    """``tensorwise`` or ``rowwise`` (torchao ``Float8LinearConfig.from_recipe_name``; torchtitan
    ``--quantize.linear.float8.recipe_name``)."""
    backward_amax: bool
    """Whether the backward's transposed operands need their own amax pass (rowwise scales run along the
    other axis of the transpose; one tensorwise scale serves both)."""
    amax_pass: bool = True
    """Whether each cast first reads its tensor for the absolute maximum (dynamic or current scaling: torchao,
    TE's ``Float8CurrentScaling``); delayed scaling takes the scale from an amax history the cast kernel
    updates (TE's ``DelayedScaling``), no extra read."""
    fused_transpose: bool = False
    """Whether the cast writes the FP8 tensor and its transpose in one pass (TE's ``fp8_cast_transpose_fused``,
    ``module/linear.py`` from v1.4), so the backward reads no transposed copy of its own."""
    weight_cache: bool = False
    """Whether the FP8 weights (and their transposes) are cast on a step's first micro-batch and cached for the
    rest (TE's ``is_first_microbatch``: "allows caching of the FP8 versions of the weights"; Megatron-core's TE
    layers pass it, ``extensions/transformer_engine.py``)."""
    saves_fp8_inputs: bool = False
    """Whether the linear layers keep their inputs for the weight gradient as the FP8 casts (1 B) instead of the
    bf16 tensors: Transformer Engine's (``module/linear.py`` v1.8 saves ``inputmat``, the cast, under FP8;
    ``layernorm_mlp.py`` saves ``ln_out`` as uint8 and the activation's output in FP8, ``fc1_out`` in bf16);
    torchao's ``Float8Linear`` saves the high-precision input and casts again in the backward."""
    gemm_factor: float
    """Share of the tensorwise FP8 GEMM rate its kernel reaches. 1 for both recipes: no kernel-level
    measurement of row-wise-scaled FP8 GEMMs is cited or measured here, so the rowwise kernel's own
    slowdown is not modelled (its extra amax passes over the transposed operands are,
    :mod:`microbatch.predict.fp8`), and a rowwise step time is optimistic by that slowdown. A factor
    fitted to torchtitan's published FP8 step times was tried and removed: those runs are held out
    (issue 28) and no constant is fitted to a step time. ``bench/gpu_microbench.py`` on a lent GPU is
    where a measured value would come from."""
    description: str
    """One line for ``--help``."""


FP8_RECIPES: dict[str, Fp8Recipe] = {
    r.name: r
    for r in (
        Fp8Recipe(name="tensorwise", backward_amax=False, gemm_factor=1.0,
                  description="one dynamic scale per tensor (fastest)"),
        Fp8Recipe(name="rowwise", backward_amax=True, gemm_factor=1.0,
                  description="one dynamic scale per row (more accurate, slower kernels)"),
        Fp8Recipe(name="te-delayed", backward_amax=False, amax_pass=False, fused_transpose=True, weight_cache=True,
                  saves_fp8_inputs=True, gemm_factor=1.0, description="Transformer Engine's delayed scaling (NeMo, Megatron's default)"),
        Fp8Recipe(name="te-current", backward_amax=False, fused_transpose=True, weight_cache=True,
                  saves_fp8_inputs=True, gemm_factor=1.0,
                  description="Transformer Engine's current scaling (Megatron-Bridge FP8-CS)"),
    )
}  # fmt: skip
"""The FP8 scaling recipes the planner knows."""


def check_gemm_dtype(precision: str, accelerator: str, peaks: Iterable[str]) -> None:
    """ConfigError when ``precision`` runs its GEMMs in a dtype ``accelerator`` has no peak for (``peaks``:
    the dtypes it has one for): fp8 needs FP8 tensor cores."""
    have = list(peaks)
    if get_precision(precision).gemm_dtype == "fp8" and "fp8" not in have:
        raise ConfigError(
            f"precision fp8 needs FP8 tensor cores; {accelerator} has none (peaks for {', '.join(have)}); use "
            "precision bf16-mixed, or an accelerator with an fp8 peak (Hopper, Ada, Blackwell, MI300X)",
            params=("precision",),
        )


def get_fp8_recipe(name: str) -> Fp8Recipe:
    """The recipe called ``name``; ConfigError naming the choices."""
    if name not in FP8_RECIPES:
        raise ConfigError(f"fp8 recipe {name!r} is not known; use one of {', '.join(FP8_RECIPES)}")
    return FP8_RECIPES[name]


def saves_fp8_inputs(precision: str, fp8_recipe: str) -> bool:
    """Whether ``precision`` runs FP8 GEMMs under a recipe whose linear layers save their inputs in FP8
    (:attr:`Fp8Recipe.saves_fp8_inputs`)."""
    return get_precision(precision).gemm_dtype == "fp8" and get_fp8_recipe(fp8_recipe).saves_fp8_inputs


def weight_cache_bytes(precision: str, fp8_recipe: str) -> int:
    """Bytes per layer parameter of FP8 weight copies kept through a step: 2 (the FP8 weight and its transpose,
    each 1 B) where ``precision`` is fp8 and its recipe caches them over the micro-batches (Transformer Engine's,
    :attr:`Fp8Recipe.weight_cache`), else 0. The embedding and output layer are not TE linears: not counted."""
    if get_precision(precision).gemm_dtype != "fp8":
        return 0
    return 2 if get_fp8_recipe(fp8_recipe).weight_cache else 0
