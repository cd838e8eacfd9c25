"""Memory-bound operators at their measured fractions of bandwidth (issue 28 item 1): each by hand."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from microbatch.hardware import cpu_accelerator, get_accelerator
from microbatch.model import get_model
from microbatch.predict.gemm import DEFAULT_EFFICIENCY, gemm_time_s
from microbatch.predict.memory_ops import rotary_forward_s, rotary_passes, score_pass_split, score_passes
from microbatch.predict.roofline import layer_forward, logits_forward

A100 = get_accelerator("a100-80gb")
FUSED = replace(DEFAULT_EFFICIENCY, fused_elementwise=True)


def test_score_passes_split_by_kernel_add_up() -> None:
    for dropout in (False, True):
        for backward in (False, True):
            assert sum(score_pass_split(dropout, backward)) == score_passes(dropout, backward)
    assert score_pass_split(True) == (2.0, 2.0, 2.5)
    assert score_pass_split(False, backward=True) == (4.0, 3.0, 0.0)


def test_measured_fractions_eager_on_a_gpu_streaming_when_fused_or_on_a_cpu() -> None:
    assert DEFAULT_EFFICIENCY.score_fractions(True) == (0.356, 0.585)  # H200 eager softmax, dropout
    assert FUSED.score_fractions(True) == (0.8, 0.8)
    assert DEFAULT_EFFICIENCY.score_fractions(False) == (0.8, 0.8)
    with pytest.raises(ValueError, match="softmax_memory must be in"):
        replace(DEFAULT_EFFICIENCY, softmax_memory=1.5)


def test_rotary_by_hand() -> None:
    shape = get_model("llama-2-7b")  # rotary, a = kv = 32 heads of 128
    assert not shape.learned_positions
    rows, t = 4096, 2
    width = (32 + 32) * 128 / t  # Q and K on one of t ranks
    bw = A100.memory_bandwidth_bytes_per_s * 0.8
    assert rotary_passes(False) == 10.0 and rotary_passes(True) == 2.0
    assert rotary_forward_s(shape, 2 * rows, t, A100, DEFAULT_EFFICIENCY) == pytest.approx(
        2 * rows * width * 10 / bw
    )
    assert rotary_forward_s(shape, 2 * rows, t, A100, FUSED) == pytest.approx(2 * rows * width * 2 / bw)
    assert (
        rotary_forward_s(get_model("gpt2"), 2 * rows, t, A100, DEFAULT_EFFICIENCY) == 0.0
    )  # learned positions
    # in the layer: forward and backward each carry it once more than without rotary
    plain = replace(shape, learned_positions=True)
    with_rope = layer_forward(shape, 2, A100, seq=2048, tensor_parallel=t, efficiency=FUSED)
    without = layer_forward(plain, 2, A100, seq=2048, tensor_parallel=t, efficiency=FUSED)
    rope = 2 * rows * width * 2 / bw
    assert with_rope.elementwise_s - without.elementwise_s == pytest.approx(rope, rel=1e-9)
    assert (with_rope.elementwise_backward_s or 0) - (without.elementwise_backward_s or 0) == pytest.approx(
        rope, rel=1e-9
    )


def test_loss_softmax_over_the_vocabulary_by_hand() -> None:
    shape = get_model("gpt2")
    rows, v = 1024, shape.vocab
    gemm = gemm_time_s(rows, shape.hidden, v, A100)
    bw = A100.memory_bandwidth_bytes_per_s
    eager, _ = logits_forward(shape, 1, A100, seq=1024)
    assert eager == pytest.approx(gemm + 4 * rows * v * (1 / 0.8 + 2 / 0.356) / bw)
    fused, _ = logits_forward(shape, 1, A100, seq=1024, efficiency=FUSED)
    assert fused == pytest.approx(gemm + 3 * 4 * rows * v / (0.8 * bw))
    cpu = cpu_accelerator(flops_per_s=1e11, bytes_per_s=1e10, source="test")
    on_cpu, _ = logits_forward(shape, 1, cpu, seq=1024)
    # a CPU adds the 7 launches of the embedding (token, position, add), final norm, output GEMM and loss (2)
    launches = 7 * 6.58e-6
    assert on_cpu == pytest.approx(
        gemm_time_s(rows, shape.hidden, v, cpu) + 3 * 4 * rows * v / (0.8 * 1e10) + launches
    )


def test_norm_rates_against_cudnn_frontends_h200_norm_benchmark(monkeypatch):
    """cudnn-frontend's H200 norm benchmark (11 model widths, forward + backward): the eager norm fraction the
    planner takes from its own LayerNorm forward (0.44) is within 15% of eager PyTorch's forward + backward there
    (0.386: its backward runs at about a third of the bandwidth), the streaming rate within 10% of cuDNN's fused
    kernels (0.745), and ``COMPILED_NORM_MEMORY`` is the compiled rows' median (0.445), which the streaming rate
    the planner gave compiled norms before was 80% over."""
    from pathlib import Path

    from microbatch.predict.gemm import COMPILED_NORM_MEMORY, DEFAULT_EFFICIENCY

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "bench"))
    from bench_norms import rows

    by = {r["mode"]: r for r in rows()}
    assert all(r["models"] == 11 for r in by.values())
    assert abs(by["eager"]["error_pct"]) <= 15.0
    assert abs(by["fused"]["error_pct"]) <= 10.0
    assert COMPILED_NORM_MEMORY == pytest.approx(by["compiled"]["median"], abs=0.001)
    assert DEFAULT_EFFICIENCY.memory / by["compiled"]["median"] > 1.75


def test_compiled_plans_run_norms_at_the_compiled_rate(capsys):
    """``plan --compile`` runs the norms at COMPILED_NORM_MEMORY, ``--fused-kernels`` (Megatron's and TE's: efficiency
    fused, no norm rate) at the streaming rate: by hand for one layer's norms, and through the CLI the compiled step
    lies between the fused one and the eager one."""
    from dataclasses import replace

    from microbatch.hardware import get_accelerator
    from microbatch.predict.gemm import COMPILED_NORM_MEMORY, DEFAULT_EFFICIENCY
    from microbatch.predict.memory_ops import elementwise_forward_s

    fused = replace(DEFAULT_EFFICIENCY, fused_elementwise=True)
    compiled = replace(fused, fused_norm_memory=COMPILED_NORM_MEMORY)
    h100 = get_accelerator("h100-sxm")
    assert compiled.elementwise_fractions(True) == (COMPILED_NORM_MEMORY, fused.memory)
    assert fused.elementwise_fractions(True) == (fused.memory, fused.memory)
    assert compiled.elementwise_fractions(False) == (
        fused.memory,
        fused.memory,
    )  # off a GPU: the streaming rate
    a = elementwise_forward_s(1e6, 4096, 0.0, False, h100, fused)
    b = elementwise_forward_s(1e6, 4096, 0.0, False, h100, compiled)
    bw = h100.memory_bandwidth_bytes_per_s
    assert b - a == pytest.approx(1e6 * 4 * 4096 * (1 / COMPILED_NORM_MEMORY - 1 / fused.memory) / bw)
    from microbatch.cli import main

    args = ["plan", "--model", "llama-3-8b", "--gpu", "h100-sxm", "-B", "8", "-d", "8", "-b", "1", "--json"]
    steps = []
    for extra in ([], ["--fused-kernels"], ["--compile"]):
        assert main([*args, *extra]) == 0
        steps.append(json.loads(capsys.readouterr().out)["recommended"]["step_time_s"])
    eager, fused_step, compiled_step = steps
    assert (
        fused_step < compiled_step < eager
    )  # the compiled norms cost more than the fused, the rest as fused
