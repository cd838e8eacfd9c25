"""What the planner plans: a model on an accelerator, a layout, and the choices to search.

:class:`PlanConfig` is validated when it is built (every rule that needs only the config and the
model), so :mod:`microbatch.predict.candidate` and :mod:`microbatch.predict.plan` take it as given.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from microbatch.batch import (
    DEFAULT_KNEE_TOLERANCE,
    check_batch_quantity,
    check_data_parallel,
    check_micro_batch,
)
from microbatch.errors import (
    ConfigError,
    as_tuple,
    check_instance,
    check_positive_int,
    plain_numbers,
    whole_number,
)
from microbatch.hardware import DEFAULT_HEADROOM, Accelerator
from microbatch.model import SHAPE_FIX, ModelShape, check_seq
from microbatch.precision import (
    check_gemm_dtype,
    get_precision,
)
from microbatch.predict.activations import RECOMPUTE_CHOICES
from microbatch.predict.collectives import ZERO3_IMPLS
from microbatch.predict.context import (
    check_context_exchange,
    check_context_layout,
    check_ulysses_heads,
    ulysses_divides,
)
from microbatch.predict.experts import check_expert_layout, ep_group_words, expert_load
from microbatch.predict.memory import MemoryCalibration, MemoryConfig
from microbatch.predict.recompute import check_every_kth
from microbatch.predict.roofline import DEFAULT_EFFICIENCY, RooflineEfficiency
from microbatch.predict.stages import check_unpipelined
from microbatch.predict.state import (
    ZERO_STAGES,
    StateSettings,
    check_bf16_fp32_zero,
    check_hybrid,
    check_pipeline_grad_reduce,
    reduce_bytes,
    zero_groups,
)
from microbatch.schedules.in_flight import served_spec

__all__ = ["PlanConfig", "CHOICES", "PLAN_TOLERANCE", "PLAN_MARGIN"]

CHOICES = ("knee", "fastest")
"""How the planner picks among the candidates that fit: ``knee`` (the default) or ``fastest``."""
PLAN_TOLERANCE = DEFAULT_KNEE_TOLERANCE
"""τ of the planner's knee: the one knee tolerance, 15% of the best, as ``tune``'s default
(:data:`microbatch.batch.DEFAULT_KNEE_TOLERANCE`; the rule and why 0.15 are in ``docs/knee.md``)."""
GPU_FIX = "take a known one with microbatch.hardware.get_accelerator('h100-sxm') or build Accelerator(...) with its figures"
"""The fix named where an accelerator is expected and something else was given."""
_CHOICES = ("schedules", "virtuals", "recompute", "zero", "micro_batches", "layers_per_stage")
"""The fields that list choices (tuples; one value given alone is a tuple of it: :func:`~microbatch.errors.as_tuple`)."""
PLAN_MARGIN = 0.05
"""μ of the planner's knee: the knee must reach (1 − τ)·(1 + μ) of the best, the margin ``tune``
asks when its reference is an estimate it has no fitted error for
(``microbatch.choose.bound.BOUND_MARGIN``; with a fitted bound ``tune`` uses the fit's own error);
a test holds the two equal."""


@dataclass(frozen=True, kw_only=True)
class PlanConfig(StateSettings):
    """What to plan: a model on an accelerator, a layout, and the choices to search."""

    shape: ModelShape
    """The model."""
    gpu: Accelerator
    """The accelerator every rank runs on."""
    global_batch: int
    """B_global: sequences per optimizer step (held fixed)."""
    data_parallel: int = 1
    """d: data-parallel replicas."""
    pipeline_parallel: int = 1
    """p: pipeline stages."""
    tensor_parallel: int = 1
    """t: tensor-parallel ranks."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (needs t > 1)."""
    seq: int | None = None
    """Sequence length; None means the model's."""
    schedules: tuple[str, ...] | None = None
    """Schedules to consider; None means every one that can serve (p, m, v)."""
    virtuals: tuple[int, ...] | None = None
    """v values for interleaved 1F1B; None means every v > 1 with p·v dividing the layers."""
    recompute: tuple[str, ...] | None = None
    """Recompute modes; None means none, selective and full."""
    zero: tuple[int, ...] | None = None
    """ZeRO stages; None means 0–3 when d > 1, else 0."""
    micro_batches: tuple[int, ...] | None = None
    """b_m values; None means every divisor of B/d."""
    layers_per_stage: tuple[int, ...] | None = None
    """An uneven split of layers over stages; None means even."""
    flash_attention: bool | None = None
    """Flash attention; None means the model's setting."""
    memory_headroom: float = DEFAULT_HEADROOM
    """Share of device memory kept free; a candidate fits when peak ≤ capacity × (1 − headroom)."""
    efficiency: RooflineEfficiency = DEFAULT_EFFICIENCY
    """Kernel and link efficiencies (calibratable)."""
    memory_calibration: MemoryCalibration = field(default_factory=MemoryCalibration)
    """Memory corrections (calibratable)."""
    simulate_top: int = 3
    """How many leading candidates to replay with the event simulator; past 0, every other contender for the fastest
    or the knee is replayed too (:func:`microbatch.predict.plan_choice.contenders_simulated`); 0: closed forms only
    (the knee is still replayed under a pipeline)."""
    dp_overlap: bool = True
    """ZeRO 0/1: the data-parallel gradient reduction runs behind the last micro-batch's backward, as
    PyTorch DDP's bucketed all-reduce does (Li et al., "PyTorch Distributed", VLDB 2020, §3.2.3); False:
    after the backward, exposed whole, as Megatron-LM's own DDP did (``DDP_impl='local'``: ``train_step``
    calls ``allreduce_gradients()`` after ``forward_backward_func``; the runs of Narayanan et al. 2021)."""
    grad_clip: bool = True
    """Gradients clipped by their global norm before the update (Megatron's ``clip_grad`` 1.0, torch's
    ``clip_grad_norm_``, DeepSpeed's ``gradient_clipping``, the Hugging Face Trainer's ``max_grad_norm``):
    :func:`microbatch.predict.dp_comm.clip_s` adds its passes to the update."""
    choose: str = "knee"
    """``knee``: among the candidates that fit, the one with the least peak memory whose predicted
    tokens/s reach (1 − tolerance)·(1 + margin) of the fastest (the rule ``tune`` applies to a measured
    curve); ``fastest``: the fastest that fits."""
    tolerance: float = PLAN_TOLERANCE
    """τ of the knee (a fraction of the fastest's tokens/s)."""
    margin: float = PLAN_MARGIN
    """μ of the knee: extra share the knee must reach, for the prediction's error."""
    expert_parallel: int = 1
    """EP: GPUs the routed experts are spread over, inside the data-parallel group (divides d and E);
    the GPUs stay d·p·t (:mod:`microbatch.predict.experts`)."""
    capacity_factor: float | None = None
    """MoE token capacity per expert over the balanced share (GShard); None means dropless."""
    recompute_every: int = 1
    """K: the ``full`` candidates recompute one layer in K (torchtitan ``selective_ac_option = "K"``)."""
    ep_overlap: bool = False
    """MoE all-to-all overlapped with another micro-batch's computation in every schedule (Megatron-core's
    ``--overlap-moe-expert-parallel-comm``); DualPipeV always overlaps it (DeepSeek-V3 §3.2.1)."""
    async_tp: bool = False
    """Tensor-parallel collectives overlapped with their GEMMs (torchtitan's async TP; needs sequence parallel)."""
    context_parallel: int = 1
    """c: GPUs each sequence is split over (exchanged by ``cp_comm``, :mod:`microbatch.predict.context`); the GPUs are
    d·p·t·c and the gradient reduction spans the d·c ranks, as ZeRO does unless ``shard_degree``."""
    shard_degree: int | None = None
    """Hybrid sharding (HSDP): ZeRO shards over groups of this many data-parallel ranks (× c) and the d /
    shard_degree groups all-reduce their gradient shards (:func:`microbatch.predict.state.zero_groups`); None
    shards over all d·c."""
    cp_comm: str = "allgather"
    """How the c ranks exchange K/V (:data:`microbatch.predict.context.CP_EXCHANGES`): ``allgather``, torch's
    ``context_parallel`` and torchtitan's default and Llama 3's; ``ring``, Megatron's ``--cp-comm-type p2p``;
    ``ulysses``, all-to-alls of the heads (DeepSpeed Ulysses, Megatron's ``a2a``)."""
    reduce_dtype: str = "auto"
    """What ZeRO-3's reduce-scatter moves (:data:`microbatch.predict.state.REDUCE_DTYPES`): ``auto`` fp32 under
    ``fsdp2`` (torchtitan's ``mixed_precision_reduce``), the gradients' own dtype otherwise; :attr:`reduce_bytes`."""
    zero3_impl: str = "fsdp2"
    """Who runs ZeRO-3 (:data:`microbatch.predict.collectives.ZERO3_IMPLS`): ``fsdp2`` (PyTorch's
    ``fully_shard``, torchtitan's) copies each gathered layer out on the compute stream
    (:func:`~microbatch.predict.collectives.fsdp2_copy_out_s`); ``fsdp1``, ``deepspeed`` and ``megatron``
    (Megatron-core's FSDP) compute from the gathered buffer. Also ZeRO-2 under a pipeline, which is FSDP under
    ``torch.distributed.pipelining`` (the plan's check line says DeepSpeed and Megatron take ZeRO ≤ 1 there)."""
    parallel_block: bool | None = None
    """Attention and MLP side by side on one input (GPT-J, GPT-NeoX ``use_parallel_residual``, PaLM): one
    tensor-parallel all-reduce (and one sequence-parallel gather) per layer and pass instead of two. None: the shape's
    own ``parallel_block`` (a Hugging Face config that says so); True or False overrides it (:attr:`block_parallel`)."""
    expert_imbalance: float = 1.0
    """Dropless MoE: the most loaded GPU's routed rows over the balanced share (1: even, the assumption)."""
    pipeline_grad_reduce: str = "last"
    """ZeRO-2/3 under a pipeline: gradients reduce-scattered once after the ``last`` micro-batch (torch's
    pipelining) or after ``each`` one behind its backward, only a shard kept (FSDP without ``no_sync``; Llama
    3): :func:`microbatch.predict.state.resident_zero`."""

    def __post_init__(self) -> None:
        for name in _CHOICES:
            object.__setattr__(self, name, as_tuple(name, getattr(self, name)))
        plain_numbers(self)
        self._check_types()
        for name in ("global_batch", "data_parallel"):
            check_batch_quantity(name, getattr(self, name))
        for name in ("pipeline_parallel", "tensor_parallel"):
            check_positive_int(name, getattr(self, name))
        check_data_parallel(self.global_batch, self.data_parallel)
        if not (0 <= self.memory_headroom < 1):
            raise ConfigError(
                f"memory_headroom {self.memory_headroom!r} must be in [0, 1); it is the share of memory kept "
                "free, for example 0.1",
                params=("memory_headroom",),
            )
        if self.seq is not None:
            check_positive_int("seq", self.seq)
            if self.seq != self.shape.seq:
                # as resolve_model does for --seq: refused past a learned position table, and the shape
                # (its position table's parameters) at the planned length, so the API and the CLI agree
                check_seq(self.shape, self.seq)
                object.__setattr__(self, "shape", self.shape.with_seq(self.seq))
        if self.sequence_parallel and self.tensor_parallel == 1:
            raise ConfigError(
                "sequence_parallel needs tensor_parallel > 1; give tensor_parallel or drop sequence_parallel",
                params=("sequence_parallel", "tensor_parallel"),
            )
        self._check_choices()
        self.check_settings()  # the precision, the four state settings, the loss's dtype and kernel, the FP8 recipe
        self._check_eager_layers()
        self._check_virtuals_fit_schedules()  # each v >= 1 first, then one the named schedules run
        self._check_virtuals_split_layers()
        if self.choose not in CHOICES:
            raise ConfigError(f"choose {self.choose!r} is not known; use one of {', '.join(CHOICES)}")
        for name in ("tolerance", "margin"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 <= v < 1):
                raise ConfigError(f"{name} {v!r} must be a fraction in [0, 1), for example 0.15")
        if (1 - self.tolerance) * (1 + self.margin) > 1:
            raise ConfigError(
                f"tolerance {self.tolerance:g} with margin {self.margin:g} asks the knee to beat the fastest "
                f"((1 − τ)·(1 + μ) = {(1 - self.tolerance) * (1 + self.margin):.3f} > 1); lower the margin"
            )
        self._check_issue29_layout()
        if whole_number(self.simulate_top) is None or self.simulate_top < 0:
            raise ConfigError(
                f"simulate_top must be a whole number >= 0, got {self.simulate_top!r}; e.g. 3 (0: simulate none)",
                params=("simulate_top",),
            )
        # the rules that need the model (t | heads, p <= layers, uneven split)
        MemoryConfig(
            micro_batch=1,
            tensor_parallel=self.tensor_parallel,
            pipeline_parallel=self.pipeline_parallel,
            sequence_parallel=self.sequence_parallel,
            layers_per_stage=self.layers_per_stage,
        ).validate_for(self.shape)

    def _check_eager_layers(self) -> None:
        """ConfigError for eager layers' memory beside a memory calibration (fitted to what the measured layers kept:
        counted twice) or fused or compiled elementwise kernels (which keep the fused count): the CLI's rule, here."""
        if self.layer_kernels != "eager":
            return
        why = (
            "a memory calibration, fitted to what the measured layers kept (the excess counted twice)"
            if self.memory_calibration != MemoryCalibration()
            else "fused or compiled elementwise kernels, which keep the fused count"
            if self.efficiency.fused_elementwise
            else None
        )
        if why:
            raise ConfigError(
                f"layer_kernels eager with {why}; drop one of them",
                params=("layer_kernels",),
            )

    def _check_choices(self) -> None:
        """ConfigError for a schedule, recompute or ZeRO choice not known, or a micro-batch that does not divide
        B/d."""
        if self.schedules is not None:  # each one the planner serves, aliases read as their names
            object.__setattr__(
                self, "schedules", tuple(served_spec(s, planned=True).name for s in self.schedules)
            )
        for r in self.recompute or ():
            if r not in RECOMPUTE_CHOICES:
                raise ConfigError(
                    f"recompute {r!r} is not known; use one of {', '.join(RECOMPUTE_CHOICES)}, or recompute=None for "
                    "every one (the command line's auto)"
                )
        for z in self.zero or ():
            if isinstance(z, bool) or z not in ZERO_STAGES:
                raise ConfigError(f"ZeRO stage {z!r} is not known; use 0, 1, 2, 3, or zero=None for every one (the "
                                  "command line's auto)")  # fmt: skip
        for b in self.micro_batches or ():
            check_positive_int("micro_batches", b)
            check_micro_batch(self.global_batch, b, self.data_parallel)
        self._check_no_op_choices()

    def _check_no_op_choices(self) -> None:
        """ConfigError for a choice that cannot apply, rather than a plan that ignores it: a pipeline schedule other
        than 1F1B's label or a v > 1 without pipeline stages, expert overlap on a dense model."""
        check_unpipelined(
            self.pipeline_parallel,
            self.schedules or (),
            self.virtuals or (),
            ("schedules", "virtuals", "pipeline_parallel"),
        )
        if self.ep_overlap and self.shape.moe is None:
            raise ConfigError(
                f"ep_overlap hides the expert all-to-alls, and {self.shape.name} is dense (no expert layers); give "
                "experts E and top_k K, a MoE model, or drop ep_overlap",
                params=("ep_overlap", "experts", "top_k"),
            )

    def _check_virtuals_split_layers(self) -> None:
        """ConfigError for a v that leaves a chunk without a layer (uneven stages) or does not divide L/p."""
        L, p = self.shape.layers, self.pipeline_parallel
        for v in self.virtuals or ():
            if self.layers_per_stage is not None:  # uneven stages: each chunk needs a layer
                if self.layers_per_stage and v > min(self.layers_per_stage):
                    raise ConfigError(
                        f"virtual {v}: interleaved 1F1B over layers_per_stage {list(self.layers_per_stage)} "
                        f"leaves a chunk without a layer (v must be at most the fewest layers on a stage, "
                        f"{min(self.layers_per_stage)}); use a smaller virtual",
                        params=("virtuals", "layers_per_stage"),
                    )
            elif v > 1 and L % (p * v):  # v = 1: one chunk a rank, split unevenly as without virtuals
                ok = [x for x in range(2, L // p + 1) if L % (p * x) == 0]
                raise ConfigError(
                    f"virtual {v}: interleaved 1F1B needs layers {L} divisible by stages {p} × virtual {v} = {p * v}; "
                    f"use virtual among {ok or 'none (no v > 1 fits; drop virtuals)'}",
                    params=("virtuals",),
                )

    def _check_types(self) -> None:
        """ConfigError unless the model is a ModelShape and the accelerator an Accelerator (a name or a dict failed
        deep in the search), and the headroom is a number."""
        check_instance("shape", self.shape, ModelShape, SHAPE_FIX)
        check_instance("gpu", self.gpu, Accelerator, GPU_FIX)
        check_instance(
            "efficiency", self.efficiency, RooflineEfficiency,
            "build one (RooflineEfficiency(gemm_max=0.7)) or leave it out for the defaults",
        )  # fmt: skip
        check_instance(
            "memory_calibration", self.memory_calibration, MemoryCalibration,
            "build one (MemoryCalibration(activation_scale=1.1)) or leave it out for none",
        )  # fmt: skip
        if isinstance(self.memory_headroom, bool) or not isinstance(self.memory_headroom, int | float):
            raise ConfigError(
                f"memory_headroom must be a number in [0, 1), got {self.memory_headroom!r}; e.g. 0.1 keeps 10% free",
                params=("memory_headroom",),
            )

    def _check_virtuals_fit_schedules(self) -> None:
        """With named schedules, each v given must be one some schedule runs: a free v (interleaved), or the v a V
        schedule fixes (DualPipeV: 2); 1F1B, GPipe and ZB-H1 hold one stage per rank. A v no schedule runs was
        dropped without a word, or refused quoting interleaving's rule for DualPipeV."""
        from microbatch.schedules.registry import get_spec

        for v in self.virtuals or ():
            check_positive_int("virtual", v)
        if not self.schedules or not self.virtuals:
            return
        fixed = {name: get_spec(name).stages_per_rank for name in self.schedules}
        for v in self.virtuals:
            if any(k is None or k == v for k in fixed.values()):
                continue
            holds = "; ".join(
                f"{name} holds {k} stage{'s' if k != 1 else ''} per rank" for name, k in fixed.items()
            )
            runs = sorted({k for k in fixed.values() if k is not None})
            raise ConfigError(
                f"virtual {v} is run by none of schedules {', '.join(self.schedules)} ({holds}); use virtual "
                f"{' or '.join(map(str, runs))} with them, or schedules interleaved-1f1b for a v of your choice",
                params=("virtuals", "schedules"),
            )

    def _check_issue29_layout(self) -> None:
        """Expert and context parallelism, FP8, every-K recompute and async TP: their rules."""
        check_positive_int("context_parallel", self.context_parallel)
        check_positive_int("recompute_every", self.recompute_every)
        if self.recompute_every > 1 and self.recompute is not None and "full" not in self.recompute:
            raise ConfigError(
                f"recompute_every {self.recompute_every} applies to full recomputation; give recompute full or auto",
                params=("recompute_every", "recompute"),
            )
        check_every_kth(
            self.recompute_every, self.shape.layers, self.pipeline_parallel, self.layers_per_stage
        )
        if self.async_tp and not self.sequence_parallel:
            raise ConfigError(
                "async_tp overlaps the sequence-parallel all-gathers and reduce-scatters with the "
                "GEMMs; give sequence_parallel (and tensor_parallel > 1) with async_tp",
                params=("async_tp", "sequence_parallel", "tensor_parallel"),
            )
        if get_precision(self.precision).gemm_dtype is not None:
            check_gemm_dtype(self.precision, self.gpu.name, self.gpu.peak_flops)
        words = ep_group_words(self.data_parallel, self.context_parallel, self.shard_degree)
        check_expert_layout(self.shape, self.expert_parallel, self.shard_group, self.capacity_factor, words)
        flash = self.shape.flash_attention if self.flash_attention is None else self.flash_attention
        ulysses = check_context_exchange(self.cp_comm) == "ulysses"
        heads = (lambda c: ulysses_divides(self.shape, self.tensor_parallel, c)) if ulysses else None
        check_context_layout(
            self.seq_len, self.context_parallel, flash, also=heads
        )  # the c offered meet both
        if ulysses:
            check_ulysses_heads(self.shape, self.tensor_parallel, self.context_parallel, seq=self.seq_len)
        zero_groups(self.data_parallel, self.context_parallel, self.shard_degree)  # validates shard_degree
        check_hybrid(self.shard_degree, self.expert_parallel, tuple(self.zero or ()))
        check_bf16_fp32_zero(self.grad_dtype, tuple(self.zero or ()), self.zero_group, self.replicas > 1)
        self.reduce_bytes  # noqa: B018 - validates reduce_dtype
        if self.zero3_impl not in ZERO3_IMPLS:
            raise ConfigError(
                f"zero3_impl {self.zero3_impl!r} is not known; use one of {', '.join(ZERO3_IMPLS)}",
                params=("zero3_impl",),
            )
        expert_load(self.capacity_factor, self.expert_imbalance)  # validates both
        check_pipeline_grad_reduce(self.pipeline_grad_reduce, self.pipeline_parallel, self.zero)

    @property
    def num_gpus(self) -> int:
        """GPUs in the layout: d·p·t·c."""
        return self.data_parallel * self.pipeline_parallel * self.tensor_parallel * self.context_parallel

    @property
    def shard_group(self) -> int:
        """d·c: the ranks that hold the same weights, over which gradients are reduced and ZeRO shards
        (Megatron's data-parallel × context-parallel group)."""
        return self.data_parallel * self.context_parallel

    @property
    def zero_group(self) -> int:
        """Ranks ZeRO shards over: d·c, or shard_degree·c under hybrid sharding."""
        return zero_groups(self.data_parallel, self.context_parallel, self.shard_degree)[0]

    @property
    def replicas(self) -> int:
        """Copies of each ZeRO shard (1 unless hybrid sharding): their gradients are all-reduced."""
        return zero_groups(self.data_parallel, self.context_parallel, self.shard_degree)[1]

    @property
    def expert_load(self) -> float:
        """Routed rows over the balanced share: the capacity factor, or the imbalance when dropless."""
        return expert_load(self.capacity_factor, self.expert_imbalance)

    @property
    def reduce_bytes(self) -> int:
        """Bytes per gradient element ZeRO-3's reduce-scatter moves (:func:`microbatch.predict.state.reduce_bytes`)."""
        return reduce_bytes(self.reduce_dtype, self.sharding_impl, self.state_bytes_per_param()[1])

    @property
    def sharding_impl(self) -> str:
        """Who runs ZeRO-3 in effect: ``zero3_impl``, or FSDP2 under a pipeline (ZeRO-2/3 with p > 1 is FSDP under
        ``torch.distributed.pipelining`` whatever ``zero3_impl`` says)."""
        return "fsdp2" if self.pipeline_parallel > 1 else self.zero3_impl

    @property
    def block_parallel(self) -> bool:
        """The parallel block in effect: ``parallel_block`` when given, else the shape's."""
        return self.shape.parallel_block if self.parallel_block is None else self.parallel_block

    @property
    def seq_len(self) -> int:
        """Sequence length in effect."""
        return self.seq or self.shape.seq

    @property
    def memory_budget_bytes(self) -> float:
        """Bytes a candidate may use: capacity × (1 − headroom)."""
        return self.gpu.memory_bytes * (1 - self.memory_headroom)

    @property
    def elementwise(self) -> str:
        """The elementwise kernels priced: ``compiled`` (torch.compile), ``fused`` (hand-written) or ``eager``."""
        eff = self.efficiency
        return "eager" if not eff.fused_elementwise else "compiled" if eff.fused_norm_memory else "fused"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the model, the accelerator, the layout and the memory budget."""
        return {
            "model": self.shape.name,
            "model_shape": self.shape.to_dict(),
            "total_params": self.shape.param_count(),
            "active_params": self.shape.active_param_count(),
            "gpu": self.gpu.to_dict(),
            "global_batch": self.global_batch,
            "data_parallel": self.data_parallel,
            "pipeline_parallel": self.pipeline_parallel,
            "layers_per_stage": list(self.layers_per_stage) if self.layers_per_stage is not None else None,
            "tensor_parallel": self.tensor_parallel,
            "sequence_parallel": self.sequence_parallel,
            "flash_attention": self.shape.flash_attention
            if self.flash_attention is None
            else self.flash_attention,
            "expert_parallel": self.expert_parallel,
            "context_parallel": self.context_parallel,
            "cp_comm": self.cp_comm,
            "shard_degree": self.shard_degree,
            "zero3_impl": self.zero3_impl,
            "reduce_dtype": self.reduce_dtype,
            "pipeline_grad_reduce": self.pipeline_grad_reduce,
            "recompute_every": self.recompute_every,
            "async_tp": self.async_tp,
            "parallel_block": self.block_parallel,
            "ep_overlap": self.ep_overlap,
            "capacity_factor": self.capacity_factor,
            "expert_imbalance": self.expert_imbalance,
            "seq": self.seq_len,
            **self.settings_dict(),
            "elementwise": self.elementwise,
            "memory_headroom": self.memory_headroom,
            "memory_budget_bytes": self.memory_budget_bytes,
            "num_gpus": self.num_gpus,
            "dp_overlap": self.dp_overlap,
            "grad_clip": self.grad_clip,
            "choose": self.choose,
            "tolerance": self.tolerance,
            "margin": self.margin,
        }
