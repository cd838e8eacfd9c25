"""A kernel microbenchmark as a calibration: the measured terms replace the analytic ones on the accelerator
it ran on (GEMM times at measured shapes exactly, read between them; the attention ceiling; streaming
fractions; the all-reduce bus bandwidth), nowhere else; the plan says where each term came from.

Synthetic results have known times (the analytic model would give others), so each check has an exact answer.
One real CPU microbenchmark of the tiny model is compared with a measured step (bench/bench_microbench_calibration.py
prints the same comparison)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from microbatch.cli import main
from microbatch.hardware import get_accelerator
from microbatch.measure.microbench import MicrobenchConfig, layer_gemm_shapes, run_microbench
from microbatch.microbench_record import (
    AttentionTiming,
    CollectiveTiming,
    GemmTiming,
    MicrobenchResult,
    StreamTiming,
)
from microbatch.model import get_model
from microbatch.predict.apply_calibration import apply_calibration, apply_microbench
from microbatch.predict.attention import flash_rate_fraction
from microbatch.predict.gemm import DEFAULT_EFFICIENCY, gemm_time_s
from microbatch.predict.measured_gemm import interpolate_ratio
from microbatch.predict.steptime import predict_step_time_s

SHAPE = get_model("llama-2-7b")
H100 = get_accelerator("h100-sxm")
ROOT = Path(__file__).resolve().parents[2]


def _rate(rows: int) -> float:
    """A made-up GEMM rate: 400 TFLOP/s with a 500-row ramp (not the analytic model's)."""
    return 400e12 * rows / (rows + 500)


def synthetic(collective: bool = False, soak_s: float = 0.1, **square: float) -> MicrobenchResult:
    """A made-up H100 result; its kernels timed after a soak (the sustained clock) unless ``soak_s`` is 0."""
    gemms = [
        GemmTiming(label=lab, rows=r, k=k, n=n, seconds=2 * r * k * n / _rate(r), flops_per_s=_rate(r))
        for b in (1, 4) for lab, r, k, n in layer_gemm_shapes(SHAPE, b * SHAPE.seq)
    ]  # fmt: skip
    bw = H100.memory_bandwidth_bytes_per_s
    stream = tuple(
        StreamTiming(kernel=k, nbytes=1, seconds=1.0, bytes_per_s=f * bw)
        for k, f in (("copy", 0.7), ("add", 0.8), ("gelu", 0.4), ("layernorm", 0.3))
    )
    coll = (CollectiveTiming(op="all_reduce", nbytes=1, world_size=8, seconds=1.0, bus_bytes_per_s=300e9),)
    return MicrobenchResult(
        device="cuda", device_name="NVIDIA H100 80GB HBM3", accelerator="h100-sxm", torch_version="2.11",
        dtype="bf16", timer="CUDA events", model=SHAPE.name, seq=SHAPE.seq, micro_batches=(1, 4),
        gemms=tuple(gemms), stream=stream, collectives=coll if collective else (), launch_s_per_kernel=5e-6,
        overlap_slowdown=0.25 if collective else None,
        attention=(AttentionTiming(seq=4096, heads=32, head_dim=128, batch=2, seconds=1.0, flops_per_s=300e12),),
        soak_s=soak_s, **square,
    )  # fmt: skip


@pytest.fixture
def h100_file(tmp_path: Path) -> Path:
    p = tmp_path / "h100.json"
    p.write_text(synthetic().to_json())
    return p


def test_planner_gemm_time_at_a_measured_shape_is_the_measured_time(h100_file: Path) -> None:
    a = apply_calibration(h100_file, shape=SHAPE, precision="bf16-mixed", gpu=H100)
    assert a.accelerator is not None
    run = a.accelerator.at_sustained_clock()  # as the planner runs kernels (layer_forward)
    for g in synthetic().gemms:
        t = gemm_time_s(g.rows, g.k, g.n, run, dtype="bf16", efficiency=a.efficiency)
        assert t == pytest.approx(g.seconds, rel=1e-9)
        plain = gemm_time_s(g.rows, g.k, g.n, H100, dtype="bf16")
        assert abs(plain / g.seconds - 1) > 0.1  # the uncalibrated model differs there


def test_between_measured_rows_the_ratio_lies_between_theirs() -> None:
    pts = ((1000.0, 4096.0, 4096.0, 1.5), (4000.0, 4096.0, 4096.0, 1.1))
    mid = interpolate_ratio(pts, 2000.0, 4096.0, 4096.0)
    assert 1.1 < mid < 1.5
    assert interpolate_ratio(pts, 1000.0, 4096.0, 4096.0) == 1.5
    # equal log-distance from both: their mean
    assert interpolate_ratio(pts, 2000.0, 4096.0, 4096.0) == pytest.approx(1.3)


def test_attention_streaming_network_and_launch_are_the_measured_ones(tmp_path: Path) -> None:
    p = tmp_path / "mb.json"
    p.write_text(synthetic(collective=True).to_json())
    a = apply_calibration(p, shape=SHAPE, precision="bf16-mixed", gpu=H100)
    assert a.accelerator is not None
    f = a.accelerator.attention_fraction
    assert f is not None  # the model's flash rate at the measured s equals the measured rate
    # the model's rate at the sustained clock it plans at (the row's, kept)
    assert a.accelerator.sustained_clock_fraction == H100.sustained_clock_fraction
    assert flash_rate_fraction(4096, f, 128) * H100.sustained_flops("bf16") == pytest.approx(300e12)
    e = a.efficiency
    assert e.memory == pytest.approx(statistics.median([0.7, 0.8]))
    assert (e.norm_memory, e.activation_memory) == (pytest.approx(0.3), pytest.approx(0.4))
    assert e.network == pytest.approx(300e9 / (H100.intra_node_bytes_per_s * H100.intra_node_achievable))
    assert e.launch_s_per_kernel == 5e-6
    assert e.overlap_slowdown == 0.25  # the measured GEMM slowdown beside an all-reduce, not the cited 0.189
    assert all(v.startswith("measured") for v in a.sources.values())
    assert a.calibration.details["from"] == "microbench"


def test_the_launch_cost_is_a_real_layers_per_kernel_host_time_where_measured(tmp_path: Path) -> None:
    """A file with the layer figure sets the launch cost from it (a GPU's floor, a CPU's added dispatch); a file
    written before it, from the bare add; the CPU takes it too (it had no launch term before)."""
    p = tmp_path / "mb.json"
    p.write_text(replace(synthetic(), layer_host_s_per_kernel=1.4e-5).to_json())
    a = apply_calibration(p, shape=SHAPE, precision="bf16-mixed", gpu=H100)
    assert a.efficiency.launch_s_per_kernel == 1.4e-5
    assert (
        a.sources["launch_s_per_kernel"]
        == "measured: 14.00 µs per kernel of an eager layer's forward and backward"
    )
    p.write_text(synthetic().to_json())  # no layer figure: the bare add's 5 µs
    a = apply_calibration(p, shape=SHAPE, precision="bf16-mixed", gpu=H100)
    assert a.efficiency.launch_s_per_kernel == 5e-6 and "per eager kernel" in a.sources["launch_s_per_kernel"]
    cpu = replace(synthetic(), device="cpu", device_name="cpu", accelerator=None, dtype="fp32",
                  layer_host_s_per_kernel=1.2e-5)  # fmt: skip
    from microbatch.predict.kernel_calibration import kernel_terms, measured_cpu_accelerator

    terms = kernel_terms(cpu, measured_cpu_accelerator(cpu))
    assert terms.efficiency.launch_s_per_kernel == 1.2e-5


def test_another_accelerator_gets_the_analytic_terms_and_says_so(h100_file: Path) -> None:
    a100 = get_accelerator("a100-80gb")
    a = apply_calibration(h100_file, shape=SHAPE, precision="bf16-mixed", gpu=a100)
    assert a.efficiency == DEFAULT_EFFICIENCY and a.accelerator == a100
    assert any("NOT applied" in n for n in a.notes)
    assert all(v.startswith("analytic") for v in a.sources.values())
    # in another dtype too: nothing applied, so no word of "applied to the other dtype" beside "NOT applied"
    other = apply_calibration(h100_file, shape=SHAPE, precision="fp32", gpu=a100)
    assert any("NOT applied" in n for n in other.notes) and not any("other dtype" in n for n in other.notes)
    same = apply_calibration(h100_file, shape=SHAPE, precision="fp32", gpu=get_accelerator("h100-sxm"))
    assert any("applied to the other dtype" in n for n in same.notes)  # applied there: the extrapolation said


def _plan(*extra: str, capsys: pytest.CaptureFixture[str]) -> dict:
    args = ["plan", "--model", "llama-2-7b", "--gpu", "h100-sxm", "-B", "64", "-d", "8", "--json", *extra]
    assert main(args) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_with_a_microbenchmark_uses_the_measured_terms_and_names_them(
    h100_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plain = _plan(capsys=capsys)
    cal = _plan("--calibration", str(h100_file), capsys=capsys)
    # the measured GEMMs run at 0.23-0.36 of peak where the default reaches about 0.6: slower steps
    assert cal["recommended"]["step_time_s"] > 1.2 * plain["recommended"]["step_time_s"]
    sources = cal["calibration"]["details"]["term_sources"]
    assert sources["gemm"].startswith("measured") and sources["network"].startswith("analytic")
    assert main(["plan", "--model", "llama-2-7b", "--gpu", "h100-sxm", "-B", "64", "-d", "8",
                 "--calibration", str(h100_file)]) == 0  # fmt: skip
    text = capsys.readouterr().out
    assert "kernel terms from a microbenchmark of NVIDIA H100 80GB HBM3 (h100-sxm)" in text
    assert "gemm: measured" in text


def test_a_plan_under_a_lower_power_limit_scales_the_measured_kernels_by_the_clock_law(
    h100_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The measured kernels carry the clock of the row's 700 W; at 500 W the clock is (360/560)^(1/3) of it, by
    hand: measured GEMMs run that much slower (up to the per-tile seconds that do not scale), and the plan
    says so. The planned accelerator keeps its own fraction; without a new limit no clock source is added."""
    f = (360 / 560) ** (1 / 3)
    capped = H100.with_overrides(power_limit_w=500)
    a = apply_calibration(h100_file, shape=SHAPE, precision="bf16-mixed", gpu=capped)
    assert a.accelerator is not None
    assert a.accelerator.sustained_clock_fraction == pytest.approx(capped.sustained_clock_fraction)
    assert "700 W" in a.sources["clock"] and "500 W" in a.sources["clock"]
    run = a.accelerator.at_sustained_clock()
    for g in synthetic().gemms:
        t = gemm_time_s(g.rows, g.k, g.n, run, dtype="bf16", efficiency=a.efficiency)
        assert g.seconds < t <= g.seconds / f * (1 + 1e-9)
        assert t == pytest.approx(g.seconds / f, rel=0.03)
    full = apply_calibration(h100_file, shape=SHAPE, precision="bf16-mixed", gpu=H100)
    assert full.accelerator is not None
    assert full.accelerator.sustained_clock_fraction == H100.sustained_clock_fraction
    assert "clock" not in full.sources
    cal = _plan("--calibration", str(h100_file), capsys=capsys)["recommended"]["step_time_s"]
    low = _plan("--calibration", str(h100_file), "--gpu-set", "power_limit_w=500", capsys=capsys)
    assert cal < low["recommended"]["step_time_s"] < cal / f


@pytest.fixture(scope="module")
def cpu_bench() -> MicrobenchResult:
    return run_microbench(MicrobenchConfig(shape=get_model("tiny"), micro_batches=(1, 2, 4, 8), quick=True))


def test_a_cpu_microbenchmark_on_a_named_gpu_is_not_applied(
    cpu_bench: MicrobenchResult, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    p = tmp_path / "cpu.json"
    p.write_text(cpu_bench.to_json())
    plain = _plan(capsys=capsys)
    cal = _plan("--calibration", str(p), capsys=capsys)
    assert cal["recommended"]["step_time_s"] == pytest.approx(plain["recommended"]["step_time_s"])
    assert any("NOT applied" in n for n in cal["calibration_notes"])


def test_the_cpu_microbenchmark_sets_this_cpus_terms(cpu_bench: MicrobenchResult) -> None:
    a = apply_microbench(cpu_bench, shape=get_model("tiny"), precision="fp32")
    assert a.accelerator is not None and a.accelerator.name == "cpu"
    for g in cpu_bench.gemms:  # a shape measured twice (tiny's proj is on the grid too): their mean
        same = [h.seconds for h in cpu_bench.gemms if (h.rows, h.k, h.n) == (g.rows, g.k, g.n)]
        t = gemm_time_s(g.rows, g.k, g.n, a.accelerator, dtype="fp32", efficiency=a.efficiency)
        assert t == pytest.approx(statistics.mean(same), rel=1e-9)


def _held(errors: dict[int, float]) -> bool:
    """The microbenchmark's prediction of tiny's step held to the measured one: the median error over the micro-batches
    within 35% and none past 70% (the old bias was 50-70% short at every b_m; on 2026-12-06's VM single points of one
    run spread from -52% to +3% and, in another, +53 to +66%)."""
    return abs(statistics.median(errors.values())) < 0.35 and all(abs(e) < 0.70 for e in errors.values())


@pytest.mark.serial  # a microbenchmark and a tune run taken apart: beside another test worker, −28% and −43% (CI)
def test_tiny_step_predicted_from_a_cpu_microbenchmark_against_a_measured_step(
    cpu_bench: MicrobenchResult,
) -> None:
    """The error is measured, not hidden. It was 50-70% short at b_m 1-8 on the 2-core VM: tune's probe child
    mapped and faulted in every tensor each step (the steps it timed were 1.4-1.7x a user's), and the planner
    had no CPU dispatch term. With the repeats timed on the steady heap and each counted kernel's host time
    (a real layer's, measured) added, it is within 3% under the test suite's load and -9 to -14% on the idle VM
    (BENCHMARKS.md). The bound, a median |error| < 35% (:func:`_held`), is that with margin for a busy machine; it
    fails the old 50-70%;
    the target lives in the bench (bench/bench_microbench_calibration.py). The microbenchmark and the tune run
    minutes apart on a shared VM whose speed drifts (2026-12-06: the same code read +53 to +66% once, in a
    clean-clone run's serial pass, after the host slowed ~8% within the hour): a second attempt measures both
    again, back to back; a systematic bias fails both."""
    tiny = get_model("tiny")
    cmd = [sys.executable, "-m", "microbatch", "tune", "--model", "tiny", "--start", "1", "--max-micro-batch", "8",
           "--patience", "99", "--threads", "1", "--clock", "process", "--no-cache", "--json"]  # fmt: skip
    tries = []
    for attempt in range(2):
        bench = cpu_bench if attempt == 0 else run_microbench(
            MicrobenchConfig(shape=tiny, micro_batches=(1, 2, 4, 8), quick=True)
        )  # fmt: skip
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT, timeout=240)
        points = {
            p["micro_batch"]: p["step_time_s"]
            for p in json.loads(out.stdout)["points"]
            if p.get("step_time_s")
        }
        a = apply_microbench(bench, shape=tiny, precision="fp32")
        assert a.accelerator is not None
        errors = {
            b: predict_step_time_s(tiny, b, a.accelerator, precision="fp32", efficiency=a.efficiency) / t - 1
            for b, t in points.items()
        }
        tries.append(errors)
        if _held(errors):
            break
    assert len(errors) >= 3
    assert _held(errors), tries
    # more work takes more predicted time, as it takes more measured time
    bms = sorted(errors)
    preds = [
        predict_step_time_s(tiny, b, a.accelerator, precision="fp32", efficiency=a.efficiency) for b in bms
    ]
    assert preds == sorted(preds)


def test_memory_with_a_microbenchmark_is_refused_naming_what_it_is(
    h100_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["memory", "--model", "llama-2-7b", "-b", "1", "--calibration", str(h100_file)]) == 2
    assert "is a kernel microbenchmark: it measures kernel times, not memory" in capsys.readouterr().err


def test_a_measured_overlap_slowdown_moves_an_fsdp_plan_and_a_negative_one_counts_as_none(
    tmp_path: Path,
) -> None:
    """Issue 28 item 3 measured: the GEMM slowdown beside an all-reduce replaces the cited 0.189."""
    from dataclasses import replace

    from microbatch.predict.plan import PlanConfig, make_plan

    def zero3_s(overlap: float) -> float:
        p = tmp_path / f"mb{overlap}.json"
        p.write_text(replace(synthetic(collective=True), overlap_slowdown=overlap).to_json())
        a = apply_calibration(p, shape=SHAPE, precision="bf16-mixed", gpu=H100)
        assert a.efficiency.overlap_slowdown == max(0.0, overlap)
        cfg = PlanConfig(shape=SHAPE, gpu=H100, global_batch=64, data_parallel=64, zero=(3,), micro_batches=(1,),
                         recompute=("full",), choose="fastest", memory_headroom=0.0, efficiency=a.efficiency)  # fmt: skip
        best = make_plan(cfg).fastest
        assert best is not None
        return float(best.time["zero_comm_s"])

    assert zero3_s(0.4) > zero3_s(0.1) > zero3_s(0.0)
    assert zero3_s(-0.05) == zero3_s(
        0.0
    )  # a GEMM measured faster beside the collective: no slowdown, not a gain


def test_kernels_timed_in_bursts_are_slowed_to_the_sustained_rate(tmp_path: Path) -> None:
    """Issue 28: a file whose kernels were timed in bursts (no soak, as every file before the field) carries the
    clock of a burst, not of a training step: on a Hopper part the square GEMM's measured sustained / burst ratio
    slows them, or, where the file has none, the cited HOPPER_BURST_TO_SUSTAINED; off Hopper with no ratio, 1.
    Timed after a soak they carry the sustained clock: the measured times. The planned accelerator keeps the
    row's own fraction either way, so what the file did not measure stays the row's (review of 2026-12-05: a
    soaked file without attention had set fraction 1 and run the analytic attention 18% fast)."""
    from microbatch.hardware_clocks import HOPPER_BURST_TO_SUSTAINED as K

    g = synthetic().gemms[0]

    def planned(result: MicrobenchResult, gpu=H100) -> tuple[float, str, float]:
        """(planned / measured seconds of a measured GEMM, the clock source, the planned fraction)."""
        p = tmp_path / "mb.json"
        p.write_text(result.to_json())
        a = apply_calibration(p, shape=SHAPE, precision="bf16-mixed", gpu=gpu)
        assert a.accelerator is not None
        run = a.accelerator.at_sustained_clock()
        t = gemm_time_s(g.rows, g.k, g.n, run, dtype="bf16", efficiency=a.efficiency)
        return t / g.seconds, a.sources.get("clock", ""), a.accelerator.sustained_clock_fraction

    assert planned(synthetic()) == (pytest.approx(1.0), "", pytest.approx(K))
    slow, why, frac = planned(synthetic(soak_s=0.0))
    assert slow == pytest.approx(1 / K) and "in bursts" in why and "cited" in why and frac == pytest.approx(K)
    measured = synthetic(soak_s=0.0, burst_square_flops_per_s=760e12, sustained_square_flops_per_s=646e12)
    assert measured.sustained_over_burst == pytest.approx(0.85)
    slow, why, _ = planned(measured)
    assert slow == pytest.approx(1 / 0.85) and "sustained over burst" in why
    # a ratio below MIN_SUSTAINED_OVER_BURST (0.5: a disturbed measurement) is not used: the cited one stands
    slow, why, _ = planned(
        synthetic(soak_s=0.0, burst_square_flops_per_s=760e12, sustained_square_flops_per_s=300e12)
    )
    assert slow == pytest.approx(1 / K) and "0.395 is below 0.5: not used" in why
    # a sustained rate above the burst's (noise) slows nothing
    assert planned(
        synthetic(soak_s=0.0, burst_square_flops_per_s=700e12, sustained_square_flops_per_s=710e12)
    )[0] == pytest.approx(1.0)
    # a soaked file keeps the measured times whatever its square GEMM says
    assert planned(synthetic(burst_square_flops_per_s=760e12, sustained_square_flops_per_s=646e12))[0] == (
        pytest.approx(1.0)
    )
    # the same burst file on a part its kernel terms were not measured in bursts on, without a ratio: as measured
    a100 = get_accelerator("a100-80gb")
    rebranded = replace(synthetic(soak_s=0.0), device_name="NVIDIA A100-SXM4-80GB", accelerator="a100-80gb")
    # (the H100's rates written as an A100's pass its sustained peak: capped there, 2026-12-08)
    assert planned(rebranded, a100)[0] == pytest.approx(
        max(1.0, g.flops_per_s / a100.sustained_flops("bf16"))
    )
    assert planned(rebranded, a100)[0] > 1.0
    # a soaked file without attention: the analytic attention at the row's sustained clock, as uncalibrated
    no_attn = tmp_path / "na.json"
    no_attn.write_text(replace(synthetic(), attention=()).to_json())
    a = apply_calibration(no_attn, shape=SHAPE, precision="bf16-mixed", gpu=H100)
    assert a.accelerator is not None and a.sources["attention_fraction"].startswith("analytic")
    from microbatch.predict.roofline import layer_forward

    ours = layer_forward(SHAPE, 1, a.accelerator, flash_attention=True).attention_s
    assert ours == pytest.approx(layer_forward(SHAPE, 1, H100, flash_attention=True).attention_s, rel=1e-12)


def test_calibration_keeps_a_named_attention_kernel_and_the_compiled_norms(
    h100_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A microbenchmark measures PyTorch's SDPA: with ``--attention-kernel cudnn`` the rows keep cuDNN 9.19's ceiling
    and ramp (0.716 at 2.3), with the default sdpa they take the measured one; ``--compile`` keeps torch.compile's norm rate through
    the calibration (its step longer than ``--fused-kernels``' by the norms alone)."""
    from microbatch.predict.attention import CUDNN_919_HOPPER

    sdpa = _plan("--calibration", str(h100_file), capsys=capsys)
    named = _plan("--calibration", str(h100_file), "--attention-kernel", "cudnn", capsys=capsys)
    assert (named["gpu"]["attention_fraction"], named["gpu"]["attention_ramp"]) == CUDNN_919_HOPPER
    assert sdpa["gpu"]["attention_fraction"] != CUDNN_919_HOPPER[0] and sdpa["gpu"]["attention_ramp"] == 1
    compiled = _plan("--calibration", str(h100_file), "--compile", capsys=capsys)
    fused = _plan("--calibration", str(h100_file), "--fused-kernels", capsys=capsys)
    assert compiled["recommended"]["step_time_s"] > fused["recommended"]["step_time_s"]
    assert main(["plan", "--model", "gpt2", "--gpu", "h100", "-B", "8", "--compile", "--fused-kernels"]) == 2
    assert "describe different code" in capsys.readouterr().err


def test_a_b200_calibration_inverts_only_the_lengths_its_curve_was_fitted_from(tmp_path: Path) -> None:
    """The B200 row's ramped curve holds from 2k keys: a microbenchmark's causal SDPA timed at 1k, 2k, 4k and 8k at
    cuDNN's own forward bars (255, 479, 856, 1,171 TFLOP/s, cudnn-frontend's B200 benchmark) gives a ceiling within
    10% of the row's, and the 1k timing, where the curve is 43% fast, is left out (its inversion alone would be
    30% low)."""
    from microbatch.microbench_record import AttentionTiming
    from microbatch.predict.attention import flash_shape_factor

    b200 = get_accelerator("b200")
    bars = ((1024, 254.5e12), (2048, 478.9e12), (4096, 855.7e12), (8192, 1171.3e12))
    timings = tuple(AttentionTiming(seq=s, heads=128, head_dim=128, batch=1, seconds=1.0, flops_per_s=r)
                    for s, r in bars)  # fmt: skip
    # cuDNN's bars are burst figures (its script pauses between calls against throttling): a file without a soak, slowed
    # by the B200's cited sustained rate, which the row's clock is too
    result = replace(synthetic(soak_s=0.0), accelerator="b200", device_name="NVIDIA B200", attention=timings)
    p = tmp_path / "b200.json"
    p.write_text(result.to_json())
    a = apply_calibration(p, shape=SHAPE, precision="bf16-mixed", gpu=b200)
    assert a.accelerator is not None
    f = a.accelerator.attention_fraction
    assert f == pytest.approx(b200.attention_fraction, rel=0.10)
    assert "s = 2048, 4096, 8192" in a.sources["attention_fraction"]
    assert "x 0.861, the B200 row's cited sustained rate" in a.sources["clock"]
    one_k = 254.5e12 / b200.flops("bf16") / flash_shape_factor(1024 / b200.attention_ramp)
    assert one_k < 0.75 * b200.attention_fraction


@pytest.mark.parametrize(
    "where,key,value,says",
    [
        ("gemms", "seconds", "2e-4", r"gemms\[0\]: seconds is '2e-4', not a finite number"),
        ("gemms", "seconds", float("nan"), r"gemms\[0\]: seconds is nan, not a finite number"),
        ("gemms", "seconds", -2e-4, r"gemms\[0\]: seconds is -0\.0002; it must be > 0"),
        ("gemms", "rows", 0, r"gemms\[0\]: rows is 0; it must be > 0"),
        ("gemms", "rows", 4096.5, r"gemms\[0\]: rows is 4096\.5, not a whole number"),
        ("attention", "seq", 0, r"attention\[0\]: seq is 0; it must be > 0"),
        ("stream", "bytes_per_s", "1e12", r"stream\[0\]: bytes_per_s is '1e12', not a finite number"),
        (None, "launch_s_per_kernel", "5e-6", r": launch_s_per_kernel is '5e-6', not a finite number"),
        (None, "power_limit_w", -700, r": power_limit_w is -700; it must be > 0"),
        (None, "overlap_slowdown", float("nan"), r": overlap_slowdown is nan, not a finite number"),
        (None, "overlap_slowdown", -1.5, r": overlap_slowdown is -1\.5; it must be > -1"),
        (
            None,
            "burst_square_flops_per_s",
            -1e15,
            r": burst_square_flops_per_s is -1000000000000000\.0; it must be > 0",
        ),
    ],
)
def test_a_microbenchmark_file_with_a_bad_number_is_refused_naming_the_file_and_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], where: str | None, key: str, value: object, says: str
) -> None:
    # a fuzzing helper's findings: each of these reached kernel_calibration raw (tracebacks, or NaN and negative
    # timings used in the plan); json writes NaN as its non-standard literal, which Python reads back
    d = synthetic(collective=True).to_dict()
    (d[where][0] if where else d)[key] = value
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(d))
    args = ["plan", "--model", "llama-2-7b", "--gpu", "h100-sxm", "-B", "64", "--calibration", str(p)]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0]
    assert err[0].startswith(f"error: {p}") and __import__("re").search(says, err[0]), err[0]
    assert "give the file bench-gpu wrote" in err[0]


def test_a_measured_adamw_step_sets_the_unfused_optimizers_rate_by_the_bytes_its_kernels_move() -> None:
    """A bench-gpu file's ``adamw`` row counts 28 B per parameter; its unfused kernels move 80 (EAGER_PASSES), so the
    optimizer's streaming rate is the row's fraction × 80/28: the H200 run's 1.26 TB/s of 4.8 is 0.751."""
    base = synthetic()
    row = StreamTiming(
        kernel="adamw", nbytes=28, seconds=1.0, bytes_per_s=0.2 * H100.memory_bandwidth_bytes_per_s
    )
    result = replace(base, stream=(*base.stream, row))
    a = apply_microbench(result, shape=SHAPE, precision="bf16-mixed", gpu=H100)
    assert a.efficiency.optimizer_memory == pytest.approx(0.2 * 80 / 28)
    assert apply_microbench(
        base, shape=SHAPE, precision="bf16-mixed", gpu=H100
    ).efficiency.optimizer_memory == (DEFAULT_EFFICIENCY.optimizer_memory)
    assert 1262122602346.131 / 4.8e12 * 80 / 28 == pytest.approx(
        DEFAULT_EFFICIENCY.optimizer_memory, abs=5e-4
    )
