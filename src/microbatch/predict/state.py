"""Model state per parameter: weights, gradients and optimizer state, and how ZeRO shards them.

The two common mixed-precision conventions are named, not hidden behind one flag:

- ``bf16-mixed`` (or ``fp16-mixed``) with **half-precision gradients**: 2 (weights) + 2
  (gradients) + 12 (fp32 master weights and the two Adam moments) = **16 bytes per parameter**
  (Rajbhandari et al., ZeRO, SC20, §3.1: "K = 12").
- the same with **fp32 gradient accumulation**: 2 + 4 + 12 = **18 bytes** (Megatron-LM,
  Korthikanti et al. 2022 Table 3 note; Megatron's distributed-optimizer doc table).
- ``fp32``: 4 + 4 + 8 (two Adam moments) = 16 bytes.

Frameworks that keep less are named too: **bf16 moments** (``moments="bf16"``: DeepSeek-V3's report §3.3.3
"Low-Precision Storage"; Megatron-Core's precision-aware optimizer ``exp_avg_dtype``/``exp_avg_sq_dtype``; apex's
``DistributedFusedAdam(dtype=bf16)``, NeMo's ``optim.dtype``), and the fp32 master kept as its **16-bit
remainder** under the bf16 weights (``master="remainder"``: apex ``store_param_remainders``, which NeMo's
distributed Adam turns on for bf16 models with fp32 state; Megatron-Core ``store_param_remainders`` with the
precision-aware optimizer, TE ≥ 2.1, bf16 and no FP8 recipe or a delayed one) or **none** (the optimizer updates the bf16 weights themselves: apex with
``dtype`` equal to the model's, ``store_params=False``). NeMo's distributed Adam at its defaults is thus 2 + 4
(its gradient buffer in ``grad_sync_dtype``, = ``dtype`` = fp32) + 2 + 8 = 16 B; NeMo's Nemotron-4 340B
config (``dtype: bf16``, ``grad_sync_dtype: bf16``) 2 + 2 + 0 + 4 = 8 B.

SGD keeps one momentum buffer instead of two moments (``sgd-plain``, torch's default momentum 0, none). ZeRO stage 1 shards the optimizer state
over the d data-parallel replicas (Megatron's *distributed optimizer* is this), stage 2 also the
gradients, stage 3 also the weights. The precisions are :data:`microbatch.precision.PRECISIONS`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from microbatch.errors import ConfigError
from microbatch.microbench_record import ADAMW_RECORDED_BYTES
from microbatch.precision import (
    check_layer_kernels,
    check_loss_kernel,
    get_fp8_recipe,
    get_precision,
    loss_bytes,
)

__all__ = [
    "EAGER_PASSES", "StateSettings", "bf16_fp32_accumulate_bytes", "check_bf16_fp32_grads", "check_bf16_fp32_zero", "reduced_grad_bytes", "RECORDED_TO_PASSES", "GRAD_DTYPES", "MASTER_WEIGHTS", "config_eager_update_bytes", "eager_update_bytes", "MOMENT_DTYPES", "OPTIMIZERS", "PIPELINE_GRAD_REDUCE", "ZERO_STAGES", "bytes_per_param", "config_bytes_per_param", "check_pipeline_grad_reduce", "held_grad_bytes", "model_state_bytes", "check_zero", "resident_zero", "zero_groups", "check_hybrid",
]  # fmt: skip

GRAD_DTYPES = ("half", "fp32", "bf16+fp32")
"""Gradient buffer type under mixed precision: ``half`` (ZeRO paper, 16 B/param), ``fp32`` (Megatron, 18), or
``bf16+fp32``: bf16 gradients from the backward and an fp32 buffer beside them that each micro-batch's are added
into (DeepSpeed's ``BF16_Optimizer``, 20 B/param: :func:`bf16_fp32_accumulate_bytes`)."""
MOMENT_DTYPES = ("fp32", "bf16")
"""The optimizer's moment buffers: fp32 (4 B each) or bf16 (2 B each; DeepSeek-V3, Megatron ``exp_avg_dtype``)."""
MASTER_WEIGHTS = ("fp32", "remainder", "none")
"""Mixed precision's master weights: an fp32 copy (4 B), the 16 bits of it the bf16 weights lack (2 B; apex and
Megatron ``store_param_remainders``), or none (the half weights updated in place)."""
OPTIMIZERS = ("adamw", "sgd", "sgd-plain", "lion")
"""Optimizers with a state-size rule (Adam/AdamW: two moments; SGD with momentum and Lion: one buffer — Lion keeps
only its momentum, Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", Algorithm 2; llm-foundry's
``DecoupledLionW``; ``sgd-plain``: ``torch.optim.SGD`` at its default momentum 0, no state)."""
_BUFFERS = {"adamw": 2, "sgd": 1, "sgd-plain": 0, "lion": 1}

EAGER_PASSES: dict[str, tuple[int, int, int, int]] = {
    "adamw": (4, 2, 8, 6),
    "sgd": (2, 1, 5, 0),
    "sgd-plain": (2, 1, 0, 0),
    "lion": (4, 2, 3, 4),
}
"""Element passes of one unfused optimizer step over each parameter: (the updated copy, the gradient, the state
buffers, the temporaries), each pass one read or one write of one element, counted from the code that runs:

- ``adamw``: torch's ``_multi_tensor_adam`` (``torch/optim/adam.py``, torch 2.x, decoupled decay, the default
  ``foreach`` path): ``_foreach_mul_`` of the weights by 1 − lr·wd (2 passes), ``_foreach_lerp_`` of the first
  moment towards the gradient (m 2, g 1), ``_foreach_mul_`` of the second moment (v 2), ``_foreach_addcmul_`` of g²
  into it (v 2, g 1), ``_foreach_sqrt`` into a temporary (v 1, t 1), ``_foreach_div_`` and ``_foreach_add_`` on it
  (t 4), ``_foreach_addcdiv_`` into the weights (p 2, m 1, t 1): 4, 2, 3 + 5, 6.
- ``sgd``: ``_multi_tensor_sgd`` (``torch/optim/sgd.py``) with momentum: ``_foreach_mul_`` of the buffer (2),
  ``_foreach_add_`` of the gradient into it (buffer 2, g 1), ``_foreach_add_`` of it into the weights (p 2,
  buffer 1). ``sgd-plain``: the last with the gradient (p 2, g 1).
- ``lion``: llm-foundry's ``DecoupledLionW.lionw`` (per tensor): the decay ``mul_`` (p 2), ``exp_avg.lerp(grad)``
  into a temporary (m 1, g 1, t 1), its ``sign_`` (t 2), ``p.add_`` of it (p 2, t 1), ``exp_avg.lerp_(grad)``
  (m 2, g 1).

A fused optimizer (apex's, Megatron's, ``fused=True``) reads and writes each once instead; the unfused rate
``RooflineEfficiency.optimizer_memory`` is measured on an AdamW step and these counts carry it to the others."""


def eager_update_bytes(optimizer: str, updated: float, grad: float, state: float) -> float:
    """Bytes one unfused optimizer step moves per parameter: :data:`EAGER_PASSES` × each tensor's bytes per element
    (``updated``: the copy the step writes, the fp32 master under mixed precision; ``grad``; ``state``: one buffer
    element, temporaries alike). An fp32 AdamW step: 4·4 + 2·4 + (8 + 6)·4 = 80 B."""
    p, g, s, t = EAGER_PASSES[optimizer]
    return p * updated + g * grad + (s + t) * state


RECORDED_TO_PASSES = eager_update_bytes("adamw", 4, 4, 4) / ADAMW_RECORDED_BYTES
"""80/28: a rate counted over the 28 B a bench-gpu ``adamw`` row records (and a calibration saved before the passes
kept) carried to the 80 B an fp32 AdamW step's unfused kernels move."""


ZERO_STAGES = (0, 1, 2, 3)
"""ZeRO stages: none, optimizer state, + gradients, + weights sharded over the data-parallel replicas."""


def bytes_per_param(
    precision: str,
    grad_dtype: str = "half",
    optimizer: str = "adamw",
    moments: str = "fp32",
    master: str = "fp32",
) -> tuple[int, int, int]:
    """(weights, gradients, optimizer state) bytes per parameter before any sharding.

    Mixed precision keeps 2-byte weights, 2- or 4-byte gradients and fp32 master weights (4) plus
    the optimizer's fp32 buffers (Adam: 8; SGD momentum or Lion: 4) — ZeRO §3.1 (16 B with Adam) and
    Megatron (18 B with fp32 gradients). ``moments="bf16"`` halves the buffers; ``master`` keeps the master
    copy as 4 (fp32), 2 (``remainder``) or 0 (``none``) bytes. fp32 keeps 4 + 4 + buffers (no master copy).
    ``grad_dtype="bf16+fp32"`` keeps both: 2 + 4 B of gradients (:func:`check_bf16_fp32_grads`). Ignores 8-bit
    optimizers.
    """
    prec = get_precision(precision)
    _check_state_dtypes(prec.name, prec.master_copy, moments, master)
    if grad_dtype not in GRAD_DTYPES:
        raise ConfigError(
            f"grad dtype {grad_dtype!r} is not known; use 'half' (16 B/param, ZeRO), 'fp32' (18 B/param, Megatron) "
            "or 'bf16+fp32' (20 B/param, DeepSpeed's bf16 optimizer)"
        )
    check_bf16_fp32_grads(grad_dtype, prec.name, moments, master)
    if optimizer not in OPTIMIZERS:
        raise ConfigError(f"optimizer {optimizer!r} is not known; use one of {', '.join(OPTIMIZERS)}")
    if not _BUFFERS[optimizer] and moments != "fp32":  # a setting of buffers the optimizer does not keep
        raise ConfigError(
            f"moments_dtype {moments} sets the optimizer's buffers, and {optimizer} keeps none; drop moments_dtype, or "
            f"use an optimizer with moments ({', '.join(k for k, n in _BUFFERS.items() if n)})",
            params=("moments_dtype", "optimizer"),
        )
    buffers = _BUFFERS[optimizer] * (
        4 if moments == "fp32" else 2
    )  # Lion and SGD: one buffer, plain SGD none
    w = prec.weight_bytes
    if not prec.master_copy:
        return w, w, buffers
    grads = {"half": w, "fp32": 4, "bf16+fp32": w + 4}[grad_dtype]
    return w, grads, {"fp32": 4, "remainder": 2, "none": 0}[master] + buffers


def check_bf16_fp32_grads(
    grad_dtype: str, precision: str, moments: str = "fp32", master: str = "fp32"
) -> None:
    """ConfigError for ``bf16+fp32`` gradients outside what DeepSpeed's ``BF16_Optimizer`` runs
    (``deepspeed/runtime/bf16_optimizer.py``): it asserts bf16 is enabled, keeps an fp32 master partition
    (``fp32_groups_flat_partition``) and steps the wrapped optimizer on it (fp32 moments)."""
    if grad_dtype != "bf16+fp32":
        return
    if precision != "bf16-mixed" or moments != "fp32" or master != "fp32":
        raise ConfigError(
            f"grad_dtype bf16+fp32 is DeepSpeed's bf16 optimizer, which runs bf16 weights with an fp32 master copy "
            f"and fp32 moments; here precision {precision}, moments_dtype {moments}, master_weights {master}: use "
            "precision bf16-mixed with fp32 moments and master weights, or grad_dtype half or fp32",
            params=("grad_dtype", "precision", "moments_dtype", "master_weights"),
        )


def check_bf16_fp32_zero(
    grad_dtype: str, zeros: tuple[int, ...], zero_group: int, hybrid: bool = False
) -> None:
    """ConfigError for ``bf16+fp32`` gradients under a ZeRO stage DeepSpeed does not run them at: its engine picks
    ``BF16_Optimizer`` for a bf16 model accumulating in fp32 at ZeRO 0 or 1 only (``_do_optimizer_sanity_check``:
    stage 1 with ``grad_accum_dtype`` fp32; stage 0, where fp32 is bf16's default accumulation), and the optimizer
    partitions its fp32 master and moments over the data-parallel ranks whatever the stage: ZeRO 1 as priced here
    (ZeRO 0 only where there is one data-parallel rank), over every data-parallel rank (``hybrid``, a shard degree
    below d, is refused: DeepSpeed's optimizer partitions over the whole data-parallel group)."""
    if grad_dtype != "bf16+fp32":
        return
    if hybrid:
        raise ConfigError(
            "grad_dtype bf16+fp32 (DeepSpeed's bf16 optimizer) partitions its fp32 master and moments over every "
            "data-parallel rank, not over shard groups; drop shard_degree, or use grad_dtype half or fp32",
            params=("grad_dtype", "shard_degree"),
        )
    bad = [z for z in zeros if z >= 2 or (z == 0 and zero_group > 1)]
    if bad:
        raise ConfigError(
            f"grad_dtype bf16+fp32 (DeepSpeed's bf16 optimizer) with ZeRO {bad[0]}: DeepSpeed runs it at ZeRO 0 or 1 "
            f"and shards its fp32 master and moments over the {zero_group} data-parallel ranks either way (ZeRO-1 "
            "as it runs); use zero 1, or grad_dtype half or fp32 for ZeRO 2 and 3",
            params=("grad_dtype", "zero"),
        )


def reduced_grad_bytes(grad_dtype: str, grad_bytes: int) -> int:
    """Bytes per parameter of the gradients a reduction moves and an optimizer step reads: the gradients' own
    (``grad_bytes``), but the fp32 buffer's 4 under ``bf16+fp32`` (DeepSpeed all-reduces
    ``get_grads_for_reduction()``, the fp32 flat buffers, and steps with their partition)."""
    return 4 if grad_dtype == "bf16+fp32" else grad_bytes


def bf16_fp32_accumulate_bytes(grad_dtype: str, weight_bytes: int) -> int:
    """Bytes per parameter one micro-batch moves accumulating ``bf16+fp32`` gradients, 5w + 16 = 26 (0 for the other
    gradient types, whose accumulation autograd or a fused wgrad GEMM does within the backward), from DeepSpeed's
    ``BF16_Optimizer`` (``deepspeed/runtime/bf16_optimizer.py``) and its engines: the bf16 gradients zeroed before
    each backward (``clear_lp_grads``: write w), autograd's ``AccumulateGrad`` adding the backward's gradient into
    that existing one in place (read 2w, write w), then ``_update_hp_grad``'s
    ``hp_grad.add_(lp.grad.to(hp_grad.dtype))``: the cast (read w, write 4) and the add (read 4 + 4, write 4)."""
    if grad_dtype != "bf16+fp32":
        return 0
    return 5 * weight_bytes + 16


def _check_state_dtypes(precision: str, master_copy: bool, moments: str, master: str) -> None:
    """ConfigError for a moment or master-weight type not known, or a master setting the precision has no use
    for: fp32 training keeps no master copy; the remainder completes bf16 weights only (fp16 shares no bits)."""
    if moments not in MOMENT_DTYPES:
        raise ConfigError(
            f"moments_dtype {moments!r} is not known; use fp32 (4 B per moment) or bf16 (2 B: DeepSeek-V3, "
            "Megatron exp_avg_dtype)",
            params=("moments_dtype",),
        )
    if master not in MASTER_WEIGHTS:
        raise ConfigError(
            f"master_weights {master!r} is not known; use fp32 (4 B), remainder (2 B: the low 16 bits under "
            "bf16 weights) or none (the half weights updated in place)",
            params=("master_weights",),
        )
    if master != "fp32" and not master_copy:
        raise ConfigError(
            f"master_weights {master} with precision {precision}: fp32 training keeps no master copy; drop "
            "master_weights or give precision bf16-mixed",
            params=("master_weights", "precision"),
        )
    if master == "remainder" and precision == "fp16-mixed":
        raise ConfigError(
            "master_weights remainder completes bf16 weights to fp32 (the low 16 bits); fp16 weights share no "
            "bits with fp32: use master_weights fp32 or none with fp16-mixed, or precision bf16-mixed",
            params=("master_weights", "precision"),
        )


@dataclass(frozen=True, kw_only=True)
class StateSettings:
    """How a step keeps its training state and computes its loss: the fields
    :class:`~microbatch.predict.memory_config.MemoryConfig` and :class:`~microbatch.predict.plan_config.PlanConfig`
    share (each checks them in its own ``__post_init__``)."""

    precision: str = "bf16-mixed"
    """bf16-mixed, fp16-mixed, fp32 or fp8 (:data:`microbatch.precision.PRECISIONS`)."""
    grad_dtype: str = "half"
    """Gradients under mixed precision: half (16 B/param with Adam), fp32 (18 B/param) or bf16+fp32 (20: both,
    DeepSpeed's bf16 optimizer)."""
    optimizer: str = "adamw"
    """adamw, sgd, sgd-plain or lion (:data:`OPTIMIZERS`)."""
    moments_dtype: str = "fp32"
    """The optimizer's moment buffers: fp32 or bf16 (:data:`MOMENT_DTYPES`)."""
    master_weights: str = "fp32"
    """Mixed precision's master copy: fp32, remainder (2 B) or none (:data:`MASTER_WEIGHTS`)."""
    loss_dtype: str = "fp32"
    """The logits the loss reads and keeps: fp32 (upcast) or half (:data:`microbatch.precision.LOSS_DTYPES`)."""
    loss_kernel: str = "fused"
    """fused (in place) or eager (PyTorch's F.cross_entropy: two more copies of the logits in its backward):
    :data:`microbatch.precision.LOSS_KERNELS`."""
    layer_kernels: str = "fused"
    """What a layer keeps for its backward: fused (Korthikanti's count) or eager (transformers' layers op by op, which
    keep more): :data:`microbatch.precision.LAYER_KERNELS`."""
    fp8_recipe: str = "tensorwise"
    """With ``precision="fp8"``: the scaling recipe (:data:`microbatch.precision.FP8_RECIPES`). Transformer Engine's
    (``te-delayed``, ``te-current``) cache the FP8 weights and transposes and save the linear layers' inputs in FP8;
    torchao's keep the weights and the saved activations in bf16."""

    def settings_dict(self) -> dict[str, str | None]:
        """These settings, JSON-ready, in the order declared (the recipe None unless the precision is fp8)."""
        out: dict[str, str | None] = {f.name: getattr(self, f.name) for f in fields(StateSettings)}
        out["fp8_recipe"] = self.fp8_recipe if self.precision == "fp8" else None
        return out

    def check_settings(self) -> None:
        """ConfigError for a setting not known or one the others rule out (the precision and the four state settings:
        :func:`bytes_per_param`; the loss's dtype and kernel; the FP8 recipe)."""
        self.state_bytes_per_param()
        loss_bytes(self.loss_dtype, self.precision)
        check_loss_kernel(self.loss_kernel)
        check_layer_kernels(self.layer_kernels)
        get_fp8_recipe(self.fp8_recipe)
        if self.master_weights == "remainder" and self.precision == "fp8" and self.fp8_recipe != "te-delayed":
            raise ConfigError(
                f"master_weights remainder with precision fp8 and fp8_recipe {self.fp8_recipe}: the remainder is "
                "Megatron-core's precision-aware optimizer (store_param_remainders), which keeps it only without "
                "FP8 or with delayed scaling; use fp8_recipe te-delayed, or master_weights fp32",
                params=("master_weights", "fp8_recipe", "precision"),
            )

    def state_bytes_per_param(self) -> tuple[int, int, int]:
        """(weights, gradients, optimizer) bytes per parameter before sharding (:func:`bytes_per_param`)."""
        return config_bytes_per_param(self)


def config_bytes_per_param(cfg: StateSettings) -> tuple[int, int, int]:
    """:func:`bytes_per_param` of a config's precision, gradient type, optimizer, moments and master weights."""
    return bytes_per_param(
        cfg.precision, cfg.grad_dtype, cfg.optimizer, cfg.moments_dtype, cfg.master_weights
    )


def config_eager_update_bytes(cfg: StateSettings) -> float:
    """:func:`eager_update_bytes` of a config: under mixed precision with a master copy an unfused optimizer is
    torch's, stepping fp32 parameters with fp32 gradients (autocast keeps the parameters in fp32; FSDP's mixed
    precision steps its fp32 shards with gradients cast to them): 4 B each; else the weights and gradients as they
    are held. Each buffer element is ``moments_dtype``'s bytes. The default bf16-mixed AdamW: 80 B."""
    w, g, _ = config_bytes_per_param(cfg)
    master = get_precision(cfg.precision).master_copy and cfg.master_weights != "none"
    state = 4 if cfg.moments_dtype == "fp32" else 2
    return eager_update_bytes(cfg.optimizer, 4 if master else w, 4 if master else g, state)


def model_state_bytes(
    params: float,
    *,
    precision: str = "bf16-mixed",
    grad_dtype: str = "half",
    optimizer: str = "adamw",
    zero: int = 0,
    data_parallel: int = 1,
    moments: str = "fp32",
    master: str = "fp32",
) -> dict[str, float]:
    """Bytes of weights, gradients and optimizer state for ``params`` parameters on one GPU.

    ZeRO (Rajbhandari et al. 2020, Fig. 1): stage 1 divides the optimizer state by d, stage 2
    also the gradients, stage 3 also the weights — 16, 4 + 12/d, 2 + 14/d, 16/d bytes per
    parameter with mixed-precision Adam. Ignores temporary buffers (all-gather, bucket copies).
    """
    check_zero(zero)
    w, g, o = bytes_per_param(precision, grad_dtype, optimizer, moments, master)
    d = data_parallel
    return {
        "weights": params * w / (d if zero >= 3 else 1),
        "gradients": params * g / (d if zero >= 2 else 1),
        "optimizer": params * o / (d if zero >= 1 else 1),
    }


def check_zero(zero: object) -> int:
    """``zero`` if it is a ZeRO stage 0–3, else :class:`ConfigError` naming the stages."""
    if isinstance(zero, bool) or not isinstance(zero, int) or zero not in ZERO_STAGES:
        raise ConfigError(
            f"ZeRO stage {zero!r} is not known; use 0 (none), 1 (optimizer state; = distributed optimizer), "
            "2 (+ gradients) or 3 (+ weights)"
        )
    return zero


PIPELINE_GRAD_REDUCE = ("last", "each")
"""When ZeRO-2/3 under a pipeline reduce-scatters the gradients: after the ``last`` micro-batch's backward
(torch's pipelining, the default) or after ``each`` one, keeping only a shard (FSDP without ``no_sync``: the
Llama 3 report's FSDP, arXiv 2407.21783 §3.3.2, "shards optimizer states and gradients" under its pipeline)."""


def check_pipeline_grad_reduce(
    value: object, pipeline_parallel: int | None = None, zeros: tuple[int, ...] | None = None
) -> str:
    """``value`` if it is one of :data:`PIPELINE_GRAD_REDUCE`, else :class:`ConfigError` naming them; ``each``
    is refused where it would change nothing: without a pipeline (``pipeline_parallel`` 1: ZeRO-2/3 reduce
    every micro-batch there already) or when the ZeRO stages searched (``zeros``, None for all) are all below 2."""
    if value not in PIPELINE_GRAD_REDUCE:
        raise ConfigError(
            f"pipeline_grad_reduce {value!r} is not known; use last (gradients reduce-scattered once, after the "
            "last micro-batch: torch's pipelining) or each (after every micro-batch, a shard kept: FSDP without "
            "no_sync)",
            params=("pipeline_grad_reduce",),
        )
    if value == "each" and pipeline_parallel == 1:
        raise ConfigError(
            "pipeline_grad_reduce each applies under a pipeline (without one ZeRO-2/3 already reduce-scatter "
            "every micro-batch); give pipeline_parallel > 1 or drop it",
            params=("pipeline_grad_reduce", "pipeline_parallel"),
        )
    if value == "each" and zeros and max(zeros) < 2:
        raise ConfigError(
            f"pipeline_grad_reduce each applies to ZeRO 2 or 3 (sharded gradients), not ZeRO {max(zeros)}; "
            "give zero 2 or 3",
            params=("pipeline_grad_reduce", "zero"),
        )
    return str(value)


def resident_zero(zero: int, pipeline_parallel: int, grad_reduce: str = "last") -> int:
    """The ZeRO stage whose sharding holds through a training step: 1 for ZeRO-2/3 under a pipeline (2 when the
    gradients are reduce-scattered after ``each`` micro-batch), else ``zero``.

    ZeRO-2/3 with pipeline stages is FSDP under ``torch.distributed.pipelining`` (torchtitan; DeepSpeed's
    pipeline engine and Megatron-LM take ZeRO ≤ 1): the stage turns off FSDP's gradient sync and its
    resharding after backward for every micro-batch but the last (``backward_maybe_with_nosync``: FSDP
    ``set_requires_gradient_sync(False)``, ``set_reshard_after_backward(False)``) and reduces the gradients
    once, after the last backward (``perform_reduce_grad``), and torchtitan does not reshard after forward
    under PP ("to avoid per-microbatch all-gathers", ``reshard_after_forward = not pp_enabled``). So from the
    first forward to the step's end the stage holds its weights and accumulated gradients whole: ZeRO-1's
    memory (:func:`microbatch.predict.dp_comm.data_parallel_comm` times its one gather and exposed reduce-scatter).
    With ``grad_reduce="each"`` every micro-batch's gradients are reduce-scattered behind its backward and only
    the shard is accumulated (FSDP's default without ``no_sync``; Llama 3's FP32 accumulation over micro-batches),
    the weights still whole from the first forward (not resharded, as both run it): ZeRO-2's memory.
    """
    if pipeline_parallel > 1 and zero >= 2:
        return 2 if grad_reduce == "each" else 1
    return zero


def held_grad_bytes(zero: int, pipeline_parallel: int, grad_reduce: str, stored: int, reduce: int) -> int:
    """Bytes per parameter of the gradients a stage holds through the step, ``stored`` (the gradients' own) but under
    a pipeline with ZeRO-2/3 reducing after the ``last`` micro-batch: FSDP2 then accumulates each unit's unsharded
    gradient in its reduce dtype (``reduce``), not the compute dtype — with gradient sync off, its post-backward
    upcasts the first backward's bf16 gradient to ``reduce_dtype`` and adds each later one to it
    (torch/distributed/fsdp/_fully_shard/_fsdp_param.py ``to_accumulated_grad_if_needed``,
    ``accumulate_unsharded_grad_if_needed``; called from ``_fsdp_param_group.py`` ``post_backward`` when
    ``reduce_grads`` is False): 4 B under torchtitan's fp32 ``mixed_precision_reduce``. A pipeline of one micro-batch
    syncs its only backward (the gradients sharded at once) but is priced the same."""
    if zero >= 2 and pipeline_parallel > 1 and grad_reduce == "last":
        return max(stored, reduce)
    return stored


def zero_groups(
    data_parallel: int, context_parallel: int = 1, shard_degree: int | None = None
) -> tuple[int, int]:
    """(ranks ZeRO shards over, replicas of that shard): (d·c, 1), or under hybrid sharding (HSDP: FSDP's
    ``HYBRID_SHARD``, torchtitan's ``data_parallel_shard_degree`` × ``data_parallel_replicate_degree``)
    (shard_degree·c, d / shard_degree): the state sharded inside groups of shard_degree data-parallel ranks
    (with their context-parallel ranks, as torchtitan's ``dp_shard_cp`` mesh), each group a replica whose
    gradient shards are all-reduced across the replicas. A ConfigError unless shard_degree divides d.
    """
    if shard_degree is None:
        return data_parallel * context_parallel, 1
    if isinstance(shard_degree, bool) or not isinstance(shard_degree, int) or shard_degree < 1:
        raise ConfigError(
            f"shard_degree must be a positive integer, got {shard_degree!r}", params=("shard_degree",)
        )
    if data_parallel % shard_degree:
        ok = [x for x in range(1, data_parallel + 1) if data_parallel % x == 0]
        raise ConfigError(
            f"shard_degree {shard_degree} must divide data_parallel {data_parallel} (each replica is a group of "
            f"shard_degree ranks); use one of {ok[:16]}",
            params=("shard_degree", "data_parallel"),
        )
    return shard_degree * context_parallel, data_parallel // shard_degree


def check_hybrid(shard_degree: int | None, expert_parallel: int, zeros: tuple[int, ...] = ()) -> None:
    """ConfigError when hybrid sharding meets expert parallelism (the experts' state over d/EP is not split
    into hybrid groups here), or only ZeRO 0 (``zeros``: the stages given, () for any), which shards nothing."""
    if shard_degree is not None and shard_degree > 1 and zeros and not any(zeros):
        raise ConfigError(
            f"shard_degree {shard_degree} shards the training state over groups of its ranks, and zero 0 "
            "shards nothing; give zero 1, 2 or 3, or drop shard_degree",
            params=("shard_degree", "zero"),
        )
    if shard_degree is not None and expert_parallel > 1:
        raise ConfigError(
            f"shard_degree {shard_degree} with expert_parallel {expert_parallel}: hybrid sharding of expert "
            "state is not modelled; drop one of them",
            params=("shard_degree", "expert_parallel"),
        )


REDUCE_DTYPES = ("auto", "fp32", "half")
"""The dtype ZeRO-3's gradient reduce-scatter (and HSDP's all-reduce of its shards) moves: ``fp32``, ``half`` (the
16-bit gradients as they are), or ``auto``: fp32 under FSDP2 with a 16-bit compute dtype, as torchtitan runs it
(``apply_fsdp`` passes ``MixedPrecisionPolicy(reduce_dtype=mixed_precision_reduce)``, whose default is
``"float32"``; FSDP2 then allocates its reduce-scatter input in that dtype, ``foreach_reduce``), else the stored
gradients' own dtype (FSDP1's ``MixedPrecision``, DeepSpeed and Megatron reduce what they hold)."""


def reduce_bytes(reduce_dtype: str, zero3_impl: str, grad_bytes: int) -> int:
    """Bytes per gradient element the ZeRO-3 reduction moves (:data:`REDUCE_DTYPES`); ``grad_bytes``: the stored
    gradients' (:func:`bytes_per_param`'s second)."""
    if reduce_dtype not in REDUCE_DTYPES:
        raise ConfigError(
            f"reduce_dtype {reduce_dtype!r} is not known; use one of {', '.join(REDUCE_DTYPES)}",
            params=("reduce_dtype",),
        )
    if reduce_dtype == "fp32" or (reduce_dtype == "auto" and zero3_impl == "fsdp2"):
        return 4
    return min(grad_bytes, 2) if reduce_dtype == "half" else grad_bytes


def zero3_buffer_bytes(unit_params: float, weight_bytes: int, reduce_bytes_: int) -> float:
    """Bytes ZeRO-3 holds beside its shards while a unit (a layer, ``unit_params`` of it on this GPU) runs its
    backward, as FSDP2 runs it (torch/distributed/fsdp/_fully_shard): the unit gathered and the next one prefetched
    (2 × ``weight_bytes``), the unit's unsharded gradients in the weights' dtype (``weight_bytes``), and the previous
    unit's reduce-scatter input in the reduce dtype (``reduce_bytes_``), held until this unit's post-backward frees it
    (``reduce_scatter_max_input_buffers`` 1, ``_fsdp_param_group.py``). The embedding's and the output's larger units
    are not counted apart (a 128K vocabulary's output is two Llama-3-8B layers)."""
    return unit_params * (3 * weight_bytes + reduce_bytes_)
