"""What an eager layer keeps beyond the fused count: the tensors Hugging Face transformers' modelling code saves for
its backward when PyTorch runs it op by op (``layer_kernels="eager"``).

:func:`microbatch.predict.activations.layer_activation_terms` counts what a fused or compiled layer keeps
(Korthikanti et al. 2022's terms: Megatron's kernels; a ``torch.compile``'d layer keeps the same within 5%,
``bench/bench_saved_activations.py``). transformers' layers keep more, and the excess has two causes, each measured
on the CPU by the tensors autograd saves (``torch.autograd.graph.saved_tensors_hooks``, each storage once:
``bench/bench_saved_activations.py --ops``; the CPU's autograd saves what the GPU's does, the graph being the
same):

- **RMSNorm written out** (``LlamaRMSNorm`` and the families that copy it: ``hidden.to(float32)``, ``pow``,
  ``mean``, ``rsqrt``, the multiply, ``.to(dtype)``, ``weight *``): it keeps an fp32 copy of its input and the
  normalised tensor before the weight, 6 B an element in bf16 (8 in fp32, where the copy is the input), against the
  fused norm's one input: :data:`RMSNORM_EAGER_EXTRA` = 4 B an element more, in either dtype. ``nn.LayerNorm`` is
  one kernel that keeps its input (and two floats a row): nothing more.
- **The activation written as several operations**: :data:`EAGER_ACTIVATION_SAVES`, the tensors of the MLP's width
  each of transformers' activations (``ACT2FN``) saves besides its own output. The fused count keeps the activation's
  input and output (the next linear's input); a gated MLP the gate, the up projection and their product. Eager, a
  plain MLP keeps the activation's saves and its output (saves − 1 more tensors: GPT-2's ``gelu_new`` 3 more); a
  gated one its saves, the activation's output (the product's multiply keeps it) and the up projection and the
  product (saves more: Llama's ``silu`` 1).

Measured on one layer (bf16, b 2, s 256, h 512; the fused count from the formula): Llama's decoder layer keeps
21.7 units of e·s·b·h, the formula 14.8, and 4 + 2.75 of the difference are these terms (its f = 2.75h); GPT-2's
block 28.0 against 16.0, 12 of it the three tensors of gelu_new (f = 4h). tests/predict/test_eager_memory.py
measures the families in :data:`microbatch.hf_families` against it. Not counted: GPT-2's copies of K and V into its
cache while ``use_cache`` is on, its config's default, in training too (2 of its 30 units a layer; 28 with
``use_cache=False``, the count's exactly), the rotary tables (per position,
not per sequence), Gemma's norm (``x.float()`` then ``* (1 + w)``, 2 B an element more than Llama's), autocast over
fp32 weights (the Trainer's ``bf16=True`` on an fp32 model; measured on the CPU, a Llama layer keeps 27.0 units of
e·s·b·h against 21.7 held in bf16: the residual stream and the norms in fp32, +1 a norm, and each projection's own
bf16 cast of its input, +2 for separate q, k, v and +1 for gate and up; and a bf16 copy of each layer's weights,
2 B a parameter, until its backward; CUDA's autocast lists differ from the CPU's, ``pow`` among them, so GPT-2's
``gelu_new`` would run in fp32 there: not priced), a mixture-of-experts block's experts, and PyTorch's own
``nn.RMSNorm`` (8 B an element on the CPU in bf16: torch's composite, not transformers'). Pure Python: no torch.
"""

from __future__ import annotations

from microbatch.model import ModelShape

__all__ = [
    "EAGER_ACTIVATION_SAVES",
    "RMSNORM_EAGER_EXTRA",
    "eager_layer_terms",
    "activation_extra_tensors",
    "rmsnorm_kept",
]

