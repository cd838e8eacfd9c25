"""Time of a transformer layer at b_m·s rows, and of the communication around it.

**Roofline** (Williams, Waterman, Patterson 2009): a kernel takes the longer of its FLOPs over
the peak FLOP/s and its bytes over the memory bandwidth, each derated by an efficiency. A GEMM
``[rows, k] × [k, n]`` moves ``rows·k + k·n + rows·n`` elements and does ``2·rows·k·n`` FLOPs, so
its arithmetic intensity grows with rows = b_m·s until it passes the device's ridge point
(peak / bandwidth) and the kernel turns compute-bound (seed 002: "intensity ≈ b_m·s·h/(h + b_m·s)").
Attention's score matrix (without flash attention) and the elementwise ops (norms, residuals,
activation functions, dropout, rotary embeddings) are memory traffic, each at its measured fraction of the
bandwidth (:mod:`microbatch.predict.memory_ops`). A GEMM's backward is 2 × its forward (input and
weight gradients); the memory-bound kernels' backward is counted by its own passes
(:func:`score_passes`, :func:`elementwise_backward_ratio`); recompute adds its forward again. GPU
GEMMs lose efficiency at short inner dimensions and few rows (:func:`k_efficiency`,
:func:`row_efficiency`, measured on an H200 by ``bench/gpu_microbench.py``).

**Communication** (:mod:`microbatch.predict.collectives`, re-exported here; ring collectives,
Patarasuk & Yuan 2009; Megatron-LM's placement, Narayanan et al. 2021 §3): tensor-parallel
all-reduces in every layer (two forward, two backward), pipeline point-to-point sends per micro-batch, the data-parallel gradient all-reduce once per optimizer
step (partly hidden behind the last backward), and under ZeRO-3/FSDP the weight all-gathers and
gradient reduce-scatter of every micro-step (hidden behind compute where it is shorter; once per step under a
pipeline, :mod:`microbatch.predict.dp_comm`).
Latency (α) terms are ignored: they matter only for messages far smaller than these.

The efficiencies are a :class:`RooflineEfficiency` — a value a calibration from measurements can
replace (any object with the same two methods works).
"""

from __future__ import annotations

from dataclasses import replace

from microbatch.hardware import Accelerator
from microbatch.model import ModelShape
from microbatch.precision import get_fp8_recipe
from microbatch.predict.attention_core import attention_core_s, attention_span
from microbatch.predict.collectives import (
    allgather_time_s,
    allreduce_time_s,
    alltoall_time_s,
    group_bandwidth,
    overlap_exposed_s,
    p2p_time_s,
    pipeline_send_time_s,
    ranks_per_node,
    reduce_scatter_time_s,
    scatter_gather_send_s,
    sp_regather_time_s,
)
from microbatch.predict.context import CpLayout, attention_key_split, cp_exchange_s
from microbatch.predict.experts import attention_widths, dispatch_bytes, gemm_weights, rows_per_expert
from microbatch.predict.fp8 import cast_bytes, weight_cast_bytes
from microbatch.predict.gemm import (
    DEFAULT_EFFICIENCY,
    RooflineEfficiency,
    arithmetic_intensity,
    gemm_bytes,
    gemm_flops,
    gemm_time_s,
    k_efficiency,
    row_efficiency,
    wave_efficiency,
)
from microbatch.predict.launch import head_kernels, host_time_s, launch_floor
from microbatch.predict.layer_time import LayerTime
from microbatch.predict.memory_ops import (
    PERMUTE_PASSES,
    elementwise_backward_ratio,
    elementwise_forward_s,
    rotary_forward_s,
    rotary_passes,
    score_pass_split,
    score_passes,
)
from microbatch.predict.recompute import op_recompute_gemm_share

