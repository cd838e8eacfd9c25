"""Ulysses context parallelism (DeepSpeed Ulysses, Megatron's a2a): all-to-alls of the heads, the kernel on whole
sequences, each term against a hand computation."""

from __future__ import annotations

import json

import pytest

from microbatch.errors import ConfigError
from microbatch.hardware import get_accelerator
from microbatch.model import get_model
from microbatch.predict.attention_core import attention_core_s
from microbatch.predict.collectives import alltoall_time_s
from microbatch.predict.context import (
    attention_key_split,
    check_ulysses_heads,
    kv_exchange_exposed_s,
    ring_merge_bytes,
    ulysses_bytes,
)
from microbatch.predict.gemm import DEFAULT_EFFICIENCY
from microbatch.predict.plan import make_plan
from microbatch.predict.plan_config import PlanConfig
from microbatch.predict.roofline import layer_forward
from microbatch.show.export import export_plan

H100 = get_accelerator("h100-sxm")
LLAMA = get_model("llama-3-8b")  # 32 query heads of 128, 8 K/V heads


def test_bytes_by_hand():
    """e·b·(s/c)·(2·a·d + 2·kv·d)/t: Llama 3 8B, b 2, s 32k, c 4, t 2: 2·2·8192·(2·4096 + 2·1024)/2 bytes; MLA's
    Q and K at a·(d + d_R), V and O at a·d_v; none without context parallelism."""
    assert ulysses_bytes(LLAMA, 2, 32768, 4, tensor_parallel=2) == 2 * 2 * 8192 * (2 * 4096 + 2 * 1024) / 2
    v3 = get_model("deepseek-v3")
    mla = v3.mla
    assert ulysses_bytes(v3, 1, 4096, 2) == 2 * 2048 * 2 * v3.heads * (mla.qk_head_dim + mla.v_head_dim)
    assert ulysses_bytes(LLAMA, 2, 32768, 1) == 0.0


def test_heads_must_split_over_t_times_c():
    check_ulysses_heads(LLAMA, 2, 4)  # 8 divides 32 and 8
    check_ulysses_heads(LLAMA, 8, 1)  # no context parallelism: nothing to check
    with pytest.raises(
        ConfigError, match=r"2 × 8 = 16 GPUs.*32 query heads and the 8 K/V heads.*among \[2, 4\]"
    ):
        check_ulysses_heads(LLAMA, 2, 8)
    with pytest.raises(
        ConfigError, match=r"8 × 2 = 16 GPUs.*use tensor_parallel among \[1, 2, 4\], or use cp_comm"
    ):
        check_ulysses_heads(LLAMA, 8, 2)  # no c works at t 8: a smaller t does
    check_ulysses_heads(get_model("deepseek-v3"), 8, 16)  # MLA: K and V per query head (128 of them)


def test_the_kernel_sees_whole_sequences_and_the_all_to_alls_are_exposed():
    """Under Ulysses each rank's attention is the unsplit kernel on 1/c of the heads: exactly 1/c of the c = 1
    time (same curve point); the exchange is exposed whole however long the attention, where the ring's hides
    behind it."""
    s, c = 16384, 4
    rows = s / c
    split = attention_key_split(c, "ulysses")
    assert (split, attention_key_split(c, "ring"), attention_key_split(c, "allgather")) == (1, c, c)
    whole = attention_core_s(LLAMA, s, s, 1, 1, True, H100, "bf16", DEFAULT_EFFICIENCY)
    uly = attention_core_s(LLAMA, rows, s, split, 1, True, H100, "bf16", DEFAULT_EFFICIENCY)
    ring = attention_core_s(LLAMA, rows, s, c, 1, True, H100, "bf16", DEFAULT_EFFICIENCY)
    assert uly[0] == pytest.approx(whole[0] / c) and uly[1] == pytest.approx(whole[1] / c)
    # the ring's steps (a causal diagonal and unmasked rectangles, test_ring_steps_by_hand): the forward's run nearer
    # its plateau than one causal kernel over 16k keys; the backward's shorter keys cost about what they gain
    assert ring[0] < uly[0] and abs(ring[1] / uly[1] - 1) < 0.05
    assert kv_exchange_exposed_s(1e-3, 1.0, 2.5, c, "ulysses", 0.189) == (1e-3, 1e-3)
    assert kv_exchange_exposed_s(1e-3, 1.0, 2.5, c, "ring", 0.0) == (0.0, 0.0)


