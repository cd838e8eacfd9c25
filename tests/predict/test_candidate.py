"""One planner candidate: the fast paths of the evaluation give the numbers of the plain computation.

The planner's hot loop caches per (b_m, recompute), per (schedule, m, v), per ZeRO stage, computes the
step-time rule once per distinct stage and fills the Candidate's dictionary at once (bench/bench_plan.py,
issue 17's ≥ 50,000 candidates/s). These tests hold each shortcut to the plain computation, value for
value: a shortcut that changed a number fails here.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from microbatch.hardware import get_accelerator
from microbatch.model import get_model
from microbatch.predict.candidate import (
    Candidate,
    _fast_candidate,
    _stage_times,
    _v_stage_times,
    evaluate,
    evaluate_zeros,
    layer_costs,
    make_context,
)
from microbatch.predict.plan import PlanConfig, _enumerate, _schedule_options, make_plan, search_layouts
from microbatch.predict.roofline import model_flops_per_step
from microbatch.predict.steptime import pipeline_stage_times

A100 = get_accelerator("a100-80gb")
CONFIGS = [
    dict(shape=get_model("gpt2"), global_batch=48, pipeline_parallel=3, data_parallel=2),
    dict(shape=get_model("gpt2"), global_batch=64, pipeline_parallel=4, layers_per_stage=(2, 3, 3, 4)),
    dict(
        shape=get_model("llama-2-7b"), global_batch=64, pipeline_parallel=5, tensor_parallel=2
    ),  # 32 = 6+6+6+7+7
    dict(shape=get_model("llama-2-7b"), global_batch=32, data_parallel=4),
]


def _keys(cfg: PlanConfig) -> list[tuple[int, int, str, int, str, int]]:
    per = cfg.global_batch // cfg.data_parallel
    out = []
    for b in (b for b in range(1, per + 1) if per % b == 0):
        for sched, v in _schedule_options(cfg, per // b):
            for rc in ("none", "selective", "full"):
                for z in (0, 1, 2, 3) if cfg.data_parallel > 1 else (0,):
                    out.append((b, per // b, sched, v, rc, z))
    return out


@pytest.mark.parametrize("kw", CONFIGS, ids=["gpt2-p3-d2", "gpt2-uneven", "7b-p5-t2", "7b-d4"])
def test_shared_caches_give_each_candidate_what_a_fresh_context_gives(kw):
    """Every candidate evaluated in a shared context, in a shuffled order, equals the same candidate
    evaluated alone in a fresh context: no cache key misses a choice the numbers depend on."""
    cfg = PlanConfig(gpu=A100, simulate_top=0, **kw)
    mf = model_flops_per_step(cfg.shape, cfg.global_batch, cfg.seq)
    keys = _keys(cfg)
    assert len({k[2] for k in keys}) >= (1 if cfg.pipeline_parallel == 1 else 3)
    random.Random(17).shuffle(keys)
    shared = make_context(cfg)
    for key in keys:
        got = evaluate(shared, *key, mf)
        assert got == evaluate(make_context(cfg), *key, mf), key


def test_one_b_m_at_two_m_on_one_context_gives_what_fresh_contexts_give():
    """``evaluate`` takes m free of b_m (the planner's search ties them): the data-parallel seconds a context caches
    (ZeRO-2/3 reduce and gather every micro-step: m times) must not be shared by two m of one b_m."""
    cfg = PlanConfig(gpu=A100, simulate_top=0, **CONFIGS[3])  # d 4, no pipeline: ZeRO-3 every micro-step
    mf = model_flops_per_step(cfg.shape, cfg.global_batch, cfg.seq)
    shared = make_context(cfg)
    for z in (2, 3):
        got = [evaluate(shared, 2, m, "1f1b", 1, "full", z, mf) for m in (2, 4)]
        assert got == [evaluate(make_context(cfg), 2, m, "1f1b", 1, "full", z, mf) for m in (2, 4)]
        assert (
            got[1].time["zero_comm_s"] > got[0].time["zero_comm_s"]
        )  # twice the micro-steps, more exposed ZeRO seconds


@pytest.mark.parametrize("kw", CONFIGS[:3], ids=["gpt2-p3-d2", "gpt2-uneven", "7b-p5-t2"])
def test_stage_times_equal_the_step_time_rule_on_every_stage(kw):
    """The rule is run once per distinct stage and spread: the lists equal the rule on the full split
    (this fails if the rule gains a term that depends on a stage's position)."""
    cfg = PlanConfig(gpu=A100, **kw)
    ctx = make_context(cfg)
    for b in (1, 2):
        for rc in ("none", "selective", "full"):
            costs = layer_costs(ctx, b)
            f, i, w = pipeline_stage_times(costs.layer, costs.logits_s, split=ctx.split, p2p_s=costs.p2p_s,
                                           recompute=rc)  # fmt: skip
            tm = _stage_times(ctx, b, rc)
            assert (tm.f, tm.i, tm.w) == (f, i, w)
            T = [a + b_ + c for a, b_, c in zip(f, i, w, strict=True)]
            assert (tm.Tk, tm.sumT, tm.fk, tm.ik, tm.wk) == (max(T), sum(T), f[tm.k], i[tm.k], w[tm.k])
            assert T.index(max(T)) == tm.k


def test_v_stage_times_split_each_rank_in_two_chunks_with_the_head_on_rank_0():
    cfg = PlanConfig(gpu=A100, shape=get_model("gpt2"), global_batch=48, pipeline_parallel=3)
    ctx = make_context(cfg)
    costs = layer_costs(ctx, 2)
    f, i, w = pipeline_stage_times(costs.layer, costs.logits_s, split=(2,) * 6, p2p_s=costs.p2p_s)
    tm = _v_stage_times(ctx, 2, "none")
    assert (tm.f, tm.i, tm.w) == (f, i, w)  # per virtual stage, the output layer on stage 5
    assert tm.k == 0 and tm.fk == f[0] + f[5] and tm.ik == i[0] + i[5] and tm.wk == w[0] + w[5]
    assert tm.Tk == pytest.approx(sum(f[s] + i[s] + w[s] for s in (0, 5)))


def test_fast_candidate_is_the_dataclass():
    cfg = PlanConfig(gpu=A100, shape=get_model("gpt2"), global_batch=48, pipeline_parallel=3, data_parallel=2)
    ctx = make_context(cfg)
    c = evaluate(ctx, 2, 12, "1f1b", 1, "selective", 2, 1e15)
    plain = Candidate(**c.to_dict())
    assert c == plain and type(c) is Candidate and c.__dict__ == plain.__dict__
    assert replace(c, zero=3).zero == 3 and Candidate.from_dict(c.to_dict()) == c
    assert _fast_candidate(c.to_dict()) == plain
    with pytest.raises(AttributeError):
        c.zero = 1  # type: ignore[misc]  # still frozen


def test_fsdp_edges_by_hand_and_exposed_whatever_the_compute():
    """Issue 28: ZeRO-3's first gather per micro-step and last reduce-scatter per step are never hidden."""
    from microbatch.predict.collectives import allgather_time_s, fsdp_edges_s, reduce_scatter_time_s

    assert fsdp_edges_s(0.8, 0.4, units=4, microsteps=3) == pytest.approx(
        3 * (0.2 + 0.1)
    )  # each backward waits
    assert fsdp_edges_s(0.8, 0.4, units=0, microsteps=1) == pytest.approx(1.2)
    # a long sequence on 8 GPUs: compute hides the whole gather and reduce-scatter, the edges stay
    from microbatch.predict.dp_comm import data_parallel_comm as _comm

    cfg = PlanConfig(gpu=A100, shape=get_model("gpt2"), global_batch=64, data_parallel=8, seq=1024)
    ctx = make_context(cfg)
    tm = _stage_times(ctx, 2, "none")
    n = 124e6
    wb, gb, _ = ctx.state_bpp
    alpha = 12 * (8.4e-6 + 7 * 3.4e-6)  # one gather (reduce-scatter) per layer, 7 NVLink ring steps each
    ag = allgather_time_s(n * wb, 8, ctx.bw_dp) + alpha
    rs = reduce_scatter_time_s(n * gb, 8, ctx.bw_dp) + alpha
    rs32 = reduce_scatter_time_s(n * 4, 8, ctx.bw_dp) + alpha  # FSDP2 as torchtitan runs it: reduced in fp32
    assert ag < tm.fk and ag + rs32 < tm.ik + tm.wk  # all of it hidden by the old rule
    dp, zero_s, _ = _comm(ctx, 4, 3, tm, n)
    # hidden, but the compute beside each collective runs σ = 0.189 slower: σ·comm/(1 + σ) each
    slowed = 0.189 / 1.189 * (ag + (ag + rs32))
    # FSDP2 (the default) copies each gather out on the compute stream: read + write of n·wb, twice a micro-step;
    # and each reduction's gradients in: read n·wb, write n·4
    rate = A100.memory_bandwidth_bytes_per_s * 0.8
    copy, copy_in = 2 * n * wb / rate, n * (wb + 4) / rate
    edges = (
        4 * (ag + rs32) / 12
    )  # gpt2: 12 layers on the one stage; each micro-step's backward waits on its last
    assert zero_s == pytest.approx(4 * slowed + edges + 4 * (2 * copy + copy_in))
    assert ctx.split == (12,)
    free = make_context(
        replace(cfg, zero3_impl="fsdp1", efficiency=replace(cfg.efficiency, overlap_slowdown=0.0))
    )
    edges16 = 4 * (ag + rs) / 12  # FSDP1 reduces the 16-bit gradients it holds
    assert _comm(free, 4, 3, tm, n)[1] == pytest.approx(edges16)  # σ = 0 and no copies: the edges alone


def test_interleaved_rank_sends_v_times_per_micro_batch():
    """Narayanan et al. 2021 §2.2.2: with v chunks a micro-batch crosses v boundaries on each rank (issue 28:
    pipeline_stage_times' ``virtual`` was written and not wired)."""
    cfg = PlanConfig(gpu=A100, shape=get_model("gpt2"), global_batch=48, pipeline_parallel=3)
    ctx = make_context(cfg)
    p2p = layer_costs(ctx, 2).p2p_s
    assert p2p > 0
    one, two = _stage_times(ctx, 2, "none", 1), _stage_times(ctx, 2, "none", 2)
    for a, b in zip(two.f + two.i, one.f + one.i, strict=True):
        assert a - b == pytest.approx(p2p)
    assert two.w == one.w
    c = evaluate(ctx, 2, 24, "interleaved-1f1b", 2, "none", 0, 1e15)
    assert c.time["pipeline_s"] == pytest.approx(24 * two.Tk + 2 * two.Tk / 2)


def test_ring_latency_grows_with_the_group_by_nccls_model():
    """NCCL's tuning model (ring, Simple): 8.4 µs + 3.4 µs per NVLink step + 9.6 µs per inter-node step."""
    from microbatch.predict.collectives import ring_latency_s

    assert ring_latency_s(1, 1) == 0.0
    assert ring_latency_s(8, 1) == pytest.approx(8.4e-6 + 7 * 3.4e-6)
    # 512 ranks one per node (t = 8): 511 inter-node steps
    assert ring_latency_s(512, 512) == pytest.approx(8.4e-6 + 511 * 9.6e-6)
    # 64 ranks on 8 nodes: 56 NVLink steps and 7 inter-node ones; an all-reduce twice the steps
    assert ring_latency_s(64, 8) == pytest.approx(8.4e-6 + 56 * 3.4e-6 + 7 * 9.6e-6)
    assert ring_latency_s(64, 8, allreduce=True) == pytest.approx(8.4e-6 + 112 * 3.4e-6 + 14 * 9.6e-6)
    # FSDP over 128 and 512 ranks of one model: the exposed ZeRO-3 time grows with the width
    times = []
    for d in (128, 512):
        cfg = PlanConfig(gpu=A100, shape=get_model("llama-2-7b"), global_batch=d, data_parallel=d, zero=(3,),
                         micro_batches=(1,), recompute=("full",))  # fmt: skip
        times.append(make_plan_fastest(cfg).time["zero_comm_s"])
    # the exposed edges (one gather, one reduce-scatter per step at m = 1) carry one α each: on 16 and 64 nodes of 8
    d_alpha = ring_latency_s(512, 64) - ring_latency_s(128, 16)
    assert d_alpha == pytest.approx((448 - 112) * 3.4e-6 + (63 - 15) * 9.6e-6)
    # and the compute beside the gathers and reduce-scatters (32 layers: each collective 32 α longer; forward
    # gather, backward gather + reduce-scatter) runs σ = 0.189 slower for σ/(1 + σ) of their growth
    grow = 2 * d_alpha + 0.189 / 1.189 * 3 * 32 * d_alpha
    assert times[1] - times[0] == pytest.approx(grow, rel=0.05)  # the bandwidth terms barely move
    assert times[1] - times[0] > 5 * 2 * d_alpha  # the slowed compute, not the edges, carries the growth


def make_plan_fastest(cfg: PlanConfig) -> Candidate:
    plan = make_plan(replace(cfg, choose="fastest", memory_headroom=0.0))
    return plan.fastest or plan.candidates[0]


def test_optimizer_update_at_the_measured_eager_rate_unless_fused():
    """Issue 28: an eager AdamW's kernels move 80 B per parameter under bf16-mixed (torch's foreach passes over fp32
    parameters and gradients: 4 × 4 B, 2 × 4 B, the moments and temporaries 14 × 4 B) at 0.751 of the bandwidth (H200
    measured), a fused one reads and writes each once at ``memory`` (the gradient clip off:
    tests/predict/test_optimizer_state.py prices it)."""
    from microbatch.predict.dp_comm import data_parallel_comm as _comm

    cfg = PlanConfig(gpu=A100, shape=get_model("gpt2"), global_batch=8, grad_clip=False)
    ctx = make_context(cfg)
    tm = _stage_times(ctx, 1, "none")
    wb, gb, ob = ctx.state_bpp
    n = 124e6
    _, _, opt = _comm(ctx, 8, 0, tm, n)
    assert (wb, gb, ob) == (2, 2, 12)
    assert opt == pytest.approx((4 * 4 + 2 * 4 + 14 * 4) * n / (2039e9 * 0.751))
    fused = replace(cfg, efficiency=replace(cfg.efficiency, fused_elementwise=True))
    _, _, opt_fused = _comm(make_context(fused), 8, 0, tm, n)
    assert opt_fused == pytest.approx(2 * (wb + gb + ob) * n / (2039e9 * 0.8))


def test_communication_cache_keeps_v_apart():
    """The data-parallel overlap reads the stage times, which carry v sends per chunk: a context that evaluated
    interleaved v = 2 first gives 1F1B's communication as a fresh context does (found in review, 2026-12-04:
    the cache key left v out, so the first schedule evaluated decided the other's)."""
    slow = A100.with_overrides(inter_node_bytes_per_s=2e9)  # the reduction outlasts the backward it overlaps
    cfg = PlanConfig(gpu=slow, shape=get_model("llama-2-7b"), global_batch=256, data_parallel=64,
                     pipeline_parallel=4, zero=(0,))  # fmt: skip
    flops = model_flops_per_step(cfg.shape, cfg.global_batch, cfg.seq)
    shared = make_context(cfg)
    inter = evaluate(shared, 1, 4, "interleaved-1f1b", 2, "none", 0, flops)
    after = evaluate(shared, 1, 4, "1f1b", 1, "none", 0, flops)
    fresh = evaluate(make_context(cfg), 1, 4, "1f1b", 1, "none", 0, flops)
    assert after.to_dict()["time"] == fresh.to_dict()["time"]
    assert inter.to_dict()["time"]["dp_comm_s"] != fresh.to_dict()["time"]["dp_comm_s"]


def test_the_zero_stages_of_one_screen_equal_each_evaluated_alone():
    """evaluate_zeros shares the stage times, pipeline time and activations over the ZeRO stages: each of its
    candidates equals the one evaluated alone in a fresh context."""
    cfg = PlanConfig(gpu=A100, simulate_top=0, **CONFIGS[0])
    mf = model_flops_per_step(cfg.shape, cfg.global_batch, cfg.seq)
    for b, m, sched, v, rc, _ in _keys(cfg)[::4]:
        got = evaluate_zeros(make_context(cfg), b, m, sched, v, rc, (3, 0, 2, 1), mf)
        assert [c.zero for c in got] == [3, 0, 2, 1]
        assert got == [evaluate(make_context(cfg), b, m, sched, v, rc, z, mf) for z in (3, 0, 2, 1)]


def test_a_context_like_another_of_the_layout_search_shares_only_what_reads_neither_p_nor_d():
    """make_context(cfg, like): the per-b_m forward and activation caches are shared where the configurations
    differ in p and d alone (a layout search's neighbours), and each candidate still equals a fresh context's;
    another t (or a layer split) shares nothing."""
    from microbatch.predict.plan_context import activations

    mix = get_model("mixtral-8x7b")  # three dense first blocks: the caches hold a dense block's entries too
    for shape in (get_model("llama-2-7b"), replace(mix, moe=replace(mix.moe, dense_layers=3))):
        base = dict(shape=shape, gpu=A100, global_batch=64, simulate_top=0, seq=2048)
        first = make_context(PlanConfig(**base, pipeline_parallel=2, data_parallel=4))
        mf = model_flops_per_step(shape, 64, 2048)
        for b in (1, 2):
            for rc in ("none", "selective", "full"):
                layer_costs(first, b), activations(first, b, rc)
        assert len(first.forward_cache) == 2 and len(first.act_cache) == 6
        nxt_cfg = PlanConfig(**base, pipeline_parallel=4, data_parallel=2)
        nxt = make_context(nxt_cfg, first)
        assert nxt.forward_cache is first.forward_cache and nxt.act_cache is first.act_cache
        for key in _keys(nxt_cfg)[::5]:
            assert evaluate(nxt, *key, mf) == evaluate(make_context(nxt_cfg), *key, mf), key
    base = dict(shape=get_model("llama-2-7b"), gpu=A100, global_batch=64, simulate_top=0)
    first = make_context(PlanConfig(**base, pipeline_parallel=2, data_parallel=4))
    other_t = make_context(PlanConfig(**base, pipeline_parallel=2, data_parallel=2, tensor_parallel=2), first)
    split = make_context(
        PlanConfig(**base, pipeline_parallel=2, data_parallel=4, layers_per_stage=(15, 17)), first
    )
    assert other_t.forward_cache is not first.forward_cache and not other_t.forward_cache
    assert split.act_cache is not first.act_cache


def test_the_layout_search_finds_the_best_of_every_layouts_candidates():
    """search_layouts builds a Candidate for each new best only: its best, and its counts, are those of
    every layout's whole enumeration."""
    shape, n, B = get_model("llama-2-7b"), 16, 64
    every = []
    for t in (1, 2, 4):
        for p in (x for x in range(1, 17) if (n // t) % x == 0):
            d = n // (t * p)
            if B % d:
                continue
            every += _enumerate(PlanConfig(shape=shape, gpu=A100, global_batch=B, data_parallel=d,
                                           pipeline_parallel=p, tensor_parallel=t, simulate_top=0))  # fmt: skip
    fits = [c for c in every if c.fits]
    best, evaluated, feasible = search_layouts(
        shape, A100, global_batch=B, num_gpus=n, tensor_parallel=(1, 2, 4)
    )
    assert (evaluated, feasible) == (len(every), len(fits)) and 100 < len(fits) < len(every)
    assert best == min(fits, key=lambda c: c.step_time_s)
