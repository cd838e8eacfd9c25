"""Activation bytes of one transformer layer (and of the embedding and output layers) per micro-batch.

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", arXiv
2205.05198, §4), written term by term so that grouped-query attention, a gated MLP, an MLP width
other than 4h and training without dropout change the right terms; for a GPT block with dropout
they reduce exactly to the paper's ``s·b·h·(34 + 5·a·s/h)`` per layer (and its
tensor/sequence-parallel and selective forms). They are linear in b_m. Flash attention (or
selective recompute) drops the ``5·a·s²·b`` term. How many micro-batches a stage holds is
:mod:`microbatch.predict.memory`'s.
"""

from __future__ import annotations

from typing import Any

from microbatch.errors import ConfigError
from microbatch.model import ModelShape
from microbatch.predict.eager_memory import eager_layer_terms, rmsnorm_kept
from microbatch.predict.experts import moe_activation_terms
from microbatch.predict.recompute import every_kth, op_saved_terms, recompute_working

__all__ = [
    "RECOMPUTE_MODES",
    "RECOMPUTE_CHOICES",
    "check_recompute",
    "layer_activation_terms",
    "layer_activation_bytes",
    "embedding_activation_bytes",
    "output_activation_bytes",
    "deferred_output_share",
    "output_micro_batches",
    "loss_backward_bytes",
    "block_activation_bytes",
    "stage_block_bytes",
    "blocks_activation_bytes",
]

RECOMPUTE_MODES = ("none", "selective", "full")
"""Activation recomputation the planner searches by default: none, selective (attention core only,
Korthikanti §5), full (per layer)."""
RECOMPUTE_CHOICES = (*RECOMPUTE_MODES, "op")
"""Every mode: also ``op``, torchtitan's per-op selective recompute (:mod:`microbatch.predict.recompute`)."""


def check_recompute(recompute: str) -> str:
    """``recompute`` if it is one of :data:`RECOMPUTE_CHOICES`, else :class:`ConfigError` naming them."""
    if recompute not in RECOMPUTE_CHOICES:
        raise ConfigError(f"recompute {recompute!r} is not known; use one of {', '.join(RECOMPUTE_CHOICES)}")
    return recompute


