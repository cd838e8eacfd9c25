"""Memory model against the published figures (Korthikanti 2022, ZeRO) and its own invariants."""

from __future__ import annotations

import json

import pytest
from _published import PUBLISHED

from microbatch.cli import main
from microbatch.errors import ConfigError
from microbatch.model import ModelShape, get_model
from microbatch.predict.activations import layer_activation_bytes
from microbatch.predict.memory import (
    MemoryCalibration,
    MemoryConfig,
    estimate_memory,
    in_flight_layers,
    split_layers,
)
from microbatch.predict.state import bytes_per_param, model_state_bytes
from microbatch.schedules.rules import interleaved_in_flight_factor

needs_published = pytest.mark.skipif(PUBLISHED is None, reason="shared/reference/published.json not present")
GiB = 2**30
MODELS = {"22B": "megatron-22b", "175B": "megatron-175b", "530B": "megatron-530b", "1T": "megatron-1t"}


def _cases():
    return PUBLISHED["activation_memory"]["cases"] if PUBLISHED else []


@needs_published
@pytest.mark.parametrize("case", _cases(), ids=lambda c: c["model"])
def test_published_activation_memory_within_half_percent(case):
    shape = get_model(MODELS[case["model"]])
    assert (shape.layers, shape.hidden, shape.heads, shape.seq) == (
        case["layers"], case["hidden"], case["heads"], case["seq"],
    )  # fmt: skip
    v = case.get("virtual", 1)
    common = dict(
        micro_batch=case["micro_batch"], tensor_parallel=case["tp"], pipeline_parallel=case["pp"], virtual=v,
        schedule="interleaved-1f1b" if v > 1 else "1f1b", flash_attention=False,
    )  # fmt: skip
    # the published figures count the transformer layers only (the "layers" term) on the first stage
    tp_only = estimate_memory(shape, MemoryConfig(**common)).stages[0].activation_terms["layers"]
    sp_sel = (
        estimate_memory(shape, MemoryConfig(**common, sequence_parallel=True, recompute="selective"))
        .stages[0]
        .activation_terms["layers"]
    )
    assert tp_only / GiB == pytest.approx(case["activations_tp_only_gib"], rel=0.005)
    assert sp_sel / GiB == pytest.approx(case["activations_sp_selective_gib"], rel=0.005)


def test_per_layer_formulas_reduce_to_korthikanti():
    shape = get_model("megatron-22b")
    s, b, h, a, t = 2048, 4, 6144, 64, 8
    sbh = s * b * h
    kw = dict(flash_attention=False, tensor_parallel=t)
    assert layer_activation_bytes(shape, b, **kw) == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)))
    assert layer_activation_bytes(shape, b, sequence_parallel=True, **kw) == pytest.approx(
        sbh * (34 / t + 5 * a * s / (h * t))
    )
    assert layer_activation_bytes(shape, b, recompute="selective", **kw) == pytest.approx(sbh * (10 + 24 / t))
    assert layer_activation_bytes(shape, b, recompute="full", tensor_parallel=1) == pytest.approx(2 * sbh)
    assert layer_activation_bytes(shape, b, flash_attention=False) == pytest.approx(
        sbh * (34 + 5 * a * s / h)
    )


def test_flash_attention_drops_the_quadratic_term():
    shape = get_model("megatron-22b")
    no_flash = layer_activation_bytes(shape, 1, flash_attention=False)
    flash = layer_activation_bytes(shape, 1, flash_attention=True)
    selective = layer_activation_bytes(shape, 1, flash_attention=False, recompute="selective")
    # flash keeps only a 4-byte log-sum-exp per head and row instead of 5·a·s²·b
    assert flash - selective == pytest.approx(4 * shape.heads * shape.seq)
    assert no_flash - selective == pytest.approx(5 * shape.heads * shape.seq**2)


def test_activations_are_linear_in_micro_batch():
    shape = get_model("llama-2-7b")
    one = estimate_memory(shape, MemoryConfig(micro_batch=1, pipeline_parallel=4)).stages[0]
    eight = estimate_memory(shape, MemoryConfig(micro_batch=8, pipeline_parallel=4)).stages[0]
    assert eight.activations_bytes == pytest.approx(8 * one.activations_bytes)
    assert eight.weights_bytes == one.weights_bytes  # model state does not depend on b_m


