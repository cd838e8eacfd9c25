"""Pipeline-parallel runs on torch.distributed.pipelining (gloo, CPU, several processes).

Fast tests check the pieces (split, torch's order, rules, loss scaling); the multi-process tests
run the tiny model for 2 steps and check gradients against the unsplit model, in-flight counts
against the formulas, the executed order against torch's, and that failures never hang.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

from microbatch.errors import ConfigError, PipelineError, ScheduleError
from microbatch.run.pipeline.config import PipelineConfig
from microbatch.run.pipeline.instrument import make_loss_fn
from microbatch.run.pipeline.launch import run_pipeline, under_torchrun
from microbatch.run.pipeline.resolved import resolve
from microbatch.run.pipeline.split import balanced_split, model_units, split_units
from microbatch.run.pipeline.summary import predict
from microbatch.schedules.registry import check_servable, stage_ranks
from microbatch.schedules.torch_order import torch_order
from microbatch.show.pipeline_report import chrome_trace

torch = pytest.importorskip("torch")


_RUNS: dict = {}


def run(deadline_s: float = 150, **kw):
    kw.setdefault("steps", 2)
    kw.setdefault("timeout_s", 60)
    return run_pipeline(PipelineConfig(**kw), deadline_s=deadline_s)


def run_cached(**kw):
    """A successful run shared by the tests that read it (each costs seconds on 2 cores)."""
    key = tuple(sorted(kw.items()))
    if key not in _RUNS:
        _RUNS[key] = run(**kw)
    return _RUNS[key]


# -- pieces ---------------------------------------------------------------------------


def test_balanced_split_minimises_the_heaviest_stage():
    assert balanced_split([1, 1, 1, 1], 2) == [2, 2]
    assert balanced_split([4, 1, 1, 1, 1], 2) == [1, 4]
    assert balanced_split([1, 2, 3, 4, 5, 6, 7, 8, 9], 3) == [5, 2, 2]  # 15 | 13 | 17 -> max 17
    assert sum(balanced_split([3, 1, 4, 1, 5, 9, 2, 6], 4)) == 8
    with pytest.raises(ConfigError, match=r"5 stages .* only 4 layers"):
        balanced_split([1, 1, 1, 1], 5)


def test_split_units_of_the_gpt_keeps_the_function():
    from microbatch.measure.gpt import build_model
    from microbatch.model import get_model

    model = build_model(get_model("tiny"), seed=0)
    units = model_units(model)
    assert len(units) == 4  # embed, 2 blocks, head
    stages = split_units(units, balanced_split([sum(p.numel() for p in u.parameters()) for u in units], 3))
    tokens = torch.randint(0, 512, (2, 16))
    x = tokens
    for st in stages:
        x = st(x)
    assert torch.allclose(x, model(tokens), atol=1e-6)
    with pytest.raises(ConfigError, match="stack of layers"):
        model_units(torch.nn.Linear(2, 2))


@pytest.mark.parametrize(
    "name,ours,v",
    [  # GPipe and 1F1B: torch_order is our reading of their loops; tests/schedules compares torch's own
        ("interleaved-1f1b", "interleaved-1f1b", 2),
        ("dualpipev", "dualpipev", 2),
        ("zbv", "zbv", 2),
        ("zb-interleaved", "zb-interleaved", 2),
        ("zb-interleaved", "zb-interleaved", 3),
    ],
)
def test_our_generators_match_torchs_order(name, ours, v):
    from microbatch.schedules.registry import generate

    for p in (2, 3, 4):
        for m in (p, 2 * p, 3 * p):
            if name == "dualpipev" and m < 2 * p:
                continue
            t = torch_order(name, p, m, v)
            g = generate(ours, p, m, v)
            assert [[str(a) for a in r] for r in g.actions] == [t[r] for r in range(p)], (p, m)


def test_torch_zero_bubble_with_one_stage_per_rank_is_zb_h1():
    from microbatch.schedules.registry import generate

    for p, m in [(2, 2), (2, 6), (3, 6), (4, 8)]:
        t = torch_order("zb-interleaved", p, m, 1)
        assert [[str(a) for a in r] for r in generate("zb-h1", p, m).actions] == [t[r] for r in range(p)]


def test_every_action_appears_once_in_torchs_zero_bubble_orders():
    for p, m, v in [(2, 4, 2), (3, 6, 2), (2, 3, 1)]:
        order = torch_order("zb-interleaved", p, m, v)
        flat = [a for r in order.values() for a in r]
        assert sorted(flat) == sorted(f"{s}{k}{i}" for s in range(p * v) for k in "FIW" for i in range(m))


def test_placement():
    assert stage_ranks("zbv", 2, 2) == [0, 1, 1, 0]
    assert stage_ranks("zbv", 3, 2) == [0, 1, 2, 2, 1, 0]
    assert stage_ranks("interleaved-1f1b", 2, 2) == [0, 1, 0, 1]


def test_the_runner_reads_names_aliases_and_torch_classes_from_the_registry():
    assert PipelineConfig(schedule="zb-h1", stages=2, microbatches=4).schedule == "zb-h1"  # the name asked
    assert resolve(PipelineConfig(schedule="zb-h1", stages=2, microbatches=4)).spec.name == "zb-interleaved"
    assert PipelineConfig(schedule="ZB-V", stages=2, microbatches=4, virtual=2).schedule == "zbv"
    assert PipelineConfig(schedule="interleaved", stages=2, microbatches=4, virtual=2).schedule == (
        "interleaved-1f1b"
    )
    with pytest.raises(ConfigError, match=r"schedule 'pipedream' is unknown; known schedules: gpipe"):
        PipelineConfig(schedule="pipedream")
    assert torch_order("zb-h1", 2, 4) == torch_order("zb-interleaved", 2, 4)


def test_rules_are_refused_with_rule_and_fix():
    with pytest.raises(ScheduleError, match=r"needs m >= p; use microbatches 4 or more, or schedule gpipe$"):
        check_servable("1f1b", 4, 2)
    with pytest.raises(ScheduleError, match=r"exactly two stages per rank.*use virtual 2$"):
        check_servable("zbv", 2, 4, 1)
    with pytest.raises(
        ScheduleError, match=r"multiple of its number of rounds .* = 2; use microbatches 8 or 10"
    ):
        check_servable("interleaved-1f1b", 4, 9, 2)
    with pytest.raises(ScheduleError, match="one stage per rank"):
        check_servable("gpipe", 2, 4, 2)
    with pytest.raises(ConfigError, match=r"global batch 10 is not divisible by 4 .* 8, 12"):
        PipelineConfig(stages=2, microbatches=4, global_batch=10)
    with pytest.raises(ConfigError, match="pipelining needs p >= 2"):
        PipelineConfig(stages=1, microbatches=4, schedule="gpipe")
    check_servable("interleaved-1f1b", 4, 10, 2)  # 10 // 4 = 2 rounds, 10 % 2 == 0: allowed


def test_sum_over_total_tokens_gives_the_mean_loss_gradient():
    """Micro-batch losses Σ CE / N_total summed (scale_grads=False) equal the full-batch mean loss."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 5)
    x, y = torch.randn(6, 3, 8), torch.randint(0, 5, (6, 3))
    full = torch.nn.functional.cross_entropy(lin(x).flatten(0, 1), y.flatten())
    g_full = torch.autograd.grad(full, lin.weight)[0]
    loss_fn = make_loss_fn(total_tokens=18)
    parts = [loss_fn(lin(x[i : i + 2]), y[i : i + 2]) for i in (0, 2, 4)]
    assert torch.allclose(sum(parts), full, atol=1e-6)
    assert torch.allclose(torch.autograd.grad(sum(parts), lin.weight)[0], g_full, atol=1e-6)
    # the mean of per-micro-batch means differs when token counts differ (the 2024 HF bug)
    uneven = [loss_fn(lin(x[:1]), y[:1]) * 18 / 3, loss_fn(lin(x[1:]), y[1:]) * 18 / 15]
    assert not torch.allclose(sum(uneven) / 2, full, atol=1e-4)


