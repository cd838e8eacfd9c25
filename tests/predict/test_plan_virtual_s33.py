"""What a metamorphic sweep of plan found (2026-12-07, evening): each fixed with a test that fails without it."""

from __future__ import annotations

import pytest

from microbatch.errors import ConfigError
from microbatch.hardware import get_accelerator
from microbatch.model import get_model
from microbatch.predict.plan import make_plan
from microbatch.predict.plan_config import PlanConfig


def _cfg(**kw):
    base = dict(shape=get_model("gpt2"), gpu=get_accelerator("a100-80gb"), global_batch=8, pipeline_parallel=8,
                micro_batches=(1,), schedules=("1f1b",))  # fmt: skip
    return PlanConfig(**{**base, **kw})


def test_virtual_1_is_no_interleaving_and_splits_unevenly_like_none_given():
    """12 layers over 8 stages: v = 1 was refused with interleaved 1F1B's L % (p·v) rule, while the same plan without
    virtuals split the layers unevenly and ran."""
    one = make_plan(_cfg(virtuals=(1,))).recommended
    none = make_plan(_cfg()).recommended
    assert one is not None and none is not None
    assert one.step_time_s == pytest.approx(none.step_time_s, rel=1e-12)
    assert one.peak_memory_bytes == pytest.approx(none.peak_memory_bytes, rel=1e-12)
    with pytest.raises(
        ConfigError, match=r"virtual 2: interleaved 1F1B needs layers 12 divisible by stages 8 × virtual 2"
    ):
        _cfg(virtuals=(2,), schedules=("interleaved-1f1b",))