@needs_published
def test_zero_paper_model_state():
    case = PUBLISHED["model_state_memory"]["case"]
    n, d = case["params"], case["data_parallel"]
    for z, key in enumerate(("baseline_gb", "zero1_gb", "zero2_gb", "zero3_gb")):
        total = sum(model_state_bytes(n, zero=z, data_parallel=d).values())
        assert total / 1e9 == pytest.approx(case[key], rel=1e-9)


@needs_published
def test_megatron_18_bytes_per_param_case():
    case = PUBLISHED["activation_memory"]["cases"][0]
    L, h, t = case["layers"], case["hidden"], case["tp"]
    total = sum(model_state_bytes(12 * L * h * h / t, grad_dtype="fp32").values())
    assert total / GiB == pytest.approx(case["params_and_optimizer_gib_at_18_bytes"], rel=1e-9)


def test_named_conventions():
    assert sum(bytes_per_param("bf16-mixed", "half")) == 16  # ZeRO paper
    assert sum(bytes_per_param("bf16-mixed", "fp32")) == 18  # Megatron
    assert sum(bytes_per_param("fp32")) == 16
    assert bytes_per_param("bf16-mixed", "half", "sgd") == (2, 2, 8)
    with pytest.raises(ConfigError, match="grad dtype 'bf16' is not known"):
        bytes_per_param("bf16-mixed", "bf16")


def test_in_flight_counts_per_schedule():
    p, m = 4, 16
    assert [in_flight_layers("1f1b", i, p, m, 1, 1) for i in range(p)] == [4, 3, 2, 1]
    assert [in_flight_layers("gpipe", i, p, m, 1, 1) for i in range(p)] == [16] * 4
    assert in_flight_layers("1f1b", 0, p, 2, 1, 1) == 2  # min(m, p − i)
    # interleaved: stage 0 holds L_stage·p·(1 + (p−1)/(p·v)) layer-micro-batches
    assert in_flight_layers("interleaved-1f1b", 0, 8, 32, 3, 12) == pytest.approx(
        12 * 8 * interleaved_in_flight_factor(8, 3)
    )
    assert (
        interleaved_in_flight_factor(8, 1) == 2 - 1 / 8
    )  # torch's order at one stage per rank: 2(p − 1) + 1


@pytest.mark.parametrize(
    "name,p,m,v", [("1f1b", 4, 8, 1), ("interleaved-1f1b", 4, 8, 2), ("gpipe", 3, 5, 1), ("zb-h1", 4, 8, 1)]
)
def test_in_flight_matches_the_simulator(name, p, m, v):
    from microbatch.schedules.registry import generate
    from microbatch.schedules.simulate import simulate

    res = simulate(generate(name, p, m, v), forward_time=1.0, input_time=1.0, weight_time=1.0)
    ours = [in_flight_layers(name, i, p, m, v, v) / v for i in range(p)]  # in rank-layer units
    assert ours == pytest.approx(list(res.peak_in_flight))


def test_uneven_split_and_stage_terms():
    shape = get_model("gpt2")
    est = estimate_memory(
        shape, MemoryConfig(micro_batch=2, pipeline_parallel=4, layers_per_stage=(2, 3, 3, 4))
    )
    assert [s.layers for s in est.stages] == [2, 3, 3, 4]
    assert "embedding" in est.stages[0].activation_terms and "output" in est.stages[-1].activation_terms
    # tied embeddings: the last stage keeps its own copy of the embedding matrix
    assert (
        est.stages[-1].params - 4 * shape.layer_params() == shape.output_params() + shape.vocab * shape.hidden
    )
    assert split_layers(10, 4) == (2, 2, 3, 3)
    with pytest.raises(ConfigError, match="must be 4 whole numbers >= 1 summing to 12"):
        split_layers(12, 4, (3, 3, 3))


