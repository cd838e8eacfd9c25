"""torchtitan's FSDP for a ZeRO 1/2 plan (a helper's review of the FSDP timing, 2026-12-08): without resharding
after forward it still gathers and reduce-scatters every micro-batch at p = 1, which the plan's ZeRO 2 (one
reduce-scatter and one gather a step) did not time: the export says so and how to plan it."""

from __future__ import annotations

from microbatch.hardware import get_accelerator
from microbatch.model import get_model
from microbatch.predict.plan import make_plan
from microbatch.predict.plan_config import PlanConfig
from microbatch.show.export import export_plan


def _plan(**kw):
    base = dict(shape=get_model("llama-2-7b"), gpu=get_accelerator("h100-80gb"), global_batch=64, data_parallel=8,
                pipeline_parallel=1, micro_batches=(2,), zero=(2,))  # fmt: skip
    return make_plan(PlanConfig(**{**base, **kw})).to_dict()


def test_zero_2_accumulating_under_torchtitan_says_its_communication_differs():
    out = export_plan(_plan(), "torchtitan")  # g = 64 / (2 · 8) = 4
    assert out.config["parallelism"]["fsdp_reshard_after_forward"] == "never"
    said = [n for n in out.notes if "ZeRO 2 maps to FSDP" in n]
    assert (
        said
        and "every one of the 4 micro-batches" in said[0]
        and "plan it at zero 3 with zero3_impl fsdp2" in said[0]
    )
    one = export_plan(
        _plan(micro_batches=(8,)), "torchtitan"
    )  # g = 1: one gather and one reduction either way
    assert not any("every one of the" in n for n in one.notes)
