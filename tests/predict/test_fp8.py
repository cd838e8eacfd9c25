"""FP8 linear layers: the FP8 GEMM rate, the casting overhead of each recipe, the bytes kept, published ratios."""

from __future__ import annotations

from dataclasses import replace

import pytest

from microbatch.errors import ConfigError
from microbatch.hardware import get_accelerator
from microbatch.model import get_model
from microbatch.precision import FP8_RECIPES
from microbatch.predict.fp8 import cast_bytes
from microbatch.predict.plan import make_plan
from microbatch.predict.plan_config import PlanConfig
from microbatch.predict.roofline import DEFAULT_EFFICIENCY, gemm_time_s, layer_forward, model_flops_per_step
from microbatch.predict.state import bytes_per_param

H100 = get_accelerator("h100-80gb")
RUN = H100.at_sustained_clock()  # the clock its kernels run at (the Hopper rows' sustained clock)
LLAMA = get_model("llama-3-8b")
GEMMS = (
    (4096, 4096, 6144),
    (4096, 4096, 4096),
    (4096, 4096, 2 * 14336),
    (4096, 14336, 4096),
)  # rows k n, b=1 s=4096


def test_fp8_keeps_the_bytes_of_bf16_mixed():
    assert bytes_per_param("fp8") == bytes_per_param("bf16-mixed") == (2, 2, 12)
    assert bytes_per_param("fp8", "fp32") == (2, 4, 12)


def test_linear_gemms_run_at_the_fp8_rate_and_attention_does_not():
    bf = layer_forward(LLAMA, 1, H100, seq=4096)
    tw = layer_forward(LLAMA, 1, H100, seq=4096, fp8_recipe="tensorwise")
    expected = sum(gemm_time_s(r, k, n, RUN, dtype="fp8") for r, k, n in GEMMS)
    assert tw.gemm_s == pytest.approx(expected, rel=1e-12)
    assert tw.gemm_s < 0.7 * bf.gemm_s  # twice the peak, less the fixed costs
    assert tw.attention_s == bf.attention_s and tw.flops == bf.flops


def test_casts_cost_their_traffic_per_recipe():
    bw = H100.memory_bandwidth_bytes_per_s * DEFAULT_EFFICIENCY.memory
    bf = layer_forward(LLAMA, 1, H100, seq=4096)
    for name in ("tensorwise", "rowwise"):
        r = FP8_RECIPES[name]
        lt = layer_forward(LLAMA, 1, H100, seq=4096, fp8_recipe=name)
        fwd = sum(cast_bytes(*g, r)[0] for g in GEMMS)
        bwd = sum(cast_bytes(*g, r)[1] for g in GEMMS)
        assert lt.elementwise_s - bf.elementwise_s == pytest.approx(fwd / bw)
        assert (lt.elementwise_backward_s or 0) - (bf.elementwise_backward_s or 0) == pytest.approx(bwd / bw)
    # tensorwise: amax + cast of x and W (2e + 1 bytes each element); backward: dout (2e + 1) and the transposes (e + 1)
    assert cast_bytes(10, 20, 30, FP8_RECIPES["tensorwise"]) == (5 * (200 + 600), 5 * 300 + 3 * (200 + 600))
    assert cast_bytes(10, 20, 30, FP8_RECIPES["rowwise"]) == (5 * (200 + 600), 5 * 300 + 5 * (200 + 600))
    rw = layer_forward(LLAMA, 1, H100, seq=4096, fp8_recipe="rowwise")
    eff = replace(
        DEFAULT_EFFICIENCY, gemm_max=DEFAULT_EFFICIENCY.gemm_max * FP8_RECIPES["rowwise"].gemm_factor
    )
    assert rw.gemm_s == pytest.approx(sum(gemm_time_s(*g, RUN, dtype="fp8", efficiency=eff) for g in GEMMS))


