"""Mixture-of-experts costs: rows per expert, expert activations, the all-to-all, expert parallelism.

A MoE block (:class:`microbatch.moe.Experts`) routes each of a micro-batch's b·s tokens to K of E
experts plus S shared ones; expert parallelism (EP, GShard) places E/EP experts on each of EP GPUs
inside the data-parallel group, with a dispatch and a combine all-to-all. The layout (Megatron-core's),
how it differs from Megatron-LM's memory formula, and the routing assumptions (dropless with a stated
``load``, or a capacity factor) are in ``docs/moe.md``.
"""

from __future__ import annotations

from microbatch.errors import ConfigError, check_positive, check_positive_int
from microbatch.moe import Experts
from microbatch.shape import ModelShape

__all__ = [
    "check_expert_layout",
    "expert_load",
    "rows_per_expert",
    "routed_rows",
    "expert_params",
    "zero3_unit_params",
    "moe_activation_terms",
    "dispatch_bytes",
    "attention_widths",
    "gemm_weights",
]


def ep_group_words(data_parallel: int, context_parallel: int = 1, shard_degree: int | None = None) -> str:
    """The ranks expert parallelism is carved from, in words: the data-parallel (× context-parallel) group, or hybrid
    sharding's shard group; the count :func:`check_expert_layout` is given."""
    d = data_parallel if shard_degree is None else shard_degree
    what = "data-parallel" if shard_degree is None else "shard-group"
    return (
        f"{what} {d}"
        if context_parallel == 1
        else f"{what} × context-parallel {d} × {context_parallel} = {d * context_parallel}"
    )


def check_expert_layout(
    shape: ModelShape, expert_parallel: int, data_parallel: int, capacity_factor: float | None = None,
    group: str | None = None,
) -> None:  # fmt: skip
    """ConfigError unless EP divides E and the data-parallel size d (EP lives inside the d replicas), and
    unless a capacity factor comes with routed experts (on a dense model it would change nothing). ``group``: the
    ranks ``data_parallel`` counts, in words (:func:`ep_group_words`)."""
    group = group or f"data-parallel {data_parallel}"
    check_positive_int("expert_parallel", expert_parallel)
    if capacity_factor is not None and shape.moe is None:
        raise ConfigError(
            f"capacity_factor {capacity_factor:g} pads the routed experts' buffers, and {shape.name} is dense "
            "(no experts); give experts E and top_k K, a MoE model (mixtral-8x7b, deepseek-v3), or drop capacity_factor",
            params=("capacity_factor", "experts", "top_k"),
        )
    if capacity_factor is not None and shape.moe is not None:
        # a buffer of c × b·s·K/E copies holds every token at c = E/K and every copy of the micro-batch at c = E:
        # padded implementations (GShard, DeepSpeed) take more than E/K, wastefully; past E nothing is left to pad for
        most = shape.moe.experts
        if not (isinstance(capacity_factor, (int, float)) and 0 < capacity_factor <= most):
            raise ConfigError(
                f"capacity_factor {capacity_factor!r} is outside (0, E = {most}]: at E an expert's buffer holds "
                f"every routed copy of the micro-batch (at E/K = {most / shape.moe.top_k:g}, every token); give for "
                "example 1.25 (GShard, Switch), or none for dropless",
                params=("capacity_factor",),
            )
    if expert_parallel == 1:
        return
    if shape.moe is None:
        raise ConfigError(
            f"expert_parallel {expert_parallel} needs a mixture-of-experts model ({shape.name} is dense); "
            "give experts E and top_k K, a MoE model (mixtral-8x7b, deepseek-v3), or drop expert_parallel",
            params=("expert_parallel", "experts", "top_k"),
        )
    e = shape.moe.experts
    if e % expert_parallel:
        ok = [x for x in range(1, e + 1) if e % x == 0 and data_parallel % x == 0]
        wider = [x for x in range(2, e + 1) if e % x == 0 and x not in ok]
        raise ConfigError(
            f"expert_parallel {expert_parallel} does not divide experts {e}; every GPU holds E/EP whole "
            f"experts; use expert_parallel among {ok}"
            + (f" at {group} ({', '.join(map(str, wider))} with a data-parallel they divide)"
               if wider else ""),
            params=("expert_parallel", "data_parallel"),
        )  # fmt: skip
    if data_parallel % expert_parallel:
        ok = [x for x in range(1, data_parallel + 1) if data_parallel % x == 0 and e % x == 0]
        raise ConfigError(
            f"expert_parallel {expert_parallel} does not divide {group}; the experts are "
            f"spread over ranks of the data-parallel group (Megatron's layout); use expert_parallel among {ok}",
            params=("expert_parallel",),
        )


