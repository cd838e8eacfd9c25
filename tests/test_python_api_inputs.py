"""The public Python API on the inputs library users give it, right and wrong (the API sweep of 2026-12-06).

Each case was a defect: a hang, a value silently taken as another, a raw error from deep inside, or a message that
named the wrong thing. Every refusal is a ConfigError naming the parameter; NumPy and torch scalars work as ints.
"""

from __future__ import annotations

import json
import math
import time

import numpy as np
import pytest

import microbatch as mb
from microbatch.errors import ConfigError, as_tuple, plain_numbers
from microbatch.hardware import get_accelerator
from microbatch.model import get_model

torch = pytest.importorskip("torch")

GPT2, H100 = get_model("gpt2"), get_accelerator("h100-sxm")


def named(fn, *args, match: str, **kwargs) -> bool:
    """``fn`` refused (:func:`refused`) with a message that names a parameter the command line can rewrite."""
    e = refused(fn, *args, match=match, **kwargs)
    return bool(e.params)


def refused(fn, *args, match: str, **kwargs) -> ConfigError:
    with pytest.raises(ConfigError, match=match) as e:
        fn(*args, **kwargs)
    return e.value


# -- numbers of other kinds, one value where a tuple belongs, caps ------------------------------------------


def test_numpy_and_torch_scalars_become_python_numbers_and_results_write_json():
    cfg = mb.solve(global_batch=np.int64(64), micro_batch=np.int64(8))
    assert type(cfg.global_batch) is int and cfg.grad_accum == 8
    json.dumps(cfg.to_dict())
    plan = mb.plan(
        mb.PlanConfig(shape=GPT2, gpu=H100, global_batch=np.int64(64), data_parallel=torch.tensor(2))
    )
    json.dumps(plan.to_dict())
    shape = mb.ModelShape(name="x", layers=np.int64(2), hidden=64, heads=4, vocab=100, seq=np.int32(32))
    assert type(shape.layers) is int and shape.param_count() > 0
    pt = mb.CurvePoint(micro_batch=np.int64(4), throughput=np.float32(10.5), oom=np.bool_(False))
    assert (type(pt.micro_batch), type(pt.throughput), type(pt.oom)) == (int, float, bool)


def test_plain_numbers_leaves_other_values_alone():
    class Holder:
        pass

    h = Holder()
    arr, text = np.array([1, 2]), "8"
    h.__dict__.update(a=arr, b=text, c=(np.int64(3), 4), d=None)
    plain_numbers(h)
    assert h.a is arr and h.b == "8" and h.c == (3, 4) and type(h.c[0]) is int and h.d is None


def test_a_numpy_width_past_the_cap_is_refused_not_overflowed():
    assert named(
        mb.ModelShape, name="x", layers=2, hidden=np.int64(2**40), heads=4, vocab=100, seq=32, match="hidden"
    )


def test_one_choice_given_alone_is_a_tuple_of_it():
    assert as_tuple("schedules", "1f1b") == ("1f1b",) and as_tuple("micro_batches", 8) == (8,)
    assert as_tuple("zero", [0, 1]) == (0, 1) and as_tuple("zero", None) is None
    cfg = mb.PlanConfig(
        shape=GPT2, gpu=H100, global_batch=64, schedules="1f1b", recompute="full", micro_batches=8
    )
    assert (cfg.schedules, cfg.recompute, cfg.micro_batches) == (("1f1b",), ("full",), (8,))
    assert mb.plan(cfg).recommended.micro_batch == 8
    refused(as_tuple, "zero", object(), match="zero must be a tuple")


