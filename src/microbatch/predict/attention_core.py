"""The attention core of one layer (QKᵀ, softmax, ·V): its time on one GPU, and the keys a query sees.

:func:`attention_core_s` is the core's (forward, backward) seconds: a flash kernel on its own curve
(:mod:`microbatch.predict.attention`), or the scores through memory without flash. :func:`window_span` and
:func:`attention_span` carry a local (sliding-window) layer: a causal query that sees only its last w keys runs
the work of a full causal layer of a shorter length, the span σ; a model whose ``sliding_layers`` of L layers
attend that way runs, per layer on average, (1 − share)·(full) + share·(windowed). A flash kernel skips the
blocks outside the window (FlashAttention-2's ``window_size``); eager attention computes the whole masked
matrix, so without flash a window saves nothing here. Under ring or all-gather context parallelism the window is
not applied (each step's keys are another rank's block; taken as full: pessimistic); under Ulysses each rank
attends to whole sequences, so it is.
"""

from __future__ import annotations

from microbatch.hardware import Accelerator
from microbatch.model import ModelShape
from microbatch.predict.attention import flash_attention_times_s
from microbatch.predict.experts import attention_widths
from microbatch.predict.gemm import RooflineEfficiency
from microbatch.predict.memory_ops import score_pass_split

__all__ = ["ring_steps_s", "attention_core_s", "attention_span", "local_span", "window_span"]


def window_span(seq: float, window: int | None, chunked: bool = False) -> float:
    """σ: the length of a full causal layer with the (query, key) pairs of a causal ``window`` over ``seq`` tokens.

    Pairs: Σᵢ min(i, w) = s·w − w(w − 1)/2 for w ≤ s, against s(s + 1)/2 with no window; so σ = s × their ratio
    = (2·s·w − w² + w)/(s + 1), and σ = s for w ≥ s (or no window). Counting in the full-matrix convention the
    FLOPs use (2·rows·s·width, Narayanan et al. 2021 Eq. 3), a window scales them by σ/s. ``chunked`` (Llama 4's
    chunked attention: a query sees the keys of its own w-token chunk up to itself): s = q·w + r tokens hold
    q·w(w + 1)/2 + r(r + 1)/2 pairs, σ = 2 × that / (s + 1), about w + 1 for s ≫ w — each chunk a causal
    sequence of its own (transformers' ``chunked_attention`` mask: position // w equal, key ≤ query). Both
    assume a kernel that skips the blocks outside the window or chunk (FlashAttention-2's ``window_size``;
    FlexAttention's block mask, as torchtitan runs Llama 4); SDPA with a boolean mask computes every block.
    """
    if window is None or window >= seq:
        return float(seq)
    w = float(window)
    if chunked:
        q, r = divmod(float(seq), w)
        return (q * w * (w + 1.0) + r * (r + 1.0)) / (seq + 1.0)
    return (2.0 * seq * w - w * w + w) / (seq + 1.0)


def local_span(shape: ModelShape, seq: float) -> float:
    """σ of ``shape``'s local layers at ``seq`` (:func:`window_span`, sliding or chunked)."""
    return window_span(seq, shape.sliding_window, shape.local_attention == "chunked")


def attention_span(shape: ModelShape, seq: float) -> float:
    """The keys per query of an average layer, in the full-matrix convention: (1 − share)·s + share·σ
    (``ModelShape.sliding_share`` of the layers windowed, :func:`window_span`)."""
    share = shape.sliding_share
    if not share:
        return float(seq)
    return (1.0 - share) * seq + share * local_span(shape, seq)


def ring_steps_s(
    full_flops: float, keys: float, c: int, peak: float, ceiling: float, head_dim: int
) -> tuple[float, float]:
    """(forward, backward) seconds of one rank's causal attention run as c flash steps over the keys in c pieces,
    ``full_flops`` being the rank's full-matrix count.

    Under the causal load balance (two chunks a rank, :mod:`microbatch.predict.context`) every step does the same
    work, 1/c of the rank's causal FLOPs, but only the first, the rank's chunks against each other, is causal: the
    c − 1 others are unmasked rectangles, all of one chunk pair's keys against all of its queries (Transformer
    Engine v1.4 ``AttnFuncWithCP``: ``attn_mask_type="causal"`` on the diagonal step, ``"no_mask"`` on the others),
    half of them s/c queries against s/2c keys, half s/2c against s/c, each on the unmasked curve at its key length.
    c = 1: the one causal kernel at s. The two kinds are averaged over the ranks; the last rank runs all its steps
    at the shorter keys and the layer waits for it (at most 1.4% slower on these curves: not charged).
    """
    diagonal = flash_attention_times_s(full_flops / c, keys / c, peak, ceiling, head_dim=head_dim)
    if c <= 1:
        return diagonal
    causal_work = full_flops / 2 * (c - 1) / c  # the off-diagonal steps' FLOPs, run unmasked
    short, long = (
        flash_attention_times_s(causal_work / 2, length, peak, ceiling, head_dim=head_dim, causal=False)
        for length in (keys / (2 * c), keys / c)
    )
    return diagonal[0] + short[0] + long[0], diagonal[1] + short[1] + long[1]


