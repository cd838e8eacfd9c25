"""Activation bytes one transformer layer keeps for its backward: measured (eager and torch.compile) against the
memory model (issue 28 item 4: "activation memory that matches what ran").

For a Hugging Face Llama decoder layer (RMSNorm, rotary, grouped-query SDPA, SwiGLU) and a GPT-2 block (LayerNorm,
GELU, multi-head attention), bf16 on the CPU, this counts every tensor autograd saves during one forward
(``torch.autograd.graph.saved_tensors_hooks``; each storage once, the layer's parameters excluded, its input
included as the memory model counts it) in eager mode and under ``torch.compile`` (AOTAutograd's partitioner
decides what a compiled layer saves and what its backward recomputes; that decision is made before the backend,
so the CPU's is the GPU's), and prints both beside
:func:`microbatch.predict.activations.layer_activation_bytes` (Korthikanti et al. 2022's terms: Megatron's fused
kernels). A measurement: the counts come from the tensors the run kept, not from the model's arithmetic.

    .venv/bin/python bench/bench_saved_activations.py [--json]
    .venv/bin/python bench/bench_saved_activations.py --ops   # the eager terms' constants

``--ops`` measures the constants of :mod:`microbatch.predict.eager_memory`: the tensors each of transformers'
activations (``ACT2FN``) saves besides its output, in units of its input (``EAGER_ACTIVATION_SAVES``), and the bytes an
element transformers' ``LlamaRMSNorm`` keeps (``RMSNORM_EAGER_EXTRA``: what it keeps, plus its output, less a fused
norm's input and output), in bf16 and fp32.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

from microbatch.model import ModelShape  # noqa: E402
from microbatch.predict.activations import layer_activation_bytes  # noqa: E402

B, S = 2, 256


def _saved(fn, x: torch.Tensor, params: set[int], **kw) -> tuple[dict[int, int], object]:
    """({storage: bytes} of what autograd saves in one forward of ``fn``, parameters excluded; its output)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = max(seen.get(ptr, 0), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(x, **kw)
    return seen, out


def saved_bytes(fn, x: torch.Tensor, params: set[int], **kw) -> int:
    """Bytes of the distinct storages autograd saves in one forward of ``fn`` (parameters excluded)."""
    seen, out = _saved(fn, x, params, **kw)
    out = out[0] if isinstance(out, tuple) else out
    out.float().sum().backward()
    return sum(seen.values())


def _llama():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    cfg = LlamaConfig(hidden_size=512, intermediate_size=1408, num_attention_heads=8, num_key_value_heads=2,
                      num_hidden_layers=1, vocab_size=1000)  # fmt: skip
    cfg._attn_implementation = "sdpa"
    layer = LlamaDecoderLayer(cfg, 0).to(torch.bfloat16)
    x = torch.randn(B, S, 512, dtype=torch.bfloat16, requires_grad=True)
    cos, sin = LlamaRotaryEmbedding(cfg)(x, torch.arange(S).unsqueeze(0))
    shape = ModelShape(name="hf-llama-512", layers=1, hidden=512, heads=8, kv_heads=2, ffn_hidden=1408, vocab=1000,
                       seq=S, gated_mlp=True, bias=False, activation="silu")  # fmt: skip
    return layer, x, {"position_embeddings": (cos, sin), "attention_mask": None}, shape


def _gpt2():
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    cfg = GPT2Config(
        n_embd=512, n_head=8, n_layer=1, n_positions=S, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    cfg._attn_implementation = "sdpa"
    layer = GPT2Block(cfg, layer_idx=0).to(torch.bfloat16)
    x = torch.randn(B, S, 512, dtype=torch.bfloat16, requires_grad=True)
    shape = ModelShape(name="hf-gpt2-512", layers=1, hidden=512, heads=8, vocab=1000, seq=S, dropout=False)
    return layer, x, {}, shape


def _kept(fn, x: torch.Tensor, params: set[int]) -> tuple[float, torch.Tensor]:
    """(bytes of the storages ``fn`` saves other than its output's, its output)."""
    seen, y = _saved(fn, x, params)
    out = y.untyped_storage().data_ptr()
    return float(sum(v for p, v in seen.items() if p != out)), y


def ops() -> dict:
    """The eager terms' constants, measured (``--ops``)."""
    import warnings

    from transformers.activations import ACT2FN
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    warnings.filterwarnings("ignore")
    out: dict = {"activation_saves": {}, "rmsnorm_extra_bytes": {}}
    for dt in (torch.bfloat16, torch.float32):
        x = torch.randn(64, 1024, dtype=dt, requires_grad=True)
        for name in sorted(ACT2FN):
            try:
                saved, _ = _kept(ACT2FN[name], x, set())
            except Exception:  # noqa: BLE001 - an activation that needs its own parameters' dtype (prelu in bf16)
                continue
            out["activation_saves"].setdefault(name, {})[str(dt)] = saved / (x.numel() * x.element_size())
        norm = LlamaRMSNorm(1024).to(dt)
        params = {p.untyped_storage().data_ptr() for p in norm.parameters()}
        saved, y = _kept(norm, x, params)
        e = x.element_size()  # what it keeps and its output, less a fused norm's input and output
        out["rmsnorm_extra_bytes"][str(dt)] = (
            saved / x.numel()
            + (e if y.untyped_storage().data_ptr() != x.untyped_storage().data_ptr() else 0)
            - 2 * e
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--ops", action="store_true", help="the eager terms' constants (activations, RMSNorm)")
    args = ap.parse_args()
    torch.manual_seed(0)
    if args.ops:
        print(json.dumps(ops(), indent=1))
        return
    rows = []
    for name, build in (("hf llama layer", _llama), ("hf gpt2 block", _gpt2)):
        layer, x, kw, shape = build()
        params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
        eager = saved_bytes(layer, x, params, **kw)
        t0 = time.perf_counter()
        compiled_layer = torch.compile(layer)
        saved_bytes(compiled_layer, x, params, **kw)  # compile
        compiled = saved_bytes(compiled_layer, x, params, **kw)
        model = layer_activation_bytes(shape, B, seq=S, flash_attention=True)
        rows.append({
            "layer": name, "b": B, "s": S, "hidden": 512, "eager_bytes": eager, "compiled_bytes": compiled,
            "model_bytes": model, "eager_over_model": eager / model, "compiled_over_model": compiled / model,
            "compile_s": time.perf_counter() - t0, "torch": torch.__version__,
        })  # fmt: skip
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"saved activation bytes of one layer, bf16, b {B}, s {S}, h 512, CPU, torch {torch.__version__}")
    for r in rows:
        print(f"  {r['layer']:15s} eager {r['eager_bytes'] / 2**20:6.2f} MiB  compiled {r['compiled_bytes'] / 2**20:6.2f} MiB"
              f"  model {r['model_bytes'] / 2**20:6.2f} MiB  eager/model {r['eager_over_model']:.2f}"
              f"  compiled/model {r['compiled_over_model']:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