def test_prediction_with_equal_times_is_the_closed_form():
    cfg = PipelineConfig(schedule="gpipe", stages=4, microbatches=4)
    res = predict(resolve(cfg), {(s, k): t for s in range(4) for k, t in (("F", 1.0), ("B", 2.0))})
    assert res.bubble_fraction == pytest.approx(3 / 7)
    cfg = PipelineConfig(schedule="1f1b", stages=4, microbatches=8)
    res = predict(resolve(cfg), {(s, k): t for s in range(4) for k, t in (("F", 1.0), ("B", 2.0))})
    assert list(res.peak_in_flight) == [4, 3, 2, 1]


def test_torchrun_detection():
    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    assert under_torchrun(env)
    assert not under_torchrun({**env, "MICROBATCH_WORKER": "1"})
    assert not under_torchrun({})


def test_chrome_trace_events():
    from types import SimpleNamespace

    from microbatch.run.pipeline.report import TimelineOp

    report = SimpleNamespace(
        stages=2,
        timeline=[
            TimelineOp(rank=0, stage=0, kind="F", microbatch=0, start_s=0.0, end_s=0.002),
            TimelineOp(rank=1, stage=1, kind="B", microbatch=0, start_s=0.003, end_s=0.004),
        ],
    )
    trace = chrome_trace(report)["traceEvents"]
    ev = [e for e in trace if e["ph"] == "X"]
    assert [(e["name"], e["pid"], e["ts"], e["dur"]) for e in ev] == [
        ("F0", 0, 0.0, 2000.0),
        ("B0", 1, 3000.0, 1000.0),
    ]
    counters = [(e["pid"], e["ts"], e["args"]["micro-batches"]) for e in trace if e["ph"] == "C"]
    assert counters == [(0, 2000.0, 1), (1, 4000.0, -1)]


