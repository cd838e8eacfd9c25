"""The batch identity B_global = b_m × g × d: solve derives the missing one; bad inputs name value, rule and fix."""

from __future__ import annotations

import itertools
import re

import pytest

from microbatch.batch import (
    DEFAULT_KNEE_TOLERANCE,
    LADDER_MIN_RATIO,
    BatchConfig,
    check_data_parallel,
    check_micro_batch,
    divisors,
    global_batch_of,
    grad_accum_for,
    nearest_multiples,
    next_micro_batch,
    per_replica,
    solve,
)
from microbatch.errors import ConfigError

FIELDS = ("global_batch", "micro_batch", "grad_accum", "data_parallel")


def config(b: int, g: int, d: int) -> dict[str, int]:
    return {"global_batch": b * g * d, "micro_batch": b, "grad_accum": g, "data_parallel": d}


@pytest.mark.parametrize("missing", FIELDS)
def test_solve_recovers_each_missing_unknown(missing):
    """For every (b_m, g, d) on a grid, leaving one out and solving gives it back, and b_m·g·d = B."""
    for b, g, d in itertools.product((1, 2, 3, 8), (1, 4, 6), (1, 2, 5)):
        full = config(b, g, d)
        given = {k: v for k, v in full.items() if k != missing}
        got = solve(**given)
        assert got.to_dict() == full
        assert got.micro_batch * got.grad_accum * got.data_parallel == got.global_batch


def test_solve_values():
    assert solve(global_batch=512, micro_batch=8, data_parallel=4).grad_accum == 16
    assert solve(global_batch=512, grad_accum=16, data_parallel=4).micro_batch == 8
    assert solve(global_batch=512, micro_batch=8, grad_accum=16).data_parallel == 4
    assert solve(micro_batch=8, grad_accum=4, data_parallel=2).global_batch == 64


def test_data_parallel_defaults_to_one_when_two_are_missing():
    got = solve(global_batch=64, micro_batch=8)
    assert (got.grad_accum, got.data_parallel) == (8, 1)
    got = solve(micro_batch=4, grad_accum=3)
    assert (got.global_batch, got.data_parallel) == (12, 1)


def test_all_four_given_are_checked():
    assert solve(global_batch=64, micro_batch=4, grad_accum=8, data_parallel=2) == BatchConfig(
        global_batch=64, micro_batch=4, grad_accum=8, data_parallel=2
    )
    with pytest.raises(
        ConfigError,
        match=r"^global batch 12 != micro-batch 2 × grad-accum 3 × data-parallel 3 = 18; "
        r"the identity B_global = b_m × g × d must hold: give three of global_batch, micro_batch, grad_accum, "
        r"data_parallel and derive the fourth$",
    ):
        solve(global_batch=12, micro_batch=2, grad_accum=3, data_parallel=3)


def test_not_divisible_names_value_rule_and_nearest_valid_global_batches():
    with pytest.raises(ConfigError) as info:
        solve(global_batch=500, micro_batch=8, data_parallel=4)
    msg = str(info.value)
    assert re.fullmatch(
        r"global batch 500 is not divisible by micro-batch 8 × data-parallel 4 = 32; "
        r"the rule is B_global = b_m × g × d; nearest valid global batches: 480, 512; "
        r"or micro-batch in 1, 5, 25",
        msg,
    ), msg


@pytest.mark.parametrize(
    "given",
    [
        {"global_batch": 500, "micro_batch": 8, "data_parallel": 4},
        {"global_batch": 100, "micro_batch": 8, "grad_accum": 3},
        {"global_batch": 7, "grad_accum": 2, "data_parallel": 3},
        {"global_batch": 1000, "micro_batch": 6, "grad_accum": 7, "data_parallel": None},
    ],
)
def test_the_suggested_fixes_are_valid(given):
    """Every global batch and every factor the error suggests solves without error."""
    given = {k: v for k, v in given.items() if v is not None}
    with pytest.raises(ConfigError, match=r"is not divisible by .* = (\d+); the rule is") as info:
        solve(**given)
    msg = str(info.value)
    unit = int(re.search(r"= (\d+); the rule", msg).group(1))
    nearest = [
        int(n) for n in re.search(r"nearest valid global batches: ([\d, ]+)", msg).group(1).split(", ")
    ]
    assert nearest and all(n % unit == 0 for n in nearest)
    assert min(nearest) <= given["global_batch"] <= max(nearest)
    for n in nearest:
        assert solve(**{**given, "global_batch": n}).global_batch == n
    for name, values in re.findall(r"or ([a-z-]+) in ([\d, ]+)", msg):
        field = name.replace("-", "_")
        for v in (int(x) for x in values.split(", ")):
            solve(**{**given, field: v})  # a suggested factor makes B divisible


@pytest.mark.parametrize("field", FIELDS)
@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "8"])
def test_bad_values_name_the_value_the_rule_and_the_fix(field, bad):
    given = {"global_batch": 64, "micro_batch": 8, "grad_accum": 4, "data_parallel": 2}
    given[field] = bad
    # the library names the parameter, never the flag (the CLI writes --micro-batch: commands/_flags.py)
    pattern = rf"^{field} must be a whole number >= 1, got {re.escape(repr(bad))}; give .*e\.g\. {field} \d+"
    with pytest.raises(ConfigError, match=pattern) as info:
        solve(**given)
    assert "--" not in str(info.value) and info.value.params == (field,)
    with pytest.raises(ConfigError, match=pattern):
        BatchConfig(**given)


def test_too_many_missing():
    with pytest.raises(
        ConfigError,
        match=r"^give three of global_batch, micro_batch, grad_accum, data_parallel; "
        r"missing: global_batch, grad_accum$",
    ):
        solve(micro_batch=8)
    with pytest.raises(ConfigError, match=r"missing: micro_batch, grad_accum$"):
        solve(global_batch=64, data_parallel=2)


