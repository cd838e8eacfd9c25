"""Roofline times and FLOP counts against the published formulas and the roofline's shape."""

from __future__ import annotations

from dataclasses import replace

import pytest

from microbatch.hardware import get_accelerator
from microbatch.model import get_model
from microbatch.predict.roofline import (
    RooflineEfficiency,
    allgather_time_s,
    allreduce_time_s,
    arithmetic_intensity,
    elementwise_backward_ratio,
    gemm_flops,
    gemm_time_s,
    group_bandwidth,
    hardware_flops_per_step,
    k_efficiency,
    layer_forward,
    model_flops_per_step,
    ranks_per_node,
    score_passes,
    sp_regather_time_s,
    wave_efficiency,
)
from microbatch.predict.steptime import layer_pass_times

A100 = get_accelerator("a100-80gb")
PURE = RooflineEfficiency(
    gemm_max=1.0, memory=1.0, tile_rows=0, tile_cols=0, ramp_rows=0.0, launch_s_per_kernel=0.0
)


@pytest.mark.parametrize("name", ["megatron-22b", "megatron-175b", "megatron-530b", "megatron-1t"])
def test_flops_formulas_of_narayanan_2021(name):
    sh = get_model(name)
    B, s, L, h, V = 512, sh.seq, sh.layers, sh.hidden, sh.vocab
    assert model_flops_per_step(sh, B) == pytest.approx(
        72 * B * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h))
    )
    assert hardware_flops_per_step(sh, B, recompute="full") == pytest.approx(
        96 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))
    )
    # parameter formula 12·L·h²·(1 + 13/(12h) + (V+s)/(12·L·h)): our count adds only the final norm (2h); the
    # output layer is the embedding (Megatron's default, as the formula counts V·h once)
    formula = 12 * L * h * h * (1 + 13 / (12 * h) + (V + s) / (12 * L * h))
    assert sh.tied_embeddings and sh.param_count() == pytest.approx(formula + 2 * h, rel=1e-12)


def test_gemm_crosses_the_ridge_point():
    k = n = 4096
    ridge = A100.ridge_point()
    small, large = arithmetic_intensity(8, k, n), arithmetic_intensity(8192, k, n)
    assert small < ridge < large
    # memory-bound: doubling rows barely changes time; compute-bound: time doubles
    t8, t16 = gemm_time_s(8, k, n, A100, efficiency=PURE), gemm_time_s(16, k, n, A100, efficiency=PURE)
    t8k, t16k = (
        gemm_time_s(8192, k, n, A100, efficiency=PURE),
        gemm_time_s(16384, k, n, A100, efficiency=PURE),
    )
    assert t16 / t8 < 1.05
    assert t16k / t8k == pytest.approx(2.0)
    assert t8k == pytest.approx(2 * 8192 * k * n / 312e12)


def test_throughput_rises_then_plateaus_with_micro_batch():
    shape = get_model("gpt2")
    rates = []
    for b in (1, 2, 4, 8, 16, 32, 64):
        lt = layer_forward(shape, b, A100, seq=16, efficiency=PURE)
        rates.append(lt.flops / lt.total_s)
    assert all(b >= a * 0.999 for a, b in zip(rates, rates[1:], strict=False))  # never falls
    assert rates[2] / rates[0] > 2  # steep at first (memory-bound)
    assert rates[-1] / rates[-2] < 1.1  # flat at the end


def test_wave_quantisation():
    assert wave_efficiency(128 * 108, 128, 108) == 1.0  # one full wave
    assert wave_efficiency(128 * 109, 128, 108) == pytest.approx(109 / 216)  # one tile spills into wave 2
    assert wave_efficiency(100, 100, None) == 1.0


def test_efficiency_scales_compute_time():
    half = RooflineEfficiency(gemm_max=0.5, memory=1.0, tile_rows=0, tile_cols=0, ramp_rows=0.0)
    assert gemm_time_s(8192, 4096, 4096, A100, efficiency=half) == pytest.approx(
        2 * gemm_time_s(8192, 4096, 4096, A100, efficiency=PURE)
    )