def test_transformer_engine_recipes_fuse_the_transpose_and_cast_the_weights_once_a_step():
    """te-delayed: read + FP8 + FP8ᵀ (e + 2 bytes an element) of x forward and dout backward, no amax pass (delayed
    scaling's history), no transposes of their own; te-current adds the amax read (2e + 2); both cast each weight
    once a step (weight_cast_bytes), not per micro-batch. In a plan the once-a-step casts add L × the layer's
    weight-cast seconds, and more micro-batches amortise them (torchao's tensorwise pays them every one)."""
    from microbatch.predict.fp8 import weight_cast_bytes

    de, cur, tw = FP8_RECIPES["te-delayed"], FP8_RECIPES["te-current"], FP8_RECIPES["tensorwise"]
    assert cast_bytes(10, 20, 30, de) == (4 * 200, 4 * 300)
    assert cast_bytes(10, 20, 30, cur) == (6 * 200, 6 * 300)
    assert (weight_cast_bytes(20, 30, de), weight_cast_bytes(20, 30, cur)) == (4 * 600, 6 * 600)
    assert weight_cast_bytes(20, 30, tw) == 0.0
    lt = layer_forward(LLAMA, 1, H100, seq=4096, fp8_recipe="te-current")
    bw = H100.memory_bandwidth_bytes_per_s * DEFAULT_EFFICIENCY.memory
    assert lt.weight_cast_s == pytest.approx(sum(weight_cast_bytes(k, n, cur) for _, k, n in GEMMS) / bw)

    def step(recipe: str, batch: int) -> tuple[float, dict]:
        cfg = PlanConfig(shape=LLAMA, gpu=H100, global_batch=batch, data_parallel=8, micro_batches=(1,), zero=(1,),
                         recompute=("none",), precision="fp8", fp8_recipe=recipe, seq=4096)  # fmt: skip
        c = make_plan(cfg).candidates[0]
        return c.step_time_s, c.time

    from microbatch.predict.roofline import logits_forward
    from microbatch.predict.steptime import predict_step_time_s, stage_time

    logits, _ = logits_forward(LLAMA, 1, H100, seq=4096)
    one = stage_time(lt, logits, layers=LLAMA.layers, last=True, recompute="none").total_s
    assert predict_step_time_s(
        LLAMA, 1, H100, seq=4096, precision="fp8", fp8_recipe="te-current"
    ) == pytest.approx(one + LLAMA.layers * lt.weight_cast_s)  # a one-micro-batch step pays its weight casts
    s1, time1 = step("te-current", 8)
    assert time1["fp8_weight_cast_s"] == pytest.approx(LLAMA.layers * lt.weight_cast_s)
    s8, time8 = step("te-current", 64)
    assert time8["fp8_weight_cast_s"] == time1["fp8_weight_cast_s"]  # once a step, whatever m
    t1, t8 = step("tensorwise", 8)[0], step("tensorwise", 64)[0]
    assert step("tensorwise", 8)[1]["fp8_weight_cast_s"] == 0.0
    # per micro-batch, TE's once-a-step casts cost less with 8 micro-batches than with 1; torchao's do not
    assert (s1 - s8 / 8) > (t1 - t8 / 8)


