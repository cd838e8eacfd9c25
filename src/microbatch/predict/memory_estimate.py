"""What :func:`microbatch.predict.memory.estimate_memory` returns: each pipeline stage's bytes at its peak, and the
estimate of one configuration (with its JSON form)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from microbatch.model import ModelShape

if TYPE_CHECKING:
    from microbatch.predict.memory_config import MemoryConfig

__all__ = ["StageMemory", "MemoryEstimate"]


@dataclass(frozen=True, kw_only=True)
class StageMemory:
    """The bytes one GPU of one pipeline stage holds at its peak."""

    stage: int
    """Stage index i (0 = first)."""
    layers: int
    """Transformer layers on the stage."""
    params: float
    """Parameters this GPU holds (after tensor parallelism, before ZeRO sharding)."""
    in_flight: int
    """Micro-batches in flight at the peak."""
    weights_bytes: float
    """Weight bytes."""
    gradients_bytes: float
    """Gradient bytes."""
    optimizer_bytes: float
    """Optimizer-state bytes (master weights and moments)."""
    activations_bytes: float
    """Activation bytes at the peak (all in-flight micro-batches)."""
    other_bytes: float
    """Buffers: ZeRO-3 gathered layers (not under a pipeline: :func:`~microbatch.predict.state.resident_zero`),
    the calibration's fixed offset."""
    activation_terms: dict[str, float] = field(default_factory=dict)
    """``activations_bytes`` split into transformer layers, embedding, output/loss, and the larger transient: the
    recompute working set or an eager loss's backward (bytes by term)."""

    @property
    def state_bytes(self) -> float:
        """Model state: weights + gradients + optimizer state."""
        return self.weights_bytes + self.gradients_bytes + self.optimizer_bytes

    @property
    def peak_bytes(self) -> float:
        """Everything the stage holds at its peak."""
        return self.state_bytes + self.activations_bytes + self.other_bytes

    def breakdown(self) -> dict[str, float]:
        """The five JSON terms (bytes): weights, gradients, optimizer, activations, other."""
        return {
            "weights": self.weights_bytes,
            "gradients": self.gradients_bytes,
            "optimizer": self.optimizer_bytes,
            "activations": self.activations_bytes,
            "other": self.other_bytes,
        }

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the peak, its five terms (``memory``) and the activation terms, in bytes."""
        return {
            "stage": self.stage,
            "layers": self.layers,
            "params": self.params,
            "in_flight": self.in_flight,
            "peak_memory_bytes": self.peak_bytes,
            "memory": self.breakdown(),
            "activation_terms": dict(self.activation_terms),
        }


@dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    """Per-stage memory of one configuration."""

    shape: ModelShape
    """The model."""
    config: MemoryConfig
    """The configuration."""
    stages: tuple[StageMemory, ...]
    """One entry per pipeline stage."""

    @property
    def peak_stage(self) -> StageMemory:
        """The stage with the highest peak."""
        return max(self.stages, key=lambda st: st.peak_bytes)

    @property
    def peak_bytes(self) -> float:
        """The highest peak over the stages."""
        return self.peak_stage.peak_bytes

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the configuration in effect, the peak stage's terms and every stage."""
        peak = self.peak_stage
        cfg = self.config
        return {
            "model": self.shape.name,
            "model_shape": self.shape.to_dict(),
            "config": {
                "micro_batch": cfg.micro_batch,
                "seq": cfg.seq or self.shape.seq,
                "tensor_parallel": cfg.tensor_parallel,
                "sequence_parallel": cfg.sequence_parallel,
                "pipeline_parallel": cfg.pipeline_parallel,
                "virtual": cfg.virtual,
                "microbatches": cfg.m,
                "schedule": cfg.schedule,
                "data_parallel": cfg.data_parallel,
                "zero": cfg.zero,
                **cfg.settings_dict(),
                "recompute": cfg.recompute,
                "recompute_every": cfg.recompute_every,
                "expert_parallel": cfg.expert_parallel,
                "context_parallel": cfg.context_parallel,
                "shard_degree": cfg.shard_degree,
                "capacity_factor": cfg.capacity_factor,
                "expert_imbalance": cfg.expert_imbalance,
                "pipeline_grad_reduce": cfg.pipeline_grad_reduce,
                "zero3_impl": cfg.zero3_impl,
                "reduce_dtype": cfg.reduce_dtype,
                "flash_attention": self.shape.flash_attention
                if cfg.flash_attention is None
                else cfg.flash_attention,
            },
            "peak_stage": peak.stage,
            "peak_memory_bytes": peak.peak_bytes,
            "memory": peak.breakdown(),
            "stages": [st.to_dict() for st in self.stages],
        }