def expert_load(capacity_factor: float | None, imbalance: float = 1.0) -> float:
    """Token copies a GPU's experts hold per micro-batch, over the balanced share b·s·K.

    Dropless (``capacity_factor`` None): ``imbalance`` (1 = perfectly balanced, the stated assumption).
    With a capacity factor c: the buffers are padded to c × the balanced share (GShard §2.2), so c.
    """
    if check_positive("expert_imbalance", imbalance) < 1:
        raise ConfigError(
            f"expert_imbalance {imbalance!r} must be >= 1: the most loaded GPU's rows over the balanced share "
            "(1 = even load); give 1 for balanced experts"
        )
    if capacity_factor is None:
        return imbalance
    return check_positive(
        "capacity factor", capacity_factor, fix="give for example 1.25, or none for dropless"
    )


def rows_per_expert(
    moe: Experts, micro_batch: int, seq: int, expert_parallel: int = 1, load: float = 1.0
) -> float:
    """Rows one expert's GEMMs see per micro-batch: EP·b_m·s·K/E × load.

    Each of the EP GPUs routes b_m·s·K token copies evenly over E experts; an expert lives on one GPU
    of the EP group and receives its share from all EP of them (the micro-batches of the EP ranks are
    dispatched together). At EP = 1 this is b_m·s·K/E, the knee's variable: with E = 256, K = 8 an
    expert sees 1/32 of the micro-batch's tokens.
    """
    return expert_parallel * micro_batch * seq * moe.top_k / moe.experts * load


def routed_rows(moe: Experts, micro_batch: int, seq: int, load: float = 1.0) -> float:
    """Token copies one GPU's experts hold per micro-batch: b_m·s·K × load (E/EP experts × the rows of each)."""
    return micro_batch * seq * moe.top_k * load


def expert_params(shape: ModelShape, first: int, count: int, moe_blocks: int | None = None) -> int:
    """Routed-expert parameters of blocks ``first`` … ``first + count − 1`` (the part EP shards), or of
    ``moe_blocks`` MoE blocks wherever they are (a rank's under a chunked placement):
    E · matrices · h · F per MoE block. The router and the shared experts are replicated like dense weights."""
    moe = shape.moe
    if moe is None:
        return 0
    if moe_blocks is None:
        moe_blocks = shape.moe_layer_count(first, count)
    return moe_blocks * moe.routed_params(shape.hidden, 3 if shape.gated_mlp else 2)


def moe_activation_terms(
    shape: ModelShape,
    micro_batch: int,
    seq: int,
    *,
    tensor_parallel: int,
    sp: int,
    dtype_bytes: int,
    load: float,
) -> dict[str, float]:
    """Bytes a MoE block's MLP keeps for its backward per micro-batch, replacing the dense ``mlp_hidden``.

    Korthikanti et al. 2022 §4.1's MLP terms applied to the R = b·s·K·load routed rows (Megatron-core's
    ``MoELayer``: router, permutation, grouped expert MLP, unpermutation):

    - ``router``: fp32 logits and probabilities, 2 × 4·b·s·E (Megatron keeps the router in fp32);
    - ``expert_input``: the permuted token copies, e·R·h (/t with sequence parallelism, like ``mlp_input``);
    - ``expert_hidden``: the experts' activation input and output, matrices·e·R·F/t (gate, up, product);
    - ``expert_output``: the expert outputs kept for the gate weights' gradient, e·R·h (/t with SP);
    - ``shared_hidden``: the shared experts' MLP at b·s rows, matrices·e·b·s·S·F_s/t.
    """
    moe = shape.moe
    if moe is None:
        return {}
    e, t = dtype_bytes, tensor_parallel
    tokens = micro_batch * seq
    rows = routed_rows(moe, micro_batch, seq, load)
    mats = 3 if shape.gated_mlp else 2
    return {
        "router": 2 * 4 * tokens * moe.experts,
        "expert_input": e * rows * shape.hidden / sp,
        "expert_hidden": mats * e * rows * moe.expert_ffn_hidden / t,
        "expert_output": e * rows * shape.hidden / sp,
        "shared_hidden": mats * e * tokens * moe.shared_experts * moe.shared_width / t,
    }


