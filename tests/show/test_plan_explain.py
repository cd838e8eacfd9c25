"""The plan's explanation: several lints read as separate clauses (they ran together with a space)."""

from __future__ import annotations

from microbatch.hardware import get_accelerator
from microbatch.model import get_model
from microbatch.predict.plan import PlanConfig, make_plan
from microbatch.show.plan_report import explain, plan_lints


def test_two_lints_are_separate_clauses_ending_the_check():
    # 16 stages, m = 16 < 4p and ZeRO 2 with a pipeline: two lints on one recommendation
    cfg = PlanConfig(shape=get_model("llama-3-8b"), gpu=get_accelerator("h100-sxm"), global_batch=32,
                     data_parallel=2, pipeline_parallel=16, micro_batches=(1,), zero=(2,), recompute=("none",),
                     schedules=("1f1b",))  # fmt: skip
    plan = make_plan(cfg)
    lints = plan_lints(plan)
    assert len(lints) >= 2
    text = explain(plan)
    assert "Check: " + "; ".join(lints) + "." in text
    assert "buried ZeRO" not in text


def test_the_neighbouring_micro_batches_are_read_as_the_recommendation_runs():
    # the knee (ZeRO 3 at b_m = 2) beside b_m = 1, whose fastest is ZeRO 1 with more memory: the sentence compared
    # the two and read "would save -2.8 GiB"; it compares b_m = 1 under ZeRO 3, which does save memory
    import re

    # (2026-12-07: FSDP2's copy-in and fp32 reduction made ZeRO 3 dearer; the case is now b_m = 4 beside 2 on A100s)
    plan = make_plan(PlanConfig(shape=get_model("llama-3-8b", seq=1024), gpu=get_accelerator("a100-80gb"),
                                global_batch=64, data_parallel=8))  # fmt: skip
    c = plan.recommended
    assert c is not None and c.micro_batch == 4 and c.zero == 3
    best_1 = next(x for x in plan.candidates if x.micro_batch == 2)
    assert (
        best_1.zero != c.zero and best_1.peak_memory_bytes > c.peak_memory_bytes
    )  # the case that read wrong
    like_1 = next(
        x for x in plan.candidates if x.micro_batch == 2 and (x.zero, x.recompute) == (c.zero, c.recompute)
    )
    text = explain(plan)
    saved = re.search(
        r"Smaller b_m = 2 run as the recommendation \(recompute \w+, ZeRO 3\) would save ([0-9.]+) GiB", text
    )
    assert saved and "save -" not in text
    assert abs(float(saved.group(1)) - (c.peak_memory_bytes - like_1.peak_memory_bytes) / 2**30) < 0.06
    assert f"its step takes {like_1.step_time_s:.3g} s" in text


def test_a_neighbour_that_fits_only_otherwise_is_read_as_it_fits():
    # b_m = 2 under the knee's recompute none does not fit, under full recompute it does: the sentence says the
    # latter (what b_m = 2 would cost), not "does not fit"
    cfg = PlanConfig(shape=get_model("llama-3-8b", seq=8192), gpu=get_accelerator("h100-sxm"), global_batch=1024,
                     data_parallel=16, pipeline_parallel=4)  # fmt: skip
    plan = make_plan(cfg)
    c = plan.recommended
    assert c is not None and c.micro_batch == 1 and c.recompute == "none"
    same = [
        x
        for x in plan.candidates
        if x.micro_batch == 2 and (x.recompute, x.zero, x.schedule) == ("none", 1, "1f1b")
    ]
    assert same and not same[0].fits
    best_2 = next(x for x in plan.candidates if x.micro_batch == 2)
    assert best_2.fits
    assert f"Larger b_m = 2 would run GEMMs at {100 * best_2.gemm_efficiency:.0f}% of peak" in explain(plan)


def test_an_mfu_over_one_says_why():
    """MFU counts attention's whole s×s matrix (Narayanan Eq. 3, PaLM) where a causal kernel runs half, so a long
    sequence's MFU passes 100%; the sentence says so there and only there."""
    import json

    from microbatch.show.plan_report import explain_result

    plan = make_plan(PlanConfig(shape=get_model("gpt2"), gpu=get_accelerator("h100-sxm"), global_batch=8))
    result = json.loads(json.dumps(plan.to_dict()))
    plain = explain_result(result)
    assert "MFU" in plain and "whole s×s matrix" not in plain
    result["recommended"]["mfu"] = 1.02
    said = explain_result(result)
    assert "MFU 102.0% (its model FLOPs count attention's whole s×s matrix" in said
