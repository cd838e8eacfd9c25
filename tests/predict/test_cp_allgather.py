"""Context parallelism's two K/V exchanges (issue 28, item 4): torch's all-gather against Megatron's ring.

The all-gather moves the same bytes as the ring but hides only behind the local attention step (1/c of the
rank's causal attention); the ring hides each send behind a step. Hand computations, then the layer, the
planner, the CLI and the torchtitan export."""

from __future__ import annotations

import pytest
from _helpers import plan_json

from microbatch.errors import ConfigError
from microbatch.hardware import get_accelerator
from microbatch.model import get_model
from microbatch.predict.collectives import group_bandwidth, ring_hop_bandwidth
from microbatch.predict.context import kv_exchange_bytes, kv_exchange_exposed_s, ring_merge_bytes
from microbatch.predict.plan import make_plan
from microbatch.predict.plan_config import PlanConfig
from microbatch.predict.roofline import layer_forward
from microbatch.show.export import export_plan

H100 = get_accelerator("h100-sxm")
LLAMA = get_model("llama-3-8b")


def test_exposed_seconds_by_hand_without_slowdown():
    # comm 3 s, attention 8 s forward and 16 s backward, c = 4: the local step is 2 s forward, 4 s backward
    assert kv_exchange_exposed_s(3.0, 8.0, 16.0, 4, "allgather") == (1.0, 0.0)  # 3 − 2; 3 < 4 and 3 < 12
    assert kv_exchange_exposed_s(3.0, 8.0, 16.0, 4, "ring") == (0.0, 0.0)  # 3 < 8; 6 < 16
    # comm 5 s: the gather shows past the local step both ways; the gradients' ring (5 s) hides behind 12 s
    assert kv_exchange_exposed_s(5.0, 8.0, 16.0, 4, "allgather") == (3.0, 1.0)
    # comm 10 s: ring forward 10 − 8, backward 20 − 16; gather 10 − 2, backward (10 − 4) + 0 (10 < 12)
    assert kv_exchange_exposed_s(10.0, 8.0, 16.0, 4, "ring") == (2.0, 4.0)
    assert kv_exchange_exposed_s(10.0, 8.0, 16.0, 4, "allgather") == (8.0, 6.0)
    # no context parallelism, nothing moved
    assert kv_exchange_exposed_s(10.0, 8.0, 16.0, 1, "allgather") == (0.0, 0.0)
    assert kv_exchange_exposed_s(0.0, 8.0, 16.0, 4, "allgather") == (0.0, 0.0)


def test_exposed_seconds_by_hand_with_slowdown():
    sig = 0.2
    # forward: comm 1 s beside a 2 s local step (c = 4, attention 8 s): hidden, the step slowed σ·comm/(1 + σ)
    f, b = kv_exchange_exposed_s(1.0, 8.0, 16.0, 4, "allgather", sig)
    assert f == pytest.approx(sig * 1.0 / 1.2)
    # backward: the re-gather beside the 4 s local step, the gradients' ring beside the other 12 s
    assert b == pytest.approx(sig / 1.2 + sig / 1.2)
    # comm 3 s over the 2 s step: max(3 − 2, σ·min(3/1.2, 2)) = max(1, 0.4) = 1
    assert kv_exchange_exposed_s(3.0, 8.0, 16.0, 4, "allgather", sig)[0] == pytest.approx(1.0)


@pytest.mark.parametrize("sig", [0.0, 0.189, 0.4])
@pytest.mark.parametrize("c", [2, 4, 16])
def test_the_gather_never_hides_more_than_the_ring(sig, c):
    for comm in (0.1, 0.5, 1.0, 2.0, 5.0, 20.0):
        for attn in (0.3, 1.0, 4.0):
            ag = kv_exchange_exposed_s(comm, attn, 2 * attn, c, "allgather", sig)
            ring = kv_exchange_exposed_s(comm, attn, 2 * attn, c, "ring", sig)
            assert ag[0] >= ring[0] - 1e-12 and ag[1] >= ring[1] - 1e-12, (comm, attn)
            # and never more than the bytes moved twice over (gather, then gradients) on top of the attention
            assert ag[0] <= comm + 1e-12 and ag[1] <= 2 * comm + 1e-12


def test_unknown_exchange_is_refused_naming_the_choices():
    with pytest.raises(ConfigError, match=r"cp_comm 'p2p' .* use one of allgather, ring"):
        kv_exchange_exposed_s(1.0, 1.0, 1.0, 2, "p2p")
    with pytest.raises(ConfigError, match="cp_comm"):
        PlanConfig(shape=LLAMA, gpu=H100, global_batch=8, context_parallel=2, seq=8192, cp_comm="p2p")


