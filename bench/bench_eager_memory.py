"""What Hugging Face transformers' layers keep for their backward, measured, beside the memory model's fused count and
its eager terms (``--layer-kernels eager``, :mod:`microbatch.predict.eager_memory`).

For each family a tiny config (hidden 256, 4 heads, every dropout off) is built by transformers with random weights,
held in bf16 (or run under CPU autocast over fp32 weights with ``--autocast``, less the bf16 copy of the layer's
weights autocast keeps, 2 B a parameter, which does not grow with the batch), and one layer's bytes are read as two
layers' less one layer's saved tensors (``torch.autograd.graph.saved_tensors_hooks``, each storage once, parameters
excluded: the embedding and the head cancel). A measurement: nothing of the formula is used to take it.

    .venv/bin/python bench/bench_eager_memory.py [--autocast] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

from microbatch.hf_config import from_hf_config  # noqa: E402
from microbatch.predict.activations import layer_activation_bytes  # noqa: E402

B, S = 2, 128
FAMILIES = {
    "llama": {"hidden_size": 256, "intermediate_size": 704, "num_attention_heads": 4, "num_key_value_heads": 2},
    "mistral": {"hidden_size": 256, "intermediate_size": 896, "num_attention_heads": 4, "num_key_value_heads": 2,
                "sliding_window": None},
    "qwen2": {"hidden_size": 256, "intermediate_size": 704, "num_attention_heads": 4, "num_key_value_heads": 2},
    "phi3": {"hidden_size": 256, "intermediate_size": 704, "num_attention_heads": 4, "num_key_value_heads": 4,
             "pad_token_id": 0},
    "gemma": {"hidden_size": 256, "intermediate_size": 704, "num_attention_heads": 4, "num_key_value_heads": 1,
              "head_dim": 64},
    "gpt2": {"n_embd": 256, "n_head": 4, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
    "gpt_neox": {"hidden_size": 256, "intermediate_size": 1024, "num_attention_heads": 4, "hidden_dropout": 0.0,
                 "attention_dropout": 0.0},
    "qwen3": {"hidden_size": 256, "intermediate_size": 704, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 64},
    "olmo2": {"hidden_size": 256, "intermediate_size": 704, "num_attention_heads": 4, "num_key_value_heads": 4},
    "gemma2": {"hidden_size": 256, "intermediate_size": 704, "num_attention_heads": 4, "num_key_value_heads": 2,
               "head_dim": 64},
    "gemma3_text": {"hidden_size": 256, "intermediate_size": 704, "num_attention_heads": 4, "num_key_value_heads": 2,
                    "head_dim": 64},
    "stablelm": {"hidden_size": 256, "intermediate_size": 704, "num_attention_heads": 4, "num_key_value_heads": 4},
    "olmo": {"hidden_size": 256, "intermediate_size": 704, "num_attention_heads": 4},
    "opt": {"hidden_size": 256, "ffn_dim": 1024, "num_attention_heads": 4, "dropout": 0.0, "attention_dropout": 0.0,
            "word_embed_proj_dim": 256},
}  # fmt: skip


def saved_bytes(model, ids, autocast: bool) -> int:
    """Bytes of the distinct storages autograd saves in one forward (parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(x):
        ptr = x.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = max(seen.get(ptr, 0), x.untyped_storage().nbytes())
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        if autocast:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                model(input_ids=ids)
        else:
            model(input_ids=ids)
    return sum(seen.values())


def measure(family: str, autocast: bool) -> dict:
    import transformers

    measured, params, path = [], [], Path(tempfile.mkdtemp()) / f"{family}.json"
    for layers in (1, 2):
        cfg = transformers.AutoConfig.for_model(
            family, vocab_size=512, **{"n_layer" if family == "gpt2" else "num_hidden_layers": layers},
            **FAMILIES[family],
        )  # fmt: skip
        torch.manual_seed(0)
        try:
            cfg._attn_implementation = "sdpa"
            model = transformers.AutoModelForCausalLM.from_config(cfg).train()
        except ValueError:  # Gemma 2: no SDPA (its logit soft-capping), eager attention as it runs
            cfg._attn_implementation = "eager"
            model = transformers.AutoModelForCausalLM.from_config(cfg).train()
        model = model if autocast else model.to(torch.bfloat16)
        measured.append(saved_bytes(model, torch.randint(0, 512, (B, S)), autocast))
        params.append(sum(p.numel() for p in model.parameters()))
        path.write_text(json.dumps(cfg.to_dict()))
    layer = measured[1] - measured[0]
    if (
        autocast
    ):  # less the bf16 copy of the layer's weights autocast keeps for the backward: not an activation
        layer -= 2 * (params[1] - params[0])
    shape = from_hf_config(path, seq=S)
    fused = layer_activation_bytes(shape, B, seq=S)
    eager = layer_activation_bytes(shape, B, seq=S, eager_layers=True)
    return {"family": family, "activation": shape.activation, "norm": shape.norm, "measured_bytes": layer,
            "fused_bytes": fused, "eager_bytes": eager, "fused_err": fused / layer - 1, "eager_err": eager / layer - 1}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--autocast", action="store_true", help="CPU autocast to bf16 over fp32 weights")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    rows = [measure(f, args.autocast) for f in FAMILIES]
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    mode = "autocast bf16 over fp32 weights" if args.autocast else "held in bf16"
    print(f"one layer's saved bytes, b {B}, s {S}, h 256, {mode}, CPU, torch {torch.__version__}")
    print(f"  {'family':9s} {'activation':18s} {'norm':9s} {'measured':>10s} {'fused':>8s} {'eager':>8s}")
    for r in rows:
        print(f"  {r['family']:9s} {r['activation']:18s} {r['norm']:9s} {r['measured_bytes'] / 2**20:8.3f}Mi"
              f" {100 * r['fused_err']:+7.1f}% {100 * r['eager_err']:+7.1f}%")  # fmt: skip


if __name__ == "__main__":
    main()
