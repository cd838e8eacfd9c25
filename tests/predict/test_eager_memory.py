"""Eager layers' activation memory (``layer_kernels="eager"``): the terms by hand, and against what transformers'
layers really keep on the CPU (autograd's saved tensors, measured: never the formula's own arithmetic)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from microbatch.errors import ConfigError
from microbatch.model import get_model
from microbatch.predict.activations import layer_activation_bytes, layer_activation_terms
from microbatch.predict.eager_memory import (
    EAGER_ACTIVATION_SAVES,
    activation_extra_tensors,
    eager_layer_terms,
)


def test_eager_terms_by_hand_llama_like():
    shape = get_model("llama-2-7b")  # RMSNorm, SwiGLU (silu), h 4096, f 11008
    b, s, t, sp = 2, 512, 2, 2
    terms = eager_layer_terms(shape, b * s, tensor_parallel=t, sp=sp, dtype_bytes=2)
    assert terms["eager_norms"] == 2 * 4 * b * s * 4096 / sp  # two norms, 4 B an element more each
    assert (
        terms["eager_activation"] == 1 * 2 * b * s * 11008 / t
    )  # silu's output, kept by the gate's multiply
    fused = layer_activation_terms(shape, b, seq=s, tensor_parallel=t, sequence_parallel=True)
    eager = layer_activation_terms(
        shape, b, seq=s, tensor_parallel=t, sequence_parallel=True, eager_layers=True
    )
    assert sum(eager.values()) - sum(fused.values()) == pytest.approx(sum(terms.values()))


def test_activation_counts_follow_how_the_activation_is_written():
    gpt2 = get_model("gpt2")  # gelu_new written out: x, tanh, 0.5x, 1 + tanh; its input counted: 3 more
    assert gpt2.activation == "gelu_new" and activation_extra_tensors(gpt2) == 3
    assert activation_extra_tensors(replace(gpt2, activation="gelu")) == 0  # one kernel keeping its input
    assert activation_extra_tensors(replace(gpt2, activation="relu")) == -1  # keeps only its output
    assert (
        activation_extra_tensors(replace(gpt2, activation="never-heard-of-it")) == 0
    )  # the fused count's own
    llama = get_model("llama-2-7b")
    assert activation_extra_tensors(llama) == EAGER_ACTIVATION_SAVES["silu"] == 1
    assert (
        eager_layer_terms(replace(gpt2, norm="layernorm"), 10)["eager_norms"] == 0
    )  # nn.LayerNorm: one kernel


def test_full_recompute_keeps_no_eager_terms_but_its_working_set_does():
    from microbatch.predict.activations import block_activation_bytes

    shape = get_model("llama-2-7b")
    kept_f, work_f = block_activation_bytes(shape, 1, seq=256, recompute="full")
    kept_e, work_e = block_activation_bytes(shape, 1, seq=256, recompute="full", eager_layers=True)
    assert kept_e == kept_f  # the checkpointed input only
    extra = sum(eager_layer_terms(shape, 256).values())
    assert work_e - work_f == pytest.approx(extra)  # the recomputed layer re-materialises them
    sel = layer_activation_bytes(shape, 1, seq=256, recompute="selective", eager_layers=True)
    assert sel - layer_activation_bytes(shape, 1, seq=256, recompute="selective") == pytest.approx(extra)


def test_layer_kernels_checked():
    from microbatch.predict.memory import MemoryConfig

    with pytest.raises(ConfigError, match="layer_kernels 'compiled' is not known; use fused"):
        MemoryConfig(micro_batch=1, layer_kernels="compiled")


FAMILIES = {  # tiny configs of the families, every dropout off; (family, its keys, the largest error allowed)
    "llama": ({"hidden_size": 256, "intermediate_size": 704, "num_attention_heads": 4, "num_key_value_heads": 2}, 0.02),
    "mistral": ({"hidden_size": 256, "intermediate_size": 896, "num_attention_heads": 4, "num_key_value_heads": 2,
                 "sliding_window": None}, 0.02),
    "qwen2": ({"hidden_size": 256, "intermediate_size": 704, "num_attention_heads": 4, "num_key_value_heads": 2}, 0.02),
    "gpt_neox": ({"hidden_size": 256, "intermediate_size": 1024, "num_attention_heads": 4, "hidden_dropout": 0.0,
                  "attention_dropout": 0.0}, 0.02),
    "opt": ({"hidden_size": 256, "ffn_dim": 1024, "num_attention_heads": 4, "dropout": 0.0, "attention_dropout": 0.0,
             "word_embed_proj_dim": 256}, 0.02),
    # GPT-2's model keeps K and V copies (2 of ~30 units), Phi-3's SDPA its output, Gemma's norm 2 B more: not counted
    "gpt2": ({"n_embd": 256, "n_head": 4, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}, 0.08),
    "phi3": ({"hidden_size": 256, "intermediate_size": 704, "num_attention_heads": 4, "num_key_value_heads": 4,
              "pad_token_id": 0}, 0.08),
    "gemma": ({"hidden_size": 256, "intermediate_size": 704, "num_attention_heads": 4, "num_key_value_heads": 1,
               "head_dim": 64}, 0.10),
}  # fmt: skip


def _saved_bytes(model, ids) -> int:
    """Bytes of the distinct storages autograd saves in one forward (parameters excluded): measured."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(x):
        ptr = x.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = max(seen.get(ptr, 0), x.untyped_storage().nbytes())
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        model(input_ids=ids)
    return sum(seen.values())


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_eager_count_matches_what_transformers_layers_keep(family, tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from microbatch.hf_config import from_hf_config

    keys, allowed = FAMILIES[family]
    b, s = 2, 128
    measured = []
    for layers in (1, 2):  # one layer's bytes: two layers' less one layer's (embedding, head cancel)
        cfg = transformers.AutoConfig.for_model(
            family, vocab_size=512, **{"n_layer" if family == "gpt2" else "num_hidden_layers": layers}, **keys
        )
        cfg._attn_implementation = "sdpa"
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).train()
        measured.append(_saved_bytes(model, torch.randint(0, 512, (b, s))))
        path = tmp_path / f"{family}.json"
        path.write_text(json.dumps(cfg.to_dict()))
    layer = measured[1] - measured[0]
    shape = from_hf_config(path, seq=s)
    fused = layer_activation_bytes(shape, b, seq=s)
    eager = layer_activation_bytes(shape, b, seq=s, eager_layers=True)
    assert abs(eager / layer - 1) <= allowed, (family, layer, eager, fused)
    assert (
        abs(eager / layer - 1) < abs(fused / layer - 1) or abs(fused / layer - 1) < 0.005
    )  # closer, or equal


