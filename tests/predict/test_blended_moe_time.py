"""A mixture-of-experts model whose blocks are not all MoE blocks (DeepSeek-V3's three dense first blocks, Llama 4's
dense block between two MoE blocks) is timed block by block: each dense block at the dense MLP's cost (no router,
permutation or all-to-all), each MoE block at its own; before, every block was timed as a MoE block."""

from __future__ import annotations

from dataclasses import replace

import pytest

from microbatch.hardware import get_accelerator
from microbatch.model import get_model
from microbatch.predict.candidate import _stage_times, _v_stage_times, layer_costs, make_context
from microbatch.predict.plan import PlanConfig
from microbatch.predict.roofline import layer_forward, logits_forward
from microbatch.predict.steptime import (
    layer_pass_times,
    pipeline_stage_times,
    predict_step_time_s,
    stage_time,
)

H100 = get_accelerator("h100-sxm")
MIXTRAL = get_model("mixtral-8x7b")
EVERY_OTHER = replace(MIXTRAL, moe=replace(MIXTRAL.moe, moe_every=2))  # Llama 4's interleave step 2
DENSE_FIRST = replace(
    MIXTRAL, layers=12, moe=replace(MIXTRAL.moe, dense_layers=3)
)  # DeepSeek-V3's pattern, short


def test_a_stage_is_its_moe_blocks_at_the_moe_time_and_its_dense_blocks_at_the_dense_time():
    moe = layer_forward(MIXTRAL, 2, H100, seq=4096, moe_layout=(4, 1.0))
    dense = layer_forward(MIXTRAL.dense_block(), 2, H100, seq=4096)
    assert dense.total_s < moe.total_s and dense.ep_comm_s == 0 < moe.ep_comm_s
    f, i, w = pipeline_stage_times(moe, 0.01, split=(5, 4, 3), p2p_s=0.002, dense=dense, moe_split=(2, 4, 0))
    fm, im, wm = layer_pass_times(moe)
    fd, id_, wd = layer_pass_times(dense)
    assert f == pytest.approx([2 * fm + 3 * fd + 0.002, 4 * fm + 0.002, 3 * fd + 0.01 + 0.002])
    assert i == pytest.approx([2 * im + 3 * id_ + 0.002, 4 * im + 0.002, 3 * id_ + 0.01 + 0.002])
    assert w == pytest.approx([2 * wm + 3 * wd, 4 * wm, 3 * wd + 0.01])
    # every block a MoE block: the rule as it was
    assert pipeline_stage_times(moe, 0.01, split=(5,), dense=dense, moe_split=(5,)) == pipeline_stage_times(
        moe, 0.01, split=(5,)
    )
    with pytest.raises(ValueError, match="together") as e:  # one without the other: refused, not ignored
        pipeline_stage_times(moe, 0.01, split=(5,), dense=dense)
    assert "moe_split" in str(e.value)


def test_one_device_step_counts_each_block_at_its_kind():
    shape = get_model("deepseek-v3")
    assert shape.moe_layer_count(0, shape.layers) == shape.layers - 3
    lt = layer_forward(shape, 1, H100, seq=4096)
    dense = layer_forward(shape.dense_block(), 1, H100, seq=4096)
    logits, _ = logits_forward(shape, 1, H100, seq=4096)
    by_hand = 58 * sum(layer_pass_times(lt)) + 3 * sum(layer_pass_times(dense)) + 3 * logits
    assert predict_step_time_s(shape, 1, H100, seq=4096) == pytest.approx(by_hand)
    all_moe = stage_time(lt, logits, layers=61, last=True).total_s
    assert predict_step_time_s(shape, 1, H100, seq=4096) < all_moe  # the dense blocks cost less here
    # a model whose every block has the experts: unchanged
    assert predict_step_time_s(MIXTRAL, 1, H100, seq=4096) == pytest.approx(
        stage_time(
            layer_forward(MIXTRAL, 1, H100, seq=4096),
            logits_forward(MIXTRAL, 1, H100, seq=4096)[0],
            layers=32,
            last=True,
        ).total_s  # fmt: skip
    )


