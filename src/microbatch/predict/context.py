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

from microbatch.errors import ConfigError, check_positive_int
from microbatch.model import ModelShape
from microbatch.predict.collectives import overlap_exposed_s

__all__ = [
    "CP_EXCHANGES",
    "check_context_layout",
    "check_context_exchange",
    "kv_exchange_bytes",
    "ring_exposed_s",
    "kv_exchange_exposed_s",
    "ulysses_bytes",
    "check_ulysses_heads",
    "attention_key_split",
]

CP_EXCHANGES = ("allgather", "ring", "ulysses")
"""How context parallelism moves K/V: one all-gather (torch's and torchtitan's default), a ring of sends
(Megatron's p2p), or all-to-alls of the heads (DeepSpeed Ulysses, Megatron's a2a)."""


def check_context_layout(seq: int, context_parallel: int, flash_attention: bool) -> None:
    """ConfigError unless 2c divides s (causal load balance: Megatron's and torch's chunking, under every exchange)
    and attention is flash (the kernel of ring attention's steps, and the one Ulysses runs as its frameworks do)."""
    c = check_positive_int("context_parallel", context_parallel)
    if c == 1:
        return
    if seq % (2 * c):
        ok = [x for x in range(2, 65) if seq % (2 * x) == 0]
        nearest = (seq // (2 * c)) * 2 * c or 2 * c
        fix = (
            f"use context_parallel among {ok[:12]} or another seq"
            if ok
            else f"use seq {nearest} (no context_parallel from 2 to 64 splits {seq})"
        )
        raise ConfigError(
            f"context_parallel {c} needs seq {seq} divisible by 2 × {c} = {2 * c} (each rank holds two "
            f"of 2c chunks, for causal load balance, as Megatron and torch split it whatever the exchange); {fix}",
            params=("context_parallel", "seq"),
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


def check_ulysses_heads(shape: ModelShape, tensor_parallel: int, context_parallel: int) -> None:
    """ConfigError unless t·c divides the query heads and the K/V heads: under Ulysses each GPU attends with whole
    heads, a/(t·c) of them over the full sequence (DeepSpeed's ``DistributedAttention`` and Transformer Engine's
    a2a both assert it)."""
    t, c = tensor_parallel, context_parallel
    kv = shape.heads if shape.mla is not None else shape.kv
    if c <= 1 or (shape.heads % (t * c) == 0 and kv % (t * c) == 0):
        return
    ok = [x for x in range(2, 65) if shape.heads % (t * x) == 0 and kv % (t * x) == 0]
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


def kv_exchange_exposed_s(
    comm_s: float, attention_s: float, attention_backward_s: float, context_parallel: int,
    exchange: str = "allgather", slowdown: float = 0.0,
) -> tuple[float, float]:  # fmt: skip
    """(forward, backward) seconds one layer's K/V exchange adds to its attention, ``comm_s`` being the
    forward's (c − 1)/c of K/V moved once (:func:`kv_exchange_bytes` over the group's bandwidth), or under
    ``ulysses`` the forward's all-to-alls (:func:`ulysses_bytes`), exposed whole in each direction.

    ``ring``: forward :func:`ring_exposed_s` (comm, attention); backward K/V again and their gradients
    back, 2·comm behind the attention backward. ``allgather`` (module docstring): forward comm behind the
    local step only, attention/c; backward the re-gather behind attention_backward/c plus the gradients'
    ring behind the other (c − 1)/c of it. Each through :func:`overlap_exposed_s` with ``slowdown``.
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
        + ring_exposed_s(comm_s, attention_backward_s - local_bwd, slowdown),
    )