@pytest.mark.parametrize(("t", "c", "crosses"), [(2, 4, False), (4, 4, True)])
def test_layer_exchange_is_the_all_to_all_inside_or_across_nodes(t, c, crosses):
    """cp_comm_s = one all-to-all of the Q, K, V and O bytes over the c ranks t apart: over NVLink while t·c ≤ 8,
    else mostly over each GPU's NIC; the same in the backward."""
    s = 32768
    lt = layer_forward(LLAMA, 1, H100, seq=s, tensor_parallel=t, context_parallel=c, cp_comm="ulysses",
                       flash_attention=True)  # fmt: skip
    acc = H100.at_sustained_clock()
    intra = acc.intra_node_bytes_per_s * acc.intra_node_achievable * DEFAULT_EFFICIENCY.network
    inter = acc.inter_node_bytes_per_s * acc.inter_node_achievable * DEFAULT_EFFICIENCY.network
    per_node = max(1, min(c, 8 // t))
    nbytes = ulysses_bytes(LLAMA, 1, s, c, tensor_parallel=t)
    expected = alltoall_time_s(nbytes, c, per_node, intra, inter)
    assert lt.cp_comm_s == pytest.approx(expected) and lt.cp_comm_backward_s == pytest.approx(expected)
    assert (nbytes * (c - per_node) / c / inter > nbytes * (per_node - 1) / c / intra) == crosses


def _cfg(**kw):
    base = dict(shape=LLAMA.with_seq(65536), gpu=H100, global_batch=32, data_parallel=4, tensor_parallel=2,
                sequence_parallel=True, context_parallel=4, micro_batches=(1,), zero=(1,), flash_attention=True)  # fmt: skip
    return PlanConfig(**(base | kw))


def test_planner_runs_ulysses_and_refuses_heads_that_do_not_split():
    """Llama 3 8B at 64k, t 2, c 4 (one node): the same memory as the ring; the step differs as the layers do (the
    ring's unmasked steps outrun Ulysses' one causal kernel, which in turn merges nothing and hides nothing);
    t·c = 16 does not divide the 8 K/V heads."""
    uly, ring = make_plan(_cfg(cp_comm="ulysses")), make_plan(_cfg(cp_comm="ring"))
    a, b = uly.candidates[0], ring.candidates[0]
    assert a.cp_comm == "ulysses" and a.peak_memory_bytes == pytest.approx(b.peak_memory_bytes)
    kw = dict(seq=65536, tensor_parallel=2, sequence_parallel=True, context_parallel=4, flash_attention=True)
    from microbatch.predict.steptime import layer_pass_times

    la, lb = (
        sum(layer_pass_times(layer_forward(LLAMA, 1, H100, cp_comm=x, **kw))) for x in ("ulysses", "ring")
    )
    layer = la - lb
    assert (a.step_time_s - b.step_time_s) * layer > 0  # the same sign
    assert a.step_time_s - b.step_time_s == pytest.approx(LLAMA.layers * 8 * layer, rel=0.05)
    with pytest.raises(ConfigError, match="must divide both the 32 query heads"):
        _cfg(cp_comm="ulysses", context_parallel=8, data_parallel=2)
    with pytest.raises(ConfigError, match="Ulysses run flash on each rank's heads"):
        _cfg(cp_comm="ulysses", flash_attention=False)


def test_one_layer_by_hand():
    """Llama 3 8B, b 1, s 32k, t 2, c 4 on H100s (one node): Q, K, V, O bytes 2·8192·(2·4096 + 2·1024)/2 =
    83,886,080 per GPU, 3/4 of them over NVLink at 450 GB/s × 0.82 = 0.170 ms each way; the ring of the same layout
    hides its K/V behind the attention (exposed: only the attention's slowdown beside the sends, then its merges)."""
    kw = dict(seq=32768, tensor_parallel=2, context_parallel=4, flash_attention=True)
    uly = layer_forward(LLAMA, 1, H100, cp_comm="ulysses", **kw)
    ring = layer_forward(LLAMA, 1, H100, cp_comm="ring", **kw)
    assert ulysses_bytes(LLAMA, 1, 32768, 4, tensor_parallel=2) == 83_886_080
    assert uly.cp_comm_s == pytest.approx(83_886_080 * 3 / 4 / (450e9 * 0.82), rel=1e-9)
    assert uly.cp_comm_s == pytest.approx(1.705e-4, rel=1e-3)
    merge_f, _ = ring_merge_bytes(LLAMA, 1, 32768, 4, tensor_parallel=2)
    hidden = ring.cp_comm_s - merge_f / (H100.memory_bandwidth_bytes_per_s * 0.8)
    assert (
        0 < hidden < uly.cp_comm_s / 4
    )  # only the attention's slowdown beside the ring's sends, then its merges
    # the ring's unmasked steps run nearer the plateau than Ulysses' one causal kernel over 32k keys
    assert ring.attention_s < uly.attention_s and ring.attention_backward_s < uly.attention_backward_s


def test_windowed_layers_keep_their_window_under_ulysses():
    """GPT-OSS's sliding-window layers: under Ulysses each rank attends with whole sequences, so the window holds and
    c = 2 halves the c = 1 attention; the ring's steps read other ranks' blocks, taken as full (slower)."""
    oss = get_model("gpt-oss-120b")
    s, kw = 8192, dict(flash_attention=True)
    whole = layer_forward(oss, 1, H100, seq=s, **kw).attention_s
    uly = layer_forward(oss, 1, H100, seq=s, context_parallel=2, cp_comm="ulysses", **kw).attention_s
    ring = layer_forward(oss, 1, H100, seq=s, context_parallel=2, cp_comm="ring", **kw).attention_s
    assert uly == pytest.approx(whole / 2) and ring > uly


def test_selective_recompute_repeats_the_exchange():
    """Selective recompute reruns the attention core, and with it the context-parallel exchange inside it."""
    from microbatch.predict.steptime import layer_pass_times

    lt = layer_forward(LLAMA, 1, H100, seq=32768, tensor_parallel=4, context_parallel=4, cp_comm="ulysses",
                       flash_attention=True)  # fmt: skip
    assert lt.cp_comm_s > 0
    none, selective = layer_pass_times(lt, "none"), layer_pass_times(lt, "selective")
    assert selective[1] - none[1] == pytest.approx(lt.attention_s + lt.cp_comm_s)


def test_cli_and_export(capsys):
    from microbatch.cli import main

    args = ["plan", "--model", "llama-3-8b", "--seq", "65536", "--gpu", "h100", "-B", "32", "-d", "4", "-t", "2",
            "-c", "4", "--cp-comm", "ulysses", "--json"]  # fmt: skip
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["cp_comm"] == out["candidates"][0]["cp_comm"] == "ulysses"
    assert main([*args[:9], "-t", "2", "-c", "8", "-d", "2", "--cp-comm", "ulysses"]) == 2  # each option once
    err = capsys.readouterr().err
    assert "--cp-comm ulysses splits the heads over --tensor-parallel × --context-parallel = 2 × 8" in err
    plan = make_plan(_cfg(cp_comm="ulysses")).to_dict()
    for fmt in ("torchtitan", "deepspeed"):
        with pytest.raises(ConfigError, match=f"{fmt} has no Ulysses context parallelism"):
            export_plan(plan, fmt)


def test_ring_steps_by_hand():
    """The ring's attention: its diagonal step causal at s/c keys with 1/c of the rank's causal FLOPs, the c − 1
    others unmasked, half at s/2c keys and half at s/c, sharing the rest; c = 1 the one causal kernel."""
    from microbatch.predict.attention import flash_attention_times_s
    from microbatch.predict.attention_core import ring_steps_s

    full, s, c, peak, ceil = 8e12, 65536.0, 8, 989.4e12, 0.57
    diag = flash_attention_times_s(full / c, s / c, peak, ceil)
    short = flash_attention_times_s(full / 2 * (c - 1) / c / 2, s / (2 * c), peak, ceil, causal=False)
    long = flash_attention_times_s(full / 2 * (c - 1) / c / 2, s / c, peak, ceil, causal=False)
    got = ring_steps_s(full, s, c, peak, ceil, 128)
    assert got[0] == pytest.approx(diag[0] + short[0] + long[0]) and got[1] == pytest.approx(
        diag[1] + short[1] + long[1]
    )
    assert ring_steps_s(full, s, 1, peak, ceil, 128) == flash_attention_times_s(full, s, peak, ceil)
    # the unmasked steps run nearer the kernel's plateau than one causal kernel at s/c would
    all_causal = flash_attention_times_s(full, s / c, peak, ceil)
    assert got[0] < all_causal[0] and got[1] < all_causal[1]


def test_ring_merges_by_hand():
    """Llama 2 7B (32 heads, MHA: K = V = Q in bytes), b 1, s 32k, c 4, t 2: U = 2·8192·4096/2 = 33,554,432 bytes;
    forward 4U + 4U + 3·(U + 2.75U) = 19.25U = 645,922,816, backward 14U + 3U + 3·(8.5U + 3.75U) = 53.75U =
    1,803,550,720; Llama 3 8B's K = V = U/4 (8 of 32 heads): forward 7·U/4 + 12.25U = 14U; none at c = 1."""
    from microbatch.predict.context import CpLayout, cp_exchange_s

    llama2 = get_model("llama-2-7b")
    f, b = ring_merge_bytes(llama2, 1, 32768, 4, tensor_parallel=2)
    assert (f, b) == (645_922_816, 1_803_550_720)
    assert ring_merge_bytes(llama2, 1, 32768, 1) == (0.0, 0.0)
    f8, _ = ring_merge_bytes(LLAMA, 1, 32768, 4, tensor_parallel=2)
    assert f8 == 14 * 33_554_432
    uly = cp_exchange_s(llama2, 1, 32768, H100, CpLayout(4, 2, "ulysses"), 1.0, 0.8, (1.0, 2.5))
    assert (
        uly[0]
        == uly[1]
        == pytest.approx(
            alltoall_time_s(
                ulysses_bytes(llama2, 1, 32768, 4, tensor_parallel=2), 4, 4, 450e9 * 0.82, 50e9 * 0.96
            )
        )
    )


@pytest.mark.parametrize("c", [1, 2, 3, 8, 32])
def test_ring_steps_keep_the_ranks_causal_flops(c, monkeypatch):
    """However the steps are cut, the kernels a rank runs do exactly its causal half of the full count F/2."""
    import microbatch.predict.attention_core as core

    seen: list[float] = []
    real = core.flash_attention_times_s

    def spy(full, seq, peak, ceiling, head_dim=128, causal=True):
        seen.append(full / 2 if causal else full)
        return real(full, seq, peak, ceiling, head_dim=head_dim, causal=causal)

    monkeypatch.setattr(core, "flash_attention_times_s", spy)
    core.ring_steps_s(8e12, 65536.0, c, 989.4e12, 0.57, 128)
    assert sum(seen) == pytest.approx(4e12, rel=1e-12)
