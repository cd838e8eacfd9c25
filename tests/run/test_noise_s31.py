"""The noise scale's uncertainty (a helper's review, 2026-12-07): with --decay below 1 the printed B_simple was the
smoothed one but its ±, the resolved test and the lower bound the plain mean's (at decay 0.5, ± 1 SE covered the truth
in 31% of runs); with 2–5 steps the test at two normal standard errors called an infinite B resolved in 4–11.5% of runs,
and one step got a suggestion with no test at all."""

from __future__ import annotations

import math
import random

import pytest

from microbatch.run.noise import (
    MIN_STEPS,
    _weights,
    b_simple_rel_se,
    g_sq_resolved,
    resolved_errors,
)
from microbatch.show.answers import render_noise


def _pairs(n: int, seed: int = 0) -> list[tuple[float, float]]:
    rng = random.Random(seed)
    return [(1.0 + rng.gauss(0, 0.3), 50.0 + rng.gauss(0, 5)) for _ in range(n)]


def test_the_error_is_the_printed_average_s():
    pairs = _pairs(20)
    w, share = _weights(20, 1.0)
    assert share == pytest.approx(1 / 20)
    assert _weights(20, 0.0)[1] == pytest.approx(1.0)  # decay 0: the last step alone
    plain, half, last = (b_simple_rel_se(pairs, d) for d in (1.0, 0.5, 0.0))
    assert plain is not None and half is not None and last is not None
    assert plain < half < last  # fewer effective steps, more error
    n_eff = 1 / _weights(20, 0.5)[1]
    assert n_eff == pytest.approx(3.0, rel=1e-3)  # (Σw)²/Σw² = 2² / (4/3): three steps' worth at decay 0.5


def test_t_quantiles_and_too_few_steps():
    assert resolved_errors(MIN_STEPS - 1) == math.inf
    assert resolved_errors(5) == pytest.approx(2.87, abs=0.02)  # t(0.977, 4) = 2.87
    assert resolved_errors(10) == pytest.approx(2.32, abs=0.02)
    assert resolved_errors(1000) == pytest.approx(2.0, abs=0.01)
    assert g_sq_resolved(_pairs(3)) is None and g_sq_resolved(_pairs(20)) is True


def _result(steps: int, se: float, resolved: bool | None) -> dict:
    return {"model": "tiny", "seq": 16, "global_batch": 8, "micro_batch": 4, "steps": steps, "g_sq": 1.0,
            "trace_sigma": 90.0, "b_simple_tokens": 90.0, "b_simple_sequences": 6.0, "tokens_per_sequence": 15,
            "b_simple_rel_se": se, "g_sq_resolved": resolved, "b_simple_lower_tokens": 60.0}  # fmt: skip


def test_a_suggestion_only_where_it_is_resolved_and_within_30_percent():
    assert "suggestion: B_global near 6" in render_noise(_result(20, 0.06, True))
    assert "too few to tell" in render_noise(_result(3, 0.19, None))  # was a suggestion
    assert "past 30%" in render_noise(_result(20, 0.41, True))
    assert "suggestion" not in render_noise(_result(1, 0.0, None))
