"""Collectives and point-to-point sends: seconds of moving bytes between GPUs, at achievable bandwidth.

Ring collectives (Patarasuk & Yuan 2009) at the bus bandwidth a process group reaches
(:func:`group_bandwidth`: NVLink inside a node, one NIC per rank of the group in each node across
nodes, each at the fraction NCCL reaches on that link, ``Accelerator.intra_node_achievable`` /
``inter_node_achievable``); Megatron-LM's pipeline hand-off (scatter/gather, Narayanan et al. 2021
§4.1) and the sequence-parallel backward re-gather (Korthikanti et al. 2022 §4.2.2). Latency (α)
terms are ignored: they matter only for messages far smaller than a layer's activations.

Pure Python: no torch.
"""

from __future__ import annotations

from microbatch.hardware import Accelerator

__all__ = [
    "allreduce_time_s",
    "allgather_time_s",
    "reduce_scatter_time_s",
    "p2p_time_s",
    "pipeline_send_time_s",
    "scatter_gather_send_s",
    "sp_regather_time_s",
    "group_bandwidth",
    "ring_hop_bandwidth",
    "pipeline_hop_bandwidth",
    "ranks_per_node",
    "alltoall_time_s",
    "fsdp_edges_s",
    "ZERO3_IMPLS",
    "fsdp2_accumulate_s",
    "fsdp2_copy_in_s",
    "fsdp2_copy_out_s",
    "ring_latency_s",
    "overlap_exposed_s",
    "OVERLAP_COMPUTE_SLOWDOWN",
    "NCCL_RING_BASE_LATENCY_S",
    "NCCL_RING_NVLINK_HOP_S",
    "NCCL_RING_NET_HOP_S",
]

NCCL_RING_BASE_LATENCY_S = 8.4e-6
"""A ring collective's fixed latency, Simple protocol: NCCL's own tuning model (``baseLat`` ring/Simple, 8.4 µs,
NVIDIA/nccl src/graph/tuning.cc at commit 01afd20)."""
NCCL_RING_NVLINK_HOP_S = 3.4e-6
"""Latency of one ring step inside a node over NVLink, Simple protocol (``hwLat`` NVLink ring/Simple, 3.4 µs, same file)."""
NCCL_RING_NET_HOP_S = 9.6e-6
"""Latency of one ring step between nodes, Simple protocol (``hwLat`` NET ring/Simple, 9.6 µs, same file at that
commit; later NCCL releases list 14 µs there: the cited commit's figure is the one used, and what a run's NCCL
version pays is not known to the planner)."""


OVERLAP_COMPUTE_SLOWDOWN = 0.189
"""How much longer computation takes while a collective runs beside it on the same GPU: 18.9%, the mean
computational slowdown measured when GPT and Llama layers overlap NCCL collectives on 4 A100s,
H100s, MI250s and MI210s ("Characterizing Compute-Communication Overlap in GPU-Accelerated Distributed Deep
Learning", arXiv 2507.03114, abstract: mean 18.9%, max 40.0%, against the same kernels run alone). The cause
is physical: NCCL's kernels hold one thread block per channel on the SMs and share HBM bandwidth with the
GEMMs (an FSDP prefetch all-gather on an H100 launched 24 blocks on its 132 SMs, 18.2% of them: NVIDIA
developer forum, "Compute-communication overlap causes severe GEMM performance degradation because of tail
effect", 2025). Used by :func:`overlap_exposed_s`; ``RooflineEfficiency.overlap_slowdown`` carries it."""


def overlap_exposed_s(comm_s: float, compute_s: float, slowdown: float = OVERLAP_COMPUTE_SLOWDOWN) -> float:
    """Seconds a collective of ``comm_s`` run beside ``compute_s`` of computation adds to that computation.

    While the collective runs, computation proceeds at 1/(1 + σ) of its rate (σ = ``slowdown``,
    :data:`OVERLAP_COMPUTE_SLOWDOWN`), so the ``comm_s`` window covers comm_s/(1 + σ) seconds of work and
    the pair ends at max(comm, compute + σ·min(comm/(1 + σ), compute)); minus the computation alone:
    exposed = max(comm − compute, σ·min(comm/(1 + σ), compute)). With σ = 0 it is the usual
    max(0, comm − compute): communication hidden wherever computation outlasts it.
    """
    if comm_s <= 0.0:
        return 0.0
    sigma = max(0.0, slowdown)
    slowed = sigma * min(comm_s / (1.0 + sigma), compute_s)
    return max(comm_s - compute_s, slowed)


