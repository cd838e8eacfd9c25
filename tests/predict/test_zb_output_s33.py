"""A split-backward schedule's last stage holds, for each micro-batch whose weight gradient waits, the logits'
gradient in the compute dtype, not the loss's fp32 logits (torch.distributed.pipelining: stage_backward_input keeps
the graph and the gradient at each weight's output; the loss is detached at the I pass). A review measured torch's
ZB-H1 on gloo ranks and read its source (2026-12-07); the planner charged fp32 logits p times."""

from __future__ import annotations

import pytest

from microbatch.hardware import get_accelerator
from microbatch.model import get_model
from microbatch.predict.activations import (
    deferred_output_share,
    output_activation_bytes,
    output_micro_batches,
)
from microbatch.predict.memory import estimate_memory
from microbatch.predict.memory_config import MemoryConfig
from microbatch.predict.plan import make_plan
from microbatch.predict.plan_config import PlanConfig


def test_the_share_by_hand():
    shape = get_model("gpt2")  # h 768, V 50,257
    s = 1024
    kw = dict(
        seq=s, tensor_parallel=1, sequence_parallel=False, dtype_bytes=2, logits_bytes=4, eager_layers=False
    )
    full = output_activation_bytes(shape, 1, **kw)
    assert full == 2 * 2 * s * 768 + 4 * s * 50257
    held = 2 * 2 * s * 768 + 2 * s * 50257  # the norm's and projection's inputs, and bf16 dL/dlogits
    assert deferred_output_share(shape, **kw) == pytest.approx(held / full, rel=1e-12)
    assert output_micro_batches(8, True, 0.5) == 1 + 7 * 0.5
    assert output_micro_batches(8, False, 0.5) == 8 and output_micro_batches(1, True, 0.5) == 1


def test_zb_h1_s_last_stage_holds_one_whole_output_and_p_minus_1_gradients():
    shape = get_model("gpt2")
    cfg = dict(micro_batch=4, pipeline_parallel=8, microbatches=16)
    zb = estimate_memory(shape, MemoryConfig(schedule="zb-h1", **cfg)).stages[-1].activation_terms["output"]
    one = estimate_memory(shape, MemoryConfig(schedule="1f1b", **cfg)).stages[-1].activation_terms["output"]
    # 1F1B's last stage holds one micro-batch; ZB-H1's p = 8, seven of them waiting on W
    kw = dict(seq=shape.seq, tensor_parallel=1, sequence_parallel=False, dtype_bytes=2, logits_bytes=4,
              eager_layers=False)  # fmt: skip
    assert zb == pytest.approx(one * (1 + 7 * deferred_output_share(shape, **kw)), rel=1e-12)
    assert one < zb < 8 * one


def test_the_planner_s_screen_agrees_with_the_estimate_under_zb_h1():
    shape = get_model("gpt2")
    plan = make_plan(PlanConfig(shape=shape, gpu=get_accelerator("a100-80gb"), global_batch=64, micro_batches=(4,),
                                pipeline_parallel=8, schedules=("zb-h1",), recompute=("none",), zero=(0,)))  # fmt: skip
    c = plan.recommended
    assert c is not None
    est = estimate_memory(shape, MemoryConfig(micro_batch=4, pipeline_parallel=8, microbatches=c.microbatches,
                                              schedule="zb-h1", recompute="none", zero=0))  # fmt: skip
    assert c.peak_memory_bytes == pytest.approx(est.peak_bytes, rel=1e-9)