def layer_activation_terms(
    shape: ModelShape,
    micro_batch: int,
    *,
    seq: int | None = None,
    tensor_parallel: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
    flash_attention: bool | None = None,
    dtype_bytes: int = 2,
    expert_load: float = 1.0,
    fp8_inputs: bool = False,
    eager_layers: bool = False,
) -> dict[str, float]:
    """Bytes one transformer layer keeps for its backward, for one micro-batch, by term.

    Korthikanti et al. 2022 §4.1 term by term (s = seq, b = micro-batch, h = hidden, a = heads,
    t = tensor parallel; 2-byte activations, 1-byte dropout masks):

    - ``norms``: the two norm inputs, 4sbh; ``attention_input``: QKV input 2sbh; ``mlp_input``:
      first MLP linear input 2sbh — none split by t unless sequence parallel.
    - ``qkv``: Q, K, V 6sbh (K and V scaled by kv_heads/heads; 2sb·(a + 2·kv)·d_h where the model sets the
      head width d_h apart from h/a); ``attention_output``: the output projection input 2sbh (2sb·a·d_h)
      — split by t.
    - ``attention_scores``: softmax output 2as²b, its dropout mask as²b and output 2as²b = 5as²b,
      split by t; dropped by flash attention or selective recompute. Flash attention without recompute keeps
      instead a 4-byte log-sum-exp per head and row (``attention_stats``), 4asb (selective re-runs the kernel).
    - ``mlp_hidden``: activation input and output 2 × 2sbf (gated: gate, up, product, 3 × 2sbf) / t (f = 4h: 16sbh).
    - ``dropout_masks``: after attention and after the MLP, 2sbh·1 byte, not split unless SP.

    A mixture-of-experts block replaces ``mlp_hidden`` by the routed and shared experts' terms
    (:func:`microbatch.predict.experts.moe_activation_terms`, at ``expert_load`` × the balanced rows);
    DeepSeek's latent attention keeps Q, K (a·(d_h + d_h^R) each), V and the output (a·d_v each) split by t, and its
    two latents (d_c' + d_c + d_h^R per token) whole.
    With ``fp8_inputs`` (Transformer Engine's FP8) the linear layers keep 1-byte casts of their inputs
    (:func:`_fp8_saved_inputs`; a GPT block with flash and no recompute 29 sbh, not 34); not the routed experts'.
    Per-op selective recompute (``op``) keeps :func:`microbatch.predict.recompute.op_saved_terms`.
    Full recompute keeps only the layer input, 2sbh (split by t with SP) (paper's Eq. for full
    recomputation). ``eager_layers``: :func:`microbatch.predict.eager_memory.eager_layer_terms` more, without
    recompute or with selective. Ignores norm statistics (b·s floats), the RNG state, fused-kernel variations.
    """
    check_recompute(recompute)
    s = seq or shape.seq
    t, b, e = tensor_parallel, micro_batch, dtype_bytes
    h, a, f = shape.hidden, shape.heads, shape.ffn
    sp = t if sequence_parallel else 1
    sbh = s * b * h
    if recompute == "full":
        return {"layer_input": e * sbh / sp}
    flash = shape.flash_attention if flash_attention is None else flash_attention
    qw, kvd = shape.q_width, shape.kv * shape.head_dim
    terms = {
        "norms": 2 * e * sbh / sp,
        "attention_input": e * sbh / sp,
        "qkv": e * s * b * (qw + 2 * kvd) / t,
        "attention_output": e * s * b * qw / t,
        "mlp_input": e * sbh / sp,
        "mlp_hidden": (3 if shape.gated_mlp else 2) * e * s * b * f / t,
        "dropout_masks": (2 * sbh / sp) if shape.dropout else 0.0,
    }
    if shape.mla is not None:
        terms.update(_mla_terms(shape, s * b, t, e))
    if shape.moe is not None:
        del terms["mlp_hidden"]
        terms.update(
            moe_activation_terms(shape, b, s, tensor_parallel=t, sp=sp, dtype_bytes=e, load=expert_load)
        )
    if fp8_inputs:  # the linear layers' saved inputs are their FP8 casts
        _fp8_saved_inputs(terms, shape, s * b, t, sp, e, keeps_output=flash and recompute == "none")
    if flash and recompute != "selective":  # selective recompute re-runs the core, its statistics too
        terms["attention_stats"] = 4 * a * s * b / t
    elif recompute == "none":
        per_score = (2 * e + 1) if shape.dropout else e  # softmax out (+ dropout mask + dropout out)
        terms["attention_scores"] = per_score * a * s * s * b / t
    if eager_layers and recompute in ("none", "selective"):
        terms.update(eager_layer_terms(shape, s * b, tensor_parallel=t, sp=sp, dtype_bytes=e))
    if recompute == "op":
        return op_saved_terms(shape, s * b, tensor_parallel=t, sp=sp, dtype_bytes=e, none_bytes=sum(terms.values()),
                              flash_stats=4 * a * s * b / t)  # fmt: skip
    return terms


def _mla_terms(shape: ModelShape, tokens: int, t: int, e: int) -> dict[str, float]:
    """DeepSeek's latent attention: Q, K (a·(d_h + d_h^R) each), V and the output (a·d_v each) split by t, and its
    two latents (d_c' + d_c + d_h^R per token) whole."""
    m, a = shape.mla, shape.heads
    assert m is not None
    qkv = e * tokens * a * (2 * m.qk_head_dim + m.v_head_dim) / t
    qkv += e * tokens * ((m.q_lora_rank or 0) + m.kv_lora_rank + m.qk_rope_head_dim)
    return {"qkv": qkv, "attention_output": e * tokens * a * m.v_head_dim / t}


def _fp8_saved_inputs(
    terms: dict[str, float], shape: ModelShape, tokens: int, t: int, sp: int, e: int, keeps_output: bool
) -> None:
    """Rewrite ``terms`` in place for linear layers that save their inputs as 1-byte FP8 casts
    (:func:`layer_activation_terms`'s ``fp8_inputs``; :func:`microbatch.precision.saves_fp8_inputs`): the QKV and
    first MLP inputs sbh; the output projection's input 1 B per element beside the e-byte output a fused (flash)
    attention that is not recomputed keeps for its own backward (``keeps_output``: e + 1); the MLP's second linear
    input 1 B of its f while the activation's input stays e bytes (4sbf → 3sbf at e = 2, gated 6sbf → 5sbf).
    Megatron-core's MoE and MLA blocks norm standalone (``gpt_layer_specs``): the router saves the MoE block's norm
    output in bf16 and MLA's two down-projections each keep a 1-byte cast of theirs, so those inputs keep e bytes."""
    # MLA's standalone norm feeds two down-projections, each keeping its own cast: e bytes kept there
    if shape.mla is None:
        terms["attention_input"] = tokens * shape.hidden / sp
    if shape.moe is None:  # a MoE block's router keeps the standalone norm's bf16 output
        terms["mlp_input"] = tokens * shape.hidden / sp
    o = terms["attention_output"] / e  # elements of the output projection's input
    terms["attention_output"] = o * (1 + (e if keeps_output else 0))
    if "mlp_hidden" in terms:
        terms["mlp_hidden"] = ((2 if shape.gated_mlp else 1) * e + 1) * tokens * shape.ffn / t


