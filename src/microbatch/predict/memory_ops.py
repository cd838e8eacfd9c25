"""Memory-bound operators of a layer: passes over memory, each at its measured fraction of bandwidth.

The attention scores without flash attention (:func:`score_passes`, by kernel :func:`score_pass_split`),
norms, residual adds, the activation function and dropout (:func:`elementwise_forward_s`, backward
:func:`elementwise_backward_ratio`) and rotary embeddings (:func:`rotary_forward_s`). The rates are
``RooflineEfficiency``'s: eager kernels at the fractions ``bench/gpu_microbench.py`` measured on an H200
(LayerNorm 0.44, GELU 0.48, softmax 0.356, dropout 0.585 of the bandwidth), fused or compiled ones at the
streaming rate (copy 0.78, add 0.83; compiled norms at ``COMPILED_NORM_MEMORY``); the optimizer's (0.751 over its kernels' passes, :data:`microbatch.predict.state.EAGER_PASSES`) is read by the step-time rule and the loss's
softmax over the vocabulary by :func:`microbatch.predict.roofline.logits_forward`.
:mod:`microbatch.predict.roofline` builds a layer from these and re-exports them. Pure Python: no torch.
"""

from __future__ import annotations

from microbatch.hardware import Accelerator
from microbatch.model import ModelShape
from microbatch.predict.gemm import RooflineEfficiency

__all__ = [
    "PERMUTE_PASSES",
    "score_passes",
    "score_pass_split",
    "rotary_passes",
    "rotary_forward_s",
    "elementwise_backward_ratio",
    "elementwise_forward_s",
]


PERMUTE_PASSES = 4.0
"""Passes over a MoE block's routed token copies (b·s·K × load rows of h), each direction: the permutation
before the experts reads the tokens and writes them in expert order (2), the unpermutation after reads the
expert outputs and adds them, weighted by their router probabilities, into the tokens (2) (Megatron-core's
``moe_utils.permute`` / ``unpermute``, fused or not: the same bytes); the backward runs the same passes
over the gradients. At the streaming rate (``RooflineEfficiency.memory``: the H200 run's copy 0.78 of the
bandwidth), an assumption for gather/scatter kernels."""


def score_passes(dropout: bool, backward: bool = False) -> float:
    """Passes over the b·(a/t)·s² attention-score tensor without flash attention, in e-byte units.

    Forward: QKᵀ writes the scores (1), the fused scale-mask-softmax reads and writes them (2), ·V
    reads the probabilities (1): 4; dropout on the probabilities reads them, writes them and writes a
    1-byte mask (1 + 1 + ½ at e = 2): 2.5 more. Backward: dP = dO·Vᵀ writes (1), dV = Pᵀ·dO reads P
    (1), dropout's backward reads dP and the mask and writes (2.5), softmax's backward reads P and dP
    and writes dS (3), dQ = dS·K and dK = dSᵀ·Q read dS (2): 7, or 9.5 with dropout. (Megatron-LM's
    attention: FusedScaleMaskSoftmax then torch dropout, Korthikanti et al. 2022 §4.1 Fig. 4.)
    """
    if backward:
        return 9.5 if dropout else 7.0
    return 6.5 if dropout else 4.0


def score_pass_split(dropout: bool, backward: bool = False) -> tuple[float, float, float]:
    """:func:`score_passes` by kernel: (the matmuls' reads and writes, the softmax's, the dropout's).

    Forward: QKᵀ writes and ·V reads (2), softmax reads and writes (2), dropout 2.5 or 0. Backward: dP written,
    P read by dV, dS read by dQ and dK (4), softmax's backward reads P and dP and writes dS (3), dropout's
    backward 2.5 or 0. Each part runs at its own rate (``RooflineEfficiency.score_fractions``).
    """
    drop = 2.5 if dropout else 0.0
    return (4.0, 3.0, drop) if backward else (2.0, 2.0, drop)


def rotary_passes(fused: bool) -> float:
    """Passes over Q and K of rotary position embeddings, each direction: 10 eager, 2 fused.

    Eager (Hugging Face Llama's ``apply_rotary_pos_emb``: q·cos + rotate_half(q)·sin): q·cos reads and writes
    (2), rotate_half's negation and concatenation (1 + 2), ·sin (2), the add (3): 10; the backward's
    dy·cos, dy·sin, the inverse rotation and the add, 10 again. Fused (Megatron-core's and Transformer
    Engine's fused RoPE, ``torch.compile``): read and write, 2. The cos/sin tables are small and ignored.
    """
    return 2.0 if fused else 10.0


def rotary_forward_s(
    shape: ModelShape, row_bytes: float, tensor_parallel: int, acc: Accelerator, eff: RooflineEfficiency
) -> float:
    """Seconds of rotary embeddings on one GPU: e·rows·(a + kv)·d/t · :func:`rotary_passes` / (bw · memory).

    At the streaming rate ``eff.memory`` (elementwise multiplies and adds: the H200 run's add 0.83, copy 0.78
    of the bandwidth). 0 for learned positions and for DeepSeek's latent attention (its decoupled rotary
    slice is small: ignored).
    """
    if shape.learned_positions or shape.mla is not None:
        return 0.0
    width = (shape.heads + shape.kv) * shape.head_dim / tensor_parallel
    bw = acc.memory_bandwidth_bytes_per_s * eff.memory
    return row_bytes * width * rotary_passes(eff.fused_elementwise) / bw


def elementwise_backward_ratio() -> float:
    """Backward / forward memory traffic of an elementwise kernel: 3/2.

    y = f(x) reads x and writes y (2 passes); its backward reads the saved x (or y) and dy and writes
    dx (3 passes). The same holds for LayerNorm (x, dy in; dx out; the γ/β reductions ride on the same
    reads) and dropout (forward reads x, writes y and a ½-pass mask; backward reads dy and the mask,
    writes dx). The GEMMs' backward is 2 × their forward (FLOPs), not this.
    """
    return 1.5


def elementwise_forward_s(
    row_bytes: float,
    width_h: float,
    passes_f_width: float,
    dropout: bool,
    acc: Accelerator,
    eff: RooflineEfficiency,
) -> float:
    """Seconds of a layer's elementwise kernels: e·rows·(4·h/bw_norm + (6 [+ 4])·h/bw + P_f·f/bw_act).

    Two norms (read x, write y: 4 passes of rows × h) at the norm rate, two residual adds (read two, write
    one: 6 passes) and, with dropout, two masked passes each way (4) at the streaming rate, the activation
    function (``passes_f_width`` = 2 or 3 passes × its width) at the activation rate; h already split by t
    under sequence parallelism. Rates: ``eff.elementwise_fractions`` of the bandwidth (eager kernels at their
    measured fractions on a GPU, fused or compiled ones at the streaming rate).
    """
    bw = acc.memory_bandwidth_bytes_per_s
    norm, act = eff.elementwise_fractions(bool(acc.compute_units))
    stream = (6 + (4 if dropout else 0)) * width_h / (bw * eff.memory)
    return row_bytes * (4 * width_h / (bw * norm) + stream + passes_f_width / (bw * act))