def test_the_planner_times_each_stage_by_its_own_blocks():
    """Llama 4's pattern (every other block MoE) on p = 4 and DeepSeek-V3's (three dense first blocks) on p = 8:
    each stage's F, I, W are its MoE blocks' and its dense blocks' (moe_layer_count), the bottleneck the stage
    with the most MoE time."""
    for shape, p in ((EVERY_OTHER, 4), (get_model("deepseek-v3"), 8)):
        cfg = PlanConfig(
            shape=shape, gpu=H100, global_batch=64, pipeline_parallel=p, expert_parallel=1, seq=4096
        )
        ctx = make_context(cfg)
        costs = layer_costs(ctx, 1)
        assert costs.dense is not None and ctx.moe_split is not None
        firsts = [sum(ctx.split[:s]) for s in range(p)]
        ks = tuple(shape.moe_layer_count(firsts[s], ctx.split[s]) for s in range(p))
        assert ctx.moe_split == ks and ctx.moe_layers == sum(ks) < shape.layers
        fm, im, wm = layer_pass_times(costs.layer)
        fd, id_, wd = layer_pass_times(costs.dense)
        tm = _stage_times(ctx, 1, "none")
        for s, (n, k) in enumerate(zip(ctx.split, ks, strict=True)):
            head = costs.logits_s if s == p - 1 else 0.0
            assert tm.f[s] == pytest.approx(k * fm + (n - k) * fd + head + costs.p2p_s)
            assert tm.w[s] == pytest.approx(k * wm + (n - k) * wd + head)
        T = [a + b + c for a, b, c in zip(tm.f, tm.i, tm.w, strict=True)]
        assert tm.k == T.index(max(T))
    # a dense model and an all-MoE model keep one kind of block
    for shape in (get_model("llama-2-7b"), MIXTRAL):
        ctx = make_context(PlanConfig(shape=shape, gpu=H100, global_batch=64, pipeline_parallel=4))
        assert ctx.moe_split is None and layer_costs(ctx, 1).dense is None


def test_dualpipev_chunks_count_their_own_moe_blocks():
    """12 blocks, the first three dense, p = 3 under DualPipeV: six chunks of two blocks in order, chunk s on rank s
    (s < 3) or 5 − s, so the chunks hold 0, 1, 2, 2, 2, 2 MoE blocks (chunk 0 on rank 0, chunk 1 on rank 1)."""
    cfg = PlanConfig(shape=DENSE_FIRST, gpu=H100, global_batch=64, pipeline_parallel=3, seq=4096)
    ctx = make_context(cfg)
    costs = layer_costs(ctx, 1)
    tm = _v_stage_times(ctx, 1, "none")
    (fm, im, wm), (fd, id_, wd) = layer_pass_times(costs.layer), layer_pass_times(costs.dense)
    moe = [0, 1, 2, 2, 2, 2]
    head = [0.0] * 5 + [costs.logits_s]
    assert tm.f == pytest.approx(
        [k * fm + (2 - k) * fd + costs.p2p_s + h for k, h in zip(moe, head, strict=True)]
    )
    assert tm.i == pytest.approx(
        [k * im + (2 - k) * id_ + costs.p2p_s + h for k, h in zip(moe, head, strict=True)]
    )
    assert tm.w == pytest.approx([k * wm + (2 - k) * wd + h for k, h in zip(moe, head, strict=True)])
    # rank r holds chunks r and 5 − r: rank 0 the dense chunk 0 and the head's chunk 5, rank 2 chunks 2 and 3
    T = [tm.f[r] + tm.f[5 - r] + tm.i[r] + tm.i[5 - r] + tm.w[r] + tm.w[5 - r] for r in range(3)]
    assert tm.k == max(range(3), key=T.__getitem__) and tm.Tk == pytest.approx(max(T))