def test_tensor_parallel_splits_compute_and_adds_comm():
    shape = get_model("megatron-22b")
    one = layer_forward(shape, 1, A100, efficiency=PURE)
    eight = layer_forward(shape, 1, A100, tensor_parallel=8, efficiency=PURE)
    assert eight.gemm_s == pytest.approx(one.gemm_s / 8, rel=0.05)
    # two all-reduces of the b·s·h activation at NVLink's achievable 0.82 × 300 GB/s
    assert one.tp_comm_s == 0 and eight.tp_comm_s == pytest.approx(
        2 * 2 * 7 / 8 * (2 * 2048 * 6144) / (0.82 * 300e9)
    )


def test_collectives_and_groups():
    assert allreduce_time_s(1e9, 1, 1e9) == 0
    assert allreduce_time_s(1e9, 4, 1e9) == pytest.approx(1.5)  # 2·(n−1)/n
    assert allgather_time_s(1e9, 4, 1e9) == pytest.approx(0.75)
    # achievable, not line rate: NVLink 0.82 × 300 GB/s; one HDR NIC 0.96 × 25 GB/s per rank in a node
    assert group_bandwidth(A100, 8, 1) == pytest.approx(0.82 * 300e9)
    assert group_bandwidth(A100, 8, 8) == pytest.approx(0.96 * 25e9)  # one rank per node: one NIC
    assert group_bandwidth(A100, 8, 2) == pytest.approx(4 * 0.96 * 25e9)  # 4 ranks per node: 4 NICs
    assert group_bandwidth(A100, 32, 1) == pytest.approx(8 * 0.96 * 25e9)  # 8 NICs: 192 GB/s < NVLink 246
    assert group_bandwidth(get_accelerator("h100-sxm"), 32, 1) == pytest.approx(0.82 * 450e9)  # 384 > 369
    assert [ranks_per_node(A100, 32, s) for s in (1, 2, 4, 8, 16)] == [8, 4, 2, 1, 1]
    assert ranks_per_node(A100, 2, 1) == 2


def test_k_efficiency_by_hand():
    # k₀ = τ·(peak/SMs)/(2·128·128) = 2.73e-6 · (312e12/108) / 32768 = 240.7 on an A100
    k0 = 2.73e-6 * 312e12 / 108 / (2 * 128 * 128)
    assert k0 == pytest.approx(240.7, abs=0.1)
    assert k_efficiency(768, A100) == pytest.approx(768 / (768 + k0))
    # the same τ on an H200 (989.4 TFLOP/s over 132 SMs) is the measured k₀ = 625
    h200 = get_accelerator("h200")
    assert 768 / k_efficiency(768, h200) - 768 == pytest.approx(625, abs=1)
    assert k_efficiency(768, A100, efficiency=PURE) == 1.0  # no tiles: no per-tile overhead
    # the row-parallel projection (k = h/t) loses more than the QKV GEMM (k = h)
    assert k_efficiency(6144 / 8, A100) < k_efficiency(6144, A100) < 1
    # and gemm_time_s divides by it: doubling the overhead slows a short-k GEMM more than a long-k one
    slow = RooflineEfficiency(tile_overhead_s=2 * 2.73e-6)
    r_short = gemm_time_s(2048, 768, 6144, A100, efficiency=slow) / gemm_time_s(2048, 768, 6144, A100)
    r_long = gemm_time_s(2048, 6144, 2304, A100, efficiency=slow) / gemm_time_s(2048, 6144, 2304, A100)
    assert r_short == pytest.approx((768 + 2 * k0) / (768 + k0), rel=1e-9) and r_long < r_short


