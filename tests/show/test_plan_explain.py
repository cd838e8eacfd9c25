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