@pytest.mark.timeout(20)
def test_a_global_batch_past_any_run_is_refused_at_once_not_after_a_divisor_search():
    start = time.perf_counter()
    e = refused(
        mb.solve,
        global_batch=10**18 + 1,
        micro_batch=7,
        match=r"global_batch .* is over the limit of 1,000,000,000",
    )
    refused(
        mb.PlanConfig, shape=GPT2, gpu=H100, global_batch=10**18 + 1, data_parallel=4, match="global_batch"
    )
    refused(mb.PipelineConfig, global_batch=10**18, match="global_batch")
    refused(
        mb.solve, micro_batch=2**20, grad_accum=2**20, data_parallel=2**20, match=r"B_global = b_m × g × d = "
    )
    assert e.params == ("global_batch",) and time.perf_counter() - start < 5


# -- objects of the wrong kind -------------------------------------------------------------------------------


def test_a_name_where_a_config_object_belongs_is_refused_with_the_function_that_makes_one():
    assert named(
        mb.PlanConfig, shape="gpt2", gpu=H100, global_batch=8, match=r"shape must be a ModelShape.*get_model"
    )
    assert named(
        mb.PlanConfig,
        shape=GPT2,
        gpu="h100",
        global_batch=8,
        match=r"gpu must be an Accelerator.*get_accelerator",
    )
    assert named(
        mb.PlanConfig, shape=GPT2, gpu=H100, global_batch=8, memory_headroom="0.1", match="memory_headroom"
    )
    cfg = mb.MemoryConfig(micro_batch=2)
    assert named(
        mb.estimate_memory, "gpt2", cfg, match=r"shape must be a ModelShape.*get_model\(.*from_hf_config"
    )
    assert named(mb.estimate_memory, cfg, GPT2, match="shape must be a ModelShape")
    assert named(
        mb.estimate_memory, GPT2, cfg, {"fixed_bytes": 1}, match="calibration must be a MemoryCalibration"
    )
    pts = [mb.CurvePoint(micro_batch=1, throughput=1.0)]
    assert named(mb.recommend, pts, {"tolerance": 0.1}, match="choice must be a ChoiceConfig")
    assert named(mb.recommend, [{"micro_batch": 1, "throughput": 1.0}], match=r"CurvePoint\(\*\*d\)")
    assert named(mb.recommend, None, match="points must be a list of CurvePoint")


def test_tune_refuses_a_name_a_dict_config_and_a_gpu_this_machine_lacks():
    model = torch.nn.Linear(4, 1)
    batch = lambda b: torch.randn(b, 4)  # noqa: E731
    assert named(mb.tune, "gpt2", batch, match=r"model must be an nn.Module.*tune_model\('gpt2'\)")
    assert named(mb.tune, model, batch, probe={"threads": 1}, match="probe must be a ProbeConfig")
    assert named(mb.tune, model, batch, device="cuda:x", match="'cuda:x' is not a torch device")
    if not torch.cuda.is_available():
        assert named(mb.tune, model, batch, device="cuda", match="no CUDA GPU is available")


def test_accumulate_refuses_a_number_for_noise():
    model = torch.nn.Linear(4, 1)
    x = torch.randn(8, 4)
    loss = lambda m, b: (m(b).sum(), b.shape[0])  # noqa: E731
    assert named(
        mb.accumulate,
        model,
        x,
        loss,
        micro_batch_size=4,
        noise=0.95,
        match="noise must be a GradientNoiseScale",
    )


# -- numbers that are no numbers -----------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["memory_bytes", "gpus_per_node"])
@pytest.mark.parametrize("value", [True, "80e9"])
def test_accelerator_refuses_a_bool_or_a_string_for_a_figure(field, value):
    from dataclasses import replace

    e = refused(replace, H100, **{field: value}, match=field)
    assert repr(value) in str(e) and "h100-sxm" in str(e)  # the value and the accelerator it was given for


@pytest.mark.parametrize("value", [2.5, True, 0, -4, "8"])
def test_max_positions_is_checked_like_the_other_sizes(value):
    assert named(mb.ModelShape, name="x", layers=2, hidden=64, heads=4, vocab=100, seq=32, max_positions=value,
            match="max_positions")  # fmt: skip