def test_attention_score_passes_and_backward_by_hand():
    assert (score_passes(False), score_passes(True)) == (4.0, 6.5)
    assert (score_passes(False, backward=True), score_passes(True, backward=True)) == (7.0, 9.5)
    shape = get_model("megatron-22b")  # dropout on, no flash attention, a = 64, h = 6144
    assert shape.dropout
    eff = RooflineEfficiency(tile_overhead_s=0.0)
    lt = layer_forward(shape, 4, A100, tensor_parallel=8, flash_attention=False, dtype="fp16", efficiency=eff)
    rows, s, t, e, bw = 4 * 2048, 2048, 8, 2, 0.8 * 2039e9
    qkvo = e * rows * 4 * 6144 / t
    score = e * 64 * s * rows / t  # one pass over b·(a/t)·s² fp16 scores
    # eager: the matmuls' passes at the streaming rate, the softmax's at 0.356 and dropout's at 0.585 of the
    # bandwidth (measured on an H200): forward 2 + 2 + 2.5 passes, backward 4 + 3 + 2.5
    soft, drop = 0.356 * 2039e9, 0.585 * 2039e9
    assert lt.attention_s == pytest.approx((qkvo + 2 * score) / bw + 2 * score / soft + 2.5 * score / drop)
    assert lt.attention_backward_s == pytest.approx(
        (2 * qkvo + 4 * score) / bw + 3 * score / soft + 2.5 * score / drop
    )
    # fused (Megatron's FusedScaleMaskSoftmax, compiled code): every pass at the streaming rate
    fused = replace(eff, fused_elementwise=True)
    lt = layer_forward(
        shape, 4, A100, tensor_parallel=8, flash_attention=False, dtype="fp16", efficiency=fused
    )
    assert lt.attention_s == pytest.approx((qkvo + 6.5 * score) / bw)  # memory-bound: ≈ 1.10 ms
    assert lt.attention_backward_s == pytest.approx((2 * qkvo + 9.5 * score) / bw)
    assert lt.elementwise_backward_s == pytest.approx(elementwise_backward_ratio() * lt.elementwise_s)
    assert elementwise_backward_ratio() == 1.5  # read x, read dy, write dx vs read x, write y


def test_backward_input_pass_by_hand():
    """F, I and W of one megatron-22b layer (t = 8, sequence parallel, no flash attention, fp16,
    b_m 4 × 2048 on the A100) against its parts worked out here from the layer's shape, not read
    from the LayerTime the code returns: the four GEMMs (QKV h -> 3h/t, projection h/t -> h, fc1
    h -> 4h/t, fc2 4h/t -> h) each timed by gemm_time_s; the attention core memory-bound with its
    6.5 (forward) and 9.5 (backward) passes over the b·(a/t)·s² scores; 14 elementwise passes of
    rows × h/t (norms, residuals, dropout) and 2 of rows × 4h/t (GELU), fused (Megatron's kernels: at
    the streaming rate), 1.5× that backward; the two
    all-reduces and (SP, backward) the two all-gathers of b·s·h fp16 at 0.82 × 300 GB/s."""
    shape = get_model("megatron-22b")
    fused = RooflineEfficiency(fused_elementwise=True)  # Megatron-LM's fused LayerNorm and bias-GELU
    lt = layer_forward(
        shape, 4, A100, tensor_parallel=8, sequence_parallel=True, flash_attention=False, efficiency=fused
    )
    f, i, w = layer_pass_times(lt, "none")
    rows, s, h, t, e = 4 * 2048, 2048, 6144, 8, 2
    bw = 0.8 * 2039e9
    gemms = sum(
        gemm_time_s(rows, k, n, A100, dtype="fp16")
        for k, n in [(h, 3 * h / t), (h / t, h), (h, 4 * h / t), (4 * h / t, h)]
    )
    qkvo, score = e * rows * 4 * h / t, e * 64 * s * rows / t
    attention, attention_back = (qkvo + 6.5 * score) / bw, (2 * qkvo + 9.5 * score) / bw
    elementwise = e * rows * (14 * h / t + 2 * 4 * h / t) / bw
    gather = 7 / 8 * e * rows * h / (0.82 * 300e9)  # one ring all-gather; an all-reduce is two
    all_reduces, regather = 2 * (2 * gather), 2 * gather
    assert w == pytest.approx(gemms, rel=1e-9)  # one weight-gradient GEMM per forward GEMM
    assert f == pytest.approx(gemms + attention + elementwise + all_reduces, rel=1e-9)  # ≈ 6.90 ms
    back = gemms + attention_back + 1.5 * elementwise + all_reduces + regather
    assert i == pytest.approx(back, rel=1e-9)  # ≈ 8.23 ms
    assert layer_pass_times(lt, "selective")[1] == pytest.approx(back + attention, rel=1e-9)
    # full recompute gathers again in its forward: no separate re-gather
    assert layer_pass_times(lt, "full")[1] == pytest.approx(back - regather + f, rel=1e-9)
    assert sp_regather_time_s(1e9, 8, 1e9) == pytest.approx(1.75)
    no_sp = layer_forward(shape, 4, A100, tensor_parallel=8, flash_attention=False, efficiency=fused)
    assert no_sp.sp_regather_s == 0 and no_sp.tp_comm_s == pytest.approx(all_reduces, rel=1e-9)