# -- real runs ------------------------------------------------------------------------


def _in_flight(rep):
    return [s.counted_in_flight for s in rep.measured.stage_stats]


@pytest.mark.timeout(150)
def test_1f1b_matches_unsplit_gradients_and_holds_p_minus_i():
    rep = run_cached(schedule="1f1b", stages=2, microbatches=4, global_batch=8, check_gradients=True)
    assert rep.micro_batch == 2
    assert rep.gradients_match is True
    assert rep.max_grad_rel_error <= 1e-5
    assert _in_flight(rep) == [2, 1] == rep.predicted.peak_in_flight
    assert rep.order_matches_torch
    st = rep.measured.stage_stats
    # the schedule's count: rank 0 two micro-batches' saved activations at its peak, rank 1 one —
    # against each stage's bytes of one micro-batch measured apart, on this process (not the run's hooks)
    alone = _stage_bytes(rep)
    assert st[0].counted_activation_bytes == 2 * alone[0]
    assert st[1].counted_activation_bytes == alone[1]
    assert [s.activation_bytes_per_microbatch for s in st] == alone
    # memory actually held (saved storages alive) against the prediction walking torch's order with
    # those bytes: byte counts, not times, so the same on any machine and load (0.0% on the dev
    # machine); 2% leaves out a x1.02 and anything freed an op late (a micro-batch: +50% on rank 1)
    for row in rep.memory:
        assert abs(row.error_pct) <= 2, row
    for s in st:
        assert s.busy_s > 0 and s.idle_s >= 0
        # saved activations of a micro-batch exceed its b_m·s·h fp32 input (2·64·64·4 bytes)
        assert s.activation_bytes_per_microbatch > 2 * 64 * 64 * 4
    assert 0 < rep.measured.bubble_fraction < 1
    assert len(rep.losses) == 2 and all(3 < x < 9 for x in rep.losses)  # ~ln(512) = 6.2
    assert rep.measured_steps == 1 and rep.measured.bubble_se is None  # no spread to state