__all__ = [
    "DEFAULT_EFFICIENCY",
    "RooflineEfficiency",
    "LayerTime",
    "gemm_flops",
    "gemm_bytes",
    "arithmetic_intensity",
    "gemm_time_s",
    "wave_efficiency",
    "k_efficiency",
    "row_efficiency",
    "score_passes",
    "score_pass_split",
    "rotary_passes",
    "rotary_forward_s",
    "sp_regather_time_s",
    "elementwise_backward_ratio",
    "elementwise_forward_s",
    "layer_forward",
    "logits_forward",
    "allreduce_time_s",
    "allgather_time_s",
    "reduce_scatter_time_s",
    "p2p_time_s",
    "pipeline_send_time_s",
    "scatter_gather_send_s",
    "group_bandwidth",
    "ranks_per_node",
    "model_flops_per_step",
    "hardware_flops_per_step",
    "layer_forward_flops",
]


# -- one layer -------------------------------------------------------------------------------------
def layer_forward_flops(shape: ModelShape, rows: float, seq: int, tensor_parallel: int = 1) -> float:
    """Forward FLOPs of one layer on one of t GPUs: 2·rows·(GEMM weights) + 4·rows·s·h (QKᵀ and ·V).

    At kv = a, f = 4h: (24·b·s·h² + 4·b·s²·h)/t, Narayanan et al. 2021 Eq. 3 (per layer, forward).
    Counts the full s×s score matrix (as the paper does), not the causal half flash kernels skip.
    Mixture of experts: the MLP weights one token uses (router, K routed and S shared experts,
    :meth:`microbatch.moe.Experts.active_moe_params`); DeepSeek's latent attention: its projections and a
    core of 2·rows·s·a·(d_qk + d_v) (:func:`microbatch.predict.experts.attention_widths`). Sliding-window
    layers count their keys (:func:`microbatch.predict.attention_core.attention_span`).
    """
    qk, v = attention_widths(shape)
    keys = attention_span(shape, seq)  # s, or less where layers attend through a sliding window
    return (2.0 * rows * gemm_weights(shape) + 2.0 * rows * keys * (qk + v)) / tensor_parallel


