"""torchtitan's per-op selective recompute, full recompute of every K-th layer, async tensor parallelism."""

from __future__ import annotations

import pytest

from microbatch.errors import ConfigError
from microbatch.hardware import get_accelerator
from microbatch.model import get_model
from microbatch.predict.activations import layer_activation_bytes, layer_activation_terms
from microbatch.predict.memory import MemoryConfig, estimate_memory
from microbatch.predict.plan import make_plan
from microbatch.predict.plan_config import PlanConfig
from microbatch.predict.recompute import op_recompute_gemm_share
from microbatch.predict.roofline import layer_forward
from microbatch.predict.steptime import layer_pass_times

H100 = get_accelerator("h100-80gb")
LLAMA = get_model("llama-3-8b")


def test_op_keeps_the_odd_matmuls_the_attention_output_and_the_input():
    s, h, kvd, f, a = 8192, 4096, 1024, 14336, 32
    t = layer_activation_terms(LLAMA, 1, recompute="op", tensor_parallel=2)
    assert t["layer_input"] == 2 * s * h
    # q, v, w1 (column-parallel, /t) and w2 (row-parallel, whole) — k, o, w3 are recomputed
    assert t["saved_matmuls"] == 2 * s * (h / 2 + kvd / 2 + f / 2 + h)
    assert t["attention_output"] == 2 * s * h / 2 and t["attention_stats"] == 4 * a * s / 2
    none = layer_activation_bytes(LLAMA, 1, tensor_parallel=2)
    full = layer_activation_bytes(LLAMA, 1, recompute="full", tensor_parallel=2)
    assert full < sum(t.values()) < none


def test_op_recomputes_the_even_matmuls_and_the_elementwise_kernels():
    h, kvd, f = 4096, 1024, 14336
    share = (h * kvd + h * h + h * f) / (2 * h * h + 2 * h * kvd + 3 * h * f)
    assert op_recompute_gemm_share(LLAMA) == pytest.approx(share)
    assert share == pytest.approx(0.365, abs=0.001)
    lt = layer_forward(LLAMA, 1, H100)
    assert lt.op_recompute_s == pytest.approx(share * lt.gemm_s + lt.elementwise_s)
    _, i_none, _ = layer_pass_times(lt, "none")
    _, i_op, _ = layer_pass_times(lt, "op")
    _, i_full, _ = layer_pass_times(lt, "full")
    assert i_op - i_none == pytest.approx(lt.op_recompute_s)
    assert i_none < i_op < i_full


def test_full_recompute_of_every_kth_layer():
    cfg = dict(micro_batch=1, pipeline_parallel=4, data_parallel=1)
    none = estimate_memory(LLAMA, MemoryConfig(**cfg)).stages[0].activation_terms["layers"]
    full = estimate_memory(LLAMA, MemoryConfig(**cfg, recompute="full")).stages[0].activation_terms["layers"]
    k3 = estimate_memory(LLAMA, MemoryConfig(**cfg, recompute="full", recompute_every=3)).stages[0]
    assert k3.activation_terms["layers"] == pytest.approx((full + 2 * none) / 3)
    # the layer being recomputed re-materialises what it did not keep: its activations less its checkpoint
    kept = layer_activation_bytes(LLAMA, 1, recompute="full")
    assert k3.activation_terms["recompute_working"] == pytest.approx(layer_activation_bytes(LLAMA, 1) - kept)


def test_recomputing_never_holds_more_than_keeping_everything():
    """One layer per stage and one micro-batch in flight (gpt2, p = 12, the last stage): full and per-op
    recompute hold what no recompute holds (the recomputed forward refers to the kept tensors, it does not
    copy them); with more in flight they hold less."""
    peaks = {
        rc: estimate_memory(
            get_model("gpt2"),
            MemoryConfig(micro_batch=1, pipeline_parallel=12, microbatches=12, recompute=rc),
        ).stages  # fmt: skip
        for rc in ("none", "full", "op")
    }
    last = {rc: st[-1].activations_bytes for rc, st in peaks.items()}
    assert last["full"] == pytest.approx(last["none"]) and last["op"] == pytest.approx(last["none"])
    first = {rc: st[0].activations_bytes for rc, st in peaks.items()}  # 12 in flight
    assert first["full"] < first["op"] < first["none"]
    lt = layer_forward(LLAMA, 1, H100)
    i_none, i_full = layer_pass_times(lt, "none")[1], layer_pass_times(lt, "full")[1]
    assert layer_pass_times(lt, "full", 3)[1] == pytest.approx((i_full + 2 * i_none) / 3)
    with pytest.raises(
        ConfigError, match="recompute_every 2 is full recomputation of one layer in K; give recompute full"
    ):
        MemoryConfig(micro_batch=1, recompute_every=2)


def test_planner_matches_the_memory_model_for_op_and_every_k():
    cfg = PlanConfig(shape=LLAMA, gpu=H100, global_batch=32, data_parallel=2, pipeline_parallel=4,
                     recompute=("op", "full"), recompute_every=2)  # fmt: skip
    plan = make_plan(cfg)
    assert {c.recompute for c in plan.candidates} == {"op", "full"}
    for c in plan.candidates[::6]:
        est = estimate_memory(
            LLAMA,
            MemoryConfig(
                micro_batch=c.micro_batch, pipeline_parallel=4, virtual=c.virtual, microbatches=c.microbatches,
                schedule=c.schedule, data_parallel=2, zero=c.zero, recompute=c.recompute,
                recompute_every=2 if c.recompute == "full" else 1,
            ),
        )  # fmt: skip
        assert c.peak_memory_bytes == pytest.approx(est.peak_bytes, rel=1e-9), c
    # the default search is Megatron's three modes
    auto = make_plan(PlanConfig(shape=LLAMA, gpu=H100, global_batch=8, data_parallel=2))
    assert {c.recompute for c in auto.candidates} == {"none", "selective", "full"}