def _stage_bytes(rep):
    """Each stage's saved bytes of one micro-batch (its own and those shared with the step's other
    micro-batches), measured on this process by a plain forward of the split — not by the run."""
    from microbatch.run.pipeline.stage_profile import stage_saved_bytes

    cfg = PipelineConfig(
        schedule=rep.schedule, stages=rep.stages, microbatches=rep.microbatches,
        global_batch=rep.global_batch, model=rep.model,
    )  # fmt: skip
    prof = stage_saved_bytes(resolve(cfg), rep.layers_per_stage)
    return [prof[s]["own"] + prof[s]["shared"] for s in sorted(prof)]


def _step_bubbles(rep):
    """Each measured step's bubble as the idle time it is, added up gap by gap: per rank, from the
    step's start to its first op, between its ops, and from its last op to the step's end (the
    report's figure is 1 - busy / (p · wall); the two agree only if no rank runs two ops at once)."""
    p = rep.stages
    out = []
    for st in rep.step_intervals:
        idle = 0.0
        for ivs in st.ranks:
            t = st.start
            for _k, _s, _i, a, e in sorted(ivs, key=lambda x: x[3]):
                assert a >= t - 1e-9  # one op at a time on a rank
                idle += a - t
                t = e
            idle += st.end - t
        out.append(idle / (p * (st.end - st.start)))
    return out


@pytest.mark.timeout(150)
def test_the_measured_bubble_states_its_standard_error_over_steps():
    import statistics

    rep = run(schedule="gpipe", stages=2, microbatches=2, steps=4)
    m, per_step = rep.measured, _step_bubbles(rep)
    assert len(per_step) == rep.measured_steps == 3
    assert m.bubble_steps == pytest.approx(per_step)
    assert m.bubble_fraction == pytest.approx(statistics.fmean(per_step))
    assert m.bubble_se == pytest.approx(statistics.stdev(per_step) / 3**0.5)
    assert m.bubble_se > 0


@pytest.mark.timeout(150)
def test_gpipe_holds_all_m_microbatches():
    rep = run_cached(schedule="gpipe", stages=2, microbatches=4, check_gradients=True)
    assert rep.gradients_match is True
    assert _in_flight(rep) == [4, 4] == rep.predicted.peak_in_flight
    alone = _stage_bytes(rep)  # measured apart from the run
    assert [s.counted_activation_bytes for s in rep.measured.stage_stats] == [4 * b for b in alone]


@pytest.mark.timeout(200)
def test_saved_activation_bytes_grow_linearly_with_the_micro_batch():
    one = run_cached(schedule="gpipe", stages=2, microbatches=4, check_gradients=True)  # b_m = 1
    two = run_cached(
        schedule="1f1b", stages=2, microbatches=4, global_batch=8, check_gradients=True
    )  # b_m = 2
    assert (one.micro_batch, two.micro_batch) == (1, 2)
    for a, b in zip(one.measured.stage_stats, two.measured.stage_stats, strict=True):
        ratio = b.activation_bytes_per_microbatch / a.activation_bytes_per_microbatch
        assert ratio == pytest.approx(2.0, rel=0.02)


@pytest.mark.timeout(200)
def test_1f1b_on_four_stages_holds_four_three_two_one():
    rep = run(schedule="1f1b", stages=4, microbatches=8, steps=1, check_gradients=True)
    assert _in_flight(rep) == [4, 3, 2, 1]
    assert rep.gradients_match is True
    assert rep.layers_per_stage == [1, 1, 1, 1]


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    "schedule,m,v", [("interleaved-1f1b", 4, 2), ("zb-interleaved", 4, 1), ("zbv", 4, 2)]
)
def test_interleaved_and_zero_bubble_gradients_and_order(schedule, m, v):
    rep = run(schedule=schedule, stages=2, microbatches=m, virtual=v, check_gradients=True)
    assert rep.gradients_match is True, rep.max_grad_rel_error
    assert rep.order_matches_torch, rep.executed_order
    assert _in_flight(rep) == rep.predicted.peak_in_flight
    kinds = {it.kind for it in rep.timeline}
    assert kinds == ({"F", "I", "W"} if schedule != "interleaved-1f1b" else {"F", "B"})


