"""The planner's ZB-H1 and DualPipeV step times where their closed forms are only lower bounds (a helper's review,
2026-12-07): a weight gradient longer than the forward or the input gradient (T_W > min(T_F, T_I) for ZB-H1,
T_W > T_I for DualPipeV) made the planner 64 where torch's order takes 71 (ZB-H1, p = 8, m = 16, F = I = 1,
W = 2) and 135 where it takes 142 (DualPipeV); ``bubble`` and ``simulate`` already simulated there."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

from microbatch.schedules.closed_forms import dualpipev_step_time, zb_h1_step_time
from microbatch.schedules.registry import generate, get_spec
from microbatch.schedules.simulate import simulate


def _times(stages: int, per_rank: int, f: float, i: float, w: float) -> NS:
    return NS(f=[f] * stages, i=[i] * stages, w=[w] * stages, k=0, Tk=per_rank * (f + i + w),
              sumT=stages * (f + i + w), fk=per_rank * f, ik=per_rank * i, wk=per_rank * w)  # fmt: skip


@pytest.mark.parametrize(
    "f,i,w", [(1.0, 1.0, 2.0), (1.0, 2.0, 1.5), (2.0, 1.0, 1.5), (1.0, 1.0, 1.0), (1.5, 1.2, 0.7)]
)
def test_zb_h1_is_the_simulation_of_torch_s_order(f, i, w):
    p, m = 8, 16
    planner, _ = get_spec("zb-h1").step_time(p, m, 1, _times(p, 1, f, i, w))
    sim = simulate(generate("zb-h1", p, m), forward_time=f, input_time=i, weight_time=w).makespan
    assert planner == pytest.approx(sim)
    closed, _ = zb_h1_step_time(p, m, 1, _times(p, 1, f, i, w))
    if w <= min(f, i):
        assert closed == pytest.approx(sim)  # in range the closed form is exact, and used
    else:
        assert closed < sim  # out of range it was a lower bound: 64 against 71 at (1, 1, 2)


@pytest.mark.parametrize("f,i,w", [(1.0, 1.0, 2.0), (1.0, 1.0, 1.0), (1.0, 2.0, 1.0), (2.0, 1.0, 1.5)])
def test_dualpipev_is_the_simulation_of_torch_s_order(f, i, w):
    p, m = 8, 16
    planner, _ = get_spec("dualpipev").step_time(p, m, 2, _times(2 * p, 2, f, i, w))
    sim = simulate(generate("dualpipev", p, m, 2), forward_time=f, input_time=i, weight_time=w).makespan
    assert planner == pytest.approx(sim)
    closed, _ = dualpipev_step_time(p, m, 2, _times(2 * p, 2, f, i, w))
    assert (closed == pytest.approx(sim)) if w <= i else closed < sim