def dispatch_bytes(
    shape: ModelShape, micro_batch: int, seq: int, *, dtype_bytes: int, load: float = 1.0
) -> float:
    """Bytes one GPU sends in one dispatch (and again in one combine) all-to-all: e·b·s·K·h × load.

    Each token copy's hidden state goes to its expert's GPU. These are the bytes of the micro-batch's b·s
    tokens; with tensor and sequence parallelism each tensor rank dispatches only its own s/t of them and
    its tensor group all-gathers what it received (Megatron-core's all-to-all dispatcher, EP > 1:
    :func:`microbatch.predict.roofline._moe_mlp` divides by t for the all-to-all; at EP = 1 its all-gather
    dispatcher gathers the tokens, with no all-to-all). The buffers a GPU holds
    after that gather are these bytes whatever t (:mod:`microbatch.predict.memory`).
    """
    if shape.moe is None:
        return 0.0
    return dtype_bytes * routed_rows(shape.moe, micro_batch, seq, load) * shape.hidden


def attention_widths(shape: ModelShape) -> tuple[int, int]:
    """(query/key, value) width summed over the heads: (a·d_h, a·d_h) for multi-head attention, h at
    d_h = h/a (grouped-query attention shares K and V, not the score work), a·(d_h + d_h^R) and a·d_v for
    DeepSeek's MLA."""
    if shape.mla is None:
        return shape.q_width, shape.q_width
    return shape.heads * shape.mla.qk_head_dim, shape.heads * shape.mla.v_head_dim


def gemm_weights(shape: ModelShape) -> int:
    """Weights one token's forward multiplies in one block (2 FLOPs each): attention projections (MLA's
    when present) and the MLP one token uses (:meth:`microbatch.moe.Experts.active_moe_params`), no biases
    or norms. Dense, kv = a, f = 4h: 12h² (Narayanan et al. 2021 Eq. 3's 24·b·s·h² / (2·b·s)); the q and o
    projections are h × a·d_h each (h × h at d_h = h/a)."""
    h, mats = shape.hidden, 3 if shape.gated_mlp else 2
    if shape.mla is None:
        qw, kvd = shape.q_width, shape.kv * shape.head_dim
        attn = h * (qw + 2 * kvd) + qw * h
    else:
        attn = shape.mla.params(h, shape.heads)
    mlp = mats * h * shape.ffn if shape.moe is None else shape.moe.active_moe_params(h, mats)
    return attn + mlp


def zero3_unit_params(
    shape: ModelShape, tensor_parallel: int = 1, expert_parallel: int = 1, zero_group: int | None = None
) -> float:
    """Parameters one GPU gathers for ZeRO-3's unit, the largest block: its dense part over the t ranks, its routed
    experts over t · EP (each GPU holds and gathers only its own experts; a whole layer's were counted, 11.6 GiB too
    much per GPU for Mixtral at EP 8). The routed experts' state shards over the expert-data-parallel group, the
    ``zero_group`` (d·c, or HSDP's) over EP: where that is one rank (EP = d) they are not sharded, so nothing of
    them is gathered and the unit is its dense part alone (ZeRO-3 was priced above ZeRO-1 there: Mixtral 8x7B on
    d = EP = 2, t = 4, 89.5 GiB against 88.5). ``zero_group`` None: taken as sharded."""
    routed = expert_params(shape, 0, 1, moe_blocks=1) if shape.moe is not None else 0
    gathered = routed if zero_group is None or zero_group // max(1, expert_parallel) > 1 else 0
    return (shape.layer_params() - routed) / tensor_parallel + gathered / (tensor_parallel * expert_parallel)
