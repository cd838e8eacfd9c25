"""DualPipeV: our generator equals torch's ScheduleDualPipeV, its rules, its in-flight count, its bubble."""

from __future__ import annotations

import pytest

from microbatch.errors import ScheduleError
from microbatch.schedules.registry import check_servable, generate, get_spec, in_flight_chunks
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
    """Equal op times (F = I = W = 1, B = 2): DualPipeV's idle per rank is (p − 1)·T_F, a third of
    1F1B's (p − 1)(T_F + T_B) on the same work (both measured by the event simulation)."""
    m = 2 * p
    dpv = simulate(generate("dualpipev", p, m, 2), forward_time=0.5, input_time=0.5, weight_time=0.5)
    one = simulate(generate("1f1b", p, m), forward_time=1.0, backward_time=2.0)
    assert dpv.idle == pytest.approx([(p - 1) * 0.5] * p)
    assert one.idle == pytest.approx([(p - 1) * 3.0] * p)
    assert dpv.makespan < one.makespan


def test_memory_model_reads_dualpipev_two_chunks_per_rank_and_the_head_on_rank_0():
    """predict/memory with DualPipeV: 2p + 1 chunks of half a rank's layers in flight on every rank,
    and rank 0 holds both the embedding and the output layer (the V comes back to it)."""
    from microbatch.model import get_model
    from microbatch.predict.memory import MemoryConfig, estimate_memory, layer_activation_bytes

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