def attention_core_s(
    shape: ModelShape,
    rows: float,
    s: int,
    c: int,
    t: int,
    flash: bool,
    acc: Accelerator,
    dtype: str,
    efficiency: RooflineEfficiency,
) -> tuple[float, float]:
    """(forward, backward) seconds of the attention core (QKᵀ, softmax, ·V) for ``rows`` queries on one GPU.

    FLOPs 2·rows·s·(d_qk + d_v)·a/t; bytes: read Q, K, V and write O (the backward about twice). Under flash
    attention on an accelerator with a flash ceiling (``Accelerator.attention_fraction``) the kernel's own
    curve (:func:`microbatch.predict.attention.flash_attention_times_s`: the causal half of the FLOPs, a
    backward of 5/2 × them, each direction at the ceiling × its published curve in the key length and the
    head dimension; under ring or all-gather context parallelism the c steps of :func:`ring_steps_s`); otherwise the GEMM efficiency on the full FLOPs. ``c`` is how many pieces the kernel sees the
    keys in (:func:`microbatch.predict.context.attention_key_split`: the context-parallel degree under the ring or
    the all-gather, 1 under Ulysses, whose ranks attend to whole sequences). A model with windowed layers averages
    a full layer and a windowed one, whose FLOPs are σ/s of them and whose curve is read at σ (the
    equivalent causal length, :func:`window_span`), under flash and with the keys whole (c = 1). Without
    flash the s×s scores pass through memory (:func:`~microbatch.predict.memory_ops.score_passes`): their
    GEMM-side passes at the streaming rate, the softmax's and dropout's at ``efficiency.score_fractions``
    (the eager kernels' measured rates unless fused). Each direction is the longer of its compute and memory
    times.
    """
    e = 4 if dtype == "fp32" else 2
    bw = acc.memory_bandwidth_bytes_per_s
    qk, vd = attention_widths(shape)
    flops = 2.0 * rows * s * (qk + vd) / t
    kvd = shape.kv * shape.head_dim
    fwd_bytes = e * rows * (qk + vd + (qk + vd if shape.mla else 2 * kvd)) / t  # read Q, K, V; write O
    fwd_mem, bwd_mem = fwd_bytes / (bw * efficiency.memory), 2 * fwd_bytes / (bw * efficiency.memory)
    if not flash:
        scores = e * shape.heads * s * rows / t
        soft, drop = efficiency.score_fractions(bool(acc.compute_units))
        for backward in (False, True):
            gemm_side, softmax, dropout = score_pass_split(bool(shape.dropout), backward)
            passes_s = scores * (gemm_side / efficiency.memory + softmax / soft + dropout / drop) / bw
            fwd_mem, bwd_mem = (fwd_mem, bwd_mem + passes_s) if backward else (fwd_mem + passes_s, bwd_mem)
        share, span = 0.0, float(s)
    else:
        share = shape.sliding_share if c == 1 else 0.0
        span = local_span(shape, s) if share else float(s)
    fwd_s = bwd_s = 0.0
    for part, keys in ((1.0 - share, float(s)), (share, span)):
        if part <= 0:
            continue
        if (
            flash and acc.attention_fraction
        ):  # the kernel's own curves: one causal kernel, or the ring's c steps
            f, b = ring_steps_s(  # the curves read at keys/k: the row's kernel ramps k times more slowly
                flops * keys / s, keys / acc.attention_ramp, c, acc.flops(dtype), acc.attention_fraction,
                shape.head_dim,
            )  # fmt: skip
        else:
            rate = acc.flops(dtype) * efficiency.gemm(rows)
            f, b = flops * keys / s / rate, 2 * flops * keys / s / rate
        fwd_s, bwd_s = fwd_s + part * f, bwd_s + part * b
    return max(fwd_s, fwd_mem), max(bwd_s, bwd_mem)