def _implied_by_op_times(rep):
    """(step time, bubble) that the run's measured mean op times imply on its executed order, worked
    out here independently of the simulator: each op starts when its rank is free and its input
    has arrived (F after the previous stage's F of that micro-batch, B after the next stage's B),
    plus the measured hand-off latency per cross-rank input."""
    op, comm = rep.measured.op_time_s, rep.predicted.with_comm.comm_time_s
    orders = {int(r): list(o) for r, o in rep.executed_order.items()}
    end: dict[str, float] = {}
    free = dict.fromkeys(orders, 0.0)
    pos = dict.fromkeys(orders, 0)
    last = rep.stages - 1
    while any(pos[r] < len(o) for r, o in orders.items()):
        moved = False
        for r, o in orders.items():
            if pos[r] == len(o):
                continue
            name = o[pos[r]]
            stage, kind, mb = int(name[0]), name[1], name[2:]
            dep = f"{stage - 1}F{mb}" if kind == "F" and stage > 0 else None
            dep = f"{stage + 1}B{mb}" if kind == "B" and stage < last else dep
            if dep is not None and dep not in end:
                continue
            ready = end[dep] + comm if dep is not None else 0.0
            end[name] = max(free[r], ready) + op[f"{stage}{kind}"]
            free[r], pos[r], moved = end[name], pos[r] + 1, True
        assert moved, "deadlock in the executed order"
    step = max(end.values())
    busy = sum(op[name[:2]] for o in orders.values() for name in o)
    return step, 1.0 - busy / (rep.stages * step)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_measured_bubble_falls_as_m_grows():
    one = run(schedule="gpipe", stages=2, microbatches=1, model="small", global_batch=8, steps=2)
    eight = run(schedule="1f1b", stages=2, microbatches=8, model="small", global_batch=8, steps=2)
    # m = 1 on 2 stages: the bubble is 1/2 whatever the op times (each rank idles while the other
    # works), so check what the op times imply instead: the step is the serial chain F0 F1 B1 B0
    # plus two hand-offs, and the step's wall time (barrier to the last rank's return, read apart
    # from the op intervals) must agree with it.
    step1, bubble1 = _implied_by_op_times(one)
    ops = one.measured.op_time_s
    # the hand-off, read here from the raw intervals, not from the report: in the chain each step
    # waits twice, rank 1 for stage 0's output and rank 0 for stage 1's gradient; the report's
    # comm_time_s (measured_comm_s) must be their median (the upper one of an even count)
    gaps = []
    for st in one.step_intervals:
        at = {(k, s): (a, e) for ivs in st.ranks for (k, s, _i, a, e) in ivs}
        gaps += [at[("F", 1)][0] - at[("F", 0)][1], at[("B", 0)][0] - at[("B", 1)][1]]
    comm = sorted(max(0.0, g) for g in gaps)[len(gaps) // 2]
    assert one.predicted.with_comm.comm_time_s == pytest.approx(comm, abs=1e-9)
    assert step1 == pytest.approx(sum(ops[k] for k in ("0F", "1F", "1B", "0B")) + 2 * comm)
    assert (
        comm < 0.05 * step1
    )  # small beside the ops (0.6-0.9 ms in the README's runs, 5.5 ms once under load)
    # the step's wall time holds the chain and the runtime's own work around it (the start, the cost
    # after each local op, the return: 1-3 ms idle, up to ~10% of the step at load 6-8 on 2 cores):
    # never under the chain, and within a quarter of it, which a wrong step boundary (the barrier's
    # wait, a second step) would overshoot
    assert 0.98 * step1 <= one.measured.step_time_s <= 1.25 * step1
    assert one.predicted.with_comm.step_time_s == pytest.approx(step1, rel=0.02)
    # m = 8: the stages cost differently (the last holds the head and the loss), so the bubble is
    # not the equal-time (p-1)/(m+p-1) = 1/9; the simulated bubble must match what this run's own
    # op times imply
    step8, bubble8 = _implied_by_op_times(eight)
    assert eight.predicted.with_comm.bubble_fraction == pytest.approx(bubble8, abs=0.02)
    # the measured bubble also holds the runtime's work between ops (hand-off bookkeeping, the
    # autograd engine's start), which no op interval contains, and that work grows with the
    # machine's load (0.01-0.05 above the op-time bubble over four idle runs on the 2-core dev
    # machine, 0.10 once under CI's load): so the measurement is bounded from below only, the
    # bubble and the step's wall time never under what the op times imply
    assert eight.measured.bubble_fraction >= bubble8 - 0.02
    assert eight.measured.step_time_s >= 0.98 * step8
    assert one.measured.bubble_fraction > eight.measured.bubble_fraction + 0.1
    assert bubble1 > bubble8


# -- failures never hang --------------------------------------------------------------


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "fault,pattern",
    [
        (
            "1:raise",
            r"rank 1 \(stages \[1\]\) failed \(exit status 1: RuntimeError: injected fault on rank 1",
        ),
        ("1:shape", r"rank 1 .*failed .*mat1 and mat2 shapes cannot be multiplied"),
        ("0:oom", r"rank 0 .*failed .*out of memory"),
        ("1:kill", r"rank 1 .*killed by signal SIGKILL .*: no error on its stderr before it"),
    ],
)
def test_a_failing_rank_stops_every_rank_with_its_reason(monkeypatch, fault, pattern):
    monkeypatch.setenv("MICROBATCH_PIPELINE_FAULT", fault)
    t0 = time.monotonic()
    with pytest.raises(PipelineError, match=pattern):
        run(schedule="1f1b", stages=2, microbatches=2, deadline_s=60)
    assert time.monotonic() - t0 < 45