def layer_forward(
    shape: ModelShape,
    micro_batch: int,
    acc: Accelerator,
    *,
    seq: int | None = None,
    tensor_parallel: int = 1,
    sequence_parallel: bool = False,
    flash_attention: bool | None = None,
    dtype: str = "bf16",
    efficiency: RooflineEfficiency = DEFAULT_EFFICIENCY,
    moe_layout: tuple[int, float] | None = None,
    context_parallel: int = 1,
    fp8_recipe: str | None = None,
    async_tp: bool = False,
    parallel_block: bool = False,
    cp_comm: str = "allgather",
) -> LayerTime:
    """Roofline forward time of one transformer layer at rows = b_m·s on one of t GPUs, by part.

    Linear layers: :func:`_layer_gemms` (with ``fp8_recipe`` at the FP8 rate, their casts in the elementwise
    traffic; a mixture-of-experts MLP at ``moe_layout`` = (EP, expert load), None meaning (1, 1.0)).
    Attention core: :func:`~microbatch.predict.attention_core.attention_core_s` (flash on its own curve, or the scores through memory).
    Elementwise: :func:`_elementwise_s` (norms, residual adds, activation, dropout, rotary), and the host's
    launches: a floor on a GPU, added on a CPU (:func:`~microbatch.predict.launch.launch_floor`). With context parallelism c each GPU holds rows = b_m·s/c tokens' worth of work; by ``cp_comm``
    (:mod:`microbatch.predict.context`, c ranks t apart) it gathers the K/V of the others (one all-gather or a
    ring), overlapped with its attention, or (Ulysses) trades tokens for heads in all-to-alls, exposed: the
    exposed rest, with the ring's per-step merges, is ``cp_comm_s``
    (:func:`~microbatch.predict.context.cp_exchange_s`). Tensor parallelism: two all-reduces per pass (all-gather
    + reduce-scatter under SP, the same bytes; :func:`_tp_comm`). With ``async_tp`` the collectives are
    decomposed and overlapped with the GEMMs they feed (torchtitan's async tensor parallelism, Transformer Engine's
    userbuffers): exposed as every overlapped collective is, the excess plus the GEMMs' slowdown beside it
    (:func:`~microbatch.predict.collectives.overlap_exposed_s`; TE's own defaults give its pipelined and bulk
    overlaps 16 SMs, ``module/base.py``). With ``parallel_block`` (GPT-J, GPT-NeoX, PaLM: attention and MLP on one
    input, outputs summed) one all-reduce per pass, half the tensor-parallel traffic.
    """
    acc = acc.at_sustained_clock()  # kernels run at the clock held under the power limit (issue 28)
    s, t, c, e = seq or shape.seq, tensor_parallel, context_parallel, 4 if dtype == "fp32" else 2
    rows = micro_batch * s / c
    g = _Linears(acc, dtype, efficiency, fp8_recipe)
    layout = moe_layout or (1, 1.0)
    gemm, a2a, width_moe = _layer_gemms(shape, micro_batch, s, c, t, acc, layout, g, sequence_parallel)
    flash = shape.flash_attention if flash_attention is None else flash_attention
    split = attention_key_split(c, cp_comm)  # the keys in c pieces (ring, all-gather) or whole (Ulysses)
    attention, attention_bwd = attention_core_s(shape, rows, s, split, t, flash, acc, dtype, efficiency)
    elementwise, elementwise_bwd = _elementwise_s(
        shape, rows, t, sequence_parallel, width_moe, acc, efficiency, g, dtype_bytes=e, layout=layout
    )
    tp_comm, regather = _tp_comm(e * rows * shape.hidden, acc, t, efficiency.network, shape, sequence_parallel,
                                 parallel_block, layout[0])  # fmt: skip
    sigma = efficiency.overlap_fraction(bool(acc.compute_units))  # the ring's NCCL kernels slow attention
    cp_f, cp_b = cp_exchange_s(shape, micro_batch, s, acc, CpLayout(c, t, cp_comm, e), efficiency.network,
                               efficiency.memory, (attention, attention_bwd), sigma)  # fmt: skip
    if async_tp:
        tp_comm, regather = _async_tp_exposed(tp_comm, regather, gemm, sigma)
    device = LayerTime(
        cp_comm_s=cp_f,
        cp_comm_backward_s=cp_b,
        gemm_s=gemm,
        attention_s=attention,
        elementwise_s=elementwise,
        tp_comm_s=tp_comm,
        flops=layer_forward_flops(shape, rows, s, t),
        gemm_flops=2.0 * rows * gemm_weights(shape) / t,
        ep_comm_s=a2a,
        attention_backward_s=attention_bwd,
        elementwise_backward_s=elementwise_bwd,
        sp_regather_s=regather,
        weight_cast_s=g.weight_cast_bytes / (acc.memory_bandwidth_bytes_per_s * efficiency.memory),
    )
    return _with_launches(device, shape, acc, efficiency, (flash, t, layout[0], split))


def _with_launches(lt: LayerTime, shape: ModelShape, acc: Accelerator, efficiency: RooflineEfficiency,
                   layout: tuple[bool, int, int, int]) -> LayerTime:  # fmt: skip
    """``lt`` (the device's times) with the host's launches (:func:`~microbatch.predict.launch.launch_floor`): the
    forward's and the backward's gaps carried by their elementwise parts, the per-op recompute at max(its launches,
    its device time), the weight-gradient GEMMs' launches and the slack of each pass."""
    assert (
        lt.attention_backward_s is not None and lt.elementwise_backward_s is not None
    )  # layer_forward sets both
    share = op_recompute_gemm_share(shape)
    forward = lt.gemm_s + lt.attention_s + lt.elementwise_s + lt.tp_comm_s + lt.cp_comm_s
    back = (2 * lt.gemm_s + lt.attention_backward_s + lt.elementwise_backward_s + lt.tp_comm_s + lt.sp_regather_s
            + lt.cp_comm_backward_s)  # fmt: skip
    rerun = share * lt.gemm_s + lt.elementwise_s  # the per-op recompute's device time
    forward_gap, backward_gap, weight_host, slack, rerun_gap = launch_floor(
        shape, acc, efficiency, layout, (forward, back, rerun), lt.ep_comm_s, share
    )
    return replace(
        lt, elementwise_s=lt.elementwise_s + forward_gap, elementwise_backward_s=lt.elementwise_backward_s + backward_gap,
        op_recompute_s=rerun + rerun_gap, backward_gap_s=backward_gap, weight_host_s=weight_host, host_slack_s=slack,
    )  # fmt: skip