def test_short_k_gemms_cost_more_per_flop():
    # proj (k = h/t = 768) vs fc1 (k = h = 6144) of the 22B layer at t = 8, rows 2048: same wave shape
    proj = gemm_flops(2048, 768, 6144) / gemm_time_s(2048, 768, 6144, A100)
    fc1 = gemm_flops(2048, 6144, 3072) / gemm_time_s(2048, 6144, 3072, A100)
    assert proj / fc1 == pytest.approx(k_efficiency(768, A100) / k_efficiency(6144, A100), rel=0.05)


def test_pipeline_send_scatter_gather_and_interleaving_by_hand():
    from microbatch.predict.roofline import LayerTime, pipeline_send_time_s
    from microbatch.predict.steptime import pipeline_stage_times

    # 530B hand-off at b_m 1: b·s·h·e = 2048·20480·2 bytes; t = 8 ranks each send 1/8 over one HDR NIC
    # (stages t·d = 8 ranks apart: another node), then all-gather over NVLink
    nbytes = 2048 * 20480 * 2
    send = nbytes / 8 / (0.96 * 25e9)  # 0.437 ms
    gather = 7 / 8 * nbytes / (0.82 * 300e9)  # 0.298 ms
    got = pipeline_send_time_s(nbytes, A100, tensor_parallel=8, pipeline_stride=8)
    assert got == pytest.approx(send + gather) and got == pytest.approx(0.735e-3, rel=0.01)
    assert pipeline_send_time_s(nbytes, A100, tensor_parallel=1, pipeline_stride=8) == pytest.approx(
        nbytes / (0.96 * 25e9)
    )
    # interleaving: v chunks per rank, v sends per micro-batch on F and on I, none on W
    lt = LayerTime(gemm_s=1.0, attention_s=0.0, elementwise_s=0.0, tp_comm_s=0.0, flops=1.0)
    f1, i1, w1 = pipeline_stage_times(lt, 0.0, split=(3, 3), p2p_s=0.01)
    f3, i3, w3 = pipeline_stage_times(lt, 0.0, split=(3, 3), p2p_s=0.01, virtual=3)
    assert [b - a for a, b in zip(f1, f3, strict=True)] == pytest.approx([0.02, 0.02])
    assert [b - a for a, b in zip(i1, i3, strict=True)] == pytest.approx([0.02, 0.02])
    assert w3 == w1


def test_row_efficiency_by_hand():
    from microbatch.hardware import cpu_accelerator
    from microbatch.predict.roofline import row_efficiency

    assert row_efficiency(2048, A100) == pytest.approx(2048 / (2048 + 140))  # 0.936
    assert row_efficiency(128, A100) == pytest.approx(128 / 268)
    cpu = cpu_accelerator(flops_per_s=1e11, bytes_per_s=1e10, source="test")
    assert row_efficiency(128, cpu) == 1.0  # GPU tiles only
    # gemm_time_s divides by it: b_m·s = 2048 rows vs 16384 rows of the same GEMM, per row
    per_row = [gemm_time_s(r, 4096, 16384, A100) / r for r in (2048, 16384)]
    assert per_row[0] / per_row[1] == pytest.approx((1 + 140 / 2048) / (1 + 140 / 16384), rel=1e-9)


def test_elementwise_at_measured_fractions_unless_fused():
    """Issue 28: eager norms (0.44) and activations (0.48) at their measured fractions of bandwidth on a GPU;
    fused or compiled ones, and every CPU, at the streaming rate (``memory``)."""
    from dataclasses import replace as _replace

    from microbatch.errors import ConfigError
    from microbatch.hardware import cpu_accelerator
    from microbatch.predict.gemm import DEFAULT_EFFICIENCY
    from microbatch.predict.roofline import elementwise_forward_s

    h100 = get_accelerator("h100-sxm")
    bw = h100.memory_bandwidth_bytes_per_s
    rb, h, pf = 2 * 4096.0, 4096.0, 3 * 14336.0  # e·rows with rows = 4096; h; 3 passes of f
    eager = elementwise_forward_s(rb, h, pf, False, h100, DEFAULT_EFFICIENCY)
    assert eager == pytest.approx(rb * (4 * h / (0.44 * bw) + 6 * h / (0.8 * bw) + pf / (0.48 * bw)))
    fused_eff = _replace(DEFAULT_EFFICIENCY, fused_elementwise=True)
    fused = elementwise_forward_s(rb, h, pf, True, h100, fused_eff)
    assert fused == pytest.approx(rb * (14 * h + pf) / (0.8 * bw))  # the rule before issue 28
    cpu = cpu_accelerator(flops_per_s=1e11, bytes_per_s=2e10, memory_bytes=1e10)
    assert elementwise_forward_s(rb, h, pf, False, cpu, DEFAULT_EFFICIENCY) == pytest.approx(
        elementwise_forward_s(rb, h, pf, False, cpu, fused_eff)
    )
    with pytest.raises(ConfigError, match="norm_memory"):
        _replace(DEFAULT_EFFICIENCY, norm_memory=0.0)