@pytest.mark.parametrize(
    "field, value",
    [("step_time_s", math.nan), ("step_time_s", -5.0), ("throughput_se", "x"), ("oom", "no"), ("oom", 1)],
)
def test_curve_point_checks_every_field(field, value):
    assert named(mb.CurvePoint, micro_batch=2, throughput=1.0, **{field: value}, match=field)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"warmup": 2.5}, "warmup must be a whole number"),
        ({"warmup": "2"}, "warmup must be a whole number"),
        ({"min_repeats": 1.5}, "min_repeats must be a whole number"),
        ({"warmup": True}, "warmup must be a whole number"),
        ({"max_time_s": "5"}, "max_time_s must be a number"),
    ],
)
def test_timing_config_refuses_counts_that_are_not_whole(kwargs, match):
    assert named(mb.TimingConfig, **kwargs, match=match)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"lr": math.nan}, "lr must be a finite number > 0"),
        ({"lr": -1}, "lr must be a finite number > 0"),
        ({"lr": "1e-3"}, "lr must be a number"),
        ({"seed": 2.5}, "seed must be a whole number"),
        ({"timeout_s": True}, "timeout_s must be a number"),
        ({"timeout_s": "60"}, "timeout_s must be a number"),
        (
            {"timeout_s": 0},
            r"give timeout_s 10 s or more \(the command's default is 300, the library's 120\)",
        ),
        ({"stages": "2"}, "stages '2' is not a pipeline"),
    ],
)
def test_pipeline_config_refuses_before_any_rank_starts(kwargs, match):
    assert named(mb.PipelineConfig, **kwargs, match=match)


def test_noise_scale_refuses_a_negative_squared_norm_and_a_string_decay():
    g = mb.GradientNoiseScale()
    refused(g.update, b_small=4, g_small_sq=-2.0, b_big=16, g_big_sq=1.0, match="g_small_sq")
    refused(mb.GradientNoiseScale, decay="0.9", match="decay")
    refused(mb.GradientNoiseScale, decay=True, match="decay")
    est = g.update(b_small=4, g_small_sq=np.float32(2.0), b_big=16, g_big_sq=1.0)
    assert est.b_simple == pytest.approx((2 - 1) / (1 / 4 - 1 / 16) / ((16 - 4 * 2) / 12))


def test_simulate_refuses_a_string_time_and_a_bool_comm_and_reads_tuples_as_actions():
    from microbatch.schedules.action import Action, Schedule

    s = Schedule(name="hand", stages=1, microbatches=1, actions=(((0, "F", 0), "0B0"),))
    assert s.actions == ((Action(0, "F", 0), Action(0, "B", 0)),)
    assert mb.simulate(s, forward_time=np.float32(1.0), backward_time=2.0).makespan == pytest.approx(3.0)
    refused(mb.simulate, s, forward_time="1.0", backward_time=2.0, match="forward_time must be a number")
    refused(
        mb.simulate,
        s,
        forward_time=1.0,
        backward_time=2.0,
        comm_time=True,
        match="comm_time must be a number",
    )
    refused(
        Schedule, name="hand", stages=1, microbatches=1, actions=(((0, "X", 0),),), match="is not an Action"
    )


# -- the measured curve ---------------------------------------------------------------------------------------


def test_recommend_refuses_a_micro_batch_measured_twice_instead_of_keeping_the_last():
    pts = [
        mb.CurvePoint(micro_batch=2, throughput=100.0),
        mb.CurvePoint(micro_batch=2, throughput=10.0),
        mb.CurvePoint(micro_batch=4, throughput=50.0),
    ]
    refused(mb.recommend, pts, match=r"micro_batch 2 is measured twice \(points 1 and 2\)")
    # an out-of-memory point beside a measured one at the same b_m is no repeat
    ok = [mb.CurvePoint(micro_batch=2, oom=True), *pts[1:]]
    assert mb.recommend(ok).knee.micro_batch == 4


