"""confirm_knee: a knee chosen on one disturbed probe is measured again, alternately with the fastest."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from microbatch.choose.config import ChoiceConfig
from microbatch.choose.knee import recommend
from microbatch.choose.tune.config import SearchConfig
from microbatch.choose.tune.confirm import confirm_knee
from microbatch.choose.tune.search import SearchLog, curve_point, search
from microbatch.measure.probes import Measurement

TRUE = {1: 100.0, 2: 150.0, 4: 180.0, 8: 200.0, 16: 200.0}
CHOICE = ChoiceConfig(tolerance=0.15, reference="measured")  # the line: 0.85 × 200 = 170


def _scripted(disturbed: dict[int, list[float]]):
    """measure(b, ckpt): the true curve, except the scripted values of ``disturbed`` first; logs the calls.
    Also a SearchLog whose clock advances by b at each probe (a probe's cost grows with its work)."""
    calls: list[int] = []
    now = [0.0]

    def measure(b: int, ckpt: bool) -> Measurement:
        calls.append(b)
        now[0] += b
        queue = disturbed.get(b, [])
        t = queue.pop(0) if queue else TRUE[b]
        return Measurement(micro_batch=b, throughput=t, samples_per_s=t, step_time_s=b / t, repeats=3,
                           peak_memory_bytes=1000 * b, checkpointing=ckpt)  # fmt: skip

    return measure, calls, SearchLog(clock=lambda: now[0])


def _measured(measure, log: SearchLog, sizes) -> list[Measurement]:
    """The points of ``sizes`` measured in order, their cost logged as the search logs it."""
    out = []
    for b in sizes:
        t0 = log.clock()
        out.append(measure(b, False))
        log.seconds[(b, False)] = log.clock() - t0
    return out


def _knee(points):
    return recommend([curve_point(p) for p in points], CHOICE).knee.micro_batch


def test_a_knee_passed_on_one_quiet_moment_moves_to_the_true_knee():
    measure, calls, log = _scripted({2: [190.0]})  # b_m 2 measured 27% fast once (another job paused)
    points = search(measure, SearchConfig(max_micro_batch=16), CHOICE, log=log)
    assert _knee(points) == 2  # the search alone answers 2: 150/200 = 75% of the best, below 1 − τ
    n = len(calls)
    confirmed = confirm_knee(measure, points, CHOICE, log, budget=math.inf)  # the budget: its own test
    assert _knee(confirmed) == 4 and TRUE[4] / TRUE[8] >= 0.85
    # the knee 2, its neighbour 4 and the fastest 8 alternately; then 4 is the knee, its neighbour and the
    # fastest are 8, all measured again already: done. The search's points are kept in their order.
    assert calls[n:] == [2, 4, 8, 2, 4, 8] and log.probes == n + 6
    assert sum(log.seconds.values()) == 1 + 2 + 4 + 8  # the search's probes, timed on its clock
    assert [p.micro_batch for p in confirmed] == [p.micro_batch for p in points]
    assert next(p for p in confirmed if p.micro_batch == 2).throughput == 150.0  # the median of 190, 150, 150
    assert "knee 2 checked: 2, 4, 8 re-measured alternately (2 rounds, median of 3)" in log.stop_reason
    assert "the knee moved from 2 to 4 on the re-measured points" in log.stop_reason


def test_a_knee_that_is_the_largest_and_fastest_point_costs_no_probe():
    measure, calls, log = _scripted({})
    points = _measured(measure, log, (1, 2, 4, 8))
    n = len(calls)
    assert confirm_knee(measure, points, ChoiceConfig(tolerance=0.0, reference="measured"), log) == points
    assert len(calls) == n


def test_a_true_knee_stays_and_one_disturbed_remeasurement_does_not_move_it():
    measure, calls, log = _scripted({4: [180.0, 120.0]})  # the knee's first re-measurement is disturbed
    points = _measured(measure, log, (1, 2, 4, 8, 16))
    confirmed = confirm_knee(measure, points, CHOICE, log)
    # 2 too: 150 against the knee's 180 is within the noise the curve's own scatter shows around its
    # step-time line (choose.noise.residual_scatter), so it is the knee the noise could have chosen
    assert _knee(confirmed) == 4 and calls[5:] == [2, 4, 8, 2, 4, 8]
    assert 2 in recommend([curve_point(p) for p in points], CHOICE).indistinguishable


def test_ctrl_c_while_confirming_keeps_the_points():
    measure, _, log = _scripted({2: [190.0]})
    points = _measured(measure, log, (1, 2, 4, 8))

    def interrupted(b: int, ckpt: bool) -> Measurement:
        raise KeyboardInterrupt

    assert confirm_knee(interrupted, points, CHOICE, log, budget=math.inf) == points and log.interrupted


def test_a_knee_that_is_fastest_because_larger_probes_ran_in_a_busy_moment_moves_up():
    measure, calls, log = _scripted({8: [120.0], 16: [130.0]})  # other jobs took the core for the last probes
    points = _measured(measure, log, (1, 2, 4, 8, 16))
    assert _knee(points) == 4  # 4 is the fastest measured: 180/200 = 90% of what 8 gives
    confirmed = confirm_knee(measure, points, CHOICE, log)
    # 4 and its neighbour 8 measured again: 8 is back at 200, 4 still within τ of it, the knee stays;
    # 8's 120 then 200, 200 show the machine's noise (pooled_scatter), within which 2's 150 cannot be
    # told from the knee's 180: 2 is measured again too, and stays below the line
    assert calls[5:] == [4, 8, 4, 8, 2, 2] and _knee(confirmed) == 4
    strict = ChoiceConfig(tolerance=0.05, reference="measured")  # a line 4 does not pass once 8 is known
    for budget, tail in ((2.0, [16, 16]), (1.0, [])):
        measure, calls, log = _scripted({8: [120.0], 16: [130.0]})
        points = _measured(measure, log, (1, 2, 4, 8, 16))
        assert recommend([curve_point(p) for p in points], strict).knee.micro_batch == 4
        confirmed = confirm_knee(measure, points, strict, log, budget=budget)
        assert recommend([curve_point(p) for p in confirmed], strict).knee.micro_batch == 8
        # then the new knee's neighbour 16 -- twice 16 units, past the budget of 1 × the search's 31 with 24
        # spent: not measured again, and the log says why
        assert calls[5:] == [4, 8, 4, 8, *tail]
    assert "knee 8 not re-measured: 16 would take about 32.0 s, more than the 7.0 s left" in log.stop_reason
    assert "the knee moved from 4 to 8" in log.stop_reason


def test_cuda_event_timings_are_not_measured_again():
    from dataclasses import replace

    measure, calls, log = _scripted({2: [190.0]})
    points = [
        replace(p, clock="cuda-events")
        for p in search(measure, SearchConfig(max_micro_batch=16), CHOICE, log=log)
    ]
    n = len(calls)
    confirmed = confirm_knee(measure, points, CHOICE, log)
    assert len(calls) == n and confirmed == points  # no probe: the device's own time is not re-measured
    assert "not re-measured: CUDA-event timings" in log.stop_reason
    # the same points on a host clock are re-measured
    host = [replace(p, clock="process") for p in points]
    confirm_knee(measure, host, CHOICE, log, budget=math.inf)
    assert len(calls) > n


def test_the_confirmation_takes_at_most_the_search_s_own_time():
    """A decode run on the 2-core CPU searched 1..512 in about a sweep's time, then spent ~90 s more
    re-measuring its largest points (254% of the sweep, BENCHMARKS.md): the re-measurements stop where they
    would take more than the search did, and the knee the search chose stands."""
    measure, calls, log = _scripted(
        {2: [190.0]}
    )  # the knee 2 passed on one quiet moment, as in the first test
    points = _measured(measure, log, (1, 2, 4, 8))  # 15 units of probing
    assert _knee(points) == 2
    confirmed = confirm_knee(measure, points, CHOICE, log, min_budget_s=0.0)  # 2, 4, 8 twice: 28 > 15
    assert confirmed == points and len(calls) == 4 and log.probes == 0
    assert (
        "knee 2 not re-measured: 2, 4, 8 would take about 28.0 s, more than the 15.0 s left"
        in log.stop_reason
    )
    # with one more point searched (31 units) the same confirmation fits, runs and moves the knee to 4
    measure, calls, log = _scripted({2: [190.0]})
    points = _measured(measure, log, (1, 2, 4, 8, 16))
    assert _knee(confirm_knee(measure, points, CHOICE, log)) == 4 and calls[5:] == [2, 4, 8, 2, 4, 8]
    # what the clock says the re-measurements took counts, not the estimate: a first round that runs long
    # leaves too little for the next knee. Estimated 2·(0.5 + 0.5 + 0.5) = 3, it took 28; the budget is
    # 3 × 18.5 = 55.5, so 16's 32 more do not fit after 28 (they would after the estimated 3)
    slow, calls, log = _scripted({2: [190.0]})
    points = _measured(slow, log, (1, 2, 4, 8, 16))
    log.seconds[(2, False)] = log.seconds[(4, False)] = log.seconds[(8, False)] = 0.5  # underestimated costs
    strict = ChoiceConfig(tolerance=0.05, reference="measured")
    confirmed = confirm_knee(slow, points, strict, log, budget=3.0)
    assert (
        calls[5:] == [2, 4, 8, 2, 4, 8]
        and recommend([curve_point(p) for p in confirmed], strict).knee.micro_batch == 8
    )
    assert "knee 8 not re-measured: 16 would take about 32.0 s, more than the 27.5 s left" in log.stop_reason


def test_a_confirmation_that_exactly_fits_the_budget_runs():
    measure, calls, log = _scripted({2: [190.0]})
    points = _measured(measure, log, (1, 2, 4, 8, 16))
    log.seconds.update({(1, False): 3.0, (2, False): 1.0, (4, False): 2.0, (8, False): 4.0, (16, False): 4.0})
    assert _knee(confirm_knee(measure, points, CHOICE, log)) == 4  # 2·(1 + 2 + 4) = 14 = 1 × 14
    assert calls[5:] == [2, 4, 8, 2, 4, 8]
    measure, calls, log = _scripted({2: [190.0]})
    points = _measured(measure, log, (1, 2, 4, 8, 16))
    log.seconds.update({(1, False): 3.0, (2, False): 1.5, (4, False): 2.0, (8, False): 4.0, (16, False): 4.0})
    assert confirm_knee(measure, points, CHOICE, log) == points  # 2·(1.5 + 2 + 4) = 15 > 14.5
    assert len(calls) == 5 and "15.0 s, more than the 14.5 s left" in log.stop_reason


def test_a_budget_of_zero_turns_the_confirmation_off_and_a_negative_one_is_refused():
    import pytest

    from microbatch.errors import ConfigError

    measure, calls, log = _scripted({2: [190.0]})
    points = _measured(measure, log, (1, 2, 4, 8, 16))
    assert confirm_knee(measure, points, CHOICE, log, budget=0.0) == points and len(calls) == 5
    assert "the confirmation's budget is 0" in log.stop_reason
    for bad in (-1.0, math.nan):
        with pytest.raises(ConfigError, match="must be >= 0"):
            confirm_knee(measure, points, CHOICE, log, budget=bad)
    # an unbounded budget after a search taken whole from the cache: nothing to confirm, no error
    cached = [measure(b, False) for b in (1, 2, 4, 8)]
    fresh = SearchLog()
    assert confirm_knee(measure, cached, CHOICE, fresh, budget=math.inf) == cached
    assert "its points came from the cache" in fresh.stop_reason


def test_points_from_the_cache_cost_nothing_and_a_cached_search_confirms_nothing():
    measure, calls, log = _scripted({2: [190.0]})
    points = [measure(b, False) for b in (1, 2, 4, 8, 16)]  # as if read from the cache: no time logged
    assert confirm_knee(measure, points, CHOICE, log) == points and len(calls) == 5
    assert "the search measured nothing (its points came from the cache)" in log.stop_reason
    # a search that measured 16 only (the rest cached): 2 and 4 are costed as 16's probe, 2·(16 + 16 + 16) > 16
    log.seconds[(16, False)] = 16.0
    assert confirm_knee(measure, points, ChoiceConfig(tolerance=0.15, reference="measured"), log) == points
    assert len(calls) == 5 and "2, 4, 8 would take about 96.0 s, more than the 16.0 s left" in log.stop_reason


def test_a_short_search_still_gets_the_minimum_confirmation():
    """A search of cheap probes (15 units here, a tiny model's 2-5 s on a CPU) gets min_budget_s of
    re-measurement anyway: 2, 4, 8 twice (28) fits 30, where 1 × the search's 15 did not."""
    measure, calls, log = _scripted({2: [190.0]})
    points = _measured(measure, log, (1, 2, 4, 8))
    assert confirm_knee(measure, points, CHOICE, log, min_budget_s=0.0) == points and len(calls) == 4
    measure, calls, log = _scripted({2: [190.0]})
    points = _measured(measure, log, (1, 2, 4, 8))
    confirmed = confirm_knee(measure, points, CHOICE, log, min_budget_s=30.0)
    assert calls[4:] == [2, 4, 8, 2, 4, 8] and _knee(confirmed) == 4
    measure, calls, log = _scripted({2: [190.0]})
    points = _measured(measure, log, (1, 2, 4, 8))
    assert confirm_knee(measure, points, CHOICE, log, budget=0.0, min_budget_s=30.0) == points  # 0: off


def test_a_knee_that_is_the_fastest_has_its_indistinguishable_neighbour_below_measured_again():
    """b_m 4 measured once in a busy moment (150 for 180): the knee is 8, the largest and fastest point,
    which had nothing to be compared with; the noise cannot tell 4 from it, so both are measured again
    and the knee comes back to 4."""
    measure, calls, log = _scripted({4: [150.0]})
    points = _measured(measure, log, (1, 2, 4, 8))
    rec = recommend([curve_point(p) for p in points], CHOICE)
    assert rec.knee.micro_batch == 8 == rec.fastest.micro_batch and 4 in rec.indistinguishable
    confirmed = confirm_knee(measure, points, CHOICE, log, min_budget_s=100.0)
    assert calls[4:6] == [4, 8] and _knee(confirmed) == 4


def test_the_machines_noise_pooled_over_the_re_measured_points_is_every_points_floor():
    from microbatch.choose.confirm_rules import pooled_scatter

    # by hand: groups (100, 110, 90) and (200, 220): deviations from each mean 0, .1, -.1 and -1/21, 1/21
    sigma = pooled_scatter([[100.0, 110.0, 90.0], [200.0, 220.0]])
    assert sigma == pytest.approx(math.sqrt((0.01 + 0.01 + 2 / 21**2) / 3))
    assert pooled_scatter([[5.0]]) == 0.0
    # 4 re-measured at 150 then 210 (the machine drifting by ±17%): every point now carries that noise
    measure, calls, log = _scripted({4: [150.0, 210.0, 180.0]})
    points = _measured(measure, log, (1, 2, 4, 8, 16))
    confirmed = confirm_knee(measure, points, CHOICE, log, budget=math.inf)
    once = next(p for p in confirmed if p.micro_batch == 1)  # never re-measured: one draw of the noise
    assert once.throughput_se is not None and once.throughput_se > 0.05
    assert recommend([curve_point(p) for p in confirmed], CHOICE).indistinguishable != (4,)


def test_a_knee_at_the_end_of_the_search_is_compared_with_the_point_below_it():
    """The knee is the largest and fastest point (4 dipped once to 120, 2 at 150, 8 at 200): it had
    nothing to be compared with, and the noise estimate sees nothing (the dip is too deep for the
    step-time line to call it noise: residual_scatter 0); the point below is measured again with it,
    whatever that estimate says, and the knee comes back to 4."""
    measure, calls, log = _scripted({4: [120.0]})
    points = _measured(measure, log, (1, 2, 4, 8))
    no_noise = [replace(p, throughput_se=0.0) for p in points]
    assert recommend([curve_point(p) for p in no_noise], CHOICE).indistinguishable == (8,)
    confirmed = confirm_knee(measure, no_noise, CHOICE, log, min_budget_s=100.0)
    assert calls[4:6] == [4, 8] and _knee(confirmed) == 4