def test_parallel_block_reduces_once_per_pass():
    """GPT-J/NeoX/PaLM parallel attention + MLP: one TP all-reduce (and one SP gather) per layer and pass."""
    shape = get_model("megatron-22b")
    kw = dict(tensor_parallel=8, sequence_parallel=True, flash_attention=False)
    serial = layer_forward(shape, 2, A100, **kw)
    parallel = layer_forward(shape, 2, A100, parallel_block=True, **kw)
    assert serial.tp_comm_s > 0 and serial.sp_regather_s > 0
    assert parallel.tp_comm_s == pytest.approx(serial.tp_comm_s / 2)
    assert parallel.sp_regather_s == pytest.approx(serial.sp_regather_s / 2)
    assert (parallel.gemm_s, parallel.attention_s, parallel.elementwise_s) == (
        serial.gemm_s, serial.attention_s, serial.elementwise_s,
    )  # fmt: skip
    from microbatch.predict.plan import PlanConfig, make_plan

    cfg = PlanConfig(
        shape=shape, gpu=A100, global_batch=8, tensor_parallel=8, micro_batches=(1,), recompute=("full",)
    )
    a = make_plan(cfg).candidates[0]
    b = make_plan(replace(cfg, parallel_block=True)).candidates[0]
    assert b.step_time_s < a.step_time_s


def test_launch_floor_by_hand():
    """Issue 28: on a GPU a pass takes at least its kernels' launch time on the host (6.58 µs each, measured)."""
    from microbatch.predict.gemm import DEFAULT_EFFICIENCY
    from microbatch.predict.launch import LAUNCH_S_PER_KERNEL, launch_gap_s, layer_kernels

    assert LAUNCH_S_PER_KERNEL == DEFAULT_EFFICIENCY.launch_s_per_kernel == 6.58e-6
    assert launch_gap_s(10, 1e-5, 4e-5) == pytest.approx(6e-5)
    assert launch_gap_s(10, 1e-5, 2e-4) == 0.0
    gpt2, llama = get_model("gpt2"), get_model("llama-2-7b")
    # gpt2 eager, unfused attention, dropout: 4 GEMMs + 4 attention + 2 norms + 2 adds + GELU + 2 dropouts
    assert layer_kernels(gpt2, flash=False, tensor_parallel=1, fused=False) == 4 + 4 + 2 + 2 + 1 + 2
    # llama: 5 GEMMs (gate and up apart), flash, SiLU and its multiply, no dropout, rotary on Q and K (5 eager
    # kernels each, 1 fused), 2 collectives at t = 2
    assert layer_kernels(llama, flash=True, tensor_parallel=2, fused=False) == 5 + 1 + 2 + 2 + 2 + 10 + 2
    assert layer_kernels(llama, flash=True, tensor_parallel=1, fused=True) == 5 + 1 + 3 + 2
    # a tiny micro-batch of gpt2 on an H100 (GEMMs on the plain roofline): the forward is the host's 15
    # launches, the backward its 30
    h100 = get_accelerator("h100-sxm")
    plain = RooflineEfficiency(tile_rows=0, tile_cols=0, ramp_rows=0.0, tile_overhead_s=0.0)
    lt = layer_forward(gpt2, 1, h100, seq=16, flash_attention=False, efficiency=plain)
    assert lt.compute_s == pytest.approx(15 * 6.58e-6)
    f, i, w = layer_pass_times(lt, "none")
    assert f == pytest.approx(15 * 6.58e-6)
    assert i + w == pytest.approx(30 * 6.58e-6)  # input and weight gradients together: twice the kernels
    off = layer_forward(
        gpt2, 1, h100, seq=16, flash_attention=False, efficiency=replace(plain, launch_s_per_kernel=0.0)
    )
    assert off.compute_s < lt.compute_s / 3
    big = layer_forward(gpt2, 16, h100, seq=1024, flash_attention=False)  # device-bound: no gap
    assert big.elementwise_s == pytest.approx(
        layer_forward(
            gpt2,
            16,
            h100,
            seq=1024,
            flash_attention=False,
            efficiency=RooflineEfficiency(launch_s_per_kernel=0),
        ).elementwise_s
    )


