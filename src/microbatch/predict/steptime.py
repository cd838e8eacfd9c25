"""The one step-time rule: the seconds of one micro-batch's forward and backward on a stage.

From the roofline forward time of a layer (:func:`~microbatch.predict.roofline.layer_forward`)
and of the output layer and loss (:func:`~microbatch.predict.roofline.logits_forward`):

- forward F = L·layer + logits (+ the pipeline send);
- backward, split as ZB-H1 needs it (Qi et al. 2024): weight gradients W = L·gemm + logits (one
  GEMM per forward GEMM, or their launches where the host is slower), input gradients I = L·(gemm + attention backward + elementwise backward +
  tp_comm [+ the sequence-parallel re-gather]) + logits (+ the send). The GEMMs' backward is 2 × their
  forward FLOPs; the memory-bound parts are counted by their own traffic
  (:func:`~microbatch.predict.roofline.score_passes`,
  :func:`~microbatch.predict.roofline.elementwise_backward_ratio`), not as 2 × forward. Full recompute
  adds the layer's forward to I, selective recompute the attention core.

A single device (no pipeline) runs T = F + I + W = L·(forward + I + W) [+ L·forward with full
recompute] + 3·logits per micro-step: the planner (:mod:`microbatch.predict.candidate`) and the
calibration (:mod:`microbatch.predict.calibrate`) both use this rule. The host's launches (a GPU's floor, a
CPU's added dispatch) are in the layer's elementwise parts (:func:`~microbatch.predict.roofline.layer_forward`)
and in the logits (the embedding's, final norm's, output GEMM's and loss's kernels,
:func:`~microbatch.predict.roofline.logits_forward`); the embedding lookup's memory traffic is ignored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from microbatch.hardware import Accelerator
from microbatch.model import ModelShape
from microbatch.precision import get_precision
from microbatch.predict.collectives import overlap_exposed_s
from microbatch.predict.roofline import (
    DEFAULT_EFFICIENCY,
    LayerTime,
    RooflineEfficiency,
    layer_forward,
    logits_forward,
)

__all__ = [
    "StageTime", "layer_pass_times", "stage_time", "pipeline_stage_times", "predict_step_time_s",
    "overlap_expert_comm",
]  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class StageTime:
    """Seconds of one micro-batch on one pipeline stage, by pass."""

    forward_s: float
    """Forward (F)."""
    input_grad_s: float
    """Backward for the input gradients (I), with any recompute."""
    weight_grad_s: float
    """Backward for the weight gradients (W)."""

    @property
    def total_s(self) -> float:
        """F + I + W."""
        return self.forward_s + self.input_grad_s + self.weight_grad_s


def layer_pass_times(lt: LayerTime, recompute: str = "none", every: int = 1) -> tuple[float, float, float]:
    """(forward, input-gradient, weight-gradient) seconds of one layer for one micro-batch.

    W = the GEMMs again (one weight-gradient GEMM per forward GEMM), or their launches where the host is
    slower (``LayerTime.weight_host_s``: that much of the backward's launch gap moves from I to W, so I + W
    stays the backward and faster GEMMs never lengthen a zero-bubble schedule's I − W); I = gemm + attention and
    elementwise backward (``LayerTime.backward_memory_s``) + tp_comm (the backward all-reduces) + the
    sequence-parallel re-gather (+ a MoE block's two all-to-alls again, + the exposed exchange of context
    parallelism); full recompute adds the forward to I (its forward gathers again, so no re-gather), selective
    recompute the attention core with its context-parallel exchange (the recomputed region holds it: Transformer
    Engine's attention runs the ring or the all-to-alls inside), per-op selective recompute ``op_recompute_s``;
    ``every`` = K > 1 with full recompute: one layer in K reruns its forward (the mean over K layers).
    """
    forward = lt.total_s
    weight = lt.gemm_s
    if recompute == "full" and every > 1:  # one layer in K reruns its forward: the mean over K layers
        plain, full = layer_pass_times(lt, "none"), layer_pass_times(lt, "full")
        return forward, (plain[1] * (every - 1) + full[1]) / every, plain[2]  # W as every pass has it
    inputs = lt.gemm_s + lt.backward_memory_s + lt.tp_comm_s + lt.ep_comm_s + lt.cp_comm_backward_s
    if lt.weight_host_s > weight and lt.backward_gap_s:  # a host-bound W pass: its launches, not its GEMMs
        moved = min(lt.weight_host_s - weight, lt.backward_gap_s)  # of the gap the backward carries (in I)
        weight, inputs = weight + moved, inputs - moved
    if recompute == "full":
        # no re-gather (the rerun forward gathers): the backward is max(H, D − R) where its gap was sized on
        # max(H, D); with s = H − D that adds max(0, s + R) − max(0, s) back to D − R + gap (a sweep: 112.68 → 112.92
        # ms with four times the NVLink bandwidth when the re-gather was simply dropped)
        s = -math.inf if lt.host_slack_s is None else lt.host_slack_s[1] - lt.ep_comm_s
        inputs += forward + max(0.0, s + lt.sp_regather_s) - max(0.0, s)
    else:
        inputs += lt.sp_regather_s
        if recompute == "selective":
            inputs += lt.attention_s + lt.cp_comm_s
        elif recompute == "op":
            inputs += lt.op_recompute_s
    return forward, inputs, weight


def overlap_expert_comm(lt: LayerTime, slowdown: float = 0.0) -> LayerTime:
    """``lt`` with its MoE all-to-all run beside computation, which runs ``slowdown`` slower meanwhile:
    exposed :func:`~microbatch.predict.collectives.overlap_exposed_s` (max(0, all-to-all − compute) at 0).

    DeepSeek-V3 (arXiv 2412.19437 §3.2.1): DualPipe pairs a forward chunk of one micro-batch with a backward
    chunk of another so that the dispatch and combine all-to-alls of each run under the other's
    computation ("both all-to-all and PP communication can be fully hidden"); Megatron-core's
    ``--overlap-moe-expert-parallel-comm`` does the same inside 1F1B. The all-to-all of one pass is hidden
    behind up to one layer's compute; the rest shows. Unchanged when the layer has no all-to-all.
    """
    if not lt.ep_comm_s:
        return lt
    exposed = overlap_exposed_s(lt.ep_comm_s, lt.compute_s, slowdown)
    if lt.host_slack_s is None:
        return replace(lt, ep_comm_s=exposed)
    # a host-bound pass gains nothing from hiding the all-to-all: its launch gap grows back by what was hidden,
    # max(0, slack − exposed), so a pass stays max(host, device + exposed) (faster GEMMs never lengthen it)
    slack_f, slack_b = lt.host_slack_s
    grow_f = max(0.0, slack_f - exposed) - max(0.0, slack_f - lt.ep_comm_s)
    gap_b = max(0.0, slack_b - exposed)
    grow_b = gap_b - lt.backward_gap_s
    back = 2 * lt.elementwise_s if lt.elementwise_backward_s is None else lt.elementwise_backward_s
    return replace(
        lt,
        ep_comm_s=exposed,
        elementwise_s=lt.elementwise_s + grow_f,
        elementwise_backward_s=back + grow_b,
        backward_gap_s=gap_b,
    )


def stage_time(
    lt: LayerTime,
    logits_s: float,
    *,
    layers: int,
    last: bool,
    p2p_s: float = 0.0,
    recompute: str = "none",
    dense: LayerTime | None = None,
    moe_layers: int | None = None,
) -> StageTime:
    """F, I and W of a stage of ``layers`` layers (plus the output layer and loss when ``last``).

    The output layer's backward ≈ 2 × its forward: one for I, one for W. The pipeline send
    ``p2p_s`` (activations forward, gradients back) is on F and I. ``dense``, ``moe_layers``: a mixture-of-experts
    model with dense blocks too, ``lt`` its MoE block (:func:`pipeline_stage_times`).
    """
    f, i, w = pipeline_stage_times(
        lt, logits_s, split=(layers,), p2p_s=p2p_s, recompute=recompute, last_has_logits=last, dense=dense,
        moe_split=None if moe_layers is None else (moe_layers,),
    )  # fmt: skip
    return StageTime(forward_s=f[0], input_grad_s=i[0], weight_grad_s=w[0])


def pipeline_stage_times(
    lt: LayerTime,
    logits_s: float,
    *,
    split: tuple[int, ...],
    p2p_s: float = 0.0,
    recompute: str = "none",
    last_has_logits: bool = True,
    virtual: int = 1,
    recompute_every: int = 1,
    dense: LayerTime | None = None,
    moe_split: tuple[int, ...] | None = None,
) -> tuple[list[float], list[float], list[float]]:
    """(F, I, W) of every stage of a pipeline whose stages hold ``split`` layers: :func:`stage_time`
    for each, the output layer and loss on the last. The planner's hot loop: one pass, lists out.

    ``virtual`` = v chunks per rank (interleaved 1F1B): a micro-batch crosses v chunk boundaries on
    each rank, so F and I carry v sends of ``p2p_s`` (Narayanan et al. 2021 §2.2.2: interleaving
    multiplies the pipeline communication by v).

    A mixture-of-experts model whose blocks are not all MoE blocks (DeepSeek-V3's three dense first blocks, Llama 4's
    dense block between two MoE blocks): ``lt`` is its MoE block, ``dense`` its dense block (the model's dense MLP
    width, no router, permutation or all-to-all) and ``moe_split`` the MoE blocks of each stage; a stage's time is
    its blocks' times, each at its own kind."""
    if (dense is None) != (moe_split is None):
        raise ValueError("give dense and moe_split together (a MoE model with dense blocks) or neither")
    f, i, w = layer_pass_times(lt, recompute, recompute_every)
    last = len(split) - 1
    sends = p2p_s * max(1, virtual)
    fs, is_, ws = [], [], []
    if dense is not None and moe_split is not None:
        df, di, dw = layer_pass_times(dense, recompute, recompute_every)
        for s, (n, k) in enumerate(zip(split, moe_split, strict=True)):
            extra = logits_s if s == last and last_has_logits else 0.0
            fs.append(k * f + (n - k) * df + extra + sends)
            is_.append(k * i + (n - k) * di + extra + sends)
            ws.append(k * w + (n - k) * dw + extra)
        return fs, is_, ws
    for s, n in enumerate(split):
        extra = logits_s if s == last and last_has_logits else 0.0
        fs.append(n * f + extra + sends)
        is_.append(n * i + extra + sends)
        ws.append(n * w + extra)
    return fs, is_, ws


def predict_step_time_s(
    shape: ModelShape,
    micro_batch: int,
    acc: Accelerator,
    *,
    seq: int | None = None,
    precision: str = "bf16-mixed",
    checkpointing: bool = False,
    efficiency: RooflineEfficiency = DEFAULT_EFFICIENCY,
    fp8_recipe: str = "tensorwise",
) -> float:
    """Roofline time of one training micro-step (forward + backward, no optimizer) on one device.

    T = L·(3·compute + 2·tp_comm) [+ L·forward with full recompute] + 3·logits, each at rows =
    b_m·s: the stage time (:func:`stage_time`) of one stage holding every layer. Under ``fp8`` the
    linear GEMMs run in FP8 with ``fp8_recipe``'s casts (a step of one micro-batch: a recipe that casts the
    weights once a step pays that cast here, L × the layer's ``weight_cast_s``).
    """
    s = seq or shape.seq
    prec = get_precision(precision)
    dtype = prec.compute_dtype
    recipe = fp8_recipe if prec.gemm_dtype == "fp8" else None
    lt = layer_forward(shape, micro_batch, acc, seq=s, dtype=dtype, efficiency=efficiency, fp8_recipe=recipe)
    logits_s, _ = logits_forward(shape, micro_batch, acc, seq=s, dtype=dtype, efficiency=efficiency)
    recompute = "full" if checkpointing else "none"
    L, moe = shape.layers, shape.moe_layer_count(0, shape.layers)
    if shape.moe is None or moe == L:
        step = stage_time(lt, logits_s, layers=L, last=True, recompute=recompute).total_s
        return step + L * lt.weight_cast_s
    dense = layer_forward(
        shape.dense_block(), micro_batch, acc, seq=s, dtype=dtype, efficiency=efficiency, fp8_recipe=recipe
    )
    step = stage_time(
        lt, logits_s, layers=L, last=True, recompute=recompute, dense=dense, moe_layers=moe
    ).total_s
    return step + moe * lt.weight_cast_s + (L - moe) * dense.weight_cast_s
