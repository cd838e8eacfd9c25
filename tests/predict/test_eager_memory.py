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


ALLOWED = {"llama": 0.02, "mistral": 0.02, "qwen2": 0.02, "gpt_neox": 0.02, "opt": 0.02, "gpt2": 0.08, "phi3": 0.08,
           "gemma": 0.02, "qwen3": 0.02, "gemma3_text": 0.02, "olmo2": 0.08, "gemma2": 0.25, "stablelm": 0.08,
           "olmo": 0.12}  # fmt: skip
"""The largest error allowed each family: GPT-2's model keeps K and V copies for its cache, Phi-3's SDPA its output,
OLMo's LayerNorm an fp32 copy, Gemma 2's eager attention (no SDPA: soft-capped scores in fp32) more than the count's
scores: not counted."""


def _bench():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "bench_eager_memory.py"
    spec = importlib.util.spec_from_file_location("bench_eager_memory", path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("family", sorted(ALLOWED))
def test_eager_count_matches_what_transformers_layers_keep(family):
    """One layer's saved bytes as transformers' model keeps them (``bench/bench_eager_memory.py``'s measurement:
    autograd's saved tensors, two layers' less one's) against the count with and without the eager terms."""
    pytest.importorskip("transformers")
    bench = _bench()
    assert sorted(bench.FAMILIES) == sorted(ALLOWED)
    r = bench.measure(family, autocast=False)
    assert abs(r["eager_err"]) <= ALLOWED[family], r
    assert abs(r["eager_err"]) < abs(r["fused_err"]) or abs(r["fused_err"]) < 0.005, (
        r
    )  # closer, or both exact


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
    data["model"] = "gpt2"  # the built-in GPT's tune: one-kernel GELU, torch's norms: no eager figure
    builtin = tmp_path / "builtin.json"
    builtin.write_text(json.dumps(data))
    rc, out, _ = _cli(["validate", "--calibration", str(builtin), "--json"], capsys)
    assert json.loads(out)["errors"]["memory_growth_uncalibrated_eager"] is None


@pytest.mark.parametrize("family", ["stablelm", "olmo"])
def test_llama_built_families_with_a_layernorm_are_read_so(family, tmp_path):
    """StableLM's nn.LayerNorm and OLMo's parameter-free one were read as RMSNorm (a SiLU-gated MLP made them
    Llama-built), so eager layers priced an fp32 copy they do not keep."""
    from microbatch.hf_config import from_hf_config

    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": family, "hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 2,
                                "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 512, "hidden_act": "silu"}))  # fmt: skip
    shape = from_hf_config(path)
    assert shape.norm == "layernorm" and shape.gated_mlp
    assert eager_layer_terms(shape, 100)["eager_norms"] == 0


def test_qk_norms_sandwich_and_post_norms_and_gemmas_fp32_norm_by_hand():
    """Qwen3's and Gemma 3's norms on Q and K, Gemma's sandwich norms, OLMo 2's post-norms and Gemma's fp32-scaled
    norm (a helper's sweep: Qwen3 −17%, OLMo 2 −30%, Gemma 3 −41% before they were counted)."""
    base = replace(get_model("llama-2-7b"), kv_heads=8)
    t, tokens, h = 2, 1000, 4096
    plain = eager_layer_terms(base, tokens, tensor_parallel=t, sp=1)["eager_norms"]
    assert plain == 2 * 4 * tokens * h
    qk = eager_layer_terms(replace(base, qk_norm=True), tokens, tensor_parallel=t, sp=1)["eager_norms"]
    assert (
        qk - plain == 6 * tokens * (32 + 8) * 128 / t
    )  # fp32 copy + the bf16 normalised, of uncounted Q and K
    sandwich = eager_layer_terms(replace(base, norm_placement="sandwich"), tokens)["eager_norms"]
    assert sandwich == (2 * 4 + 2 * 6) * tokens * h
    post = eager_layer_terms(replace(base, norm_placement="post"), tokens)["eager_norms"]
    assert post == 2 * 6 * tokens * h
    gemma = eager_layer_terms(replace(base, norm_fp32=True), tokens)["eager_norms"]
    assert gemma == 2 * 6 * tokens * h  # the normalised tensor kept in fp32: 2 B more a norm
    fp32 = eager_layer_terms(replace(base, norm_placement="post"), tokens, dtype_bytes=4)["eager_norms"]
    assert fp32 == 2 * 8 * tokens * h  # in fp32 the copy is the input itself: 4 + 4
    with pytest.raises(ConfigError, match="norm_placement 'middle' is not known"):
        replace(base, norm_placement="middle")


def test_the_final_norms_eager_copy_on_the_last_stage_and_plan_agreeing_with_memory():
    """The final RMSNorm keeps its fp32 copy too (4·s·b·h on the stage with the head: a sweep's find), and the plan's
    candidate and `memory` give the same peak under eager layers."""
    from microbatch.hardware import get_accelerator
    from microbatch.predict.activations import output_activation_bytes
    from microbatch.predict.memory import MemoryConfig, estimate_memory
    from microbatch.predict.plan import PlanConfig, make_plan

    llama, gpt2 = get_model("llama-2-7b"), get_model("gpt2")
    grown = output_activation_bytes(llama, 2, eager_layers=True) - output_activation_bytes(llama, 2)
    assert grown == 4 * 4096 * 2 * 4096
    assert output_activation_bytes(gpt2, 2, eager_layers=True) == output_activation_bytes(
        gpt2, 2
    )  # LayerNorm
    cfg = PlanConfig(shape=llama, gpu=get_accelerator("h100-sxm"), global_batch=16, pipeline_parallel=2,
                     micro_batches=(2,), recompute=("none",), zero=(0,), schedules=("1f1b",), layer_kernels="eager")  # fmt: skip
    c = make_plan(cfg).candidates[0]
    mem = estimate_memory(
        llama, MemoryConfig(micro_batch=2, pipeline_parallel=2, microbatches=8, layer_kernels="eager")
    )
    assert c.peak_memory_bytes == pytest.approx(mem.peak_bytes, rel=1e-9)