def test_interleaving_places_the_dense_blocks_as_the_loop_placement_does():
    """p = 2, v = 3 over 12 blocks (three dense first): six chunks of two, chunk s on rank s mod 2, so rank 0 holds
    chunks 0, 2, 4 (blocks 0-1, 4-5, 8-9: 4 MoE) and rank 1 chunks 1, 3, 5 (blocks 2-3, 6-7, 10-11: 5 MoE); without
    interleaving rank 0 holds blocks 0-5 (3 MoE) and rank 1 blocks 6-11 (6 MoE)."""
    from microbatch.predict.stages import rank_moe_blocks

    assert rank_moe_blocks(DENSE_FIRST, (6, 6), 3) == (4, 5)
    assert rank_moe_blocks(DENSE_FIRST, (6, 6)) == (3, 6)
    assert rank_moe_blocks(DENSE_FIRST, (4, 4, 4), 2, "v") == (2, 3, 4)
    # v = 4 over 6 layers a rank: chunks of 2, 2, 1, 1; virtual stages 0…7 hold blocks 0-1, 2-3, 4-5, 6-7, 8, 9,
    # 10, 11 and alternate ranks: rank 0 blocks 0, 1, 4, 5, 8, 10 (4 MoE), rank 1 blocks 2, 3, 6, 7, 9, 11 (5 MoE)
    assert rank_moe_blocks(DENSE_FIRST, (6, 6), 4) == (4, 5)
    # an uneven split: rank 0's 5 layers in chunks of 3 and 2, rank 1's 7 in 4 and 3; in order of the virtual stages
    # rank 0 holds blocks 0-2 and 7-8 (2 MoE), rank 1 blocks 3-6 and 9-11 (7 MoE)
    assert rank_moe_blocks(DENSE_FIRST, (5, 7), 2) == (2, 7)
    for shape in (DENSE_FIRST, EVERY_OTHER, get_model("deepseek-v3")):  # every block placed once
        L = shape.layers
        for p in (2, 3, 4, 5):
            split = (L // p,) * (p - 1) + (L - L // p * (p - 1),)  # the last holds the rest
            for v in range(1, min(split) + 1):
                got = rank_moe_blocks(shape, split, v)
                assert sum(got) == shape.moe_layer_count(0, L), (shape.name, split, v)
    cfg = PlanConfig(shape=DENSE_FIRST, gpu=H100, global_batch=64, pipeline_parallel=2, seq=4096)
    ctx = make_context(cfg)
    costs = layer_costs(ctx, 1)
    (fm, im, wm), (fd, id_, wd) = layer_pass_times(costs.layer), layer_pass_times(costs.dense)
    for v, moe in ((1, (3, 6)), (3, (4, 5))):
        tm = _stage_times(ctx, 1, "none", v)
        for r, k in enumerate(moe):
            head = costs.logits_s if r == 1 else 0.0
            assert tm.f[r] == pytest.approx(k * fm + (6 - k) * fd + head + v * costs.p2p_s)
            assert tm.i[r] == pytest.approx(k * im + (6 - k) * id_ + head + v * costs.p2p_s)
            assert tm.w[r] == pytest.approx(k * wm + (6 - k) * wd + head)


def test_a_stages_activations_are_its_blocks_each_at_its_kind_in_the_memory_model_and_the_planner():
    """A dense block keeps no router, permutation or expert buffers: a rank of k MoE and n − k dense blocks keeps
    k MoE blocks' activations and n − k dense blocks' (the placement's blocks: consecutive, interleaved chunks, or a
    V), in estimate_memory and in the planner's screening alike."""
    from microbatch.predict.activations import layer_activation_bytes
    from microbatch.predict.memory import MemoryConfig, estimate_memory
    from microbatch.predict.plan import make_plan

    shape = DENSE_FIRST.with_seq(2048)
    moe = layer_activation_bytes(shape, 2, seq=2048)
    dense = layer_activation_bytes(replace(shape, moe=None), 2, seq=2048)
    assert dense < 0.7 * moe  # Mixtral's block: the routed copies and expert buffers
    cases = (  # schedule, p, v, MoE blocks per rank, layer-micro-batches per rank layer at m = 8
        ("1f1b", 2, 1, (3, 6), (2, 1)),  # 1F1B holds p − i micro-batches
        ("gpipe", 2, 1, (3, 6), (8, 8)),
        ("interleaved-1f1b", 2, 3, (4, 5), None),
        ("dualpipev", 3, 2, (2, 3, 4), None),
    )
    for sched, p, v, ks, held in cases:
        cfg = MemoryConfig(micro_batch=2, pipeline_parallel=p, microbatches=8, schedule=sched, virtual=v)
        est = estimate_memory(shape, cfg)
        for st in est.stages:
            n, k = st.layers, ks[st.stage]
            mean = (k * moe + (n - k) * dense) / n
            if held is not None:
                assert st.activation_terms["layers"] == pytest.approx(mean * n * held[st.stage]), (
                    sched,
                    st.stage,
                )
            else:  # the schedule's layer-micro-batches, at the rank's own mix of blocks
                assert st.activation_terms["layers"] / mean == pytest.approx(
                    estimate_memory(shape.dense_block(), cfg).stages[st.stage].activation_terms[
                        "layers"] / dense
                )  # fmt: skip
    for p in (2, 3):
        plan = make_plan(PlanConfig(shape=shape, gpu=H100, global_batch=48, pipeline_parallel=p, data_parallel=2,
                                    simulate_top=0))  # fmt: skip
        assert {c.schedule for c in plan.candidates} >= {"1f1b", "interleaved-1f1b"}
        for c in plan.candidates[::3]:
            got = estimate_memory(shape, MemoryConfig(
                micro_batch=c.micro_batch, pipeline_parallel=p, virtual=c.virtual, microbatches=c.microbatches,
                schedule=c.schedule, data_parallel=2, zero=c.zero, recompute=c.recompute,
            ))  # fmt: skip
            assert c.peak_memory_bytes == pytest.approx(got.peak_bytes, rel=1e-9), c


def test_a_ranks_weights_and_state_are_its_placed_blocks():
    """DualPipeV at p = 3 over the 12-block, 3-dense model puts 2, 3, 4 MoE blocks on ranks 0, 1, 2 (consecutive
    blocks would be 1, 4, 4): each rank's parameters, and so its weights and optimizer state, count those blocks, in
    estimate_memory and in the planner alike."""
    from microbatch.predict.memory import MemoryConfig, estimate_memory
    from microbatch.predict.plan_context import param_tables

    shape = DENSE_FIRST.with_seq(2048)
    moe_block, dense_block = shape.layer_params(), shape.layer_params(-1)
    assert moe_block > 6 * dense_block  # eight experts against one MLP
    est = estimate_memory(
        shape,
        MemoryConfig(micro_batch=1, pipeline_parallel=3, microbatches=6, schedule="dualpipev", virtual=2),
    )
    emb, head = shape.embedding_params(), shape.output_params()
    for st, k, extra in zip(
        est.stages, (2, 3, 4), (emb + head, 0, 0), strict=True
    ):  # V: embedding and head on 0
        assert st.params == pytest.approx(k * moe_block + (4 - k) * dense_block + extra)
    loop = estimate_memory(
        shape, MemoryConfig(micro_batch=1, pipeline_parallel=3, microbatches=6, schedule="1f1b")
    )
    assert [s.params for s in loop.stages] == pytest.approx(
        [1 * moe_block + 3 * dense_block + emb, 4 * moe_block, 4 * moe_block + head]
    )
    ctx = make_context(PlanConfig(shape=shape, gpu=H100, global_batch=48, pipeline_parallel=3, seq=2048))
    v_tables = param_tables(ctx, 2, True)
    assert [v_tables.params_v[i] for i in range(3)] == pytest.approx([s.params for s in est.stages])
    assert [param_tables(ctx, 1, False).params[i] for i in range(3)] == pytest.approx(
        [s.params for s in loop.stages]
    )
    assert v_tables.max_experts == pytest.approx(4 * shape.moe.routed_params(shape.hidden, 3))
