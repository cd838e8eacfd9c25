"""DualPipeV: our generator equals torch's ScheduleDualPipeV, its rules, its in-flight count, its bubble."""

from __future__ import annotations

import pytest

from microbatch.errors import ScheduleError
from microbatch.schedules.in_flight import in_flight_chunks
from microbatch.schedules.registry import check_servable, generate, get_spec
from microbatch.schedules.simulate import simulate
from microbatch.schedules.validate import validate


def _torch_dualpipev(p: int, m: int) -> dict[int, list[str]]:
    """torch's planned order, each overlapped forward+backward written as its parts (F first)."""
    from torch.distributed.pipelining.schedules import ScheduleDualPipeV

    obj = object.__new__(ScheduleDualPipeV)
    obj.pp_group_size, obj._n_microbatches = p, m
    out: dict[int, list[str]] = {}
    for r in range(p):
        ops: list[str] = []
        for a in obj._calculate_single_rank_operations(r):
            if a is None:
                continue
            ops += [str(x) for x in a.sub_actions] if a.sub_actions else [str(a)]
        out[r] = ops
    return out


@pytest.mark.parametrize("p,m", [(1, 2), (2, 4), (2, 7), (3, 6), (3, 11), (4, 8), (4, 13), (5, 10), (6, 20)])
def test_dualpipev_order_equals_torch(p, m):
    ours = generate("dualpipev", p, m, 2)
    theirs = _torch_dualpipev(p, m)
    for r in range(p):
        assert [str(a) for a in ours.actions[r]] == theirs[r], r
    validate(ours)
    # both kinds of backward: full B while forwards remain, I + W in the tail (when p > 1)
    if p > 1:
        assert {a.kind for r in ours.actions for a in r} == {"F", "B", "I", "W"}


def test_dualpipev_v_placement_two_stages_per_rank():
    s = generate("dualpipev", 3, 6, 2)
    for r, acts in enumerate(s.actions):
        assert {a.stage for a in acts} == {r, 2 * 3 - 1 - r}
    assert get_spec("dualpipe-v").torch_name == "ScheduleDualPipeV"


@pytest.mark.parametrize(
    "p,m,v,rule",
    [
        (2, 4, 1, r"virtual = 1: dualpipev places exactly two stages"),
        (3, 5, 2, r"microbatches = 5 < 2·stages = 6"),
    ],
)
def test_dualpipev_rules_are_torchs(p, m, v, rule):
    with pytest.raises(ScheduleError, match=rule):
        check_servable("dualpipev", p, m, v)