def test_a_cpu_adds_each_counted_kernels_dispatch_to_its_compute():
    """A CPU runs an operator where it is dispatched: the host's time adds (a GPU's is a floor under the device's).
    With measured GEMM times (each timed call carried its own dispatch) the GEMMs' launches are not added again."""
    from microbatch.hardware import cpu_accelerator
    from microbatch.predict.launch import layer_gemm_kernels, layer_kernels
    from microbatch.predict.measured_gemm import MeasuredGemms

    cpu = cpu_accelerator(flops_per_s=1e11, bytes_per_s=2e10, source="test")
    tiny = get_model("tiny")
    n, gemms = layer_kernels(tiny, flash=True, tensor_parallel=1, fused=False), layer_gemm_kernels(tiny)
    assert (n, gemms) == (12, 4)  # 4 GEMMs, flash, 2 norms, 2 adds, GELU, 2 dropouts
    off = RooflineEfficiency(launch_s_per_kernel=0.0)
    for rows in (1, 64):  # added whatever the compute: at 1 sequence and at 64
        base = layer_forward(tiny, rows, cpu, efficiency=off)
        lt = layer_forward(tiny, rows, cpu, efficiency=replace(off, launch_s_per_kernel=1e-5))
        assert lt.compute_s - base.compute_s == pytest.approx(n * 1e-5)
        f0, i0, w0 = layer_pass_times(base, "none")
        f, i, w = layer_pass_times(lt, "none")
        assert (f - f0, i + w - i0 - w0) == (pytest.approx(n * 1e-5), pytest.approx(2 * n * 1e-5))
    measured = replace(off, launch_s_per_kernel=1e-5, gemm_measured=MeasuredGemms(points=()))
    plain = replace(off, gemm_measured=MeasuredGemms(points=()))
    lt, base = layer_forward(tiny, 4, cpu, efficiency=measured), layer_forward(tiny, 4, cpu, efficiency=plain)
    assert lt.compute_s - base.compute_s == pytest.approx((n - gemms) * 1e-5)
    # a GPU keeps the floor: a device-bound pass is not lengthened
    h100 = get_accelerator("h100-sxm")
    big = layer_forward(tiny, 64, h100, efficiency=replace(off, launch_s_per_kernel=1e-9))
    assert big.compute_s == pytest.approx(layer_forward(tiny, 64, h100, efficiency=off).compute_s)


def test_the_output_layer_and_loss_pay_their_launches_as_a_layer_does():
    """Embedding lookups (3 with learned positions, 1 with rotary), the final norm, the output GEMM, log-softmax and
    NLL: added on a CPU (less the GEMM's where GEMM times were measured), a floor on a GPU."""
    from microbatch.hardware import cpu_accelerator
    from microbatch.predict.launch import head_kernels
    from microbatch.predict.measured_gemm import MeasuredGemms
    from microbatch.predict.roofline import logits_forward

    tiny, llama = get_model("tiny"), get_model("llama-2-7b")
    assert (head_kernels(tiny), head_kernels(llama)) == (3 + 1 + 1 + 2, 1 + 1 + 1 + 2)
    cpu = cpu_accelerator(flops_per_s=1e11, bytes_per_s=2e10, source="test")
    off = RooflineEfficiency(launch_s_per_kernel=0.0)
    on = replace(off, launch_s_per_kernel=1e-5)
    base = logits_forward(tiny, 2, cpu, efficiency=off)[0]
    assert logits_forward(tiny, 2, cpu, efficiency=on)[0] - base == pytest.approx(7e-5)
    measured = MeasuredGemms(points=())
    base = logits_forward(tiny, 2, cpu, efficiency=replace(off, gemm_measured=measured))[0]
    got = logits_forward(tiny, 2, cpu, efficiency=replace(on, gemm_measured=measured))[0]
    assert got - base == pytest.approx(6e-5)
    h100 = get_accelerator("h100-sxm")
    assert logits_forward(tiny, 1, h100, seq=8, efficiency=on)[0] == pytest.approx(
        7e-5
    )  # host-bound: the floor
    big = logits_forward(llama, 8, h100, efficiency=on)[0]  # device-bound: unchanged
    assert big == pytest.approx(logits_forward(llama, 8, h100, efficiency=off)[0]) and big > 5e-5


