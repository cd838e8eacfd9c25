"""The planner's closed forms against the event simulator, at equal stages, wherever the schedule runs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from microbatch.schedules.closed_forms import fill_drain_step_time
from microbatch.schedules.registry import generate
from microbatch.schedules.simulate import simulate


def _times(p: int, T: float) -> SimpleNamespace:
    """Equal stages: each rank takes T per micro-batch, a third forward and two thirds backward."""
    return SimpleNamespace(Tk=T, sumT=p * T, f=[T / 3] * p, i=[T / 3] * p, w=[T / 3] * p)


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("v", [2, 3, 4])
def test_interleaved_closed_form_is_the_simulated_makespan_for_every_m(p: int, v: int) -> None:
    """Interleaved 1F1B at m < p (one round) and m >= p: the closed form is the simulator's makespan."""
    T = 0.3
    for m in range(1, 2 * p + 1):
        sched = generate("interleaved-1f1b", p, m, v)
        res = simulate(sched, forward_time=[T / 3 / v] * (p * v), backward_time=[2 * T / 3 / v] * (p * v))
        total, fraction = fill_drain_step_time(p, m, v, _times(p, T))
        assert total == pytest.approx(res.makespan, rel=1e-9), (p, v, m)
        assert fraction == pytest.approx(res.bubble_fraction, rel=1e-9, abs=1e-12), (p, v, m)


def test_one_micro_batch_costs_one_pass_whatever_the_schedule() -> None:
    """m = 1: nothing overlaps, every schedule takes p·T (by hand: 4 × 0.3 s), interleaving saves nothing."""
    for v in (1, 2, 4):
        total, fraction = fill_drain_step_time(4, 1, v, _times(4, 0.3))
        assert total == pytest.approx(1.2)
        assert fraction == pytest.approx(0.75)
