"""The noise hook inside the loops people train in (a read-only audit, 2026-12-07): an fp16 overflow step that a
GradScaler skips, a loader's short last batch, and a |G|² not yet resolved from its own scatter."""

from __future__ import annotations

import math
import statistics
import warnings

import pytest
import torch

from microbatch.run.accumulate import accumulate
from microbatch.run.noise import GradientNoiseScale, g_sq_resolved
from microbatch.run.noise_measure import measure_noise_scale
from microbatch.show.answers import render_noise
from tests.run.test_noise import make_batches, reg_loss, regression_problem


def _poisoned(batches, bad_step: int, value: float):
    for i, (x, y) in enumerate(batches):
        if i == bad_step:
            y = y.clone()
            y[0] = value  # the loss, and every gradient after it, is inf or NaN this step
        yield x, y


@pytest.mark.parametrize("value", [math.inf, math.nan])
def test_a_step_whose_gradients_are_not_finite_is_skipped_and_the_loop_goes_on(value):
    model, w_star, _, g = regression_problem(1.0)
    hook = GradientNoiseScale(decay=1.0)
    ran = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in _poisoned(make_batches(w_star, 1.0, g, 5, rows=16), 2, value):
            for p in model.parameters():
                p.grad = None
            accumulate(model, batch, reg_loss, micro_batch_size=4, noise=hook)  # raised before the fix
            ran += 1
    assert ran == 5 and hook.steps == 4 and hook.skipped == 1 and hook.nonfinite == 1
    assert math.isfinite(hook.estimate.g_sq) and math.isfinite(hook.estimate.trace_sigma)
    assert sum("not finite" in str(w.message) for w in caught) == 1


def test_the_skipped_step_leaves_the_estimate_of_the_others():
    """The four finite steps give exactly what they give without the poisoned one between them."""
    model, w_star, _, g = regression_problem(1.0, seed=3)
    batches = list(make_batches(w_star, 1.0, g, 5, rows=16))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got, _ = measure_noise_scale(model, _poisoned(batches, 2, math.nan), reg_loss, micro_batch_size=4)
    model.load_state_dict(state)
    clean, _ = measure_noise_scale(model, batches[:2] + batches[3:], reg_loss, micro_batch_size=4)
    assert got.steps == clean.steps == 4
    assert got.b_simple == pytest.approx(clean.b_simple, rel=1e-12)


def test_nan_everywhere_says_the_gradients_were_not_finite():
    model, w_star, _, g = regression_problem(1.0)
    bad = ((x, torch.full_like(y, math.nan)) for x, y in make_batches(w_star, 1.0, g, 3, rows=16))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(Exception, match=r"3 step\(s\) had gradients that are not finite .* NaN"):
            measure_noise_scale(model, bad, reg_loss, micro_batch_size=4)


def test_a_loaders_short_last_batch_is_skipped_and_the_steps_before_it_kept():
    model, w_star, _, g = regression_problem(1.0, seed=1)
    full = list(make_batches(w_star, 1.0, g, 6, rows=16))
    tail = (full[-1][0][:3], full[-1][1][:3])  # 3 rows with micro-batch 4: one micro-batch
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        final, history = measure_noise_scale(model, [*full[:5], tail], reg_loss, micro_batch_size=4)
    assert len(history) == 5 and any("one micro-batch" in str(w.message) for w in caught)
    model.load_state_dict(state)
    alone, _ = measure_noise_scale(model, full[:5], reg_loss, micro_batch_size=4)
    assert final.b_simple == pytest.approx(alone.b_simple, rel=1e-12)


def test_the_lower_bound_by_hand_and_below_the_truth_where_the_ratio_is_not():
    from microbatch.run.noise import b_simple_lower

    # |G|² 1.0, -0.6, 0.2 (mean 0.2, se 0.8/√3), tr(Σ) 5: 5 / (0.2 + 2 · 0.4619) = 4.452
    assert b_simple_lower([(1.0, 5.0), (-0.6, 5.0), (0.2, 5.0)]) == pytest.approx(
        5 / (0.2 + 2 * 0.8 / 3**0.5)
    )
    assert b_simple_lower([(1.0, 5.0)]) is None and b_simple_lower([(1.0, -1.0), (2.0, -1.0)]) is None
    import random

    rng = random.Random(0)
    shown = point_above = bound_above = 0
    for _ in range(4000):  # true |G|² 0.5, tr(Σ) 100: B 200; 8 steps of sd 1
        per = [(rng.gauss(0.5, 1.0), 100.0) for _ in range(8)]
        mean = sum(g for g, _ in per) / 8
        if mean <= 0 or g_sq_resolved(per) is not False:
            continue
        shown += 1
        point_above += 100.0 / mean > 200
        bound_above += b_simple_lower(per) > 200
    assert shown > 500 and point_above / shown > 0.5 and bound_above / shown < 0.03


def test_g_sq_resolved_by_its_standard_error():
    assert g_sq_resolved([(1.0, 5.0)]) is None
    assert (
        g_sq_resolved([(1.0, 5.0), (1.2, 5.0), (0.8, 5.0)]) is None
    )  # under 5 steps: too few to judge (s31)
    five = [(1.0, 5.0), (1.2, 5.0), (0.8, 5.0), (1.1, 5.0), (0.9, 5.0)]  # mean 1, sd 0.158, se 0.071
    assert g_sq_resolved(five) is True  # 1 > t(0.977, 4) 2.87 × 0.071
    # mean 0.2, sd 0.76, se 0.34: 0.2 < 2.87 × 0.34
    assert g_sq_resolved([(1.0, 5.0), (-0.6, 5.0), (0.2, 5.0), (0.6, 5.0), (-0.2, 5.0)]) is False
    # mean 1, sd 0.9, se 0.40: above 2 normal standard errors (0.80), below t's 2.87 (1.16): not resolved
    wide = [(0.0, 1.0), (2.0, 1.0), (1.0, 1.0), (0.2, 1.0), (1.8, 1.0)]
    assert statistics.stdev(g for g, _ in wide) / 5**0.5 == pytest.approx(0.4, abs=0.01)
    assert g_sq_resolved(wide) is False


def _result(resolved):
    return {"model": "tiny", "seq": 33, "global_batch": 8, "micro_batch": 2, "steps": 40, "g_sq": 1e-4,
            "trace_sigma": 5.0, "b_simple_tokens": 50_000.0, "b_simple_sequences": 50_000.0 / 32,
            "tokens_per_sequence": 32, "b_simple_rel_se": 0.2, "g_sq_resolved": resolved,
            "b_simple_lower_tokens": 8_000.0}  # fmt: skip


def test_an_unresolved_gradient_gives_a_lower_bound_and_no_suggestion():
    text = render_noise(_result(False))
    assert "B_simple ≥ 8,000 tokens = 250.0 sequences" in text and "suggestion" not in text
    assert "(50,000 tokens) is no estimate" in text
    assert "run more steps" in text
    resolved = render_noise(_result(True))
    assert "suggestion: B_global near 1562 sequences" in resolved and "≥" not in resolved