@pytest.mark.parametrize("p", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("extra", [0, 1, 5])
def test_dualpipev_in_flight_rule_is_what_the_simulator_counts(p, extra):
    m = 2 * p + extra
    s = generate("dualpipev", p, m, 2)
    res = simulate(s, forward_time=1.0, input_time=1.0, weight_time=1.0)
    assert list(res.peak_in_flight_chunks) == [in_flight_chunks("dualpipev", i, p, m, 2) for i in range(p)]
    assert set(res.peak_in_flight_chunks) == {2 * p + 1}


@pytest.mark.parametrize("p", [2, 3, 4, 6])
def test_dualpipev_idles_less_than_1f1b(p):
    """Equal op times (F = I = W = 1 per rank's layers, B = 2): DualPipeV's idle per rank is 2(p − 1)·T_F
    of a chunk, a third of 1F1B's (p − 1)(T_F + T_B) on the same layers (a 1F1B stage is two chunks)
    (both measured by the event simulation)."""
    m = 2 * p
    dpv = simulate(generate("dualpipev", p, m, 2), forward_time=0.5, input_time=0.5, weight_time=0.5)
    one = simulate(generate("1f1b", p, m), forward_time=1.0, backward_time=2.0)
    assert dpv.idle == pytest.approx([(p - 1) * 1.0] * p)
    assert one.idle == pytest.approx([(p - 1) * 3.0] * p)
    assert dpv.makespan < one.makespan


def _torch_overlapped(p: int, m: int) -> list[set[int]]:
    """Positions, in the flattened order of :func:`_torch_dualpipev`, of the forwards torch runs inside an
    OVERLAP_F_B step."""
    from torch.distributed.pipelining.schedules import ScheduleDualPipeV

    obj = object.__new__(ScheduleDualPipeV)
    obj.pp_group_size, obj._n_microbatches = p, m
    out = []
    for r in range(p):
        pos, i = set(), 0
        for a in obj._calculate_single_rank_operations(r):
            if a is None:
                continue
            if a.sub_actions:
                assert str(a.sub_actions[0])[1:].startswith("F")
                pos.add(i)
                i += len(a.sub_actions)
            else:
                i += 1
        out.append(pos)
    return out


@pytest.mark.parametrize("p,m", [(1, 2), (2, 4), (3, 7), (4, 8), (5, 13)])
def test_dualpipev_overlapped_steps_are_torchs(p, m):
    s = generate("dualpipev", p, m, 2)
    assert [set(x) for x in s.overlapped] == _torch_overlapped(p, m)
    assert all(
        s.actions[r][i].kind == "F" and s.actions[r][i + 1].kind == "B"
        for r in range(p)
        for i in s.overlapped[r]
    )
    assert s.to_dict()["overlapped"] == [sorted(x) for x in s.overlapped]
    assert generate("zbv", p, m, 2).overlapped == ()  # other schedules have none


def test_an_overlapped_forward_is_sent_after_the_paired_action():
    """Two ranks, hand-written: rank 0 runs F of stage 0 overlapped with a 3-unit backward of another
    micro-batch; rank 1's forward of stage 1 can start only when the pair ends (1 + 3), not when the
    forward ends (1). Without the pairing it starts at 1."""
    from microbatch.schedules.action import Schedule

    acts = (
        ("0F0", "0F1", "0B0"),
        ("1F0", "1B0", "1F1", "1B1"),
    )
    plain = Schedule.from_strings("hand", acts, microbatches=2)
    paired = Schedule(name="hand", stages=2, microbatches=2, actions=plain.actions,
                      overlapped=(frozenset({1}), frozenset()))  # fmt: skip
    kw = dict(forward_time=1.0, backward_time=3.0)
    starts = {str(a): st for r in simulate(plain, **kw).intervals for st, _, a in r}
    starts_p = {str(a): st for r in simulate(paired, **kw).intervals for st, _, a in r}
    assert starts["1F1"] == 5.0  # after 1B0 (1 + 1 + 3) on rank 1 either way
    assert starts_p["0B0"] == 2.0 + 3.0 - 3.0 + 3.0  # 1B0 ends at 5: 0B0 starts at max(2, 5) = 5
    with pytest.raises(ScheduleError, match="overlapped positions \\[2\\] are not forwards"):
        Schedule(
            name="hand",
            stages=2,
            microbatches=2,
            actions=plain.actions,
            overlapped=(frozenset({2}), frozenset()),
        )


def test_memory_model_reads_dualpipev_two_chunks_per_rank_and_the_head_on_rank_0():
    """predict/memory with DualPipeV: 2p + 1 chunks of half a rank's layers in flight on every rank,
    and rank 0 holds both the embedding and the output layer (the V comes back to it)."""
    from microbatch.model import get_model
    from microbatch.predict.activations import layer_activation_bytes
    from microbatch.predict.memory import MemoryConfig, estimate_memory

    shape = get_model("gpt2")
    p, m = 3, 8
    est = estimate_memory(
        shape,
        MemoryConfig(micro_batch=1, pipeline_parallel=p, virtual=2, microbatches=m, schedule="dualpipev"),
    )
    per_layer = layer_activation_bytes(shape, 1, dtype_bytes=2)
    for st in est.stages:
        assert st.activation_terms["layers"] == pytest.approx(per_layer * (2 * p + 1) * st.layers / 2)
    assert "output" in est.stages[0].activation_terms and "embedding" in est.stages[0].activation_terms
    assert "output" not in est.stages[-1].activation_terms
    assert est.stages[0].params > est.stages[-1].params  # embedding and head on rank 0


# -- the closed form ---------------------------------------------------------------------------

# (T_F, T_I, T_W) per chunk: equal; W = I/2; F > I (first term); I > F (second term takes over as p
# grows); I much larger; F = I + W (the edge of the rule); W = I (the other edge)
_EXACT_TIMES = [
    (1, 1, 1),
    (1, 1, 0.5),
    (2, 1.5, 0.5),
    (1, 1.3, 0.7),
    (1, 2, 1),
    (1, 3, 0.5),
    (1.5, 1, 0.5),
    (1, 2, 2),
]


@pytest.mark.parametrize("tf,ti,tw", _EXACT_TIMES)
def test_dualpipev_closed_form_equals_simulation_where_its_rule_holds(tf, ti, tw):
    """idle = max((p−1)(2T_F+T_I−T_W), (p−1)(T_F+2T_I−T_W) − T_F) on every rank, for every m >= 2p, when
    T_W <= T_I: the makespan is the closed form plus 2m(T_F+T_I+T_W)."""
    from microbatch.schedules.simulate import dualpipev_closed_form_holds, dualpipev_idle_time

    assert dualpipev_closed_form_holds(tf, ti, tw)
    for p in (1, 2, 3, 4, 5, 7):
        for m in (2 * p, 2 * p + 1, 3 * p + 2, 6 * p):
            res = simulate(generate("dualpipev", p, m, 2), forward_time=tf, input_time=ti, weight_time=tw)
            idle = dualpipev_idle_time(p, tf, ti, tw)
            assert res.idle == pytest.approx([idle] * p, abs=1e-9), (p, m)
            assert res.makespan == pytest.approx(idle + 2 * m * (tf + ti + tw), abs=1e-9)


def test_dualpipev_closed_form_second_term_is_needed():
    """With T_I > T_F the first term alone under-counts once p is large: at (1, 1.3, 0.7) and p = 7 the
    simulation idles 16.4 = 6·2.9 − 1, not 6·2.6 = 15.6."""
    from microbatch.schedules.simulate import dualpipev_idle_time

    res = simulate(generate("dualpipev", 7, 14, 2), forward_time=1, input_time=1.3, weight_time=0.7)
    assert res.idle[0] == pytest.approx(16.4)
    assert dualpipev_idle_time(7, 1, 1.3, 0.7) == pytest.approx(16.4)
    assert 6 * (2 * 1 + 1.3 - 0.7) < 16.4 - 1e-9


@pytest.mark.parametrize("tf,ti,tw", [(1, 0.5, 1), (1, 1, 1.5), (2, 0.25, 0.5), (1, 0.25, 3)])
def test_dualpipev_closed_form_is_a_lower_bound_outside_its_rule(tf, ti, tw):
    from microbatch.schedules.simulate import dualpipev_closed_form_holds, dualpipev_idle_time

    assert not dualpipev_closed_form_holds(tf, ti, tw)
    strict = False
    for p in (2, 3, 5):
        res = simulate(generate("dualpipev", p, 2 * p + 1, 2), forward_time=tf, input_time=ti, weight_time=tw)
        assert min(res.idle) >= dualpipev_idle_time(p, tf, ti, tw) - 1e-9
        strict |= min(res.idle) > dualpipev_idle_time(p, tf, ti, tw) + 1e-9
    assert strict  # and it is not exact there


def test_dualpipev_closed_form_against_the_deepseek_report():
    """The report's (PP/2 − 1)(T_F&B + T_B − 3·T_W) for DualPipeV, with PP = 2p and T_F&B = T_F + T_B (torch
    runs the overlapped step's parts one after the other), is ours when T_F = T_I, and (p−1)(T_F − T_I)
    less when the forward is slower; the simulation sides with ours."""
    from microbatch.schedules.simulate import dualpipev_idle_time

    for p in (2, 4, 6):
        for tf, ti, tw in ((1.0, 1.0, 1.0), (1.0, 1.0, 0.5), (2.0, 1.5, 1.0)):
            tb = ti + tw
            report = (2 * p / 2 - 1) * ((tf + tb) + tb - 3 * tw)
            ours = dualpipev_idle_time(p, tf, ti, tw)
            assert ours - report == pytest.approx((p - 1) * (tf - ti))
            res = simulate(
                generate("dualpipev", p, 2 * p + 1, 2), forward_time=tf, input_time=ti, weight_time=tw
            )
            assert res.idle[0] == pytest.approx(ours)


def _bubble_json(args, capsys):
    import json

    from microbatch.cli import main

    code = main(["bubble", *args, "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    return json.loads(out.out)


def test_bubble_cli_dualpipev_huge_m_is_the_closed_form_without_a_schedule(capsys):
    import time

    t0 = (
        time.process_time()
    )  # CPU time: a schedule of 10^9 micro-batches would take minutes of it, at any load
    d = _bubble_json(["-s", "dualpipev", "-p", "4", "-m", "1000000000"], capsys)
    assert time.process_time() - t0 < 1.0
    assert d["method"].startswith("closed form") and "2412.19437" in d["method"]
    assert d["simulated_bubble_fraction"] is None  # no schedule was built
    assert d["idle_time_per_stage"] == 6.0  # 2(p − 1)·T_F, default times 1
    busy = 2 * 1_000_000_000 * 3.0
    assert d["bubble_fraction"] == pytest.approx(6.0 / (6.0 + busy))
    assert d["peak_in_flight"] == [4.5] * 4


@pytest.mark.parametrize("times,closed", [((1, 2, 1), True), ((1, 1.3, 0.7), True), ((1, 0.5, 1), False)])
def test_bubble_cli_dualpipev_agrees_with_the_simulation(capsys, times, closed):
    tf, ti, tw = times
    d = _bubble_json(
        ["-s", "dualpipev", "-p", "5", "-m", "13", "--forward-time", str(tf), "--input-time", str(ti),
         "--weight-time", str(tw)],
        capsys,
    )  # fmt: skip
    res = simulate(generate("dualpipev", 5, 13, 2), forward_time=tf, input_time=ti, weight_time=tw)
    assert d["bubble_fraction"] == pytest.approx(res.bubble_fraction)
    assert d["idle_time_per_stage"] == pytest.approx(res.idle[0])
    assert d["method"].startswith("closed form") is closed
    assert any("needs T_W <= T_I" in n for n in d["notes"]) is not closed
