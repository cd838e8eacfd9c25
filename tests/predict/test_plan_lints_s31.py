"""The bubble lint (a helper's advice sweep, 2026-12-07): it quoted 1F1B's bubble (p−1)/(m+p−1) for the b_m it
suggested whatever the schedule, and fired on interleaved, zero-bubble and DualPipeV steps that already idled less
than 1F1B would at m = 4p — an interleaved 6% told to take a b_m "at 11%", which ran slower. It now fires only past
1F1B's 4p bubble, and suggests the plan's own candidate on the same schedule (its bubble, one the rules serve)."""

from __future__ import annotations

from microbatch.hardware import get_accelerator
from microbatch.model import get_model
from microbatch.predict.plan import make_plan
from microbatch.predict.plan_advice import BubbleNotBuried
from microbatch.predict.plan_config import PlanConfig
from microbatch.schedules.closed_forms import bubble_fraction

H100 = get_accelerator("h100-80gb")


def _plan(**kw):
    base = dict(shape=get_model("llama-2-7b"), gpu=H100, zero=(1,))
    return make_plan(PlanConfig(**{**base, **kw}))


def _bubble_lints(plan):
    return [x for x in plan.lints if isinstance(x, BubbleNotBuried)]


def test_a_bubble_under_1f1b_s_at_4p_is_not_linted():
    plan = _plan(
        global_batch=8, pipeline_parallel=2, tensor_parallel=2, micro_batches=(2,), recompute=("full",)
    )
    rec = plan.recommended
    assert (
        rec is not None and rec.schedule == "interleaved-1f1b" and rec.microbatches < 4 * 2
    )  # linted before
    assert rec.bubble_fraction < bubble_fraction(2, 8) and not _bubble_lints(plan)


def test_the_suggestion_is_the_plan_s_own_candidate_on_the_same_schedule():
    from types import SimpleNamespace

    from microbatch.predict.plan_lints import lint

    plan = _plan(global_batch=32, pipeline_parallel=4, schedules=("zb-h1",), micro_batches=(1, 2, 4, 8))
    big = max((c for c in plan.candidates if c.fits), key=lambda c: c.micro_batch)  # m = 4 at b_m 8: linted
    assert big.microbatches < 16 and big.bubble_fraction > bubble_fraction(4, 16)
    (found,) = [x for x in lint(SimpleNamespace(config=plan.config, candidates=plan.candidates, recommended=big))
                if isinstance(x, BubbleNotBuried)]  # fmt: skip
    alt = next(c for c in plan.candidates if c.micro_batch == found.better_micro_batch and c.schedule == "zb-h1"
               and c.recompute == big.recompute and c.zero == big.zero)  # fmt: skip
    assert found.better_microbatches >= 16 and alt.fits
    assert found.better_bubble_pct == alt.bubble_pct < big.bubble_pct  # zb-h1's own, not 1F1B's formula
    assert found.better_bubble_pct != 100 * bubble_fraction(4, found.better_microbatches)


def test_a_pinned_1f1b_micro_batch_still_gets_the_closed_form_suggestion():
    plan = _plan(global_batch=16, pipeline_parallel=4, schedules=("1f1b",), micro_batches=(2,))
    (lint,) = _bubble_lints(plan)
    assert (lint.better_micro_batch, lint.better_microbatches) == (1, 16)
    assert lint.better_bubble_pct == 100 * bubble_fraction(4, 16)


def test_the_global_batch_asked_for_is_one_the_schedule_serves():
    """Interleaved 1F1B at B = 7, p = 2, v = 2 was told "raise the global batch to at least 2" (v·p·d·b_m with
    v = 1): the round rule wants m = 8 (whole rounds of p), and gpipe takes no v = 2."""
    import pytest

    from microbatch.errors import ConfigError
    from microbatch.schedules.registry import get_spec

    with pytest.raises(ConfigError, match=r"raise the global batch to 8 \(m = 8\)") as err:
        make_plan(PlanConfig(shape=get_model("gpt2"), gpu=H100, global_batch=7, pipeline_parallel=2,
                             schedules=("interleaved-1f1b",), virtuals=(2,), micro_batches=(1,)))  # fmt: skip
    assert "gpipe" not in str(err.value)
    get_spec("interleaved-1f1b").check(2, 8, 2)  # the m asked for is served


def test_a_pinned_choice_is_left_to_the_planner_before_more_gpus_are_asked_for():
    """ZeRO 0 pinned on 8 A100-40GB for Llama 3 8B: ZeRO 3 on the same 8 fits (24 GiB); the advice asked for 32-64 GPUs
    (a helper's sweep of the advice)."""
    from microbatch.predict.plan import what_would_fit

    cfg = PlanConfig(shape=get_model("llama-3-8b"), gpu=get_accelerator("a100-40gb"), global_batch=8, data_parallel=8,
                     zero=(0,))  # fmt: skip
    advice = what_would_fit(cfg)
    first = advice.alternatives[0]
    assert first.setting == "zero" and first.fits and first.best.zero >= 1
    assert (
        first.best.data_parallel * first.best.tensor_parallel * first.best.pipeline_parallel == 8
    )  # same GPUs


def test_the_p_offered_for_dualpipev_serve_the_micro_batches():
    """80 layers over 2 × 16 chunks do not split; the p offered were [2, 4, 5, 8, 10, 20, 40], and p = 40 was refused
    in turn (m = 8 < 2p): only those DualPipeV serves at m = 1024 / (16 · 8) = 8 are offered."""
    import pytest

    from microbatch.errors import ConfigError

    cfg = PlanConfig(shape=get_model("llama-3-70b"), gpu=get_accelerator("a100-40gb"), global_batch=1024,
                     data_parallel=16, pipeline_parallel=16, zero=(1,), recompute=("full",), schedules=("dualpipev",),
                     micro_batches=(8,))  # fmt: skip
    with pytest.raises(ConfigError, match=r"use pipeline_parallel among \[2, 4\], or"):
        make_plan(cfg)