def allreduce_time_s(nbytes: float, ranks: int, bytes_per_s: float) -> float:
    """Ring all-reduce: 2·(n−1)/n · bytes / bandwidth (Patarasuk & Yuan 2009); 0 for one rank."""
    return 0.0 if ranks <= 1 else 2.0 * (ranks - 1) / ranks * nbytes / bytes_per_s


def allgather_time_s(nbytes: float, ranks: int, bytes_per_s: float) -> float:
    """Ring all-gather of a ``nbytes`` result: (n−1)/n · bytes / bandwidth."""
    return 0.0 if ranks <= 1 else (ranks - 1) / ranks * nbytes / bytes_per_s


def reduce_scatter_time_s(nbytes: float, ranks: int, bytes_per_s: float) -> float:
    """Ring reduce-scatter of a ``nbytes`` input: (n−1)/n · bytes / bandwidth."""
    return allgather_time_s(nbytes, ranks, bytes_per_s)


def p2p_time_s(nbytes: float, bytes_per_s: float) -> float:
    """One point-to-point send: bytes / bandwidth."""
    return nbytes / bytes_per_s


def scatter_gather_send_s(
    nbytes: float, tensor_parallel: int, bw_pp: float, bw_tp: float, sequence_parallel: bool = False
) -> float:
    """One pipeline hand-off of a ``nbytes`` (b·s·h·e) activation from one stage's t tensor ranks to the next's.

    Megatron-LM's scatter/gather (Narayanan et al. 2021 §4.1): each of the t ranks sends 1/t of the tensor
    over the pipeline link, then the receiving stage all-gathers the slices over NVLink:
    nbytes/t / bw_pp + (t−1)/t · nbytes / bw_tp. Under sequence parallelism the activation between stages
    is already the rank's s/t shard and Megatron sends only that, with no gather (``p2p_communication``:
    the scatter/gather applies only ``if args.scatter_gather_tensors_in_pipeline and not
    args.sequence_parallel``; the receive shape is (s/t, b, h)): nbytes/t / bw_pp. Blocking in the Megatron-LM
    of 2021–22 (the send, the receive and the gather are waited on before the next pass), so not overlapped.
    """
    t = max(1, tensor_parallel)
    send = p2p_time_s(nbytes / t, bw_pp)
    if t == 1 or sequence_parallel:
        return send
    return send + allgather_time_s(nbytes, t, bw_tp)


def pipeline_send_time_s(
    nbytes: float,
    acc: Accelerator,
    *,
    tensor_parallel: int,
    pipeline_stride: int,
    network: float = 1.0,
    sequence_parallel: bool = False,
) -> float:
    """:func:`scatter_gather_send_s` between two stages ``pipeline_stride`` ranks apart (another node when
    t·d ≥ G), both links at the achievable bandwidth (:func:`group_bandwidth`) times ``network``. With
    interleaving each micro-batch crosses v chunk boundaries per rank, so v of these per pass."""
    t = max(1, tensor_parallel)
    bw_pp = group_bandwidth(acc, 2, pipeline_stride) * network
    bw_tp = group_bandwidth(acc, t, 1) * network
    return scatter_gather_send_s(nbytes, t, bw_pp, bw_tp, sequence_parallel)


def group_bandwidth(acc: Accelerator, size: int, stride: int) -> float:
    """Achievable per-GPU bandwidth of a process group of ``size`` ranks ``stride`` apart.

    Megatron orders ranks tensor-fastest, then data, then pipeline: the group stays inside one node
    (NVLink/xGMI) when size × stride ≤ GPUs per node, else it crosses the network. The link's figure
    times the fraction collectives reach on it (``Accelerator.intra_node_achievable`` /
    ``inter_node_achievable``: NCCL's protocol overhead).
    """
    intra = acc.intra_node_bytes_per_s * acc.intra_node_achievable
    if size * stride <= acc.gpus_per_node:
        return intra
    return min(
        intra, acc.inter_node_bytes_per_s * acc.inter_node_achievable * ranks_per_node(acc, size, stride)
    )


def ring_hop_bandwidth(acc: Accelerator, size: int, stride: int) -> float:
    """Per-GPU bandwidth of a ring of point-to-point sends over ``size`` ranks ``stride`` apart, each rank sending to
    one neighbour (Transformer Engine's context-parallel ring: one ``isend``/``irecv`` pair a step): NVLink while the
    ring stays in one node, else its slowest hop, a send between two nodes through the sending GPU's own NIC — a
    collective's several rings leave a node by several NICs (:func:`group_bandwidth`), one peer-to-peer stream by
    one. Each at its achievable fraction."""
    intra = acc.intra_node_bytes_per_s * acc.intra_node_achievable
    if size * stride <= acc.gpus_per_node:
        return intra
    return min(intra, acc.inter_node_bytes_per_s * acc.inter_node_achievable)