def _cli(argv, capsys):
    from microbatch.cli import main

    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_prices_eager_layers_says_so_and_refuses_them_beside_a_calibration(capsys, tmp_path):
    base = ["memory", "--model", "gpt2", "-b", "4", "--json"]
    rc, fused, _ = _cli(base, capsys)
    rc2, eager, _ = _cli([*base, "--layer-kernels", "eager"], capsys)
    assert rc == rc2 == 0
    f, e = json.loads(fused), json.loads(eager)
    assert f["config"]["layer_kernels"] == "fused" and e["config"]["layer_kernels"] == "eager"
    shape = get_model("gpt2")
    extra = 12 * sum(eager_layer_terms(shape, 4 * 1024).values())  # 12 layers, one micro-batch in flight
    layers = [d["stages"][0]["activation_terms"]["layers"] for d in (f, e)]
    assert layers[1] - layers[0] == pytest.approx(extra) and extra > 0.5 * layers[0]
    rc, text, _ = _cli(["memory", "--model", "gpt2", "-b", "4", "--layer-kernels", "eager"], capsys)
    assert "eager layers" in text.splitlines()[0]
    rc, out, _ = _cli(
        [*base, "--layer-kernels", "eager", "--calibration", "tests/data/tune_hf_gpt2_cpu.json"], capsys
    )
    assert rc == 2 and "count it twice" in json.loads(out)["error"]


def test_an_hf_config_answer_says_its_layers_keep_more(capsys, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "gpt2", "n_embd": 256, "n_head": 4, "n_layer": 2, "vocab_size": 512,
                                "n_positions": 128}))  # fmt: skip
    rc, text, err = _cli(["memory", "--hf-config", str(path), "-b", "2"], capsys)
    assert rc == 0 and "--layer-kernels eager" in text + err
    rc, text, err = _cli(["memory", "--hf-config", str(path), "-b", "2", "--layer-kernels", "eager"], capsys)
    assert rc == 0 and "--layer-kernels eager" not in text + err


def test_eager_layers_beside_compile_refused_and_an_hf_export_of_fused_layers_says_so(capsys, tmp_path):
    rc, out, _ = _cli(["plan", "--model", "llama-3-8b", "--gpu", "h100-sxm", "-B", "64", "-d", "8", "--compile",
                       "--layer-kernels", "eager", "--json"], capsys)  # fmt: skip
    assert rc == 2 and "compiled or fused layers keep the fused count" in json.loads(out)["error"]
    plans = {}
    for kernels in ("fused", "eager"):
        path = tmp_path / f"{kernels}.json"
        rc, out, _ = _cli(["plan", "--model", "llama-3-8b", "--gpu", "h100-sxm", "-B", "64", "-d", "8", "--json",
                           "--layer-kernels", kernels], capsys)  # fmt: skip
        path.write_text(out)
        rc, out, _ = _cli(["export", "--plan", str(path), "--format", "hf", "--json"], capsys)
        plans[kernels] = [n for n in json.loads(out)["notes"] if "layers op by op" in n]
    assert len(plans["fused"]) == 1 and "--layer-kernels eager" in plans["fused"][0] and not plans["eager"]


def test_validate_gives_the_growth_with_eager_layers_where_they_keep_more(capsys, tmp_path):
    """validate's uncalibrated growth beside the same with eager layers' terms: the GPT-2 tune's (gelu_new) moves
    toward the machine's; a model whose eager layers keep nothing more (LayerNorm, one-kernel GELU) says nothing."""
    data = json.loads(open("tests/data/tune_hf_gpt2_cpu.json").read())
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps(data))
    data["model_shape"]["activation"] = "gelu_new"  # what a tune records since the field exists
    act = tmp_path / "act.json"
    act.write_text(json.dumps(data))
    rc, out, _ = _cli(["validate", "--calibration", str(act), "--json"], capsys)
    e = json.loads(out)["errors"]
    assert rc == 0 and e["memory_growth_uncalibrated"] < e["memory_growth_uncalibrated_eager"] < 0
    rc, text, _ = _cli(["validate", "--calibration", str(act)], capsys)
    assert "with eager layers" in text
    rc, out, _ = _cli(["validate", "--calibration", str(plain), "--json"], capsys)
    e = json.loads(out)["errors"]
    assert e["memory_growth_uncalibrated_eager"] == e["memory_growth_uncalibrated"]
    rc, text, _ = _cli(["validate", "--calibration", str(plain)], capsys)
    assert "with eager layers" not in text