def test_zero3_and_calibration_change_the_right_terms():
    shape = get_model("llama-2-7b")
    base = estimate_memory(shape, MemoryConfig(micro_batch=1, data_parallel=8)).peak_stage
    z3 = estimate_memory(shape, MemoryConfig(micro_batch=1, data_parallel=8, zero=3)).peak_stage
    assert z3.weights_bytes == pytest.approx(base.weights_bytes / 8) and z3.optimizer_bytes == pytest.approx(
        base.optimizer_bytes / 8
    )
    assert z3.other_bytes > 0 and z3.activations_bytes == base.activations_bytes
    cal = estimate_memory(
        shape, MemoryConfig(micro_batch=1), MemoryCalibration(activation_scale=1.5, fixed_bytes=1e9)
    ).peak_stage
    assert cal.activations_bytes == pytest.approx(
        1.5 * base.activations_bytes
    ) and cal.other_bytes == pytest.approx(1e9)


def test_bad_inputs_name_value_rule_fix():
    shape = get_model("gpt2")
    with pytest.raises(
        ConfigError, match=r"tensor-parallel 5 does not divide heads 12.*use tensor-parallel among"
    ):
        estimate_memory(shape, MemoryConfig(micro_batch=1, tensor_parallel=5))
    with pytest.raises(ConfigError, match=r"pipeline-parallel 13 > layers 12.*at most 12"):
        estimate_memory(shape, MemoryConfig(micro_batch=1, pipeline_parallel=13))
    with pytest.raises(ConfigError, match="divisible by stages 4 × virtual 2 = 8"):
        estimate_memory(
            shape, MemoryConfig(micro_batch=1, pipeline_parallel=4, virtual=2, schedule="interleaved-1f1b")
        )
    with pytest.raises(
        ConfigError,
        match="virtual 2 needs interleaved 1F1B, not schedule 1f1b; use schedule interleaved-1f1b or virtual 1",
    ):
        MemoryConfig(micro_batch=1, virtual=2)
    with pytest.raises(ConfigError, match="micro_batch must be a whole number >= 1, got -2"):
        MemoryConfig(micro_batch=-2)
    with pytest.raises(ConfigError, match="ZeRO stage 4"):
        MemoryConfig(micro_batch=1, zero=4)


def test_cli_memory_json(capsys):
    rc = main(["memory", "--model", "megatron-22b", "--micro-batch", "4", "--tensor-parallel", "8",
               "--sequence-parallel", "--recompute", "selective", "--no-flash-attention", "--json"])  # fmt: skip
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["memory"]) == {"weights", "gradients", "optimizer", "activations", "other"}
    assert out["peak_memory_bytes"] == pytest.approx(sum(out["memory"].values()))
    assert out["stages"][0]["activation_terms"]["layers"] / GiB == pytest.approx(9.5625)
    # 16 bytes/param (half gradients) of one t-shard of all parameters
    shape = get_model("megatron-22b")
    state = out["memory"]["weights"] + out["memory"]["gradients"] + out["memory"]["optimizer"]
    assert state == pytest.approx(16 * shape.param_count() / 8)


def test_cli_memory_bad_input_exit_2(capsys):
    assert main(["memory", "--model", "gpt2", "--micro-batch", "2", "--tensor-parallel", "5"]) == 2
    assert "does not divide heads" in capsys.readouterr().err
    assert main(["memory", "--model", "gpt2", "--micro-batch", "2", "-p", "20"]) == 2
    assert main(["memory", "--micro-batch", "2"]) == 2
    assert "no model given" in capsys.readouterr().err


def test_custom_shape_gqa_and_gated_mlp_terms():
    mha = ModelShape(layers=1, hidden=256, heads=8, vocab=100, seq=64, dropout=False)
    gqa = ModelShape(layers=1, hidden=256, heads=8, kv_heads=2, vocab=100, seq=64, dropout=False)
    sbh = 64 * 256
    # K and V shrink from 2·(2sbh) to 2·(2sbh)·kv/heads
    assert layer_activation_bytes(mha, 1) - layer_activation_bytes(gqa, 1) == pytest.approx(
        4 * sbh * (1 - 2 / 8)
    )