def layer_activation_bytes(
    shape: ModelShape,
    micro_batch: int,
    *,
    seq: int | None = None,
    tensor_parallel: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
    flash_attention: bool | None = None,
    dtype_bytes: int = 2,
    expert_load: float = 1.0,
    fp8_inputs: bool = False,
    eager_layers: bool = False,
) -> float:
    """Sum of :func:`layer_activation_terms`: bytes one layer keeps for one micro-batch."""
    terms = layer_activation_terms(
        shape, micro_batch, seq=seq, tensor_parallel=tensor_parallel, sequence_parallel=sequence_parallel,
        recompute=recompute, flash_attention=flash_attention, dtype_bytes=dtype_bytes, expert_load=expert_load,
        fp8_inputs=fp8_inputs, eager_layers=eager_layers,
    )  # fmt: skip
    return sum(terms.values())


def embedding_activation_bytes(
    shape: ModelShape,
    micro_batch: int,
    *,
    seq: int | None = None,
    tensor_parallel: int = 1,
    sequence_parallel: bool = False,
) -> float:
    """The input embedding's dropout mask, s·b·h bytes (/t with SP); zero without dropout.

    Korthikanti et al. 2022 §4.3. The embedding backward needs only the token ids.
    """
    if not shape.dropout:
        return 0.0
    s = seq or shape.seq
    return s * micro_batch * shape.hidden / (tensor_parallel if sequence_parallel else 1)


def output_activation_bytes(
    shape: ModelShape,
    micro_batch: int,
    *,
    seq: int | None = None,
    tensor_parallel: int = 1,
    sequence_parallel: bool = False,
    dtype_bytes: int = 2,
    logits_bytes: int = 4,
    eager_layers: bool = False,
) -> float:
    """Final norm input and output-projection input (2 × e·sbh) plus the logits the loss keeps, 4·s·b·V/t in fp32
    (``logits_bytes``: 2 when the loss takes the half logits, :data:`microbatch.precision.LOSS_DTYPES`); with
    ``eager_layers`` a final RMSNorm's eager copy too (:func:`microbatch.predict.eager_memory.rmsnorm_kept`).

    Korthikanti et al. 2022 §4.3 ("4sbh/t·(1 + v/h)" with SP and 2-byte activations); the logits
    are vocabulary-parallel, so split by t. Ignores the logits' gradient, a transient of the same size.
    """
    s = seq or shape.seq
    sp = tensor_parallel if sequence_parallel else 1
    norm = rmsnorm_kept(shape, dtype_bytes)[0] if eager_layers and shape.norm == "rmsnorm" else 0
    return (
        2 * dtype_bytes + norm
    ) * s * micro_batch * shape.hidden / sp + logits_bytes * s * micro_batch * shape.vocab / tensor_parallel


def deferred_output_share(shape: ModelShape, **output: Any) -> float:
    """A micro-batch's output-layer bytes while its weight gradient waits, over a whole one's
    (:func:`output_activation_bytes`, called with ``output``'s keywords at b_m 1): the norm's and the projection's
    inputs stay, the loss's logits go and the logits' gradient, in the compute dtype, is held in their place.

    A split-backward schedule (ZB-H1, DualPipeV: the input-gradient pass I, the weight-gradient pass W later) on
    torch.distributed.pipelining: ``stage_backward_input`` runs ``autograd.grad(..., retain_graph=True)``
    (``_backward.py``), so the graph below the weights stays, and its pre-hooks keep the gradient arriving at each
    weight's output — for the output layer dL/dlogits, b·s·V/t in the logits' dtype — in the stage's
    ``backward_state`` until W frees it; the loss and the stage output are detached at I (``t.detach_()``), which
    frees the loss's saved log-probabilities. Measured on two and four gloo ranks (V 16,384, h 64, b 2, s 128, fp32:
    the last rank held three logits' gradients more than under 1F1B at p 4, 116.1 against 68.0 MiB)."""
    full = output_activation_bytes(shape, 1, **output)
    s = output.get("seq") or shape.seq
    rows = s * shape.vocab / output.get("tensor_parallel", 1)
    held = full - output.get("logits_bytes", 4) * rows + output.get("dtype_bytes", 2) * rows
    return held / full if full > 0 else 1.0