@pytest.mark.timeout(90)
def test_a_hanging_rank_hits_the_deadline(monkeypatch):
    monkeypatch.setenv("MICROBATCH_PIPELINE_FAULT", "1:hang")
    t0 = time.monotonic()
    with pytest.raises(
        PipelineError, match=r"deadline of 10 s; ranks \[.*1.*\] were still running and were killed"
    ):
        run(schedule="gpipe", stages=2, microbatches=2, deadline_s=10)
    assert time.monotonic() - t0 < 30


@pytest.mark.timeout(120)
@pytest.mark.parametrize("hung", [0, 1])
def test_a_hanging_rank_is_named_not_the_peer_that_timed_out_waiting(monkeypatch, hung):
    """The process group's timeout (10 s) before the deadline: the healthy rank fails first, with gloo's "timed out
    waiting"; the rank still running is the one that stopped, and the error names it (it named the healthy one)."""
    monkeypatch.setenv("MICROBATCH_PIPELINE_FAULT", f"{hung}:hang")
    with pytest.raises(PipelineError, match=rf"rank {hung} \(stages \[{hung}\]\) stopped making progress: rank {1 - hung} "
                       "timed out waiting for it"):  # fmt: skip
        run(schedule="1f1b", stages=2, microbatches=2, timeout_s=10, deadline_s=100)


# -- command line ---------------------------------------------------------------------