def test_async_tp_hides_the_collectives_under_the_gemms():
    """Async TP (torchtitan's, TE's userbuffers) runs each collective under its GEMM, and that GEMM runs slower
    beside it, as beside every overlapped collective (the plan's overlap fraction σ = 0.189,
    :func:`microbatch.predict.collectives.overlap_exposed_s`): exposed max(comm − gemm, σ·min(comm/(1 + σ), gemm))."""
    from microbatch.predict.collectives import overlap_exposed_s
    from microbatch.predict.roofline import DEFAULT_EFFICIENCY

    sig = DEFAULT_EFFICIENCY.overlap_fraction(True)
    assert sig == pytest.approx(0.189)
    plain = layer_forward(LLAMA, 1, H100, tensor_parallel=4, sequence_parallel=True)
    slow = H100.with_overrides(intra_node_bytes_per_s=20e9)
    lt = layer_forward(LLAMA, 1, H100, tensor_parallel=4, sequence_parallel=True, async_tp=True)
    assert plain.tp_comm_s > 0 and lt.tp_comm_s == pytest.approx(
        overlap_exposed_s(plain.tp_comm_s, plain.gemm_s, sig)
    )
    assert 0 < lt.tp_comm_s < plain.tp_comm_s  # mostly hidden; the GEMM's slowdown beside it is not
    slow_plain = layer_forward(LLAMA, 1, slow, tensor_parallel=4, sequence_parallel=True)
    slow_async = layer_forward(LLAMA, 1, slow, tensor_parallel=4, sequence_parallel=True, async_tp=True)
    assert slow_async.tp_comm_s == pytest.approx(
        overlap_exposed_s(slow_plain.tp_comm_s, slow_plain.gemm_s, sig)
    )
    assert slow_async.tp_comm_s >= slow_plain.tp_comm_s - slow_plain.gemm_s > 0
    # the backward's SP re-gather runs under the backward GEMMs (2 × gemm) its collectives leave free
    # (Transformer Engine's bulk overlap with the dgrad GEMM); without async TP it stays exposed
    assert plain.sp_regather_s > 0 and lt.sp_regather_s < 0.5 * plain.sp_regather_s
    # the collectives hide under one pass's GEMMs (their excess is charged in tp_comm_s): the other gemm of
    # the backward's 2 × gemm is left for the re-gather (the excess is not charged twice)
    for bw in (20e9, 5e9, 80e9):
        link = H100.with_overrides(intra_node_bytes_per_s=bw)
        p = layer_forward(LLAMA, 1, link, tensor_parallel=4, sequence_parallel=True)
        a = layer_forward(LLAMA, 1, link, tensor_parallel=4, sequence_parallel=True, async_tp=True)
        cover = 2 * p.gemm_s - min(p.tp_comm_s, p.gemm_s)
        assert a.sp_regather_s == pytest.approx(overlap_exposed_s(p.sp_regather_s, cover, sig))
    assert layer_forward(LLAMA, 1, H100.with_overrides(intra_node_bytes_per_s=5e9), tensor_parallel=4,
                         sequence_parallel=True, async_tp=True).sp_regather_s > 0  # fmt: skip
    with pytest.raises(
        ConfigError, match=r"give sequence_parallel \(and tensor_parallel > 1\) with async_tp"
    ):
        PlanConfig(shape=LLAMA, gpu=H100, global_batch=8, tensor_parallel=2, async_tp=True)


def test_cli_recompute_op_every_and_async_tp(capsys):
    import json

    from microbatch.cli import main

    rc = main(["plan", "--model", "llama-3-8b", "--gpu", "h100", "-B", "32", "-d", "4", "-t", "2", "--sequence-parallel",
               "--async-tp", "--recompute", "full", "--recompute-every", "2", "-b", "1", "--json"])  # fmt: skip
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["async_tp"] is True and out["recompute_every"] == 2
    assert {c["recompute"] for c in out["candidates"]} == {"full"}
    assert main(["memory", "--model", "llama-3-8b", "-b", "1", "--recompute", "op", "--json"]) == 0
    mem = json.loads(capsys.readouterr().out)
    est = estimate_memory(LLAMA, MemoryConfig(micro_batch=1, recompute="op"))
    assert mem["peak_memory_bytes"] == pytest.approx(est.peak_bytes)


def test_a_faster_device_never_slows_a_host_bound_layer():
    """gpt2-medium on an H100 PCIe with TP 4 (SP) and CP 4 (ring) at b_m 1 is host-bound (eager launches):
    its layer takes max(host, device + exposed communication). Raising the peaks by 1.5× shrank the GEMMs, grew
    the exposed CP exchange and left the host's floor where it was: 52.9 → 53.1 → 53.2 ms before; never slower now."""
    from microbatch.hardware import get_accelerator
    from microbatch.predict.plan_config import PlanConfig

    def step(scale: float) -> float:
        base = get_accelerator("h100-pcie")
        gpu = base.with_overrides(**{k: v * scale for k, v in base.peak_flops.items()})
        cfg = PlanConfig(shape=get_model("gpt2-medium"), gpu=gpu, global_batch=32, data_parallel=8,
                         tensor_parallel=4, sequence_parallel=True, context_parallel=4, cp_comm="ring", seq=1024,
                         micro_batches=(1,), recompute=("full",), memory_headroom=0.0)  # fmt: skip
        return make_plan(cfg).candidates[0].step_time_s

    times = [step(x) for x in (1.0, 1.5, 3.0)]
    assert times[0] >= times[1] >= times[2], times