def pipeline_hop_bandwidth(acc: Accelerator, stages: int, stride: int) -> float:
    """Mean per-GPU bandwidth of the stage-to-stage sends a micro-batch makes along a pipeline of ``stages`` ranks
    ``stride`` apart: each node holds k = G/stride consecutive stages (one when stride ≥ G), so one hop in k leaves
    the node by the sending GPU's NIC and the others ride NVLink; a micro-batch passes them one after another, so
    their times add: 1/bw = (1/k)/NIC + (1 − 1/k)/NVLink (each at its achievable fraction). NVLink alone when the
    whole pipeline fits in a node. Unlike a ring step (:func:`ring_hop_bandwidth`), no send waits for the slowest."""
    intra = acc.intra_node_bytes_per_s * acc.intra_node_achievable
    if stages * stride <= acc.gpus_per_node:
        return intra
    nic = min(intra, acc.inter_node_bytes_per_s * acc.inter_node_achievable)
    k = max(1, acc.gpus_per_node // max(1, stride))
    return 1.0 / (1.0 / (k * nic) + (1.0 - 1.0 / k) / intra)


def ranks_per_node(acc: Accelerator, size: int, stride: int) -> int:
    """Ranks of a group of ``size`` ranks ``stride`` apart that share one node: ⌊G/stride⌋, in [1, size].

    A collective over such a group runs one ring per channel, each channel leaving the node through a
    different NIC (NCCL's rings, one NIC per GPU in DGX/HGX nodes): with k ranks per node every ring
    carries 1/k of the data across the k NICs of those ranks, so the per-GPU bus bandwidth is k × one
    NIC's (bounded by NVLink). With one rank per node (stride ≥ G, as for tensor × data strides of a
    pipeline, or t = 8 for data parallelism) it is one NIC's.
    """
    return max(1, min(size, acc.gpus_per_node // max(1, stride)))


def sp_regather_time_s(nbytes: float, ranks: int, bytes_per_s: float) -> float:
    """Two all-gathers of a ``nbytes`` (rows × h) tensor in each layer's backward under sequence parallelism.

    Sequence parallelism keeps only the 1/t shard of the LayerNorm outputs that feed the QKV and the
    first MLP GEMM; their weight gradients need the whole tensor, so the backward all-gathers it again
    (Korthikanti et al. 2022 §4.2.2; Megatron-LM ``LinearWithGradAccumulationAndAsyncCommunication``).
    Counted as exposed, as calculon's validation of the same runs does (``seq_par_ag_redo`` with no
    tensor-parallel overlap, calculon-ai/calculon validation/seqsel/tab5). 2·(t−1)/t·bytes/bandwidth.
    """
    return 2.0 * allgather_time_s(nbytes, ranks, bytes_per_s)


def alltoall_time_s(nbytes: float, ranks: int, ranks_in_node: int, bw_intra: float, bw_inter: float) -> float:
    """One all-to-all in which each GPU sends ``nbytes`` spread evenly over ``ranks`` GPUs (MoE dispatch or
    combine): the (k−1)/n share for the k − 1 peers in its node goes over NVLink, the (n−k)/n share for
    the other nodes over its own NIC, both at once: max(bytes·(k−1)/n / bw_intra, bytes·(n−k)/n / bw_inter)
    (the pairwise-exchange all-to-all NCCL runs, one peer per step; DeepSeek-V3 §3.2.2 bounds the
    cross-node share by routing each token to at most 4 nodes, which this does not model). 0 for one rank.
    """
    if ranks <= 1:
        return 0.0
    k = max(1, min(ranks, ranks_in_node))
    intra = nbytes * (k - 1) / ranks / bw_intra
    inter = nbytes * (ranks - k) / ranks / bw_inter if ranks > k else 0.0
    return max(intra, inter)


def fsdp_edges_s(allgather_s: float, reduce_scatter_s: float, units: int, microsteps: int) -> float:
    """ZeRO-3/FSDP communication no prefetch can hide: m · (AG + RS)/u seconds per optimizer step.

    FSDP gathers and reduce-scatters one wrapped unit (a transformer block) at a time and prefetches
    the next unit's gather behind the current unit's compute (PyTorch FSDP's forward/backward prefetch,
    Zhao et al. 2023, arXiv 2304.11277 §3.3-3.4; DeepSpeed ZeRO-3's prefetch bucket likewise). The
    first unit's gather of each micro-step's forward has nothing before it to run behind, and the last
    unit's reduce-scatter of each micro-step's backward has nothing after it: FSDP2's backward ends every
    micro-step by making the compute stream wait on the reduce-scatters (``is_last_backward`` is True unless the
    loop sets it: ``_fsdp_state.py``'s final callback, ``FSDPParamGroup.finalize_backward``), as FSDP1's root
    callback and DeepSpeed's epilogue do. Of the whole-stage all-gather ``allgather_s`` and reduce-scatter
    ``reduce_scatter_s`` spread over ``units`` units, one unit's gather and one unit's reduce-scatter per
    micro-step stay exposed whatever the compute. Ignores the latency of each call.
    """
    u = max(1, units)
    return microsteps * (allgather_s + reduce_scatter_s) / u


ZERO3_IMPLS = ("fsdp2", "fsdp1", "deepspeed", "megatron")
"""Who runs ZeRO-3: PyTorch's ``fully_shard`` (FSDP2), ``FullyShardedDataParallel`` (FSDP1), DeepSpeed, or
Megatron-core's FSDP (its ``ParamAndGradBuffer`` buckets: the parameters are views of the gathered bucket)."""


def fsdp2_copy_out_s(unit_bytes: float, bytes_per_s: float) -> float:
    """Seconds FSDP2 spends copying one gathered unit out of its all-gather buffer, on the compute stream.

    ``fully_shard`` all-gathers into one flat buffer, then ``foreach_all_gather_copy_out`` makes the
    *current* stream wait on the gather and copies each parameter out of it with
    ``torch.split_with_sizes_copy`` (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py, called from
    ``FSDPParamGroup.wait_for_unshard``): a read and a write of the unit's unsharded bytes, in line with
    the computation, never hidden. FSDP1's flat parameter, DeepSpeed's ZeRO-3 and Megatron-core's FSDP
    buckets compute from the gathered buffer itself (no copy). ``bytes_per_s``: the streaming copy rate (bandwidth × the measured copy fraction).
    """
    return 2.0 * unit_bytes / bytes_per_s


def fsdp2_accumulate_s(params: float, held_bytes: int, grad_bytes: int, bytes_per_s: float) -> float:
    """Seconds of one micro-batch's gradient accumulation under FSDP2 with gradient sync off (a pipeline stage that
    reduces after its last micro-batch): each unit's post-backward adds the new gradient (``grad_bytes`` each, the
    compute dtype) into the accumulated one (``held_bytes``, the reduce dtype), read and written on the compute
    stream: ``params`` × (2·held + grad) bytes at ``bytes_per_s`` (torch/distributed/fsdp/_fully_shard/_fsdp_param.py
    ``accumulate_unsharded_grad_if_needed``: ``unsharded_accumulated_grad += unsharded_param.grad``; in the compute
    dtype, autograd's own in-place add, the same three passes). 10 B a parameter for bf16 into fp32; the first
    micro-batch's upcast (6 B) is priced as the others."""
    return params * (2 * held_bytes + grad_bytes) / bytes_per_s


def fsdp2_copy_in_s(grad_bytes: float, reduce_bytes: float, bytes_per_s: float) -> float:
    """Seconds FSDP2 spends copying one unit's unsharded gradients into its reduce-scatter buffer, on the compute
    stream: ``foreach_reduce`` allocates the buffer in the reduce dtype and runs ``foreach_reduce_scatter_copy_in``
    on the current stream before the reduce-scatter stream waits on it (torch/distributed/fsdp/_fully_shard/
    _fsdp_collectives.py): a read of ``grad_bytes`` (the gradients in the parameters' dtype) and a write of
    ``reduce_bytes`` (fp32 under torchtitan's ``mixed_precision_reduce``), in line with the backward."""
    return (grad_bytes + reduce_bytes) / bytes_per_s


def ring_latency_s(ranks: int, nodes: int, *, allreduce: bool = False) -> float:
    """α of one ring collective over ``ranks`` GPUs on ``nodes`` nodes, NCCL's model: base + steps × hop.

    All-gather and reduce-scatter take n − 1 steps, of which N − 1 cross nodes (an all-reduce twice as
    many): α = 8.4 µs + (steps − inter)·3.4 µs + inter·9.6 µs (NVIDIA/nccl src/graph/tuning.cc, ring,
    Simple protocol; its 1.9× "plateau" factor for large inter-node all-reduces is left out). It grows
    linearly with the group: the data-parallel width's cost that the bandwidth term (n−1)/n·bytes/bw hides.
    0 for one rank.
    """
    if ranks <= 1:
        return 0.0
    k = 2 if allreduce else 1
    steps, inter = k * (ranks - 1), k * (max(1, nodes) - 1)
    return NCCL_RING_BASE_LATENCY_S + (steps - inter) * NCCL_RING_NVLINK_HOP_S + inter * NCCL_RING_NET_HOP_S