def _cli(*args, env=None, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "microbatch", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def test_cli_refuses_unservable_before_starting_anything():
    t0 = time.monotonic()
    r = _cli("pipeline", "--stages", "4", "--microbatches", "2", "--schedule", "1f1b")
    assert r.returncode == 2
    assert re.fullmatch(
        r"error: --microbatches = 2 < --stages = 4: .*needs m >= p; use --microbatches 4 or more.*\n",
        r.stderr,
    )
    assert "Traceback" not in r.stderr
    r = _cli("pipeline", "--stages", "3", "--microbatches", "3", "--schedule", "interleaved-1f1b", "-v", "2")
    assert r.returncode == 2 and "only 4 layers" in r.stderr
    assert time.monotonic() - t0 < 30


@pytest.mark.timeout(150)
def test_cli_json_and_trace(tmp_path):
    trace = tmp_path / "t.json"
    r = _cli(
        "pipeline", "-p", "2", "-m", "2", "--schedule", "1f1b", "--steps", "2",
        "--check-gradients", "--trace", str(trace), "--json",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert (out["schedule"], out["stages"], out["microbatches"]) == ("1f1b", 2, 2)
    assert out["gradients_match"] is True and out["max_grad_rel_error"] <= 1e-5
    stats = out["measured"]["stage_stats"]
    assert [s["stage"] for s in stats] == [0, 1]
    assert set(stats[0]) >= {"stage", "busy_s", "idle_s", "counted_in_flight", "peak_activation_bytes"}
    assert out["predicted"]["peak_in_flight"] == [2, 1]
    assert 0 <= out["predicted"]["bubble_fraction"] < 1
    # the prediction made before the run: profiled op times + the calibrated runtime, simulated
    before = out["before_run"]
    assert 0 < before["bubble_fraction"] < 1 and before["step_time_s"] > 0
    assert before["overhead_s"] >= 0 and before["comm_time_s"] >= 0
    assert set(before["profile_s"]) >= {"0F", "0B", "1F", "1B"}
    # gloo ranks on the CPU: the between-op terms from the calibration run loaded like the real
    # stages, the bare calibration's kept beside them
    assert before["runtime"]["loaded"] is True and "CPU load" in before["source"]
    assert set(before["runtime"]["bare_terms"]) == {
        "after_send_s", "after_send_waiting_s", "after_local_s", "hop_s", "start_s", "end_s",
    }  # fmt: skip
    assert before["runtime"]["loaded_step_s"] > 0
    assert [row["rank"] for row in out["memory"]] == [0, 1]
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    assert sorted(e["name"] for e in events) == sorted(["F0", "F1", "B0", "B1"] * 2)
    # the trace against the step's wall time (barrier before step() to the last rank's return,
    # read apart from the op intervals): every event lies inside the step, one rank's events never
    # overlap, and the last one ends near the step's end (µs in the trace, s in the report)
    step_us = out["measured"]["step_time_s"] * 1e6
    for pid in (0, 1):
        spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e["pid"] == pid)
        assert spans[0][0] >= 0 and spans[-1][1] <= step_us * 1.001 + 1
        assert all(a[1] <= b[0] + 1 for a, b in zip(spans, spans[1:], strict=False))
    # the last op ends near the step's end: what follows it is its rank's return from step() (a
    # scheduler slice or two on a loaded 2-core machine: up to 10 ms, against tiny's ~14 ms step)
    last_end = max(e["ts"] + e["dur"] for e in events)
    assert step_us - max(0.2 * step_us, 10_000) <= last_end <= step_us * 1.001 + 1


@pytest.mark.timeout(200)
def test_same_code_runs_under_torchrun():
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "microbatch", "pipeline", "-p", "2", "-m", "2", "--schedule", "gpipe", "--steps", "1",
         "--check-gradients", "--json"],
        capture_output=True, text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)  # only rank 0 prints
    assert out["gradients_match"] is True
    assert [s["counted_in_flight"] for s in out["measured"]["stage_stats"]] == [2, 2]


@pytest.mark.timeout(120)
def test_a_taken_port_is_replaced(monkeypatch):
    import socket

    import microbatch.run.pipeline.launch as launch

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    ports = iter([busy.getsockname()[1], launch.free_port()])
    monkeypatch.setattr(launch, "free_port", lambda: next(ports))
    try:
        rep = run(schedule="gpipe", stages=2, microbatches=2, steps=1)
    finally:
        busy.close()
    assert next(ports, None) is None  # the busy port was tried, then a second one
    assert rep.measured.stage_stats[0].counted_in_flight == 2


def make_stack():
    """Any stack of layers: token ids (b, s) -> logits (b, s, 64), for ``--model test_pipeline:make_stack``."""
    nn = torch.nn
    return nn.Sequential(
        nn.Embedding(64, 32), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32), nn.Linear(32, 64)
    )