def output_micro_batches(held: int, split_backward: bool, share: float) -> float:
    """The whole micro-batches' worth of output-layer bytes a stage holding ``held`` micro-batches keeps: all of them,
    or under a split backward one whole (its loss still alive) and the others at ``share``
    (:func:`deferred_output_share`)."""
    if not split_backward or held <= 1:
        return float(held)
    return 1.0 + (held - 1) * share


def loss_backward_bytes(
    shape: ModelShape,
    micro_batch: int,
    *,
    seq: int | None = None,
    tensor_parallel: int = 1,
    logits_bytes: int = 4,
    loss_kernel: str = "fused",
) -> float:
    """Bytes the cross-entropy's backward adds over the kept logits, at the step's peak: 2·``logits_bytes``·s·b·V/t
    for PyTorch's eager loss, 0 for a fused one (:data:`microbatch.precision.LOSS_KERNELS`).

    Eager ``F.cross_entropy`` is ``log_softmax`` then ``nll_loss``: the forward keeps the log-probabilities (the
    logits :func:`output_activation_bytes` counts); the backward's ``nll_loss_backward`` writes a dense gradient
    of them, and ``_log_softmax_backward_data`` a new gradient of its input while both are alive (ATen's
    ``SoftMax.cpp``, out-of-place kernels): three copies of the logits at once, two beyond the kept one.
    Measured on the CPU by a dispatch-level tracker of every tensor's storage (``tests/predict/
    test_loss_kernel.py``): 4,096 rows × V 8,000, fp32: 125 MiB kept, 250 MiB more in the backward. Megatron's
    ``_VocabParallelCrossEntropy`` keeps the softmax and writes its gradient in place (0 more). The loss backward
    runs before the stage's first layer recomputes, so the larger of this and the recompute working set counts.
    """
    if loss_kernel != "eager":
        return 0.0
    s = seq or shape.seq
    return 2.0 * logits_bytes * s * micro_batch * shape.vocab / tensor_parallel


def block_activation_bytes(
    shape: ModelShape, micro_batch: int, *, recompute: str = "none", recompute_every: int = 1, **kw: Any
) -> tuple[float, float]:
    """(bytes one block keeps per micro-batch under ``recompute``, the working set of the block being recomputed)
    of ``shape``'s block: :func:`layer_activation_bytes`, and under full or per-op recompute
    :func:`~microbatch.predict.recompute.recompute_working` (what the recomputed block re-materialises beyond what it
    keeps) and :func:`~microbatch.predict.recompute.every_kth` (one block in ``recompute_every`` recomputed); the
    other keywords are :func:`layer_activation_bytes`'."""
    per_layer = layer_activation_bytes(shape, micro_batch, recompute=recompute, **kw)
    working = 0.0
    if recompute in ("full", "op"):  # the layer being recomputed re-materialises what it did not keep
        none = layer_activation_bytes(shape, micro_batch, recompute="none", **kw)
        working = recompute_working(none, per_layer)
        per_layer = every_kth(per_layer, none, recompute_every if recompute == "full" else 1)
    return per_layer, working


def stage_block_bytes(per_layer: float, dense_per_layer: float | None, layers: int, moe_layers: int) -> float:
    """One micro-batch's activations over a stage's ``layers`` blocks: ``layers`` × ``per_layer``, or, for a
    mixture-of-experts model with dense blocks too, its ``moe_layers`` MoE blocks at ``per_layer`` and the others at
    ``dense_per_layer`` (a dense block keeps no router, permutation or expert buffers)."""
    if dense_per_layer is None:
        return per_layer * layers
    return moe_layers * per_layer + (layers - moe_layers) * dense_per_layer


def blocks_activation_bytes(shape: ModelShape, micro_batch: int, first: int, count: int, **kw: Any) -> float:
    """:func:`layer_activation_bytes` summed over blocks ``first`` … ``first + count − 1``, each at its kind (a
    mixture-of-experts model's dense blocks at its dense block's bytes: :func:`stage_block_bytes`)."""
    per = layer_activation_bytes(shape, micro_batch, **kw)
    moe = shape.moe_layer_count(first, count) if shape.moe is not None else count
    dense = layer_activation_bytes(shape.dense_block(), micro_batch, **kw) if moe < count else None
    return stage_block_bytes(per, dense, count, moe)
