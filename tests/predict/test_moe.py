"""Mixture of experts and expert parallelism: rows per expert, the all-to-all, expert memory, the planner.

Each test holds one term to its equation, so that dropping the term (or getting its sharding wrong)
fails here.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from microbatch.errors import ConfigError
from microbatch.hardware import get_accelerator
from microbatch.model import get_model, resolve_model
from microbatch.predict.activations import layer_activation_terms
from microbatch.predict.collectives import alltoall_time_s, ranks_per_node
from microbatch.predict.experts import dispatch_bytes, expert_params, gemm_weights, rows_per_expert
from microbatch.predict.memory import MemoryConfig, estimate_memory
from microbatch.predict.plan import make_plan
from microbatch.predict.plan_config import PlanConfig
from microbatch.predict.roofline import gemm_time_s, layer_forward, layer_forward_flops

H100 = get_accelerator("h100-80gb")
RUN = H100.at_sustained_clock()  # the clock its kernels run at (the Hopper rows' sustained clock)
MIX = get_model("mixtral-8x7b")
DS = get_model("deepseek-v3")


def test_rows_per_expert_is_ep_b_s_k_over_e():
    assert MIX.moe is not None and DS.moe is not None
    assert rows_per_expert(MIX.moe, 1, 4096) == 4096 * 2 / 8
    assert rows_per_expert(DS.moe, 2, 4096) == 2 * 4096 * 8 / 256
    assert rows_per_expert(DS.moe, 2, 4096, expert_parallel=8) == 8 * 2 * 4096 * 8 / 256
    assert rows_per_expert(DS.moe, 2, 4096, load=1.25) == 1.25 * 2 * 4096 * 8 / 256


def test_moe_mlp_gemms_run_at_the_rows_each_expert_receives():
    """The MLP GEMM time of a MoE block is E/EP experts at EP·b·s·K/E rows, plus the router; no shared experts in
    Mixtral. Dropping the per-expert rows (timing the experts at b·s rows) or the E/EP count fails."""
    kw = dict(dtype="bf16")
    s, h, F = 4096, 4096, 14336
    for ep in (1, 4):
        lt = layer_forward(MIX, 1, H100, moe_layout=(ep, 1.0))
        dense_attn = layer_forward(replace(MIX, moe=None), 1, H100)
        attn_gemm = dense_attn.gemm_s - (
            gemm_time_s(s, h, 2 * F, RUN, **kw) + gemm_time_s(s, F, h, RUN, **kw)
        )
        r = ep * s * 2 / 8
        expected = 8 // ep * (gemm_time_s(r, h, 2 * F, RUN, **kw) + gemm_time_s(r, F, h, RUN, **kw))
        expected += gemm_time_s(s, h, 8, RUN, **kw)  # router
        assert lt.gemm_s - attn_gemm == pytest.approx(expected, rel=1e-12)


def test_moe_knee_tokens_per_expert_lower_the_gemm_efficiency():
    """DeepSeek-V3's experts see b·s·8/256 rows: at b_m = 1, s = 512 that is 16 rows, far below the ramp, so the
    achieved FLOP rate of a layer rises with b_m much longer than a dense layer of the same active width."""
    short = DS.with_seq(512)
    rate = {
        b: layer_forward(short, b, H100).flops / layer_forward(short, b, H100).compute_s for b in (1, 8, 64)
    }
    assert rate[1] < rate[8] < rate[64]
    assert rate[64] / rate[1] > 2.0


def test_alltoall_within_and_across_nodes():
    nbytes = 1e9
    # 8 ranks in one node: 7/8 over NVLink
    assert alltoall_time_s(nbytes, 8, 8, 400e9, 50e9) == pytest.approx(nbytes * 7 / 8 / 400e9)
    # 32 ranks, 8 per node: 24/32 over the NIC dominates
    assert alltoall_time_s(nbytes, 32, 8, 400e9, 50e9) == pytest.approx(nbytes * 24 / 32 / 50e9)
    assert alltoall_time_s(nbytes, 1, 1, 400e9, 50e9) == 0.0
    # the layer's ep_comm_s: dispatch + combine of e·b·s·K·h bytes over the EP ranks t apart
    lt1 = layer_forward(MIX, 1, H100, moe_layout=(1, 1.0))
    assert lt1.ep_comm_s == 0.0
    lt = layer_forward(MIX, 1, H100, tensor_parallel=2, moe_layout=(8, 1.0))
    nb = dispatch_bytes(MIX, 1, 4096, dtype_bytes=2)
    assert nb == 2 * 4096 * 2 * 4096
    intra = H100.intra_node_bytes_per_s * H100.intra_node_achievable
    inter = H100.inter_node_bytes_per_s * H100.inter_node_achievable
    k = ranks_per_node(H100, 8, 2)
    assert k == 4  # t = 2: four EP ranks share a node
    assert lt.ep_comm_s == pytest.approx(2 * alltoall_time_s(nb, 8, k, intra, inter))
    assert lt.total_s == pytest.approx(lt.compute_s + lt.tp_comm_s + lt.ep_comm_s)


def test_with_sequence_parallelism_each_tensor_rank_dispatches_its_own_tokens():
    """Megatron-core's all-to-all dispatcher under TP + SP: each rank sends its b·s/t tokens (1/t of the bytes),
    then the tensor group all-gathers what it received and reduce-scatters the outputs, inside the node."""
    from microbatch.predict.collectives import allgather_time_s

    nb = dispatch_bytes(MIX, 1, 4096, dtype_bytes=2)
    intra = H100.intra_node_bytes_per_s * H100.intra_node_achievable
    inter = H100.inter_node_bytes_per_s * H100.inter_node_achievable
    for t, ep in ((2, 8), (4, 8), (2, 32)):
        k = ranks_per_node(H100, ep, t)
        lt = layer_forward(MIX, 1, H100, tensor_parallel=t, sequence_parallel=True, moe_layout=(ep, 1.0))
        expected = 2 * alltoall_time_s(nb / t, ep, k, intra, inter) + 2 * allgather_time_s(nb, t, intra)
        assert lt.ep_comm_s == pytest.approx(expected, rel=1e-12), (t, ep)
        whole = layer_forward(
            MIX, 1, H100, tensor_parallel=t, moe_layout=(ep, 1.0)
        )  # no SP: every rank sends all
        assert whole.ep_comm_s == pytest.approx(2 * alltoall_time_s(nb, ep, k, intra, inter), rel=1e-12)
        assert lt.ep_comm_s < whole.ep_comm_s


def test_moe_flops_count_the_active_experts():
    rows = 4096
    mla = DS.mla
    assert mla is not None
    attn = mla.params(7168, 128)
    mlp = 7168 * 256 + 8 * 3 * 7168 * 2048 + 3 * 7168 * 2048
    assert gemm_weights(DS) == attn + mlp
    core = 2.0 * rows * 4096 * 128 * (192 + 128)
    assert layer_forward_flops(DS, rows, 4096) == pytest.approx(2.0 * rows * (attn + mlp) + core)
    # a dense model keeps Narayanan's 24·b·s·h² + 4·b·s²·h
    g = get_model("gpt3-175b")
    assert layer_forward_flops(g, 2048, 2048) == pytest.approx(24 * 2048 * 12288**2 + 4 * 2048 * 2048 * 12288)


def test_moe_activation_terms():
    t = layer_activation_terms(MIX, 1, tensor_parallel=2)
    dense = layer_activation_terms(replace(MIX, moe=None), 1, tensor_parallel=2)
    rows = 4096 * 2  # b·s·K
    assert "mlp_hidden" not in t
    assert t["expert_hidden"] == 3 * 2 * rows * 14336 / 2 == 2 * dense["mlp_hidden"]
    assert t["expert_input"] == t["expert_output"] == 2 * rows * 4096
    assert t["router"] == 2 * 4 * 4096 * 8
    assert t["shared_hidden"] == 0
    ds = layer_activation_terms(DS, 1)
    assert ds["shared_hidden"] == 3 * 2 * 4096 * 1 * 2048
    assert layer_activation_terms(MIX, 1, expert_load=1.25)["expert_hidden"] == pytest.approx(
        1.25 * t["expert_hidden"] * 2
    )
    # MLA: Q and K of a·192, V of a·128, the latents 1536 + 512 + 64 per token
    assert ds["qkv"] == 2 * 4096 * 128 * (2 * 192 + 128) + 2 * 4096 * (1536 + 512 + 64)


def test_expert_weights_and_state_shard_over_ep_and_expert_data_parallel():
    """Expert weights divide by t·EP; their ZeRO-1 optimizer state by d/EP (the expert-data-parallel group);
    everything else as before. The all-to-all buffers are other bytes."""
    base = dict(micro_batch=1, tensor_parallel=2, pipeline_parallel=4, data_parallel=8, zero=1)
    one = estimate_memory(MIX, MemoryConfig(**base)).stages[1]
    ep8 = estimate_memory(MIX, MemoryConfig(**base, expert_parallel=8)).stages[1]
    experts = expert_params(MIX, 8, 8) / 2  # stage 1: layers 8..15, per tensor rank
    assert experts == 8 * 8 * 3 * 4096 * 14336 / 2
    dense = one.params - experts
    assert ep8.params == pytest.approx(dense + experts / 8)
    assert ep8.weights_bytes == pytest.approx(2 * (dense + experts / 8))
    assert ep8.optimizer_bytes == pytest.approx(12 * dense / 8 + 12 * (experts / 8) / (8 // 8))
    assert one.optimizer_bytes == pytest.approx(12 * (dense + experts) / 8)
    assert ep8.other_bytes == pytest.approx(2 * dispatch_bytes(MIX, 1, 4096, dtype_bytes=2))
    assert one.other_bytes == 0.0
    # dense first layers are dense: DeepSeek-V3's stage 0 holds fewer parameters than stage 1 of equal layers
    st = estimate_memory(DS.with_seq(1024), MemoryConfig(micro_batch=1, pipeline_parallel=61)).stages
    assert st[0].params - st[1].params == DS.embedding_params()
    assert st[1].params == DS.layer_params(1) == DS.layer_params(0)
    assert st[3].params - st[2].params == DS.layer_params() - DS.layer_params(0)


def test_expert_parallel_layout_is_checked():
    with pytest.raises(ConfigError, match="does not divide data-parallel 4"):
        estimate_memory(MIX, MemoryConfig(micro_batch=1, data_parallel=4, expert_parallel=8))
    with pytest.raises(ConfigError, match="does not divide experts 8"):
        estimate_memory(MIX, MemoryConfig(micro_batch=1, data_parallel=6, expert_parallel=3))
    with pytest.raises(ConfigError, match="needs a mixture-of-experts model"):
        estimate_memory(
            get_model("llama-2-7b"), MemoryConfig(micro_batch=1, data_parallel=2, expert_parallel=2)
        )
    with pytest.raises(ConfigError, match="capacity factor"):
        MemoryConfig(micro_batch=1, capacity_factor=0.0)


def test_planner_memory_equals_the_memory_model_with_experts():
    cfg = PlanConfig(shape=MIX, gpu=H100, global_batch=64, tensor_parallel=2, pipeline_parallel=4, data_parallel=8,
                     expert_parallel=4, capacity_factor=1.25)  # fmt: skip
    plan = make_plan(cfg)
    assert plan.candidates
    for c in plan.candidates[::5]:
        est = estimate_memory(
            MIX,
            MemoryConfig(
                micro_batch=c.micro_batch, tensor_parallel=2, pipeline_parallel=4, virtual=c.virtual,
                microbatches=c.microbatches, schedule=c.schedule, data_parallel=8, zero=c.zero,
                recompute=c.recompute, expert_parallel=4, capacity_factor=1.25,
            ),
        )  # fmt: skip
        assert c.peak_memory_bytes == pytest.approx(est.peak_bytes, rel=1e-9), c
        assert c.memory == pytest.approx(est.peak_stage.breakdown(), rel=1e-9)


def test_plan_json_gives_total_and_active_params():
    cfg = PlanConfig(shape=MIX, gpu=H100, global_batch=32, pipeline_parallel=4, data_parallel=8, expert_parallel=8,
                     tensor_parallel=2, recompute=("none",), zero=(1,))  # fmt: skip
    d = make_plan(cfg).to_dict()
    assert d["total_params"] == MIX.param_count() and d["active_params"] == MIX.active_param_count()
    assert d["expert_parallel"] == 8
    for c in d["candidates"]:
        assert (c["total_params"], c["active_params"], c["expert_parallel"]) == (
            d["total_params"],
            d["active_params"],
            8,
        )
    # more expert parallelism: less memory for the experts, an all-to-all in the step
    d1 = make_plan(replace(cfg, expert_parallel=1)).to_dict()
    by = {(c["micro_batch"], c["schedule"], c["virtual"]): c for c in d1["candidates"]}
    c8 = d["candidates"][0]
    c1 = by[(c8["micro_batch"], c8["schedule"], c8["virtual"])]
    assert c8["memory"]["weights"] < c1["memory"]["weights"]


def test_resolve_model_expert_flags_reach_the_planner():
    shape = resolve_model("llama-2-7b", experts=8, top_k=2)
    cfg = PlanConfig(
        shape=shape, gpu=H100, global_batch=16, data_parallel=8, expert_parallel=8, tensor_parallel=1
    )
    assert make_plan(cfg).to_dict()["active_params"] < shape.param_count()


def test_cli_plan_and_memory_take_the_expert_flags(capsys):
    import json

    from microbatch.cli import main

    rc = main(["plan", "--model", "llama-2-7b", "--experts", "8", "--top-k", "2", "--gpu", "h100-80gb", "-B", "32",
               "-d", "8", "-p", "4", "-e", "8", "-b", "1", "--recompute", "none", "--zero", "1", "--json"])  # fmt: skip
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    shape = resolve_model("llama-2-7b", experts=8, top_k=2)
    assert out["total_params"] == shape.param_count() and out["active_params"] == shape.active_param_count()
    assert out["expert_parallel"] == 8 and out["model_shape"]["moe"]["experts"] == 8
    assert "each expert's GEMMs see EP·b_m·s·K/E = 8,192 rows" in out["explanation"]
    assert out["recommended"]["total_params"] == shape.param_count()
    rc = main(["memory", "--model", "mixtral-8x7b", "-b", "1", "-d", "8", "-e", "8", "--capacity-factor", "1.25",
               "--json"])  # fmt: skip
    assert rc == 0
    mem = json.loads(capsys.readouterr().out)
    assert mem["config"]["expert_parallel"] == 8 and mem["config"]["capacity_factor"] == 1.25
    est = estimate_memory(
        MIX, MemoryConfig(micro_batch=1, data_parallel=8, expert_parallel=8, capacity_factor=1.25)
    )
    assert mem["peak_memory_bytes"] == pytest.approx(est.peak_bytes)
    assert main(["memory", "--model", "mixtral-8x7b", "-b", "1", "-d", "4", "-e", "8"]) == 2
    assert "does not divide data-parallel 4" in capsys.readouterr().err


def test_explain_result_keeps_the_moe_sentence():
    from microbatch.show.plan_report import explain, explain_result

    cfg = PlanConfig(shape=DS.with_seq(1024), gpu=H100, global_batch=256, pipeline_parallel=8, data_parallel=32,
                     expert_parallel=32, recompute=("full",), zero=(1,), capacity_factor=1.25)  # fmt: skip
    plan = make_plan(cfg)
    text = explain(plan)
    assert plan.recommended is not None
    rows = 32 * plan.recommended.micro_batch * 1024 * 8 / 256 * 1.25
    assert f"EP·b_m·s·K/E = {rows:,.0f} rows" in text and "capacity factor 1.25" in text
    assert explain_result(plan.to_dict()) == text


def _megatron_weight_and_optimizer_bytes(shape, t: int, d: int) -> float:
    """Megatron-LM's theoretical_memory_usage.compute_weight_and_optimizer_memory, written from its equations
    (p = 1, untied, RMSNorm, SwiGLU, distributed optimizer: 6 + 12/d bytes per parameter): dense and MoE layer
    counts, its MLA term, no router."""
    h, a, moe, mla = shape.hidden, shape.heads, shape.moe, shape.mla
    if mla is None:
        attn = 2 * h * h * (1 + shape.kv / a) * (a * shape.head_dim / h)
    else:
        q = mla.q_lora_rank * (h + a * mla.qk_head_dim + 1)
        attn = q + mla.kv_lora_rank * (h + a * (mla.qk_nope_head_dim + mla.v_head_dim) + 1)
        attn += h * mla.qk_rope_head_dim + a * mla.v_head_dim * h
    dense = 2 * h * (shape.ffn * 1.5 + 1) + attn
    moe_layer = (
        2 * h * (moe.expert_ffn_hidden * moe.experts * 1.5 + moe.shared_experts * moe.shared_width * 1.5 + 1)
    )
    moe_layer += attn
    n_dense = moe.dense_layers
    block = dense * n_dense + moe_layer * (shape.layers - n_dense) + h
    emb = h * shape.vocab
    return ((block + emb) / t + emb / t) * (6 + 12 / d)


def test_moe_state_matches_megatrons_theoretical_memory_at_ep_1():
    """A differential over random MoE shapes (with and without MLA, shared experts, dense first layers): weights,
    fp32 gradients and the distributed optimizer's state at p = 1, EP = 1 equal Megatron-LM's formula plus the
    router Megatron leaves out."""
    import random

    from microbatch.moe import Experts, LatentAttention
    from microbatch.shape import ModelShape

    rng = random.Random(29)
    for _ in range(40):
        heads = rng.choice((8, 16, 32))
        h = heads * rng.choice((64, 128))
        moe = Experts(experts=rng.choice((4, 8, 16, 64)), top_k=2, expert_ffn_hidden=rng.choice((256, 1024, 2048)),
                      shared_experts=rng.choice((0, 1, 2)), dense_layers=rng.choice((0, 1, 3)))  # fmt: skip
        mla = rng.choice(
            (None, LatentAttention(kv_lora_rank=rng.choice((128, 512)), q_lora_rank=rng.choice((256, 1536))))
        )
        shape = ModelShape(name="r", layers=rng.choice((4, 8, 12)), hidden=h, heads=heads,
                           kv_heads=None if mla else rng.choice((heads, heads // 4)), ffn_hidden=rng.choice((2048, 4096)),
                           vocab=128 * rng.randint(100, 400), seq=1024, gated_mlp=True, bias=False, norm="rmsnorm",
                           learned_positions=False, dropout=False, moe=moe, mla=mla)  # fmt: skip
        t, d = rng.choice((1, 2, 4)), rng.choice((2, 4, 8))
        if heads % t or shape.kv % t and t % shape.kv:
            continue
        st = estimate_memory(shape, MemoryConfig(micro_batch=1, tensor_parallel=t, data_parallel=d, zero=1,
                                                 grad_dtype="fp32")).stages[0]  # fmt: skip
        router = (shape.layers - moe.dense_layers) * h * moe.experts / t
        megatron = _megatron_weight_and_optimizer_bytes(shape, t, d) + router * (6 + 12 / d)
        assert st.state_bytes == pytest.approx(megatron, rel=1e-9), (shape, t, d)


def test_all_to_all_hidden_by_dualpipev_and_by_ep_overlap():
    """DeepSeek-V3 §3.2.1: the all-to-all runs under another micro-batch's compute: exposed max(0, a2a − compute);
    DualPipeV always, other schedules with ep_overlap."""
    from microbatch.predict.candidate import _stage_times, _v_stage_times, layer_costs, make_context
    from microbatch.predict.steptime import overlap_expert_comm

    slow = H100.with_overrides(inter_node_bytes_per_s=2e9)  # a slow NIC: the all-to-all outlasts the compute
    lt = layer_forward(MIX, 1, slow, tensor_parallel=2, moe_layout=(8, 1.0))
    hidden = overlap_expert_comm(lt)
    assert lt.ep_comm_s > lt.compute_s and hidden.ep_comm_s == pytest.approx(lt.ep_comm_s - lt.compute_s)
    fast = layer_forward(MIX, 1, H100, tensor_parallel=2, moe_layout=(8, 1.0))
    assert overlap_expert_comm(fast).ep_comm_s == max(0.0, fast.ep_comm_s - fast.compute_s)
    base = dict(shape=MIX, gpu=slow, global_batch=64, tensor_parallel=2, pipeline_parallel=4, data_parallel=8,
                expert_parallel=8)  # fmt: skip
    plain, over = make_context(PlanConfig(**base)), make_context(PlanConfig(**base, ep_overlap=True))
    n = plain.split[0]
    gain = layer_costs(plain, 1).layer.ep_comm_s - overlap_expert_comm(layer_costs(plain, 1).layer).ep_comm_s
    assert gain > 0
    assert _stage_times(plain, 1, "none").f[0] - _stage_times(over, 1, "none").f[0] == pytest.approx(n * gain)
    assert _stage_times(plain, 1, "none").i[0] - _stage_times(over, 1, "none").i[0] == pytest.approx(n * gain)
    # DualPipeV hides it without the flag: its first chunk holds n/2 layers and one pipeline send
    costs = layer_costs(plain, 1)
    v = _v_stage_times(plain, 1, "none")
    assert v.f[0] == pytest.approx((n // 2) * overlap_expert_comm(costs.layer).total_s + costs.p2p_s)


def test_the_planner_finds_the_peak_stage_after_the_dense_layers():
    """DeepSeek-V3's first 3 layers keep a dense MLP: stage 0 (7 layers, 3 dense) is light, stage 1 (7 MoE
    layers, one micro-batch fewer in flight) is the peak. The planner probes the first stage of each run of
    like stages; probing every stage (an explicit split) must give the same peak, and the fit follows it."""
    base = dict(
        shape=get_model("deepseek-v3"), gpu=get_accelerator("h200", memory_bytes=250 * 2**30), global_batch=128,
        data_parallel=8, pipeline_parallel=8, tensor_parallel=4, schedules=("1f1b",), recompute=("selective",),
        zero=(1,), micro_batches=(2,), memory_headroom=0.05,
    )  # fmt: skip
    runs = make_plan(PlanConfig(**base)).candidates[0]
    every = make_plan(PlanConfig(**base, layers_per_stage=(7, 7, 7, 8, 8, 8, 8, 8))).candidates[0]
    assert runs.peak_stage == every.peak_stage == 1
    assert runs.peak_memory_bytes == every.peak_memory_bytes
    assert runs.peak_memory_bytes > 0.95 * 250 * 2**30 and not runs.fits  # 238.4 GiB over a 237.5 GiB budget


def test_a_moe_block_streams_its_routed_copies_to_the_experts_and_back():
    """PERMUTE_PASSES (4) passes over b·s·K·load rows of h each direction, at the streaming rate: the only
    elementwise difference from a dense block whose MLP has the same activation width K·F."""
    from microbatch.predict.gemm import DEFAULT_EFFICIENCY
    from microbatch.predict.memory_ops import PERMUTE_PASSES
    from microbatch.predict.roofline import _elementwise_s, _Linears

    assert MIX.moe is not None and MIX.moe.shared_experts == 0
    rows, k = 4096.0, MIX.moe.top_k
    dense = replace(MIX, moe=None, ffn_hidden=k * MIX.moe.expert_ffn_hidden)
    g = _Linears(H100, "bf16", DEFAULT_EFFICIENCY, None)
    width = k * MIX.moe.expert_ffn_hidden
    bw = H100.memory_bandwidth_bytes_per_s * DEFAULT_EFFICIENCY.memory
    # under SP the all-to-all dispatcher (EP > 1) permutes the rank's own b·s/t tokens, the all-gather one
    # (EP = 1) all b·s after gathering them
    for load, t, sp, ep, own in ((1.0, 1, False, 1, 1), (1.25, 1, False, 4, 1), (1.0, 2, True, 8, 2),
                                 (1.0, 2, True, 1, 1)):  # fmt: skip
        moe_f, moe_b = _elementwise_s(MIX, rows, t, sp, width * load, H100, DEFAULT_EFFICIENCY, g, dtype_bytes=2,
                                      layout=(ep, load))  # fmt: skip
        dense_w = replace(dense, ffn_hidden=int(width * load))
        den_f, den_b = _elementwise_s(dense_w, rows, t, sp, 0.0, H100, DEFAULT_EFFICIENCY, g, dtype_bytes=2)
        expected = PERMUTE_PASSES * 2 * rows * k * load * MIX.hidden / own / bw
        assert moe_f - den_f == pytest.approx(expected, rel=1e-9), (load, t)
        assert moe_b - den_b == pytest.approx(expected, rel=1e-9), (load, t)


def test_under_sp_the_moe_block_gathers_its_routed_tokens_not_its_input():
    """With EP > 1 (the all-to-all dispatcher) and no shared experts the block's tensor-parallel traffic is the
    routed tokens' gather (in ep_comm_s): the dense rows x h pair is the attention's only (half of tp_comm_s). At
    EP = 1 Megatron's all-gather dispatcher gathers the tokens themselves: the dense pair, nothing routed."""
    kw = dict(tensor_parallel=2, sequence_parallel=True)
    dense_pair = layer_forward(MIX, 1, H100, **kw, moe_layout=(1, 1.0)).tp_comm_s
    assert layer_forward(MIX, 1, H100, **kw, moe_layout=(1, 1.0)).ep_comm_s == 0.0
    assert layer_forward(MIX, 1, H100, tensor_parallel=2, moe_layout=(1, 1.0)).tp_comm_s == pytest.approx(
        dense_pair
    )
    assert layer_forward(MIX, 1, H100, **kw, moe_layout=(8, 1.0)).tp_comm_s == pytest.approx(dense_pair / 2)
    assert (
        DS.moe is not None and DS.moe.shared_experts
    )  # shared experts need the gathered input: the pair stays
    ds = layer_forward(DS.with_seq(1024), 1, H100, **kw, moe_layout=(8, 1.0)).tp_comm_s
    assert ds == pytest.approx(layer_forward(DS.with_seq(1024), 1, H100, **kw, moe_layout=(1, 1.0)).tp_comm_s)
