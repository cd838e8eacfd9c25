"""Interleaved 1F1B over stages of uneven layers (issue 28 item 4: the 126-layer 405B runs as they ran).

A rank's work is spread evenly over its v chunks (as the simulator already replays an interleaved candidate);
v may be any number that leaves each chunk a layer. V schedules (DualPipeV) still need an even split."""

from __future__ import annotations

from dataclasses import replace

import pytest

from microbatch.errors import ConfigError
from microbatch.hardware import get_accelerator
from microbatch.model import ModelShape
from microbatch.predict.candidate import _stage_times, evaluate, make_context
from microbatch.predict.memory import MemoryConfig, estimate_memory
from microbatch.predict.plan import PlanConfig, make_plan
from microbatch.predict.roofline import model_flops_per_step
from microbatch.schedules.in_flight import in_flight_chunks
from microbatch.schedules.virtual import virtual_options

H100 = get_accelerator("h100-sxm")
SHAPE = ModelShape(name="x-30", layers=30, hidden=1024, heads=16, vocab=32000, seq=2048)
SPLIT = (7, 8, 8, 7)  # 30 layers on 4 stages, one fewer on the first and the last


def _cfg(**kw: object) -> PlanConfig:
    base = dict(shape=SHAPE, gpu=H100, global_batch=16, pipeline_parallel=4, micro_batches=(1,), recompute=("none",),
                zero=(0,), layers_per_stage=SPLIT, schedules=("interleaved-1f1b",), memory_headroom=0.0,
                choose="fastest")  # fmt: skip
    return PlanConfig(**{**base, **kw})  # type: ignore[arg-type]


def test_v_options_on_uneven_stages_leave_each_chunk_a_layer():
    assert virtual_options("interleaved-1f1b", 30, 4, (), SPLIT) == [2, 3, 4, 5, 6, 7]
    assert virtual_options("interleaved-1f1b", 30, 4, (3,), SPLIT) == [3]
    assert virtual_options("interleaved-1f1b", 32, 4) == [2, 4, 8]  # even: p·v divides the layers, as before


def test_the_closed_form_on_uneven_stages_by_hand():
    cfg = _cfg(virtuals=(2,))
    plan = make_plan(replace(cfg, simulate_top=0))
    c = next(c for c in plan.candidates if c.schedule == "interleaved-1f1b" and c.virtual == 2)
    tm = _stage_times(make_context(cfg), 1, "none", 2)
    # the bottleneck rank is one of the 8-layer middle ranks or the last (output layer); m = 16
    assert tm.Tk == pytest.approx(max(f + i + w for f, i, w in zip(tm.f, tm.i, tm.w, strict=True)))
    e = evaluate(make_context(cfg), 1, 16, "interleaved-1f1b", 2, "none", 0, model_flops_per_step(SHAPE, 16))
    assert e.time["pipeline_s"] == pytest.approx(16 * tm.Tk + 3 * tm.Tk / 2)  # the closed form
    # an uneven plan replays every candidate in the simulator (each rank's work over its v chunks): the
    # replay differs from the closed form by the uneven ranks' slack, a few per cent here
    assert c.simulated and c.time["pipeline_s"] == pytest.approx(e.time["pipeline_s"], rel=0.05)


def test_memory_holds_in_flight_chunks_of_each_ranks_own_layers():
    cfg = MemoryConfig(micro_batch=1, pipeline_parallel=4, schedule="interleaved-1f1b", virtual=2,
                       layers_per_stage=SPLIT, microbatches=16)  # fmt: skip
    est = estimate_memory(SHAPE, cfg)
    per_layer = est.stages[1].activations_bytes  # a middle rank: 8 layers, no embedding or output layer
    chunks1 = in_flight_chunks("interleaved-1f1b", 1, 4, 16, 2)
    chunks2 = in_flight_chunks("interleaved-1f1b", 2, 4, 16, 2)
    # ranks 1 and 2 hold 8 layers each: activations in proportion to in-flight chunks × 8/2 layers
    assert est.stages[2].activations_bytes / per_layer == pytest.approx(chunks2 / chunks1)
    assert est.stages[1].layers == 8 and est.stages[0].layers == 7


def test_a_chunk_without_a_layer_and_a_v_schedule_on_uneven_stages_are_refused():
    with pytest.raises(
        ConfigError, match=r"virtual 8: .* leaves a chunk without a layer .* at most the fewest"
    ):
        _cfg(virtuals=(8,))
    with pytest.raises(ConfigError, match="leaves a chunk without a layer; use virtual at most 7"):
        estimate_memory(SHAPE, MemoryConfig(micro_batch=1, pipeline_parallel=4, schedule="interleaved-1f1b",
                                            virtual=8, layers_per_stage=SPLIT, microbatches=16))  # fmt: skip
    with pytest.raises(ConfigError, match="even split"):
        make_plan(_cfg(schedules=("dualpipev",)))


def test_the_planner_may_now_choose_interleaving_on_uneven_stages():
    plan = make_plan(_cfg(schedules=None))
    kinds = {(c.schedule, c.virtual) for c in plan.candidates}
    assert ("interleaved-1f1b", 2) in kinds and ("1f1b", 1) in kinds
    inter = min((c for c in plan.candidates if c.schedule == "interleaved-1f1b"), key=lambda c: c.step_time_s)
    plain = min((c for c in plan.candidates if c.schedule == "1f1b"), key=lambda c: c.step_time_s)
    assert inter.bubble_fraction < plain.bubble_fraction