def _linear_tune(make_batch, **kw):
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    loss = lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1])  # noqa: E731
    timing = mb.TimingConfig(warmup=0, min_repeats=1, max_repeats=2, max_time_s=0.5)
    return mb.tune(model, make_batch, loss_fn=loss, use_cache=False, timing=timing, **kw)


def test_tune_refuses_a_batch_that_does_not_grow_with_b():
    x, y = torch.randn(256, 16), torch.randn(256, 1)
    shapes = r"\[\(4, 16\), \(4, 1\)\]"
    e = refused(_linear_tune, lambda b: (x[:4], y[:4]), max_micro_batch=64,
                match=rf"make_batch\(2\) returned tensors of shapes {shapes}, no larger than make_batch\(1\)'s")  # fmt: skip
    assert e.params == ("make_batch",)


def test_tune_stops_where_the_data_runs_out_and_keeps_the_points_before():
    x, y = torch.randn(32, 16), torch.randn(32, 1)
    r = _linear_tune(lambda b: (x[:b], y[:b]), max_micro_batch=256, patience=99)  # no stop on a flat curve
    measured = sorted(p.micro_batch for p in r.points if not p.oom)
    assert measured[-1] == 32 and r.recommendation.knee.micro_batch <= 32
    assert (
        "make_batch(64) returned tensors of shapes [(32, 16), (32, 1)], not 64 rows, where each smaller b's led with b"
        in r.stop_reason
    )


def test_the_row_check_takes_padded_random_rows_sequence_first_and_packed_layouts():
    from microbatch.measure.batch_check import GrowingBatches

    gen = torch.Generator().manual_seed(0)

    def padded(b):  # b rows drawn at random, padded to the longest: the padded width moves, the rows do not
        return torch.zeros(b, int(torch.randint(16, 512, (1,), generator=gen)))

    for make in (padded, lambda b: torch.zeros(32, b, 8), lambda b: torch.zeros(1, 32 * b)):
        check = GrowingBatches(make)
        for b in (1, 2, 4, 8, 16, 32, 64, 32, 64):  # the knee's re-measurements ask again
            assert tuple(check(b).shape) == tuple(make(b).shape) or make is padded


def test_the_review_of_the_conversions():
    from dataclasses import replace

    from microbatch.errors import check_positive, whole_number
    from microbatch.moe import Experts
    from microbatch.schedules.action import Schedule

    assert (
        whole_number(torch.tensor([8])) is None and whole_number(np.array(8)) == 8
    )  # a 1-element array is no count
    refused(mb.BatchConfig, global_batch=torch.tensor([8]), micro_batch=4, grad_accum=2, match="global_batch")
    gpu = replace(H100, peak_flops={**H100.peak_flops, "bf16": np.float32(9e14)})
    assert type(gpu.peak_flops["bf16"]) is float and json.dumps(gpu.to_dict())  # values of a dict field too
    refused(as_tuple, "zero", {0: "a"}, match="zero must be a tuple of choices")
    assert as_tuple("zero", {3, 1, 2}) == (1, 2, 3) and as_tuple("micro_batches", np.array([2, 4])) == (2, 4)
    refused(check_positive, "memory_bytes", np.True_, match="memory_bytes must be a number")
    s = Schedule(name="hand", stages=1, microbatches=1, actions=(("0F0", "0B0"),))
    for t in (np.array(1.0), torch.tensor(1.0)):
        assert mb.simulate(s, forward_time=t, backward_time=2.0).makespan == pytest.approx(3.0)
    refused(Schedule, name="hand", stages=1, microbatches=1, actions=["0F0"], match="the string '0F0'")
    moe = Experts(experts=4, top_k=1, expert_ffn_hidden=8, moe_every=8)
    refused(
        mb.ModelShape, name="x", layers=4, hidden=32, heads=4, vocab=100, seq=16, moe=moe, match="moe_every"
    )
