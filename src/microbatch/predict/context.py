"""Context parallelism: a sequence split over c GPUs, ring attention, causal load balance.

Context parallelism (CP; Megatron-core ``context_parallel_size``, Korthikanti et al.'s sequence
parallelism extended to attention; torch's ``torch.distributed.tensor.experimental.context_parallel``;
Liu et al. 2023, "Ring Attention with Blockwise Transformers", arXiv 2310.01889) gives each of c GPUs
s/c tokens of every sequence. Every per-token activation and GEMM shrinks by c; attention needs all
keys and values, so each layer passes the K/V blocks around a ring of c ranks (c − 1 steps), each step
overlapped with the attention of the block already held (Ring Attention §3). Causal masking would give
the last rank the most work; Megatron-core splits each sequence into 2c chunks and gives rank i chunks
i and 2c − 1 − i, so every rank does 1/c of the causal attention (causal load balance) — the rule here,
which needs s divisible by 2c.

**How the K/V blocks travel** (:data:`CP_EXCHANGES`): ``ring`` passes one block a step, each send
overlapped with the attention of the block already held (Megatron-core / Transformer Engine
``--cp-comm-type p2p``; torch's ``set_rotate_method("alltoall")``, torchtitan
``context_parallel_rotate_method = "alltoall"``). ``allgather`` gathers every rank's K/V in one
collective launched before the first (local) attention step and waited on before the second
(torch's ``context_parallel`` default, ``_AllGatherRotater`` in
``torch/distributed/tensor/experimental/_context_parallel/_attention.py``; torchtitan's default;
the Llama 3 report §3.3.2: "the all-gather communication latency is exposed in the critical path"):
the same bytes, hidden only behind the local step, 1/c of the rank's causal attention under the
load balance (its two chunks against each other: 2 of the rank's 2c chunk-pairs). The backward
gathers K/V again the same way; the K/V gradients go back around the ring, one block a step
(torch's backward keeps the all-to-all rotater for them). ``ulysses`` moves heads instead of keys
(Jacobs et al. 2023, "DeepSpeed Ulysses", arXiv 2309.14509; Megatron-core ``--cp-comm-type a2a``, Transformer
Engine's QKVO all-to-all): an all-to-all turns each rank's s/c tokens of every head into all s tokens of a/c
heads before attention, another turns the output back; the backward does the same for dO and for dQ, dK, dV.
Each rank then runs the whole causal sequence on its heads (the kernel's curve at s, not at s/c; no causal
imbalance), and the all-to-alls, on the critical path, are exposed whole; c·t must divide the query and the
K/V heads (:func:`check_ulysses_heads`).

**Layout**: GPUs = t·p·d·c; the c ranks hold the same weights, so gradients are reduced and ZeRO
shards state over the d·c ranks (Megatron's data-parallel × context-parallel group); expert
parallelism lives inside d·c. Attention runs as flash kernels (ring attention is built on them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from microbatch.errors import ConfigError, check_positive_int
from microbatch.hardware import Accelerator
from microbatch.model import ModelShape
from microbatch.predict.collectives import (
    alltoall_time_s,
    group_bandwidth,
    overlap_exposed_s,
    p2p_time_s,
    ranks_per_node,
    ring_hop_bandwidth,
)

__all__ = [
    "CP_EXCHANGES",
    "check_context_layout",
    "check_context_exchange",
    "kv_exchange_bytes",
    "ring_exposed_s",
    "kv_exchange_exposed_s",
    "ulysses_bytes",
    "ring_merge_bytes",
    "CpLayout",
    "cp_exchange_s",
    "check_ulysses_heads",
    "ulysses_divides",
    "attention_key_split",
]

CP_EXCHANGES = ("allgather", "ring", "ulysses")
"""How context parallelism moves K/V: one all-gather (torch's and torchtitan's default), a ring of sends
(Megatron's p2p), or all-to-alls of the heads (DeepSpeed Ulysses, Megatron's a2a)."""


def check_context_layout(
    seq: int, context_parallel: int, flash_attention: bool, also: Callable[[int], bool] | None = None
) -> None:
    """ConfigError unless 2c divides s (causal load balance: Megatron's and torch's chunking, under every exchange)
    and attention is flash (the kernel of ring attention's steps, and the one Ulysses runs as its frameworks do).
    ``also``: another rule a c must meet (Ulysses' heads, :func:`ulysses_divides`), so that the c offered meet it."""
    c = check_positive_int("context_parallel", context_parallel)
    if c == 1:
        return
    if seq % (2 * c):
        splits = [x for x in range(2, 65) if seq % (2 * x) == 0]
        ok = [x for x in splits if also is None or also(x)]
        nearest = (seq // (2 * c)) * 2 * c or 2 * c
        if ok:
            fix = f"use context_parallel among {ok[:12]} or another seq"
        elif splits:  # each rule has its c, none both
            fix = "no context_parallel from 2 to 64 meets the exchange's rule too at this seq; use another cp_comm or seq"
        else:
            fix = f"use seq {nearest} (no context_parallel from 2 to 64 splits {seq})"
        raise ConfigError(
            f"context_parallel {c} needs seq {seq} divisible by 2 × {c} = {2 * c} (each rank holds two "
            f"of 2c chunks, for causal load balance, as Megatron and torch split it whatever the exchange); {fix}",
            params=("context_parallel", "seq", "cp_comm"),
        )
    if not flash_attention:
        raise ConfigError(
            f"context_parallel {c} runs its attention on flash-attention kernels (the ring's and the all-gather's "
            "steps are flash calls; Megatron's and DeepSpeed's Ulysses run flash on each rank's heads); turn "
            "flash_attention on or drop context_parallel",
            params=("context_parallel", "flash_attention"),
        )


def kv_exchange_bytes(shape: ModelShape, micro_batch: int, seq: int, context_parallel: int, *,
                      tensor_parallel: int = 1, dtype_bytes: int = 2) -> float:  # fmt: skip
    """Bytes one GPU sends around the ring in one layer's forward: (c − 1) · e · b · (s/c) · (K + V width) / t.

    K + V width per token: 2 · kv_heads · head_dim (grouped-query attention sends the shared heads), or
    a · (d_h + d_h^R + d_v) for DeepSeek's MLA (Megatron exchanges the decompressed K and V). Split by t
    (each tensor rank holds its heads). The backward sends K and V again and their gradients back: 2 ×.
    """
    c = context_parallel
    if c <= 1:
        return 0.0
    if shape.mla is None:
        width = 2 * shape.kv * shape.head_dim
    else:
        width = shape.heads * (shape.mla.qk_head_dim + shape.mla.v_head_dim)
    return (c - 1) * dtype_bytes * micro_batch * seq / c * width / tensor_parallel


def ring_exposed_s(comm_s: float, attention_s: float, slowdown: float = 0.0) -> float:
    """Seconds the ring exchange adds to attention: each step's send/receive overlaps the attention of the
    block already held (Ring Attention §3), which runs ``slowdown`` slower meanwhile
    (:func:`microbatch.predict.collectives.overlap_exposed_s`; 0: max(0, comm − attention))."""
    return overlap_exposed_s(comm_s, attention_s, slowdown)


def check_context_exchange(exchange: str) -> str:
    """``exchange`` if it is one of :data:`CP_EXCHANGES`, else a ConfigError naming them."""
    if exchange not in CP_EXCHANGES:
        raise ConfigError(
            f"cp_comm {exchange!r} is not a context-parallel exchange; use one of {', '.join(CP_EXCHANGES)} "
            "(allgather: torch's context_parallel and torchtitan's default; ring: Megatron's p2p; ulysses: "
            "DeepSpeed Ulysses, Megatron's a2a)",
            params=("cp_comm",),
        )
    return exchange


def ulysses_bytes(shape: ModelShape, micro_batch: int, seq: int, context_parallel: int, *,
                  tensor_parallel: int = 1, dtype_bytes: int = 2) -> float:  # fmt: skip
    """Bytes one GPU puts through the all-to-alls of one layer's forward under Ulysses: e · b · (s/c) · (Q + K + V +
    O widths) / t, of which (c − 1)/c leave the GPU (:func:`~microbatch.predict.collectives.alltoall_time_s` takes
    that share). Widths per token: a·d_h for Q and O, kv·d_h for K and V (grouped-query attention moves the shared
    heads), or MLA's a·(d_h + d_h^R) for Q and K and a·d_v for V and O (Megatron exchanges them decompressed). The
    backward moves dO in and dQ, dK, dV out: the same bytes. 0 without context parallelism.
    """
    c = context_parallel
    if c <= 1:
        return 0.0
    if shape.mla is None:
        widths = 2 * shape.q_width + 2 * shape.kv * shape.head_dim
    else:
        widths = 2 * shape.heads * (shape.mla.qk_head_dim + shape.mla.v_head_dim)
    return dtype_bytes * micro_batch * seq / c * widths / tensor_parallel


def ulysses_divides(shape: ModelShape, tensor_parallel: int, context_parallel: int) -> bool:
    """Whether t·c divides the query heads and the K/V heads (:func:`check_ulysses_heads`' rule)."""
    n = tensor_parallel * context_parallel
    kv = shape.heads if shape.mla is not None else shape.kv
    return shape.heads % n == 0 and kv % n == 0


def check_ulysses_heads(
    shape: ModelShape, tensor_parallel: int, context_parallel: int, seq: int | None = None
) -> None:
    """ConfigError unless t·c divides the query heads and the K/V heads: under Ulysses each GPU attends with whole
    heads, a/(t·c) of them over the full sequence (DeepSpeed's ``DistributedAttention`` and Transformer Engine's
    a2a both assert it). ``seq``: the c offered also split it into 2c chunks (:func:`check_context_layout`)."""
    t, c = tensor_parallel, context_parallel
    kv = shape.heads if shape.mla is not None else shape.kv
    if c <= 1 or ulysses_divides(shape, t, c):
        return
    ok = [x for x in range(2, 65) if ulysses_divides(shape, t, x) and (seq is None or seq % (2 * x) == 0)]
    fewer_t = [x for x in range(1, t) if shape.heads % (x * c) == 0 and kv % (x * c) == 0]
    fix = (
        f"use context_parallel among {ok[:8]}"
        if ok
        else f"use tensor_parallel among {fewer_t}"
        if fewer_t
        else ""
    )
    raise ConfigError(
        f"cp_comm ulysses splits the heads over tensor_parallel × context_parallel = {t} × {c} = {t * c} GPUs, "
        f"which must divide both the {shape.heads} query heads and the {kv} K/V heads of {shape.name}; "
        + (f"{fix}, or " if fix else "")
        + "use cp_comm ring or allgather (they split the sequence, not the heads)",
        params=("cp_comm", "context_parallel", "tensor_parallel"),
    )


def attention_key_split(context_parallel: int, exchange: str) -> int:
    """How many pieces each rank's attention kernel sees the keys in: c for the ring and the all-gather (each step
    attends to s/c keys), 1 under Ulysses (whole sequences of fewer heads)."""
    return 1 if check_context_exchange(exchange) == "ulysses" else max(1, context_parallel)


def ring_merge_bytes(shape: ModelShape, micro_batch: int, seq: int, context_parallel: int, *,
                     tensor_parallel: int = 1, dtype_bytes: int = 2) -> tuple[float, float]:  # fmt: skip
    """(forward, backward) bytes of the memory-bound work around a ring's c attention steps on one GPU, in the
    tensors' own dtype — what Transformer Engine's ``AttnFuncWithCP`` runs beside the kernels (v1.4
    ``transformer_engine/pytorch/attention.py``; line numbers of that tag), with Q = O = e·b·(s/c)·a·d/t and
    K = V = e·b·(s/c)·kv·d/t bytes per rank, each off-diagonal step's tensors at their mean over its two kinds (half
    the K/V against all of Q, or half of Q against all of K/V; half the ranks run each kind at a given step):

    - forward: K and V packed into the send buffer (L537: read and write 2K); each of the c − 1 off-diagonal steps
      copies half of K/V or half of Q contiguous (L592, L606, L621: mean K + Q/2); the output zeroed (L683: Q);
      the output corrected by each step's log-sum-exp (L703–715: read the step's output, read and write the running
      one: 3Q for the diagonal step, mean 2.25Q for the others, which correct half of it when they ran half of Q):
      4K + 4Q + (c − 1)(K + 2.75Q);
    - backward: K/V copied into the buffer (L762: 4K); the diagonal step adds its dQ (3Q) and packs and adds its dK,
      dV (4K + 6K) with no copy; each of the c − 1 others copies half of K/V or half of Q, O and dO (L841, L879–884:
      mean K + 1.5Q), adds its dQ (L959, L974: mean 2.25Q), packs dK and dV (L982: mean 3K) and adds them to the
      travelling dK/dV (L997–1011: mean 4.5K): 14K + 3Q + (c − 1)(8.5K + 3.75Q).

    Counted as on the critical path: an upper bound where the forward's copies run on its second stream beside the
    other stream's kernel (TE alternates two). torch's ``context_parallel`` merges each step's output too
    (``_SDPAMerger``: out − σ(lse_b − lse)·(out − out_b) in fp32, eager) and accumulates the gradients in fp32,
    sending dK/dV in fp32: more bytes than these, so for torch's exchanges the count is a lower bound. Ulysses runs
    one kernel and merges nothing. (0, 0) without context parallelism.
    """
    c = context_parallel
    if c <= 1:
        return 0.0, 0.0
    tokens = dtype_bytes * micro_batch * seq / c / tensor_parallel
    if shape.mla is None:
        q, k = tokens * shape.q_width, tokens * shape.kv * shape.head_dim
    else:  # MLA: Q and K at a·(d + d_R), V and O at a·d_v (decompressed); each pair at its mean
        q = k = tokens * shape.heads * (shape.mla.qk_head_dim + shape.mla.v_head_dim) / 2
    forward = 4 * k + 4 * q + (c - 1) * (k + 2.75 * q)
    backward = 14 * k + 3 * q + (c - 1) * (8.5 * k + 3.75 * q)
    return forward, backward


def kv_exchange_exposed_s(
    comm_s: float, attention_s: float, attention_backward_s: float, context_parallel: int,
    exchange: str = "allgather", slowdown: float = 0.0, gradient_ring_s: float | None = None,
) -> tuple[float, float]:  # fmt: skip
    """(forward, backward) seconds one layer's K/V exchange adds to its attention, ``comm_s`` being the
    forward's (c − 1)/c of K/V moved once (:func:`kv_exchange_bytes` over the group's bandwidth: the ring's hop,
    :func:`~microbatch.predict.collectives.ring_hop_bandwidth`, or the all-gather's), or under ``ulysses`` the
    forward's all-to-alls (:func:`ulysses_bytes`), exposed whole in each direction.

    ``ring``: forward :func:`ring_exposed_s` (comm, attention); backward K/V again and their gradients
    back, 2·comm behind the attention backward. ``allgather`` (module docstring): forward comm behind the
    local step only, attention/c; backward the re-gather behind attention_backward/c plus the gradients'
    ring (``gradient_ring_s``, the same bytes sent around a ring, ``comm_s`` when None) behind the other (c − 1)/c
    of it. Each through :func:`overlap_exposed_s` with ``slowdown``.
    """
    c = context_parallel
    if c <= 1 or comm_s <= 0:
        return 0.0, 0.0
    if check_context_exchange(exchange) == "ulysses":  # all-to-alls on the critical path: exposed whole
        return comm_s, comm_s
    if exchange == "ring":
        return (
            ring_exposed_s(comm_s, attention_s, slowdown),
            ring_exposed_s(2 * comm_s, attention_backward_s, slowdown),
        )
    local, local_bwd = attention_s / c, attention_backward_s / c
    return (
        overlap_exposed_s(comm_s, local, slowdown),
        overlap_exposed_s(comm_s, local_bwd, slowdown)
        + ring_exposed_s(
            comm_s if gradient_ring_s is None else gradient_ring_s, attention_backward_s - local_bwd, slowdown
        ),
    )


@dataclass(frozen=True)
class CpLayout:
    """One layer's context-parallel layout on one GPU: c ranks ``tensor_parallel`` apart, their exchange, and the
    activations' bytes per element."""

    context_parallel: int
    tensor_parallel: int
    exchange: str
    dtype_bytes: int = 2


def cp_exchange_s(
    shape: ModelShape, micro_batch: int, seq: int, acc: Accelerator, layout: CpLayout, network: float,
    memory: float, attention: tuple[float, float], slowdown: float = 0.0,
) -> tuple[float, float]:  # fmt: skip
    """(forward, backward) seconds the context-parallel exchange adds to one layer on one GPU, ``attention`` being
    the attention core's (forward, backward) seconds it can hide behind.

    ``ulysses``: the all-to-alls of :func:`ulysses_bytes` over the c ranks (NVLink inside a node, each GPU's NIC
    across: :func:`~microbatch.predict.collectives.alltoall_time_s`), exposed whole. ``ring``: K/V
    (:func:`kv_exchange_bytes`) at the ring's slowest hop (:func:`~microbatch.predict.collectives.ring_hop_bandwidth`:
    one NIC once the ring leaves a node); ``allgather``: the gather at the group's collective bandwidth
    (:func:`~microbatch.predict.collectives.group_bandwidth`), its gradients' ring at the hop's; both through
    :func:`kv_exchange_exposed_s`, plus the steps' merges (:func:`ring_merge_bytes`) at the streaming rate
    ``memory`` of the memory bandwidth, on the critical path. Links at their achievable rate × ``network``.
    (0, 0) when c = 1.
    """
    c, t, e = layout.context_parallel, layout.tensor_parallel, layout.dtype_bytes
    if c <= 1:
        return 0.0, 0.0
    if check_context_exchange(layout.exchange) == "ulysses":
        intra = acc.intra_node_bytes_per_s * acc.intra_node_achievable * network
        inter = acc.inter_node_bytes_per_s * acc.inter_node_achievable * network
        nbytes = ulysses_bytes(shape, micro_batch, seq, c, tensor_parallel=t, dtype_bytes=e)
        a2a = alltoall_time_s(nbytes, c, ranks_per_node(acc, c, t), intra, inter)
        return a2a, a2a
    kv = kv_exchange_bytes(shape, micro_batch, seq, c, tensor_parallel=t, dtype_bytes=e)
    hop = p2p_time_s(kv, ring_hop_bandwidth(acc, c, t) * network)
    gather = hop if layout.exchange == "ring" else p2p_time_s(kv, group_bandwidth(acc, c, t) * network)
    fwd, bwd = kv_exchange_exposed_s(gather, *attention, c, layout.exchange, slowdown, gradient_ring_s=hop)
    merge_f, merge_b = ring_merge_bytes(shape, micro_batch, seq, c, tensor_parallel=t, dtype_bytes=e)
    rate = acc.memory_bandwidth_bytes_per_s * memory
    return fwd + merge_f / rate, bwd + merge_b / rate
