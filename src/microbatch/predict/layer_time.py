"""The time of one transformer layer for one micro-batch on one GPU, by part (:class:`LayerTime`).

:func:`microbatch.predict.roofline.layer_forward` fills it; :mod:`microbatch.predict.steptime` turns it into a
stage's forward, input-gradient and weight-gradient times. Pure data: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LayerTime"]


@dataclass(frozen=True, kw_only=True)
class LayerTime:
    """Forward time of one layer for one micro-batch on one GPU, by part."""

    gemm_s: float
    """Linear layers (QKV, output projection, MLP)."""
    attention_s: float
    """Attention core: QKᵀ, softmax, ·V (scores streamed through memory without flash attention)."""
    elementwise_s: float
    """Norms, residual adds, activation function, dropout, rotary embeddings, a MoE block's token permutation:
    memory traffic; and the host's launch time the device's work does not cover."""
    tp_comm_s: float
    """Two tensor-parallel all-reduces (or all-gather + reduce-scatter with SP)."""
    flops: float
    """Model FLOPs of this forward on this GPU."""
    gemm_flops: float = 0.0
    """Of them, the linear layers' (2·rows·weights/t): what ``gemm_s`` computes, for the GEMMs' share of peak."""
    attention_backward_s: float | None = None
    """Backward of the attention core (None: 2 × ``attention_s``)."""
    elementwise_backward_s: float | None = None
    """Backward of the elementwise kernels (None: 2 × ``elementwise_s``)."""
    op_recompute_s: float = 0.0
    """Per-op selective recompute: the forward rerun in the backward — the even-numbered matmuls
    (:func:`microbatch.predict.recompute.op_recompute_gemm_share` of ``gemm_s``) and the elementwise kernels."""
    cp_comm_s: float = 0.0
    """Context parallelism: the forward exchange not hidden behind the attention (the ring's or the all-gather's
    K/V, and their steps' merges through memory; Ulysses' all-to-alls of Q, K, V and O, exposed whole)."""
    cp_comm_backward_s: float = 0.0
    """Its backward not hidden behind the attention backward (ring, all-gather: K/V again and their gradients,
    2 × the bytes; Ulysses: dO in and dQ, dK, dV out, the forward's bytes)."""
    ep_comm_s: float = 0.0
    """Mixture of experts: the dispatch and combine all-to-alls of the expert-parallel group (exposed;
    the backward runs them again)."""
    sp_regather_s: float = 0.0
    """With sequence parallelism, the backward's second all-gather of the two column-parallel GEMMs'
    inputs (:func:`microbatch.predict.collectives.sp_regather_time_s`); not run under full recompute, which gathers them again anyway."""
    backward_gap_s: float = 0.0
    """The host's launch time the backward's device work does not cover (in ``elementwise_backward_s``)."""
    weight_cast_s: float = 0.0
    """FP8 weights cast (with their transposes) once a step, not per micro-batch, where the recipe caches them
    (Transformer Engine's: :func:`microbatch.predict.fp8.weight_cast_bytes`); 0 otherwise."""
    weight_host_s: float = 0.0
    """The host's launch time of the weight-gradient GEMMs alone (one per forward GEMM): a split backward's
    W pass cannot run faster than its launches (:func:`microbatch.predict.steptime.layer_pass_times`)."""
    host_slack_s: tuple[float, float] | None = None
    """On a GPU, (forward, backward): the host's issue time less the device's work but the all-to-all (negative where
    the device is the slower). A pass takes max(host, device + exposed all-to-all), so its launch gap is max(0, slack
    − exposed all-to-all): where an overlap hides some of the all-to-all the gap grows back
    (:func:`microbatch.predict.steptime.overlap_expert_comm`). None on a CPU (the host's time adds there) or
    without a launch cost."""

    @property
    def backward_memory_s(self) -> float:
        """Attention-core and elementwise backward seconds (input-gradient side, no GEMMs)."""
        a = 2 * self.attention_s if self.attention_backward_s is None else self.attention_backward_s
        e = 2 * self.elementwise_s if self.elementwise_backward_s is None else self.elementwise_backward_s
        return a + e

    @property
    def compute_s(self) -> float:
        return self.gemm_s + self.attention_s + self.elementwise_s

    @property
    def total_s(self) -> float:
        return self.compute_s + self.tp_comm_s + self.ep_comm_s + self.cp_comm_s