def _async_tp_exposed(tp_comm: float, regather: float, gemm: float, sigma: float) -> tuple[float, float]:
    """(TP collectives, SP re-gather) seconds left exposed under async TP: each collective runs under the GEMM it
    feeds (torchtitan's async TP, TE's userbuffers), which runs ``sigma`` slower beside it; the backward's re-gather
    of the SP-scattered inputs runs under the backward GEMMs the collectives leave free, min(tp_comm, gemm) of its
    2 × gemm (Transformer Engine's bulk overlap of that all-gather with the dgrad GEMM: Megatron-Bridge
    ``comm_overlap.py``, qkv_dgrad / fc1_dgrad = BulkOverlapCfg)."""
    regather = overlap_exposed_s(regather, 2 * gemm - min(tp_comm, gemm), sigma)
    return overlap_exposed_s(tp_comm, gemm, sigma), regather


def _layer_gemms(
    shape: ModelShape,
    b: int,
    s: int,
    c: int,
    t: int,
    acc: Accelerator,
    layout: tuple[int, float],
    g: _Linears,
    sp: bool = False,
) -> tuple[float, float, float]:
    """(GEMM seconds, expert all-to-all seconds, the MoE activation width) of one layer's linear layers.

    QKV [rows, h] × [h, (a·d + 2·kv·d)/t] and the output projection [rows, a·d/t] × [a·d, h] (a·d = h
    unless the model sets its head width apart); DeepSeek's latent
    attention (MLA) as one GEMM of its projection weights (k = h: FLOPs exact, efficiency approximate). The
    MLP: up (2 × f/t wide when gated) and down projections, or a mixture-of-experts block's
    (:func:`_moe_mlp`). Each GEMM at :func:`gemm_time_s` through ``g`` (FP8 rate and casts when a recipe is on).
    """
    rows = b * s / c
    h, f, qw, kvd = shape.hidden, shape.ffn, shape.q_width, shape.kv * shape.head_dim
    if shape.mla is None:
        gemm = g(rows, h, (qw + 2 * kvd) / t) + g(rows, qw / t, h)
    else:
        gemm = g(rows, h, shape.mla.params(h, shape.heads) / h / t)
    if shape.moe is not None:
        moe_s, a2a, width = _moe_mlp(shape, b, s // c, acc, t, layout, g, sp)
        return gemm + moe_s, a2a, width
    return gemm + g(rows, h, (2 if shape.gated_mlp else 1) * f / t) + g(rows, f / t, h), 0.0, 0.0


def _elementwise_s(
    shape: ModelShape,
    rows: float,
    t: int,
    sequence_parallel: bool,
    width_moe: float,
    acc: Accelerator,
    efficiency: RooflineEfficiency,
    g: _Linears,
    *,
    dtype_bytes: int,
    layout: tuple[int, float] = (1, 1.0),
) -> tuple[float, float]:
    """(forward, backward) seconds of a layer's memory-bound elementwise kernels on one GPU.

    :func:`elementwise_forward_s` (two norms, two residual adds, the activation over its width — the MoE
    block's ``width_moe`` per token when it has experts — and dropout; h split by t only under SP), backward
    :func:`elementwise_backward_ratio` × that; the FP8 casts of ``g``'s GEMMs; rotary embeddings on Q and K
    (:func:`rotary_forward_s`, the same passes backward); a MoE block's token permutation and
    unpermutation, :data:`PERMUTE_PASSES` over its K·load copies (``layout`` = (EP, load)) of each of the rank's
    tokens (h; split by t under SP with EP > 1, where each rank permutes its own tokens; at EP = 1 the
    all-gather dispatcher gathers them first), each direction.
    """
    bw = acc.memory_bandwidth_bytes_per_s * efficiency.memory
    sp = t if sequence_parallel else 1
    width_f = (3 if shape.gated_mlp else 2) * (width_moe if shape.moe else shape.ffn) / t
    row_bytes = dtype_bytes * rows
    forward = elementwise_forward_s(
        row_bytes, shape.hidden / sp, width_f, bool(shape.dropout), acc, efficiency
    )
    rotary = rotary_forward_s(shape, row_bytes, t, acc, efficiency)
    ep, load = layout
    copies = 0.0 if shape.moe is None else shape.moe.top_k * load  # routed copies per token
    own = (
        sp if ep > 1 else 1
    )  # the all-to-all dispatcher permutes the rank's own tokens, the all-gather one all
    permute = PERMUTE_PASSES * row_bytes * copies * shape.hidden / own / bw  # to the experts and back
    backward = elementwise_backward_ratio() * forward + g.cast_backward_bytes / bw + rotary + permute
    return forward + g.cast_forward_bytes / bw + rotary + permute, backward


def _tp_comm(
    nbytes: float,
    acc: Accelerator,
    t: int,
    network: float,
    shape: ModelShape,
    sp: bool,
    parallel_block: bool,
    ep: int,
) -> tuple[float, float]:
    """(two all-reduces of the rows×h activation, the sequence-parallel re-gather) over t ranks in a node.

    Half of each where the MLP needs no gather of its own: attention and MLP on one input (``parallel_block``:
    one all-reduce per pass), or a MoE block under SP with the all-to-all dispatcher (EP > 1) and no shared
    experts, which gathers only its routed tokens (in ``ep_comm_s``, :func:`_moe_mlp`); at EP = 1 Megatron's
    all-gather dispatcher gathers the tokens themselves, and shared experts need the gathered input: the pair.
    """
    if t <= 1:
        return 0.0, 0.0
    bw_tp = group_bandwidth(acc, t, 1) * network
    comm, regather = (
        2 * allreduce_time_s(nbytes, t, bw_tp),
        (sp_regather_time_s(nbytes, t, bw_tp) if sp else 0.0),
    )
    moe_sp = shape.moe is not None and sp and ep > 1 and not shape.moe.shared_experts
    return (comm / 2, regather / 2) if parallel_block or moe_sp else (comm, regather)


class _Linears:
    """The linear layers' GEMM times of one layer (:func:`gemm_time_s`), at the FP8 rate with an FP8 recipe,
    and the casting bytes they add (:func:`microbatch.predict.fp8.cast_bytes`), summed over the calls."""

    def __init__(self, acc: Accelerator, dtype: str, efficiency: RooflineEfficiency, fp8_recipe: str | None):
        self.acc, self.recipe = acc, None if fp8_recipe is None else get_fp8_recipe(fp8_recipe)
        self.high = dtype  # the compute dtype, for the GEMMs kept out of FP8 (a MoE router)
        self.dtype = dtype if self.recipe is None else "fp8"
        self.e = 4 if dtype == "fp32" else 2
        self.network = efficiency.network
        if self.recipe is not None:
            efficiency = replace(efficiency, gemm_max=efficiency.gemm_max * self.recipe.gemm_factor)
        self.efficiency = efficiency
        self.cast_forward_bytes = self.cast_backward_bytes = self.weight_cast_bytes = 0.0

    def __call__(self, rows: float, k: float, n: float, times: int = 1, fp8: bool = True) -> float:
        """Seconds of ``times`` GEMMs [rows, k] × [k, n] (a MoE block's local experts), their casts counted as
        many times; ``fp8=False`` keeps one in the compute dtype, uncast (the router, as Megatron and TE run it)."""
        if not fp8 or self.recipe is None:
            return times * gemm_time_s(rows, k, n, self.acc, dtype=self.high, efficiency=self.efficiency)
        fwd, bwd = cast_bytes(rows, k, n, self.recipe, self.e)
        self.cast_forward_bytes += times * fwd
        self.cast_backward_bytes += times * bwd
        self.weight_cast_bytes += times * weight_cast_bytes(k, n, self.recipe, self.e)
        return times * gemm_time_s(rows, k, n, self.acc, dtype=self.dtype, efficiency=self.efficiency)


def _moe_mlp(
    shape: ModelShape,
    b: int,
    s: int,
    acc: Accelerator,
    t: int,
    layout: tuple[int, float],
    g: _Linears,
    sp: bool = False,
) -> tuple[float, float, float]:
    """(GEMM seconds, all-to-all seconds, activation-function width) of a MoE block's MLP on one GPU.

    GEMMs: E/EP local experts, each at :func:`~microbatch.predict.experts.rows_per_expert` rows
    EP·b·s·K/E·load (the GEMM efficiency at that row count: the MoE knee), its F split by t; the S
    shared experts at b·s rows; the router b·s × h × E. All-to-all: dispatch and combine,
    :func:`~microbatch.predict.collectives.alltoall_time_s` of
    :func:`~microbatch.predict.experts.dispatch_bytes` over the EP ranks t apart (NVLink inside a node, the
    NICs across). With tensor and sequence parallelism (``sp``, t > 1, EP > 1) each rank dispatches only its own
    b·s/t tokens (Megatron-core's ``MoEAlltoAllTokenDispatcher``: num_local_tokens = S/TP·B), then the t
    ranks of a tensor group all-gather what they received for their F/t expert shards and reduce-scatter the
    outputs before the combine (:func:`~microbatch.predict.collectives.allgather_time_s`, inside the node):
    1/t of the all-to-all bytes, plus those two. Width: K·load·F + S·F_s, the activation function's
    per-token traffic. Zeros when dense.
    """
    moe = shape.moe
    if moe is None:
        return 0.0, 0.0, 0.0
    ep, load = layout
    h, F, mats = shape.hidden, moe.expert_ffn_hidden, 2 if shape.gated_mlp else 1
    r = rows_per_expert(moe, b, s, ep, load)
    local = moe.experts // ep  # each GEMM once per local expert: its time, casts and weight casts
    gemm = g(r, h, mats * F / t, times=local) + g(r, F / t, h, times=local)
    gemm += g(b * s, h, moe.experts, fp8=False)
    if moe.shared_experts:
        fs = moe.shared_experts * moe.shared_width
        gemm += g(b * s, h, mats * fs / t) + g(b * s, fs / t, h)
    net = g.network
    nbytes = dispatch_bytes(shape, b, s, dtype_bytes=g.e, load=load)
    intra = acc.intra_node_bytes_per_s * acc.intra_node_achievable * net
    inter = acc.inter_node_bytes_per_s * acc.inter_node_achievable * net
    shard = t if sp and t > 1 and ep > 1 else 1  # each tensor rank dispatches its own s/t tokens
    a2a = 2 * alltoall_time_s(nbytes / shard, ep, ranks_per_node(acc, ep, t), intra, inter)
    if shard > 1:  # the tensor group gathers the received tokens, and reduce-scatters the expert outputs
        a2a += allgather_time_s(nbytes, t, intra) + reduce_scatter_time_s(nbytes, t, intra)
    return gemm, a2a, moe.top_k * load * F + moe.shared_experts * moe.shared_width


def logits_forward(
    shape: ModelShape,
    micro_batch: int,
    acc: Accelerator,
    *,
    seq: int | None = None,
    tensor_parallel: int = 1,
    dtype: str = "bf16",
    efficiency: RooflineEfficiency = DEFAULT_EFFICIENCY,
    logits_bytes: int = 4,
) -> tuple[float, float]:
    """(seconds, FLOPs) of the output layer and cross-entropy at rows = b_m·s on one of t GPUs.

    GEMM rows×h×V/t, then 3 passes of the logits in the loss's dtype (``logits_bytes``·rows·V/t bytes: 4, fp32,
    unless the loss takes the half logits, :data:`microbatch.precision.LOSS_DTYPES`): written (at the streaming rate),
    read by the softmax and read again by the loss's backward preparation (2 passes at the softmax rate of
    ``efficiency.score_fractions``: an eager softmax's measured rate on a GPU unless fused). The embedding's,
    final norm's, output GEMM's and loss's launches (:func:`~microbatch.layer_kernels.head_kernels`) are a floor
    under it on a GPU and added to it on a CPU, as a layer's are.
    """
    acc = acc.at_sustained_clock()  # as layer_forward
    s = seq or shape.seq
    rows = micro_batch * s
    t = tensor_parallel
    gemm = gemm_time_s(rows, shape.hidden, shape.vocab / t, acc, dtype=dtype, efficiency=efficiency)
    softmax = efficiency.score_fractions(bool(acc.compute_units))[0]
    passes = 1 / efficiency.memory + 2 / softmax
    loss = logits_bytes * rows * shape.vocab / t * passes / acc.memory_bandwidth_bytes_per_s
    flops = gemm_flops(rows, shape.hidden, shape.vocab / t)
    host = host_time_s(  # the host's launches, as a layer's (:func:`~microbatch.predict.launch.launch_floor`); one is the output GEMM's
        head_kernels(shape), 1, efficiency.launch_s_per_kernel, gemm + loss, cpu=not acc.compute_units,
        gemms_measured=efficiency.gemm_measured is not None,
    )  # fmt: skip
    return gemm + loss + host, flops


# -- FLOPs per step -------------------------------------------------------------------------------------
def model_flops_per_step(shape: ModelShape, global_batch: int, seq: int | None = None) -> float:
    """Model FLOPs of one training step: 3 × forward (forward + 2× backward), no recompute.

    At kv = a, f = 4h this is 72·B·s·L·h²·(1 + s/(6h) + V/(12·L·h)) (Narayanan et al. 2021 Eq. 3;
    Korthikanti et al. 2022 model FLOPs). Used for MFU.
    """
    s = seq or shape.seq
    rows = global_batch * s
    layer = layer_forward_flops(shape, rows, s)
    return 3.0 * (shape.layers * layer + gemm_flops(rows, shape.hidden, shape.vocab))


def hardware_flops_per_step(
    shape: ModelShape, global_batch: int, seq: int | None = None, recompute: str = "none"
) -> float:
    """FLOPs the hardware runs: model FLOPs plus the recomputed forward.

    Full recompute runs each layer's forward twice: 96·B·s·L·h²·(1 + s/(6h) + V/(16·L·h))
    (Narayanan et al. 2021 Eq. 3). Selective recomputes QKᵀ and ·V: 4·B·s²·h per layer (2·B·s²·(d_qk + d_v)·a,
    :func:`microbatch.predict.experts.attention_widths`).
    """
    s = seq or shape.seq
    rows = global_batch * s
    extra = 0.0
    if recompute == "full":
        extra = shape.layers * layer_forward_flops(shape, rows, s)
    elif recompute == "selective":
        extra = shape.layers * 2.0 * rows * attention_span(shape, s) * sum(attention_widths(shape))
    elif recompute == "op":  # the even-numbered matmuls again (:mod:`microbatch.predict.recompute`)
        extra = shape.layers * op_recompute_gemm_share(shape) * 2.0 * rows * gemm_weights(shape)
    return model_flops_per_step(shape, global_batch, s) + extra