EAGER_ACTIVATION_SAVES: dict[str, float] = {
    "gelu": 1, "gelu_pytorch_tanh": 1, "gelu_10": 2, "gelu_accurate": 4, "gelu_fast": 7, "gelu_new": 4,
    "gelu_python": 3, "gelu_python_tanh": 4, "quick_gelu": 2, "silu": 1, "swish": 1, "mish": 1, "hardswish": 1,
    "leaky_relu": 1, "laplace": 1, "prelu": 1, "relu": 0, "relu2": 1, "relu6": 1, "sigmoid": 0, "tanh": 0,
    "linear": 0, "sqrtsoftplus": 1, "xielu": 4.5,
}  # fmt: skip
"""Tensors of the activation's width that transformers' ``ACT2FN[name]`` saves for its backward besides its own
output, measured (transformers 5.25, torch 2.13, bf16 and fp32 alike but xIELU's 4.25 in fp32:
``bench/bench_saved_activations.py --ops``): one where the activation is one kernel that keeps its input (``gelu``,
``silu``, ``gelu_pytorch_tanh``), none where it keeps only its output (``relu``, ``tanh``), more where it is written
out (``gelu_new``: 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))) keeps x, the tanh, 0.5·x and 1 + tanh). An activation
not listed counts one, the fused count's own assumption."""

RMSNORM_EAGER_EXTRA = 4
"""Bytes an element transformers' RMSNorm keeps beyond a fused norm's input: its fp32 copy and the normalised tensor
before the weight (6 B in bf16, input not kept; 8 B in fp32, the input being the copy) against e bytes, measured as
:data:`EAGER_ACTIVATION_SAVES` is."""


def rmsnorm_kept(shape: ModelShape, dtype_bytes: int) -> tuple[int, int]:
    """(bytes an element transformers' RMSNorm keeps beyond the fused count before a sublayer, whose input the count
    keeps; the same where the count keeps nothing of it: on a sublayer's output, or on Q and K before attention): its
    fp32 copy (4 B) and the normalised tensor before the weight, e B, or 4 where the norm scales in fp32
    (``ModelShape.norm_fp32``: Gemma's ``x.float()`` · (1 + w)), as :data:`RMSNORM_EAGER_EXTRA` measured them: Llama's
    4 and 6 in bf16, Gemma's 6 and 8."""
    normalised = 4 if shape.norm_fp32 else dtype_bytes
    return RMSNORM_EAGER_EXTRA + normalised - dtype_bytes, RMSNORM_EAGER_EXTRA + normalised


def activation_extra_tensors(shape: ModelShape) -> float:
    """Tensors of the MLP's width an eager layer keeps beyond the fused count (module docstring): the activation's
    saves less one in a plain MLP (its input, counted there), the saves in a gated one (nothing of them counted)."""
    saves = EAGER_ACTIVATION_SAVES.get(shape.activation.lower(), 1)
    return saves if shape.gated_mlp else saves - 1


def eager_layer_terms(
    shape: ModelShape, tokens: float, *, tensor_parallel: int = 1, sp: int = 1, dtype_bytes: int = 2
) -> dict[str, float]:
    """Bytes one eager layer keeps beyond the fused count for ``tokens`` tokens: ``eager_norms``, with RMSNorm
    (:func:`rmsnorm_kept`), its first·tokens·h/sp for each norm before a sublayer (its input is in the fused count)
    and its second·tokens·h/sp for each after one (``ModelShape.norm_placement``: Gemma's sandwich, OLMo 2's
    post-norms, on outputs the count does not keep), and for a ``qk_norm`` the same·tokens·(a + kv)·d_h/t
    (the projections' outputs, not counted: Q and K as they enter attention are); 0 with LayerNorm; and
    ``eager_activation``, :func:`activation_extra_tensors` × e·tokens·f/t (0 in a mixture-of-experts block: not
    counted)."""
    norms = 0.0
    if shape.norm == "rmsnorm":
        before = 0 if shape.norm_placement == "post" else 2
        after = 0 if shape.norm_placement == "pre" else 2
        counted, uncounted = rmsnorm_kept(shape, dtype_bytes)
        norms = (before * counted + after * uncounted) * tokens * shape.hidden / sp
        if shape.qk_norm:
            norms += uncounted * tokens * (shape.q_width + shape.kv * shape.head_dim) / tensor_parallel
    act = 0.0
    if shape.moe is None:
        act = activation_extra_tensors(shape) * dtype_bytes * tokens * shape.ffn / tensor_parallel
    return {"eager_norms": norms, "eager_activation": act}