def test_rows_below_one_tile_are_charged_once_by_the_ramp():
    """Fewer rows than a tile: the measured ramp rows/(rows + 140) owns the loss, tile quantisation does not."""
    from microbatch.predict.roofline import k_efficiency

    # 16 rows × 108·128 columns on 108 SMs: one wave of 108 column tiles, nothing lost to quantisation
    assert wave_efficiency(16, 128 * 108, 108) == 1.0
    assert wave_efficiency(16, 128 * 109, 108) == pytest.approx(109 / 216)  # the column waves still count
    assert wave_efficiency(200, 128 * 54, 108) == pytest.approx(200 / 256)  # above a tile: 2 row tiles
    # compute time by hand at 16 rows, k 8,192, n 128·108 on an A100 (bandwidth bound removed)
    eff = RooflineEfficiency()
    rows, k, n = 16, 8192, 128 * 108
    rate = A100.flops("bf16") * 0.8 * k_efficiency(k, A100) * rows / (rows + 140)
    compute = 2 * rows * k * n / rate
    memory = 2 * (rows * k + k * n + rows * n) / (A100.memory_bandwidth_bytes_per_s * 0.8)
    assert gemm_time_s(rows, k, n, A100, efficiency=eff) == pytest.approx(max(compute, memory), rel=1e-12)
    assert compute > memory  # the hand value above is the compute side, so the ramp is what is checked


@pytest.mark.parametrize("gpu", ["h100-sxm", "a100-80gb", "h200", "l4"])
def test_gemm_time_never_falls_as_rows_grow(gpu):
    """A GEMM of fewer rows can run padded to more, so it is never slower than them. The partial-wave and
    small-row terms made 128 rows slower than 512 on an H100 (1280 × 3840: 21.8 µs against 13.3 µs)."""
    acc = get_accelerator(gpu)
    for k, n in ((1280, 3840), (4096, 16384), (8192, 1024), (512, 50257), (2048, 96)):
        times = [gemm_time_s(r, k, n, acc) for r in range(16, 4097, 16)]
        assert all(b >= a * (1 - 1e-12) for a, b in zip(times, times[1:], strict=False)), (gpu, k, n)


def test_the_padded_bound_is_the_last_row_of_the_same_waves():
    from microbatch.predict.gemm import _wave_rows

    h100 = get_accelerator("h100-sxm")
    assert h100.compute_units == 132
    # 3840 columns are 30 tiles: 4 row tiles (120 of 132 SMs) fill one wave; 5 need a second
    assert _wave_rows(128, 3840, 132, 128, 128) == 512
    assert _wave_rows(513, 3840, 132, 128, 128) == 1024  # two waves hold 8 row tiles (240 of 264)
    assert _wave_rows(100, 16384, 132, 128, 128) == 128  # 128 column tiles: one row tile per wave
    assert gemm_time_s(128, 1280, 3840, h100) == pytest.approx(gemm_time_s(512, 1280, 3840, h100))
    assert _wave_rows(300, 3840, None, 128, 128) == 300  # no SM count (a CPU): no bound