def test_batch_config_derived_values():
    c = BatchConfig(global_batch=96, micro_batch=2, grad_accum=12, data_parallel=4)
    assert c.per_replica_batch == 24
    assert [c.microbatches(k) for k in (1, 2, 3, 12)] == [12, 6, 4, 1]
    with pytest.raises(
        ConfigError,
        match=r"^grad-accum 12 is not divisible by flushes 5; the rule is g = m × k; "
        r"choose flushes among 1, 2, 3, 4, 6, 12$",
    ):
        c.microbatches(5)
    with pytest.raises(ConfigError, match=r"^flushes must be a whole number >= 1, got 0"):
        c.microbatches(0)
    assert BatchConfig(global_batch=8, micro_batch=8, grad_accum=1).data_parallel == 1


def test_divisors_and_nearest_multiples():
    assert divisors(1) == [1]
    assert divisors(12) == [1, 2, 3, 4, 6, 12]
    assert divisors(49) == [1, 7, 49]
    for n in range(1, 200):
        assert divisors(n) == [k for k in range(1, n + 1) if n % k == 0]
    assert nearest_multiples(500, 32) == [480, 512]
    assert nearest_multiples(1_000_000_000, 7) == [
        999_999_994
    ]  # 1,000,000,001 is past the limit it would meet
    assert nearest_multiples(512, 32) == [512]
    assert nearest_multiples(10, 32) == [32]  # no positive multiple below


def _ladder(per, start=1):
    out, b = [start], start
    while (b := next_micro_batch(b, per)) is not None:
        out.append(b)
    return out


def test_search_ladder_steps_along_the_divisors_of_the_per_replica_batch():
    assert _ladder(64) == [1, 2, 4, 8, 16, 32, 64]  # a power of two: plain doubling
    assert _ladder(96) == [1, 2, 4, 8, 16, 32, 48, 96]
    assert _ladder(63) == [1, 3, 7, 21, 63]
    assert _ladder(1000) == [1, 2, 4, 8, 20, 40, 100, 200, 500, 1000]
    assert next_micro_batch(5) == 10 and next_micro_batch(64, 64) is None  # no B given: doubling
    for per in (6, 12, 63, 96, 100, 360, 997, 1000, 1024, 1536):
        steps = _ladder(per)
        assert steps[-1] == per and all(per % b == 0 for b in steps)  # every b_m gives an exact B
        # each step at least 1.5x (the noise of a gain per doubling), but the last one onto B/d
        assert all(b2 >= LADDER_MIN_RATIO * b1 for b1, b2 in zip(steps[:-2], steps[1:-1], strict=True))
        assert all(b2 <= 4 * b1 or per < 4 * b1 or b2 == min(d for d in divisors(per) if d >= 1.5 * b1)
                   for b1, b2 in zip(steps, steps[1:], strict=False))  # fmt: skip


def test_g_and_the_per_replica_batch_are_derived_in_one_place():
    """grad_accum_for and per_replica are B = b_m·g·d read backwards: exact when they divide, rounded
    down (g) or None (B/d) when not; every exact (B, b_m, d) they give is a valid BatchConfig."""
    assert grad_accum_for(512, 8, 4) == 16 and grad_accum_for(500, 8, 4) == 15 and grad_accum_for(8, 16) == 0
    assert per_replica(96, 4) == 24 and per_replica(97, 4) is None and per_replica(7) == 7
    for B, d in itertools.product((1, 6, 96, 100, 1000), (1, 2, 3, 4)):
        per = per_replica(B, d)
        assert (per is None) == (B % d != 0)
        for b in divisors(per) if per else ():
            g = grad_accum_for(B, b, d)
            assert (
                BatchConfig(global_batch=B, micro_batch=b, grad_accum=g, data_parallel=d).per_replica_batch
                == per
            )


def test_the_divisibility_checks_give_the_value_the_rule_and_the_fix():
    """check_data_parallel and check_micro_batch return B/d and g where they divide, and otherwise name the
    values, the identity and valid choices (each of which passes)."""
    assert check_data_parallel(96, 4) == 24 and check_micro_batch(96, 3, 4) == 8
    assert global_batch_of(3, 8, 4) == 96
    with pytest.raises(ConfigError, match=r"global batch 100 is not divisible by data-parallel 8; .*use global "
                       r"batch 96 or 104, or a data-parallel among \[1, 2, 4, 5, 10"):  # fmt: skip
        check_data_parallel(100, 8)
    with pytest.raises(ConfigError, match=r"global batch 3 is .*use global batch 8, or"):
        check_data_parallel(3, 8)
    with pytest.raises(ConfigError, match=r"micro-batch 5 does not divide the per-replica batch B/d = 96/4 = 24; "
                       r"B_global = b_m × g × d must hold; use a micro-batch among \[1, 2, 3, 4, 6, 8, 12, 24\]"):  # fmt: skip
        check_micro_batch(96, 5, 4)
    for b in divisors(24):
        g = check_micro_batch(96, b, 4)
        assert BatchConfig(global_batch=96, micro_batch=b, grad_accum=g, data_parallel=4).grad_accum == g


def test_one_knee_tolerance():
    """tune's default τ and the planner's are the one constant (the same object), 15%."""
    from microbatch.choose.config import DEFAULT_TOLERANCE
    from microbatch.predict.plan_config import PLAN_TOLERANCE

    assert DEFAULT_TOLERANCE is DEFAULT_KNEE_TOLERANCE and PLAN_TOLERANCE is DEFAULT_KNEE_TOLERANCE
    assert DEFAULT_KNEE_TOLERANCE == 0.15