def test_layer_across_nodes_shows_the_gather_past_the_local_step():
    """Llama-3-8B at 128k tokens over c = 32 ranks (4 nodes): the gather runs at the collective's bandwidth (8 NICs
    a node) and shows past the local step; the ring's sends leave a node by one NIC, hidden behind every step; the
    gather's gradients go around that ring; both merge their steps through memory."""
    s, c = 131072, 32
    kw = dict(seq=s, context_parallel=c, tensor_parallel=1)
    ag = layer_forward(LLAMA, 1, H100, cp_comm="allgather", **kw)
    ring = layer_forward(LLAMA, 1, H100, cp_comm="ring", **kw)
    kv = kv_exchange_bytes(LLAMA, 1, s, c)
    gather, hop = kv / group_bandwidth(H100, c, 1), kv / ring_hop_bandwidth(H100, c, 1)
    assert ring_hop_bandwidth(H100, c, 1) == pytest.approx(400e9 / 8 * 0.96)  # one NDR NIC
    assert group_bandwidth(H100, c, 1) > 7 * ring_hop_bandwidth(H100, c, 1)
    merge_f, merge_b = (
        x / (H100.memory_bandwidth_bytes_per_s * 0.8) for x in ring_merge_bytes(LLAMA, 1, s, c)
    )
    sig = 0.189
    local = ag.attention_s / c

    def exposed(x: float, y: float) -> float:
        return max(x - y, sig * min(x / (1 + sig), y))

    assert gather > local  # the gather outlasts the local step: it shows
    assert ag.cp_comm_s == pytest.approx(exposed(gather, local) + merge_f)
    bwd_local = (ag.attention_backward_s or 0.0) / c
    assert ag.cp_comm_backward_s == pytest.approx(
        exposed(gather, bwd_local) + exposed(hop, (ag.attention_backward_s or 0.0) - bwd_local) + merge_b
    )
    assert ring.cp_comm_s == pytest.approx(exposed(hop, ring.attention_s) + merge_f)
    assert ring.cp_comm_backward_s == pytest.approx(
        exposed(2 * hop, ring.attention_backward_s or 0.0) + merge_b
    )
    assert ag.gemm_s == ring.gemm_s and ag.attention_s == ring.attention_s  # only the exchange differs


SLOW = H100.with_overrides(intra_node_bytes_per_s=20e9)
"""An H100 node whose links are 20 GB/s: inside it the gather outlasts the local step."""


def test_inside_a_node_the_gather_never_beats_the_ring():
    """c = 8 on one node: both at the node's rate, the ring hides behind every step, the gather behind one; on
    NVLink both hide (equal), on a slow link the gather shows and the ring does not."""
    kw = dict(seq=65536, context_parallel=8, tensor_parallel=1)
    for acc in (H100, SLOW):
        ag = layer_forward(LLAMA, 1, acc, cp_comm="allgather", **kw)
        ring = layer_forward(LLAMA, 1, acc, cp_comm="ring", **kw)
        assert ring_hop_bandwidth(acc, 8, 1) == group_bandwidth(acc, 8, 1)
        assert ag.cp_comm_s >= ring.cp_comm_s and ag.total_s >= ring.total_s
    assert ag.cp_comm_s > ring.cp_comm_s  # the slow link's


def _cfg(**kw):
    base = dict(shape=LLAMA, gpu=SLOW, global_batch=32, data_parallel=2, context_parallel=8, seq=65536,
                micro_batches=(1,), recompute=("full",), zero=(1,))  # fmt: skip
    base.update(kw)
    return PlanConfig(**base)


def test_planner_default_is_torchs_all_gather_and_slower_than_the_ring_inside_a_node():
    assert PlanConfig(shape=LLAMA, gpu=H100, global_batch=8).cp_comm == "allgather"
    ag = make_plan(_cfg()).candidates[0]
    ring = make_plan(_cfg(cp_comm="ring")).candidates[0]
    assert ag.step_time_s > ring.step_time_s
    assert ag.peak_memory_bytes == ring.peak_memory_bytes  # a time term only
    assert make_plan(_cfg(cp_comm="ring")).to_dict()["cp_comm"] == "ring"


def test_cli_and_torchtitan_export_carry_the_exchange(capsys):
    from microbatch.cli import main

    args = ["plan", "--model", "llama-3-8b", "--gpu", "h100-sxm", "-B", "32", "-d", "2", "-c", "8",
            "--seq", "65536", "-b", "1", "--recompute", "full", "--zero", "1", "--gpu-set", "intra_node_bytes_per_s=2e10",
            "--json"]  # fmt: skip
    times = {}
    for how in ("allgather", "ring"):
        plan = plan_json([*args, "--cp-comm", how], capsys)
        assert plan["cp_comm"] == how
        times[how] = plan["recommended"]["step_time_s"]
        par = export_plan(plan, "torchtitan").config["parallelism"]
        assert par["context_parallel_rotate_method"] == ("allgather" if how == "allgather" else "alltoall")
    assert times["allgather"] > times["ring"]
    assert main([*args, "--cp-comm", "p2p"]) == 2
    assert "allgather" in capsys.readouterr().err


def test_pipeline_hops_average_nvlink_and_one_nic():
    """A pipeline's sends: all NVLink inside a node; one hop in k = 8/stride leaves the node by one NIC (the harmonic
    mean over the hops a micro-batch passes); every hop by one NIC once the stages are a node apart."""
    from microbatch.predict.collectives import pipeline_hop_bandwidth

    nvlink, nic = 450e9 * 0.82, 50e9 * 0.96
    assert pipeline_hop_bandwidth(H100, 4, 2) == pytest.approx(nvlink)
    assert pipeline_hop_bandwidth(H100, 4, 4) == pytest.approx(1 / (0.5 / nic + 0.5 / nvlink))  # k = 2
    assert pipeline_hop_bandwidth(H100, 8, 8) == pytest.approx(nic)
    assert ring_hop_bandwidth(H100, 4, 4) == pytest.approx(nic)
    assert ring_hop_bandwidth(H100, 4, 4) < pipeline_hop_bandwidth(
        H100, 4, 4
    )  # a ring step waits for its slowest hop