def test_a_host_bound_weight_pass_takes_its_launches_and_faster_gemms_never_lengthen_zero_bubble():
    """W of a split backward is the weight-gradient GEMMs or their launches, whichever is longer; that much of
    the backward's launch gap moves from I to W (I + W unchanged). A faster GPU had made zb-h1 slower: its GEMMs
    shrank W while the launch gap grew I, and the zero-bubble idle grows with I − W."""
    from dataclasses import replace as dc_replace

    from microbatch.predict.plan import make_plan
    from microbatch.predict.plan_config import PlanConfig

    acc = get_accelerator("h100-nvl")
    tiny = get_model("tiny")
    lt = layer_forward(tiny, 1, acc)
    assert lt.backward_gap_s > 0 and lt.weight_host_s > lt.gemm_s  # host-bound
    f, i, w = layer_pass_times(lt)
    assert w == pytest.approx(lt.gemm_s + min(lt.weight_host_s - lt.gemm_s, lt.backward_gap_s))
    bare = layer_pass_times(dc_replace(lt, backward_gap_s=0.0, weight_host_s=0.0))
    assert i + w == pytest.approx(bare[1] + bare[2])  # the backward's total is unchanged
    for every in (1, 2, 3):  # full recompute of one layer in K: W as every pass has it, I + W = B + forward/K
        _, i_k, w_k = layer_pass_times(lt, "full", every)
        assert w_k == pytest.approx(w) and i_k + w_k == pytest.approx(i + w + f / every), every
    fast = dc_replace(acc, peak_flops={k: 2 * v for k, v in acc.peak_flops.items()})
    for sched in ("zb-h1", "1f1b"):
        cfg = PlanConfig(shape=tiny, gpu=acc, global_batch=2, pipeline_parallel=2, schedules=(sched,),
                         recompute=("none",), simulate_top=0)  # fmt: skip
        slow_s, fast_s = (make_plan(dc_replace(cfg, gpu=g)).candidates[0].step_time_s for g in (acc, fast))
        assert fast_s <= slow_s * (1 + 1e-12), sched


def test_launch_floor_counts_each_local_expert():
    """A mixture-of-experts MLP issues its kernels per local expert (Transformer Engine's GroupedLinear: one GEMM
    each; an activation each): Mixtral (8 experts, gated, no shared), flash, fused, t 1, on 8 ranks (1 local expert
    each) against on 1 (all 8): GEMMs 2 + router 1 + 3 per local expert; elementwise 2 + top-k, score 2 +
    permute, unpermute 2 + the all-to-all pair 2 (spread only) + one activation per local expert; fused rotary 2."""
    from microbatch.predict.launch import layer_gemm_kernels, layer_kernels

    mixtral = get_model("mixtral-8x7b")
    assert layer_gemm_kernels(mixtral, 1) == 2 + 1 + 3 and layer_gemm_kernels(mixtral) == 2 + 1 + 24
    spread = layer_kernels(mixtral, flash=True, tensor_parallel=1, fused=True, local_experts=1)
    whole = layer_kernels(mixtral, flash=True, tensor_parallel=1, fused=True)
    assert spread == (2 + 1 + 3) + 1 + (2 + 2 + 2 + 2 + 1) + 2
    assert whole == (2 + 1 + 24) + 1 + (2 + 2 + 2 + 8) + 2
    # a dense model's count is unchanged by the argument
    llama = get_model("llama-2-7b")
    assert layer_kernels(llama, flash=True, tensor_parallel=1, fused=True, local_experts=4) == 5 + 1 + 3 + 2
    # on an H100 at a few tokens the 8-expert layer on one GPU waits on the host longer than the 1-expert one
    h100 = get_accelerator("h100-sxm")
    one = layer_forward(mixtral, 1, h100, seq=16, flash_attention=True, moe_layout=(8, 1.0))
    all8 = layer_forward(mixtral, 1, h100, seq=16, flash_attention=True)
    assert all8.weight_host_s == pytest.approx(27 * 6.58e-6) and one.weight_host_s == pytest.approx(
        6 * 6.58e-6
    )


def test_launch_floor_counts_the_ring_steps():
    """Ring attention issues c flash calls, each past the first with a correction and a copy: 3 kernels a step."""
    from microbatch.predict.launch import layer_kernels

    llama = get_model("llama-2-7b")
    one = layer_kernels(llama, flash=True, tensor_parallel=1, fused=True)
    assert layer_kernels(llama, flash=True, tensor_parallel=1, fused=True, ring_steps=8) == one + 3 * 7
    assert layer_kernels(llama, flash=False, tensor_parallel=1, fused=True, ring_steps=8) == layer_kernels(
        llama, flash=False, tensor_parallel=1, fused=True
    )
    # in a layer: a tiny micro-batch over 8 ranks waits on the host for the steps' launches (Ulysses: one call)
    h100 = get_accelerator("h100-sxm")
    kw = dict(seq=128, context_parallel=8, flash_attention=True)
    ring = layer_forward(llama, 1, h100, cp_comm="ring", **kw)
    uly = layer_forward(llama, 1, h100, cp_comm="ulysses", **kw)
    assert ring.elementwise_s > uly.elementwise_s
