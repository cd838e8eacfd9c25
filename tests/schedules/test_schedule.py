"""Schedules as data: printing, parsing, generators, validation, servability, torch's order."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from microbatch.errors import ConfigError, ScheduleError
from microbatch.schedules.action import Action, Schedule, stage_to_rank
from microbatch.schedules.registry import (
    SCHEDULES,
    ScheduleSpec,
    check_servable,
    generate,
    register_schedule,
)
from microbatch.schedules.validate import validate


def test_action_prints_like_torch_and_parses_back():
    a = Action(2, "F", 0)
    assert str(a) == "2F0"
    assert Action.parse("2F0") == a
    for text in ["0B13", "17I4", "5W0"]:
        assert str(Action.parse(text)) == text
    assert len({Action(1, "B", 2), Action.parse("1B2")}) == 1  # hashable, equal


@pytest.mark.parametrize("bad", ["2X0", "F0", "2F", "-1F0", "2 F 0"])
def test_action_parse_rejects_malformed(bad):
    with pytest.raises(ConfigError, match="<stage><kind><microbatch>"):
        Action.parse(bad)


def test_stage_to_rank_loop_and_v():
    assert [stage_to_rank(s, 4, "loop") for s in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [stage_to_rank(s, 4, "v") for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]


def test_v_placement_matches_torch():
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    for p, v in [(2, 2), (4, 2), (3, 4)]:
        torch_map = generate_stage_to_rank_mapping(p, p * v, style="v")
        assert [stage_to_rank(s, p, "v") for s in range(p * v)] == [torch_map[s] for s in range(p * v)]


def test_registry_lists_the_four_schedules_and_is_open():
    assert {"gpipe", "1f1b", "interleaved-1f1b", "zb-h1"} <= set(SCHEDULES)

    def gen(p, m, v):
        return [
            [Action(r, "F", i) for i in range(m)] + [Action(r, "B", i) for i in range(m)] for r in range(p)
        ]

    register_schedule(ScheduleSpec(name="test-fill-drain", generate=gen, check=lambda p, m, v: None))
    try:
        s = generate("test-fill-drain", 3, 2)
        validate(s)
        assert s.name == "test-fill-drain" and s.num_actions() == 12
    finally:
        del SCHEDULES["test-fill-drain"]


SIZES = [(1, 1), (2, 2), (3, 5), (4, 4), (4, 8), (5, 7), (8, 16)]


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("p,m", SIZES)
def test_generators_are_valid_and_complete(name, p, m):
    s = generate(name, p, m)
    validate(s)
    per_op = 3 if name == "zb-h1" else 2
    assert s.num_actions() == per_op * p * m
    assert all(len(r) == per_op * m for r in s.actions)


@pytest.mark.parametrize(
    "p,m,v", [(2, 4, 2), (4, 8, 2), (4, 10, 2), (3, 6, 3), (8, 64, 3), (4, 3, 2), (5, 7, 3)]
)
def test_interleaved_is_valid(p, m, v):
    s = generate("interleaved-1f1b", p, m, v)
    validate(s)
    assert s.num_actions() == 2 * p * v * m
    for r, acts in enumerate(s.actions):
        assert {a.stage % p for a in acts} == {r}


def test_gpipe_serves_m_below_p():
    s = generate("gpipe", 4, 1)
    validate(s)
    assert s.format().splitlines()[0] == "rank 0: 0F0 0B0"


def test_1f1b_order_literal():
    s = generate("1f1b", 4, 8)
    assert (
        " ".join(map(str, s.actions[0])) == "0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 0B2 0F6 0B3 0F7 0B4 0B5 0B6 0B7"
    )
    assert (
        " ".join(map(str, s.actions[3])) == "3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5 3F6 3B6 3F7 3B7"
    )


def test_schedule_round_trips_through_strings():
    s = generate("zb-h1", 3, 4)
    back = Schedule.from_strings("zb-h1", s.to_dict()["actions"], microbatches=4)
    assert back.actions == s.actions


# --- torch's own orders -------------------------------------------------------------------


def _torch_compute_order(actions):
    return [str(a) for a in actions if a is not None and a.computation_type.value in ("F", "B", "I", "W")]


def _torch_single(cls, p, m):
    sched = object.__new__(cls)
    sched._num_stages = p
    sched._n_microbatches = m
    return {r: _torch_compute_order(acts) for r, acts in sched._get_pipeline_order().items()}


@pytest.mark.parametrize("p,m", [(2, 2), (3, 5), (4, 4), (4, 8), (6, 13)])
def test_gpipe_order_equals_torch(p, m):
    from torch.distributed.pipelining.schedules import ScheduleGPipe

    theirs = _torch_single(ScheduleGPipe, p, m)
    ours = generate("gpipe", p, m)
    for r in range(p):
        assert [str(a) for a in ours.actions[r]] == theirs[r], r


@pytest.mark.parametrize("p,m", [(2, 2), (3, 5), (4, 4), (4, 8), (6, 13)])
def test_1f1b_order_equals_torch(p, m):
    """Equal to torch's Schedule1F1B order. torch's ``_get_pipeline_order`` (its drawing of the
    schedule) numbers the last rank's forwards from 1 instead of 0 (it has no warm-up forward to
    count from); its runtime ``_step_microbatches`` runs min(m, p − r) forwards, then B, F, B, …
    from micro-batch 0 — our order. So the last rank is compared with that one shift undone."""
    from torch.distributed.pipelining.schedules import Schedule1F1B

    theirs = _torch_single(Schedule1F1B, p, m)
    ours = generate("1f1b", p, m)
    for r in range(p - 1):
        assert [str(a) for a in ours.actions[r]] == theirs[r], r
    last = [Action.parse(t) for t in theirs[p - 1]]
    shifted = [str(Action(a.stage, a.kind, a.microbatch - 1)) if a.kind == "F" else str(a) for a in last]
    assert [str(a) for a in ours.actions[p - 1]] == shifted
    # and the runtime rule: warm-up min(m, p − r) forwards, then alternate B and F
    for r in range(p):
        warm = min(m, p - r)
        runtime = [f"{r}F{i}" for i in range(warm)]
        f = warm
        for b in range(m):
            runtime.append(f"{r}B{b}")
            if f < m:
                runtime.append(f"{r}F{f}")
                f += 1
        assert [str(a) for a in ours.actions[r]] == runtime


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 8, 2), (4, 10, 2), (4, 3, 2), (3, 9, 3), (8, 64, 3)])
def test_interleaved_order_equals_torch(p, m, v):
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B

    sched = object.__new__(ScheduleInterleaved1F1B)
    sched.pp_group_size = p
    sched.n_local_stages = v
    sched._n_microbatches = m
    sched.number_of_rounds = max(1, m // p)
    sched.microbatches_per_round = m // sched.number_of_rounds
    ours = generate("interleaved-1f1b", p, m, v)
    for r in range(p):
        theirs = _torch_compute_order(sched._calculate_single_rank_operations(r))
        assert [str(a) for a in ours.actions[r]] == theirs, r


# --- validation ---------------------------------------------------------------------------


def _sched(rows, m, p=None):
    return Schedule.from_strings("hand", rows, microbatches=m)


def test_validate_reports_forward_before_upstream_forward_as_deadlock():
    # rank 1 waits for 0F1 first, but rank 0 runs 0B0 (needs 1B0) before 0F1.
    s = _sched([["0F0", "0B0", "0F1", "0B1"], ["1F1", "1F0", "1B0", "1B1"]], 2)
    with pytest.raises(ScheduleError, match=r"rank 0 position 1 \(0B0\) needs 1B0 \(rank 1 position 2\)"):
        validate(s)


def test_validate_reports_backward_before_its_forward_on_same_rank():
    s = _sched([["0B0", "0F0"]], 1)
    with pytest.raises(ScheduleError, match=r"rank 0 position 0 \(0B0\) needs 0F0 .*later in its own list"):
        validate(s)


def test_validate_reports_w_before_i():
    s = _sched([["0F0", "0W0", "0I0"]], 1)
    with pytest.raises(ScheduleError, match=r"position 1 \(0W0\) needs 0I0"):
        validate(s)


def test_validate_reports_missing_and_misplaced_actions():
    with pytest.raises(ScheduleError, match=r"missing action 1B0"):
        validate(_sched([["0F0", "0B0"], ["1F0"]], 1))
    with pytest.raises(ScheduleError, match=r"rank 0 position 1 \(1F0\): stage 1 belongs to rank 1"):
        validate(_sched([["0F0", "1F0", "0B0"], ["1B0"]], 1))
    with pytest.raises(ScheduleError, match=r"duplicate"):
        validate(_sched([["0F0", "0F0", "0B0"]], 1))
    with pytest.raises(ScheduleError, match=r"micro-batch 3 is outside"):
        validate(_sched([["0F3", "0B3"]], 1))


def test_validate_accepts_all_generated_and_rejects_a_swapped_pair():
    s = generate("1f1b", 3, 3)
    validate(s)
    rows = [list(map(str, r)) for r in s.actions]
    i = rows[2].index("2B0")
    rows[2][i], rows[2][i - 1] = rows[2][i - 1], rows[2][i]  # 2B0 before 2F0
    with pytest.raises(ScheduleError, match=r"rank 2 position 0 \(2B0\) needs 2F0"):
        validate(_sched(rows, 3))


# --- servability --------------------------------------------------------------------------


def test_unknown_schedule_lists_known_ones():
    with pytest.raises(ConfigError, match=r"schedule 'pipedream' is unknown; known schedules: gpipe, 1f1b"):
        generate("pipedream", 4, 8)


def test_1f1b_needs_m_at_least_p_per_torch():
    with pytest.raises(
        ScheduleError, match=r"microbatches = 3 < stages = 4: torch's Schedule1F1B needs m >= p"
    ):
        check_servable("1f1b", 4, 3)


def test_interleaved_rule_is_torchs():
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B  # noqa: F401 (the rule's owner)

    check_servable("interleaved-1f1b", 4, 10, 2)  # rounds 2, 10 % 2 == 0
    check_servable("interleaved-1f1b", 4, 3, 2)  # rounds 1
    with pytest.raises(
        ScheduleError,
        match=r"ScheduleInterleaved1F1B needs m to be a multiple of .* = 2; use microbatches 8 or 10$",
    ) as err:
        check_servable("interleaved-1f1b", 4, 9, 2)
    assert err.value.params == ("microbatches", "stages")


@pytest.mark.parametrize("schedule, v", [("interleaved-1f1b", 2), ("zb-interleaved", 2), ("zb-h1", 1)])
def test_whole_rounds_suggestions_are_accepted(schedule, v):
    """The m a refusal suggests is one torch takes: the rounds move with m (23 over 4 ranks is 5 rounds, the
    next multiple of 5, 25, is 6 rounds and refused), so both suggestions are searched (a review found the upper
    one refused in 477 (p, m) pairs per schedule for p <= 12)."""
    import re

    with pytest.raises(ScheduleError, match=r"use microbatches 20 or 24$"):
        check_servable(schedule, 4, 23, v)
    refused = 0
    for p in range(2, 9):
        for m in range(p + 1, 6 * p):
            try:
                check_servable(schedule, p, m, v)
            except ScheduleError as e:
                refused += 1
                lo, hi = map(int, re.search(r"use microbatches (\d+) or (\d+)$", str(e)).groups())
                assert lo < m < hi
                check_servable(schedule, p, lo, v)  # raises if the suggestion is refused in turn
                check_servable(schedule, p, hi, v)
                for between in range(lo + 1, hi):  # nothing nearer was left out
                    with pytest.raises(ScheduleError):
                        check_servable(schedule, p, between, v)
    assert refused > 50


def test_single_stage_schedules_refuse_virtual():
    for name in ["gpipe", "1f1b", "zb-h1"]:
        with pytest.raises(
            ScheduleError, match=re.escape(f"virtual = 2: {name} runs one stage per rank")
        ) as err:
            check_servable(name, 4, 8, 2)
        assert "--" not in str(err.value) and "use virtual 1, or schedule interleaved-1f1b" in str(err.value)


@pytest.mark.parametrize(
    "field,args", [("stages", (0, 4, 1)), ("microbatches", (4, 0, 1)), ("virtual", (4, 4, 0))]
)
def test_sizes_below_one_are_refused(field, args):
    with pytest.raises(ConfigError, match=rf"{field} must be a whole number >= 1"):
        check_servable("gpipe", *args)


# --- every servable (p, m, v) yields a valid schedule (hypothesis) --------------------------


@settings(max_examples=80, deadline=None)
@given(
    name=st.sampled_from(["gpipe", "1f1b", "interleaved-1f1b", "zb-h1"]),
    p=st.integers(1, 7),
    m=st.integers(1, 20),
    v=st.integers(1, 4),
)
def test_servable_sizes_generate_valid_schedules(name, p, m, v):
    if name != "interleaved-1f1b":
        v = 1
    try:
        check_servable(name, p, m, v)
    except ScheduleError:
        return  # refused with the rule named (tested above)
    s = generate(name, p, m, v)
    validate(s)
    kinds = {a.kind for r in s.actions for a in r}
    assert kinds == ({"F", "I", "W"} if name == "zb-h1" else {"F", "B"})


@pytest.mark.parametrize("p,m", [(2, 2), (2, 6), (3, 6), (4, 8), (5, 10)])
def test_zb_h1_order_equals_torchs_zero_bubble_with_one_stage_per_rank(p, m):
    from torch.distributed.pipelining.schedules import ScheduleInterleavedZeroBubble

    z = object.__new__(ScheduleInterleavedZeroBubble)
    z.pp_group_size, z.n_local_stages, z._n_microbatches = p, 1, m
    z.number_of_rounds = max(1, m // p)
    z.microbatches_per_round = m // z.number_of_rounds
    ours = generate("zb-h1", p, m)
    for r in range(p):
        theirs = _torch_compute_order(z._calculate_single_rank_operations(r))
        assert [str(a) for a in ours.actions[r]] == theirs, r


# --- the one registry: aliases, in-flight rule, torch class, choices ------------------------


def test_aliases_resolve_to_one_spec():
    from microbatch.schedules.registry import get_spec

    assert get_spec("Interleaved").name == "interleaved-1f1b"
    assert get_spec("zb").name == get_spec("zero-bubble").name == "zb-interleaved"
    assert get_spec("zb-v").name == "zbv"
    assert generate("interleaved", 2, 4, 2).name == "interleaved-1f1b"


def test_names_filtered_by_what_the_spec_holds():
    from microbatch.schedules.registry import schedule_names

    assert schedule_names(in_flight=True) == ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "dualpipev")
    assert set(schedule_names(torch=True)) == {
        "dualpipev",
        "gpipe",
        "1f1b",
        "interleaved-1f1b",
        "zb-h1",
        "zbv",
        "zb-interleaved",
    }
    assert set(schedule_names(aliases=True)) - set(schedule_names()) == {
        "interleaved",
        "zb",
        "zero-bubble",
        "zb-v",
        "dualpipe-v",
        "dual-pipe-v",
    }


def test_torch_spec_follows_run_as_and_refuses_a_schedule_torch_lacks():
    from microbatch.schedules.registry import torch_spec

    assert torch_spec("zb-h1").name == "zb-interleaved"
    assert torch_spec("zb-h1").torch_name == "ScheduleInterleavedZeroBubble"
    assert torch_spec("1f1b").torch_name == "Schedule1F1B"
    register_schedule(
        ScheduleSpec(name="test-no-torch", generate=lambda p, m, v: [], check=lambda p, m, v: None)
    )
    try:
        with pytest.raises(ScheduleError, match=r"'test-no-torch' has no torch.distributed.pipelining class"):
            torch_spec("test-no-torch")
    finally:
        del SCHEDULES["test-no-torch"]


def test_a_name_cannot_shadow_another_schedule():
    with pytest.raises(
        ConfigError, match=r"'interleaved' of 'mine' already names schedule 'interleaved-1f1b'"
    ):
        register_schedule(
            ScheduleSpec(
                name="mine", generate=lambda p, m, v: [], check=lambda p, m, v: None, aliases=("interleaved",)
            )
        )
    assert "mine" not in SCHEDULES


def test_a_schedule_without_in_flight_rule_says_so():
    from microbatch.schedules.in_flight import in_flight_chunks

    with pytest.raises(ConfigError, match=r"'zbv' has no in-flight rule; use one of gpipe, 1f1b"):
        in_flight_chunks("zbv", 0, 2, 4, 2)


@settings(max_examples=120, deadline=None)
@given(
    name=st.sampled_from(["gpipe", "1f1b", "interleaved-1f1b", "zb-h1"]),
    p=st.integers(1, 6),
    m=st.integers(1, 16),
    v=st.integers(1, 4),
)
def test_the_in_flight_rule_is_what_the_simulator_counts(name, p, m, v):
    """The one in-flight rule (chunks per rank) equals the event simulation's peak, for every
    (p, m, v) the schedule serves."""
    from microbatch.schedules.in_flight import in_flight_chunks, in_flight_microbatches
    from microbatch.schedules.simulate import simulate

    if name != "interleaved-1f1b":
        v = 1
    elif v == 1:
        v = 2  # with v = 1 the rule is Megatron's 1F1B (p − i); torch's interleaved order warms up deeper
    try:
        check_servable(name, p, m, v)
    except ScheduleError:
        return
    s = generate(name, p, m, v)
    times = {"input_time": 1.0, "weight_time": 1.0} if s.split_backward else {"backward_time": 2.0}
    res = simulate(s, forward_time=1.0, **times)
    assert [in_flight_chunks(name, i, p, m, v) for i in range(p)] == list(res.peak_in_flight_chunks)
    for i in range(p):
        assert in_flight_microbatches(name, i, p, m, v) == min(m, -(-res.peak_in_flight_chunks[i] // v))