def test_moe_experts_cast_each_local_expert_and_the_router_stays_in_bf16():
    """A MoE layer's FP8 casts count every local expert's GEMMs (E/EP of them), once a step for their weights
    under TE's recipes; the router runs in bf16, uncast (Megatron and TE keep it out of FP8)."""
    from microbatch.predict.fp8 import weight_cast_bytes

    moe = get_model("mixtral-8x7b")
    cur = FP8_RECIPES["te-current"]
    h, qw, kvd, F, E = (
        moe.hidden,
        moe.q_width,
        moe.kv * moe.head_dim,
        moe.moe.expert_ffn_hidden,
        moe.moe.experts,
    )
    bw = H100.memory_bandwidth_bytes_per_s * DEFAULT_EFFICIENCY.memory
    for ep in (1, 4):
        lt = layer_forward(moe, 1, H100, seq=4096, fp8_recipe="te-current", moe_layout=(ep, 1.0))
        expected = (weight_cast_bytes(h, qw + 2 * kvd, cur) + weight_cast_bytes(qw, h, cur)
                    + E // ep * (weight_cast_bytes(h, 2 * F, cur) + weight_cast_bytes(F, h, cur)))  # fmt: skip
        assert lt.weight_cast_s == pytest.approx(expected / bw)


def test_te_recipes_hold_their_cached_fp8_weights_and_the_planner_agrees():
    """TE keeps each layer's FP8 weight and its transpose through the step: 2 B a layer parameter on top of the bf16
    weights, whole under ZeRO (the embedding and output layer are not TE linears); the planner's peak is the
    memory model's."""
    from microbatch.precision import weight_cache_bytes
    from microbatch.predict.memory import MemoryConfig, estimate_memory

    assert (weight_cache_bytes("fp8", "te-delayed"), weight_cache_bytes("fp8", "tensorwise")) == (2, 0)
    assert weight_cache_bytes("bf16-mixed", "te-current") == 0

    def est(recipe: str, zero: int = 0, p: int = 1):
        return estimate_memory(LLAMA, MemoryConfig(micro_batch=1, seq=4096, precision="fp8", fp8_recipe=recipe,
                                                   zero=zero, data_parallel=8, pipeline_parallel=p))  # fmt: skip

    layers = LLAMA.layers_params(0, LLAMA.layers)
    for zero in (0, 3):
        te, tw = est("te-current", zero).stages[0], est("tensorwise", zero).stages[0]
        assert te.weights_bytes - tw.weights_bytes == pytest.approx(2 * layers)
    cfg = PlanConfig(shape=LLAMA, gpu=H100, global_batch=64, data_parallel=8, pipeline_parallel=2,
                     micro_batches=(1,), zero=(1,), recompute=("none",), precision="fp8", fp8_recipe="te-current",
                     seq=4096, schedules=("1f1b",))  # fmt: skip
    c = make_plan(cfg).candidates[0]
    mc = MemoryConfig(micro_batch=1, seq=4096, precision="fp8", fp8_recipe="te-current", zero=1, data_parallel=8,
                      pipeline_parallel=2, microbatches=c.microbatches, schedule="1f1b")  # fmt: skip
    assert c.peak_memory_bytes == pytest.approx(estimate_memory(LLAMA, mc).peak_bytes, rel=1e-9)


def _tps(precision: str, recipe: str = "tensorwise") -> float:
    cfg = PlanConfig(shape=LLAMA, gpu=H100, global_batch=8, data_parallel=8, micro_batches=(1,), zero=(3,),
                     recompute=("selective",), precision=precision, fp8_recipe=recipe, seq=8192)  # fmt: skip
    return make_plan(cfg).candidates[0].tokens_per_s


def test_fp8_ratios_follow_from_the_terms_not_from_a_fit():
    """FP8 runs the linear GEMMs at twice the bf16 dense rate (H100 datasheet) and adds cast traffic;
    rowwise adds the backward's own amax passes and nothing else (no kernel factor is fitted: the
    published FP8 step times are held out). So bf16 < rowwise < tensorwise, and tensorwise cannot gain
    more than the GEMMs' share of the step allows."""
    bf, tw, rw = _tps("bf16-mixed"), _tps("fp8"), _tps("fp8", "rowwise")
    assert FP8_RECIPES["rowwise"].gemm_factor == FP8_RECIPES["tensorwise"].gemm_factor == 1.0
    assert bf < rw < tw < 2 * bf
    b16 = layer_forward(LLAMA, 1, H100, seq=8192)
    f8 = layer_forward(LLAMA, 1, H100, seq=8192, fp8_recipe="tensorwise")
    assert f8.gemm_s < b16.gemm_s  # the GEMMs themselves are faster ...
    assert f8.elementwise_s > b16.elementwise_s  # ... and the casts cost traffic


def test_fp8_needs_fp8_tensor_cores_and_a_known_recipe():
    with pytest.raises(ConfigError, match="a100-80gb has none"):
        PlanConfig(shape=LLAMA, gpu=get_accelerator("a100-80gb"), global_batch=8, precision="fp8")
    with pytest.raises(ConfigError, match="fp8 recipe 'blockwise' is not known"):
        PlanConfig(shape=LLAMA, gpu=H100, global_batch=8, precision="fp8", fp8_recipe="blockwise")


def test_cli_plan_fp8(capsys):
    import json

    from microbatch.cli import main

    rc = main(["plan", "--model", "llama-3-8b", "--gpu", "h100-80gb", "-B", "8", "-d", "8", "-b", "1", "--zero", "3",
               "--recompute", "selective", "--precision", "fp8", "--fp8-recipe", "rowwise", "--json"])  # fmt: skip
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["precision"] == "fp8" and out["fp8_recipe"] == "rowwise"
    assert out["recommended"]["tokens_per_s"] == pytest.approx(_tps("fp8", "rowwise"), rel=1e-9)


def test_fp8_mfu_is_a_share_of_the_fp8_peak():
    """MFU divides by the peak of the dtype the GEMMs run in: under fp8 the fp8 peak (1,978.9 TFLOP/s on an
    H100 SXM, twice bf16's), so it stays below 1 where the bf16 peak gave 1.08 (gpt3-175b, B 64, s 2,048)."""
    cfg = PlanConfig(shape=get_model("gpt3-175b", seq=2048), gpu=get_accelerator("h100-sxm"), global_batch=64,
                     precision="fp8")  # fmt: skip
    plan = make_plan(cfg)
    flops = model_flops_per_step(cfg.shape, 64, 2048)
    for c in plan.candidates:
        assert c.mfu == pytest.approx(flops / (c.step_time_s * cfg.num_gpus * 1978.9e12), rel=1e-9)
        assert 0 < c.mfu < 1


def test_te_saves_linear_inputs_in_fp8_by_hand():
    """Transformer Engine's FP8 keeps the linear layers' inputs as their 1-byte casts: a GPT block (flash, dropout,
    f = 4h) keeps 5 sbh fewer bytes without recompute (QKV and MLP inputs −1 each, the MLP's second input −4, the
    output projection's FP8 copy +1 beside the attention's own bf16 output) and 7 fewer under selective recompute
    (the attention recomputed, only the projection's copy kept); a gated MLP keeps sbh + sbf fewer; full recompute
    keeps the layer input only, unchanged. torchao's recipes save bf16: no change."""
    from microbatch.model import ModelShape
    from microbatch.precision import saves_fp8_inputs
    from microbatch.predict.activations import layer_activation_bytes

    gpt = ModelShape(name="g", layers=2, hidden=1024, heads=16, vocab=1000, seq=2048, dropout=True)
    s, b, h = 2048, 2, 1024
    sbh = s * b * h
    for rc, fewer in (("none", 5), ("selective", 7), ("full", 0)):
        kw = dict(seq=s, recompute=rc, flash_attention=True)
        diff = layer_activation_bytes(gpt, b, **kw) - layer_activation_bytes(gpt, b, fp8_inputs=True, **kw)
        assert diff == fewer * sbh, rc
    gated = ModelShape(name="l", layers=2, hidden=h, heads=16, kv_heads=4, ffn_hidden=2816, vocab=1000, seq=s,
                       gated_mlp=True, bias=False, norm="rmsnorm", learned_positions=False)  # fmt: skip
    diff = layer_activation_bytes(gated, b, seq=s, flash_attention=True) - layer_activation_bytes(
        gated, b, seq=s, flash_attention=True, fp8_inputs=True
    )
    assert diff == sbh + s * b * 2816
    assert saves_fp8_inputs("fp8", "te-delayed") and saves_fp8_inputs("fp8", "te-current")
    assert not saves_fp8_inputs("fp8", "tensorwise") and not saves_fp8_inputs("bf16-mixed", "te-delayed")


def test_plan_and_memory_hold_te_fp8_activations_alike():
    """The planner's and the memory command's activations agree under TE's FP8, and are below torchao's."""
    from microbatch.model import get_model
    from microbatch.predict.memory import MemoryConfig, estimate_memory
    from microbatch.predict.plan import make_plan
    from microbatch.predict.plan_config import PlanConfig

    shape = get_model("llama-2-7b")
    acts = {}
    for recipe in ("tensorwise", "te-delayed"):
        cfg = PlanConfig(shape=shape, gpu=get_accelerator("h100-sxm"), global_batch=8, micro_batches=(1,),
                         recompute=("none",), schedules=("1f1b",), zero=(0,), precision="fp8", fp8_recipe=recipe)  # fmt: skip
        cand = make_plan(cfg).candidates[0]
        est = estimate_memory(
            shape, MemoryConfig(micro_batch=1, microbatches=8, precision="fp8", fp8_recipe=recipe)
        )
        assert est.stages[0].activations_bytes == pytest.approx(cand.memory["activations"], rel=1e-9)
        acts[recipe] = cand.memory["activations"]
    assert acts["te-delayed"] < acts["tensorwise"]


def test_te_fp8_inputs_under_sequence_parallelism_without_flash_and_in_moe_and_mla_blocks():
    """The FP8 casts split as their bf16 tensors do: with t = 4 and SP the QKV and MLP inputs 1 B of sbh/4, the output
    projection's copy 1 B of sbh/4 and nothing beside it without flash (the unfused attention keeps P and V, not O);
    a MoE block keeps its router's bf16 norm output and an MLA block its bf16 latent input (Megatron-core norms both
    standalone)."""
    from microbatch.model import ModelShape
    from microbatch.predict.activations import layer_activation_terms

    gpt = ModelShape(name="g", layers=2, hidden=1024, heads=16, vocab=1000, seq=2048, dropout=True)
    s, b, t = 2048, 1, 4
    kw = dict(seq=s, tensor_parallel=t, sequence_parallel=True)
    bf16 = layer_activation_terms(gpt, b, flash_attention=False, **kw)
    fp8 = layer_activation_terms(gpt, b, flash_attention=False, fp8_inputs=True, **kw)
    sbh = s * b * 1024
    assert fp8["attention_input"] == fp8["mlp_input"] == sbh / t == bf16["attention_input"] / 2
    # no O kept beside the projection's cast without flash
    assert fp8["attention_output"] == sbh / t == bf16["attention_output"] / 2
    assert fp8["mlp_hidden"] == 3 * s * b * 4096 / t  # fc1 output in bf16 (2) + the activation's cast (1)
    assert fp8["attention_scores"] == bf16["attention_scores"]
    moe, mla = get_model("deepseek-v3"), get_model("deepseek-v3")
    assert moe.moe is not None and mla.mla is not None
    base = layer_activation_terms(moe, 1, seq=4096, flash_attention=True)
    cast = layer_activation_terms(moe, 1, seq=4096, flash_attention=True, fp8_inputs=True)
    assert cast["mlp_input"] == base["mlp_input"] and cast["attention_input"] == base["attention_input"]
    # O in bf16 and the projection's 1-byte copy
    assert cast["attention_output"] == base["attention_output"] * 1.5