@pytest.mark.timeout(150)
def test_any_stack_of_layers_balanced_by_measured_time(monkeypatch):
    here = os.path.dirname(os.path.abspath(__file__))
    monkeypatch.setenv("PYTHONPATH", here + os.pathsep + os.environ.get("PYTHONPATH", ""))
    rep = run(
        schedule="1f1b", stages=2, microbatches=2, model="test_pipeline:make_stack", seq=8,
        balance="time", check_gradients=True,
    )  # fmt: skip
    assert sum(rep.layers_per_stage) == 5 and min(rep.layers_per_stage) >= 1
    assert rep.gradients_match is True
    assert [s.counted_in_flight for s in rep.measured.stage_stats] == [2, 1]


@pytest.mark.cuda
@pytest.mark.timeout(300)
def test_nccl_on_two_gpus_times_with_cuda_events_and_reports_peak_memory():
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs (NCCL does not put two ranks on one GPU)")
    rep = run(schedule="1f1b", stages=2, microbatches=4, backend="nccl", check_gradients=True, steps=3)
    assert rep.device.startswith("cuda")
    assert rep.gradients_match is True
    assert [s.counted_in_flight for s in rep.measured.stage_stats] == [2, 1]
    for s in rep.measured.stage_stats:
        assert s.cuda_peak_bytes >= s.peak_activation_bytes > 0
        assert s.busy_s > 0


def test_measured_comm_is_the_median_wait_for_another_ranks_output():
    from microbatch.run.pipeline.summary import measured_comm_s

    cfg = PipelineConfig(schedule="gpipe", stages=2, microbatches=2)
    rank0 = [("F", 0, 0, 0.0, 1.0), ("F", 0, 1, 1.0, 2.0), ("B", 0, 0, 4.5, 6.0), ("B", 0, 1, 6.0, 7.0)]
    rank1 = [
        ("F", 1, 0, 1.25, 2.75),
        ("F", 1, 1, 2.75, 3.75),
        ("B", 1, 0, 3.75, 4.25),
        ("B", 1, 1, 4.25, 5.25),
    ]
    # waits: F1/0 (input at 1.0, start 1.25) and B0/0 (input at 4.25, start 4.5, idle since 2.0): 0.25 each.
    # F1/1 and B0/1 start late because their rank was busy (gaps 0.75): not latency, not counted.
    assert measured_comm_s(resolve(cfg), [[rank0, rank1]]) == pytest.approx(0.25)
    assert measured_comm_s(resolve(cfg), [[rank0[:2], []]]) == 0.0


def make_gpt_tiny():
    """The built-in tiny GPT given as a factory (``--model test_pipeline:make_gpt_tiny``): no shape is known."""
    from microbatch.measure.gpt import build_model
    from microbatch.model import get_model

    return build_model(get_model("tiny"))


def test_a_dualpipev_hand_off_is_timed_from_the_paired_ops_end():
    """DualPipeV runs a forward and the action after it as one step: the forward's output leaves when that action
    ends. Timed from the forward's own end, the hand-off read 15.6 ms against 1.2 ms on plain hand-offs (p 2, m 8; a
    review): the paired backward counted twice, once here and once by the simulator's pairing."""
    from microbatch.run.pipeline.summary import _paired_ops, measured_comm_s

    run_ = resolve(PipelineConfig(schedule="dualpipev", stages=2, microbatches=4, virtual=2))
    assert _paired_ops(run_)[("F", 0, 3)] == ("B", 3, 1)  # torch's order pairs them on rank 0
    rank0 = [("F", 0, 3, 0.0, 1.0), ("B", 3, 1, 1.0, 2.0)]  # the forward, then its paired backward
    rank1 = [("F", 1, 3, 2.1, 3.0)]  # waits for stage 0's output (rank 0), idle before
    assert measured_comm_s(run_, [[rank0, rank1]]) == pytest.approx(0.1)
    plain = resolve(PipelineConfig(schedule="1f1b", stages=2, microbatches=4))
    assert _paired_ops(plain) == {}
