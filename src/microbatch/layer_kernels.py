"""The kernels one transformer layer issues in eager PyTorch: a property of the model's implementation.

Counted once here for the two layers that use the count: the planner prices each kernel's launch
(:mod:`microbatch.predict.launch`, a GPU's floor and a CPU's added dispatch), and the kernel microbenchmark divides
a real layer's host time by it (:func:`microbatch.measure.microbench._layer_host_s`), so the measured cost per
kernel is the one the planner multiplies. Core: no torch, no layer above.
"""

from __future__ import annotations

from microbatch.model import ModelShape

__all__ = ["head_kernels", "layer_gemm_kernels", "layer_kernels", "moe_kernels"]


def layer_kernels(
    shape: ModelShape, *, flash: bool, tensor_parallel: int, fused: bool, local_experts: int | None = None,
    ring_steps: int = 1,
) -> int:  # fmt: skip
    """Kernels of one layer's forward: GEMMs, attention, elementwise ops, tensor-parallel collectives.

    GEMMs: QKV, output projection, the MLP's up (two for a gated MLP: gate and up, as Llama's code runs
    them) and down projections. Attention: one flash kernel, or four unfused (QKᵀ, softmax, dropout, ·V).
    Elementwise, eager: two norms, two residual adds, the activation (and the gate's multiply), dropout
    twice when the model trains with it; fused or compiled (``fused``): three (the norms fused with the
    adds, the activation with its multiply). Rotary embeddings (not with learned positions): five eager
    kernels on each of Q and K (q·cos, the negation and concatenation of rotate_half, ·sin, the add: Hugging
    Face Llama's ``apply_rotary_pos_emb``), one fused kernel on each (Megatron-core's and Transformer
    Engine's fused RoPE). Two collectives per layer with t > 1. A mixture-of-experts MLP
    (:func:`moe_kernels`) replaces the dense MLP's activation. Ring or all-gather context parallelism runs the
    attention as ``ring_steps`` = c flash calls, each with its output correction and, off the diagonal, a
    half-chunk copy (Transformer Engine's ``AttnFuncWithCP``): 3 kernels for each step past the first.
    """
    gated = bool(shape.gated_mlp)
    gemms = layer_gemm_kernels(shape, local_experts)
    attention = 1 if flash else 4
    activation = 1 if fused else (2 if gated else 1)
    if shape.moe is not None:
        activation = moe_kernels(shape, activation, local_experts)
    elementwise = (2 if fused else 4 + (2 if shape.dropout else 0)) + activation
    rotary = 0 if shape.learned_positions else (2 if fused else 10)
    steps = 3 * (max(1, ring_steps) - 1) if flash else 0
    return gemms + attention + steps + elementwise + rotary + (2 if tensor_parallel > 1 else 0)


def moe_kernels(shape: ModelShape, activation: int, local_experts: int | None = None) -> int:
    """Non-GEMM kernels of one mixture-of-experts MLP's forward (Megatron-core's ``MoELayer``): the router's
    top-k and its score function (2), the tokens' permutation and unpermutation (2), the dispatch and combine
    all-to-alls when the experts are spread over ranks (2), and ``activation`` kernels for each local expert and
    each shared one (Transformer Engine's ``GroupedLinear`` runs each local expert as its own kernels). Local
    experts: E/EP (``local_experts``; all E when None)."""
    moe = shape.moe
    if moe is None:
        return activation
    local = local_experts or moe.experts
    spread = 2 if local < moe.experts else 0
    return 2 + 2 + spread + activation * (local + (1 if moe.shared_experts else 0))


def layer_gemm_kernels(shape: ModelShape, local_experts: int | None = None) -> int:
    """GEMM kernels of one layer's forward: QKV, output projection, the MLP's up (gate and up when gated) and
    down; the backward runs one weight-gradient GEMM for each (the W pass of a split backward). A
    mixture-of-experts MLP: the router's GEMM and each local expert's (E/EP of them, ``local_experts``; all E when
    None) and shared expert's up, gate and down, one GEMM each as Transformer Engine's ``GroupedLinear`` issues them."""
    mats = 3 if shape.gated_mlp else 2
    if shape.moe is None:
        return 2 + mats
    local = local_experts or shape.moe.experts
    return 2 + 1 + mats * (local + (1 if shape.moe.shared_experts else 0))


def head_kernels(shape: ModelShape) -> int:
    """Kernels of a forward outside its layers: the token embedding's lookup (with learned positions, the position
    embedding's and their add: 3), the final norm, the output layer's GEMM, and the loss's log-softmax and negative
    log-likelihood (PyTorch's ``cross_entropy``: two kernels). Charged with the output layer
    (:func:`microbatch.predict.roofline.logits_forward`), on the last stage of a pipeline."""
    return (3 if shape.learned_positions else 1) + 1 + 1 + 2
