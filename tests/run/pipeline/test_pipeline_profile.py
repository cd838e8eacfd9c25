"""The prediction made before a pipeline run: profile, the runtime's costs between ops, the replay."""

from __future__ import annotations

import pytest

from microbatch.run.pipeline.before_run import predict_before
from microbatch.run.pipeline.config import PipelineConfig
from microbatch.run.pipeline.replay import ZERO_TERMS, replay, runtime_terms
from microbatch.run.pipeline.report import StepIntervals
from microbatch.run.pipeline.resolved import resolve
from microbatch.run.pipeline.stage_profile import profile_stages
from microbatch.schedules.torch_order import torch_order

torch = pytest.importorskip("torch")


def _flat(p: int, f: float = 1e-3, b: float = 2e-3) -> dict[int, dict[str, float]]:
    return {s: {"F": f, "B": b, "I": b / 2, "W": b / 2} for s in range(p)}


def _terms(**kw):
    """ZERO_TERMS with ``kw``; a send into a waiting rank costs what any send costs unless given."""
    t = {k: (dict(v) if isinstance(v, dict) else v) for k, v in ZERO_TERMS.items()}
    t.update(kw)
    if "after_send_waiting_s" not in kw:
        t["after_send_waiting_s"] = dict(t["after_send_s"])
    return t


def test_equal_stages_without_costs_between_ops_give_the_closed_form():
    cfg = PipelineConfig(schedule="1f1b", stages=2, microbatches=4)
    pred = predict_before(resolve(cfg), _flat(2), _terms())
    assert pred.bubble_fraction == pytest.approx(1 / 5)  # (p−1)/(m+p−1)
    assert pred.step_time_s == pytest.approx((4 + 1) * 3e-3)


def test_costs_between_ops_lengthen_the_step_and_count_as_idle():
    cfg = PipelineConfig(schedule="1f1b", stages=2, microbatches=4)
    base = predict_before(resolve(cfg), _flat(2), _terms())
    slow = predict_before(
        resolve(cfg),
        _flat(2),
        _terms(after_send_s={"fwd": 1e-4, "bwd": 5e-3}, hop_s={"fwd": 1e-3, "bwd": 1e-3}),
    )
    # the last rank's 4 gradient sends each hold it 5 ms; rank 0 waits for them but the first
    assert slow.step_time_s > base.step_time_s + 3 * 5e-3
    assert slow.bubble_fraction > base.bubble_fraction
    # busy stays the profiled op time: 1 − busy / (p · step)
    assert slow.bubble_fraction == pytest.approx(1 - 2 * 4 * 3e-3 / (2 * slow.step_time_s))


@pytest.mark.parametrize(
    ("schedule", "p", "m", "v"), [("1f1b", 2, 4, 1), ("interleaved-1f1b", 2, 4, 2), ("zb-h1", 2, 4, 1)]
)
def test_runtime_terms_recover_the_costs_a_trace_was_made_with(schedule, p, m, v):
    """A trace replayed with known costs between ops, read back: the measured terms are those costs
    (hand-offs longer than the after-op costs, so that every wait is the hand-off's)."""
    cfg = PipelineConfig(schedule=schedule, stages=p, microbatches=m, virtual=v)
    known = _terms(
        after_send_s={"fwd": 1e-4, "bwd": 3e-4},
        after_send_waiting_s={"fwd": 2e-4, "bwd": 7e-4},
        after_local_s=5e-5,
        hop_s={"fwd": 2e-3, "bwd": 3e-3},
        start_s=4e-4,
        end_s=6e-4,
    )
    op_s = {(s, k): t * (1 + 0.1 * s) for s, row in _flat(cfg.total_stages).items() for k, t in row.items()}
    order = torch_order(cfg.schedule, p, m, v)
    rep = replay(resolve(cfg), order, op_s, known)
    stage_of = {(r, n): a for r in range(p) for n, a in enumerate(order[r])}
    ranks = []
    for r in range(p):
        ivs = []
        for n, (a, e, kind, i) in enumerate(rep["timeline"][r]):
            s = int(stage_of[(r, n)].split(kind)[0])
            ivs.append((kind, s, i, a, e))
        ranks.append(ivs)
    got = runtime_terms(resolve(cfg), [StepIntervals(start=0.0, end=rep["step_time_s"], ranks=ranks)])
    for key in ("after_local_s", "start_s", "end_s"):
        if key != "after_local_s" or got["cases"]["after_local"]:
            assert got[key] == pytest.approx(known[key], abs=1e-9), key
    for d in ("fwd", "bwd"):
        assert got["hop_s"][d] == pytest.approx(known["hop_s"][d], abs=1e-9)
        for key in ("after_send", "after_send_waiting"):
            if got["cases"][key][d]:
                assert got[key + "_s"][d] == pytest.approx(known[key + "_s"][d], abs=1e-9), (key, d)
    # the trace shows sends into a rank that sat waiting (their own cost recovered above)
    assert sum(got["cases"]["after_send_waiting"].values()) > 0
    # and the replay with the recovered terms gives the step back
    assert replay(resolve(cfg), order, op_s, got)["step_time_s"] == pytest.approx(rep["step_time_s"])


def test_the_replay_without_costs_matches_the_event_simulation():
    from microbatch.run.pipeline.summary import predict

    cfg = PipelineConfig(schedule="interleaved-1f1b", stages=2, microbatches=4, virtual=2)
    op_s = {(s, k): 1e-3 * (1 + s) * (2 if k == "B" else 1) for s in range(4) for k in "FB"}
    sim = predict(resolve(cfg), op_s)
    rep = replay(resolve(cfg), torch_order(cfg.schedule, 2, 4, 2), op_s, ZERO_TERMS)
    assert rep["step_time_s"] == pytest.approx(sim.makespan)
    assert rep["bubble_fraction"] == pytest.approx(sim.bubble_fraction)


@pytest.mark.timeout(60)
def test_profile_measures_every_stage_of_the_split_the_ranks_use():
    cfg = PipelineConfig(schedule="zb-h1", stages=2, microbatches=2)
    prof = profile_stages(resolve(cfg), repeats=3)
    assert sorted(prof) == [0, 1]
    for row in prof.values():
        assert row["F"] > 0 and row["B"] > 0 and row["W"] > 0 and row["cpuF"] > 0
        # (which clock each column reads, and that none is scaled: the two tests on _timed below)
    assert prof[1]["I"] > 0  # stage 1's input comes from stage 0 and needs a gradient
    # the sleep before each call is not timed: a sleep of 50 ms would put F over 50 ms, while a
    # preempted sample (a few ms on a loaded 2-core machine; tiny's F is ~1 ms) stays under half of it
    idle = profile_stages(resolve(cfg), repeats=3, idle_s=0.05)
    assert idle[1]["F"] < 0.025 + 10 * prof[1]["F"]


def test_other_runnable_threads_slow_the_ops_in_short_time_slices_as_processor_sharing():
    """2 cores, 2 other runnable threads, slices far shorter than the ops: one busy rank gets
    cores / (others + 1) of a core (the processor-sharing limit of the scheduler's slices)."""
    cfg = PipelineConfig(schedule="gpipe", stages=2, microbatches=1)
    prof = {s: {"F": 1e-3, "B": 2e-3, "cpuF": 1e-3, "cpuB": 2e-3} for s in range(2)}
    alone = predict_before(resolve(cfg), prof, _terms(machine={"cores": 2.0, "others": 0.0, "slice_s": 1e-6}))
    shared = predict_before(
        resolve(cfg), prof, _terms(machine={"cores": 2.0, "others": 2.0, "slice_s": 1e-6})
    )
    assert alone.cpu_share == pytest.approx(1.0) and alone.step_time_s == pytest.approx(6e-3)
    # one rank busy at a time at m = 1 (bubble 1/2): share = 2 / (2 + 1)
    assert shared.cpu_share == pytest.approx(2 / 3, rel=1e-3)
    assert shared.step_time_s == pytest.approx(6e-3 * 1.5, rel=1e-3)
    assert shared.bubble_fraction == pytest.approx(alone.bubble_fraction, abs=1e-3)


def test_more_ranks_than_cores_wait_for_a_core_and_ops_shorter_than_a_slice_are_not_stretched():
    """GPipe p = 4 on 2 cores, ops of 1 and 2 ms, 4 ms slices: every op runs whole once it has a
    core (its busy time is its work), but ranks queue for the cores, so the step is longer than
    with a core each and never shorter than the work over the cores."""
    cfg = PipelineConfig(schedule="gpipe", stages=4, microbatches=8)
    order = torch_order(cfg.schedule, 4, 8, 1)
    op_s = {(s, k): t for s, row in _flat(4).items() for k, t in row.items() if k in "FB"}
    own = replay(resolve(cfg), order, op_s, ZERO_TERMS)
    two = replay(resolve(cfg), order, op_s, ZERO_TERMS, cores=2, slice_s=4e-3)
    work = 4 * 8 * 3e-3
    assert sum(two["busy_s"]) == pytest.approx(work) == pytest.approx(sum(own["busy_s"]))
    assert own["step_time_s"] == pytest.approx((8 + 3) * 3e-3)  # the closed form, a core each
    assert two["step_time_s"] > own["step_time_s"] * 1.2
    assert two["step_time_s"] >= work / 2 - 1e-12
    # long ops in short slices are stretched instead: their busy time exceeds their work
    slow = replay(
        resolve(cfg), order, {k: 10 * t for k, t in op_s.items()}, ZERO_TERMS, cores=2, slice_s=1e-3
    )
    assert sum(slow["busy_s"]) > 1.2 * 10 * work


def test_weight_gradient_is_timed_as_torch_runs_it_not_as_a_second_full_backward():
    """A non-first stage's W is torch's stage_backward_weight (weight gradients from the kept
    intermediate gradients), so W < B and I + W is about one backward; the first stage, whose input
    needs no gradient, runs its whole backward at W, as torch's runtime does."""
    prof = profile_stages(
        resolve(PipelineConfig(schedule="zb-h1", stages=2, microbatches=2, model="small")), repeats=3
    )
    # on the thread's CPU time, which a preempted sample does not inflate (the work, not the machine's
    # load: small's last stage measured W/B 0.61, (I+W)/B 1.24 on the 2-core dev machine)
    last, first = prof[1], prof[0]
    assert last["cpuW"] < 0.75 * last["cpuB"], last  # autograd.grad over the parameters gave W ≈ B
    assert 0.7 * last["cpuB"] < last["cpuI"] + last["cpuW"] < 1.6 * last["cpuB"], last
    assert first["cpuI"] < 0.01 * first["cpuB"], first  # I: an empty call
    assert first["cpuW"] > 0.5 * first["cpuB"], first


def test_the_dualpipev_replay_sends_an_overlapped_forward_after_its_backward():
    """The replay of a DualPipeV run holds torch's overlapped F+B steps (the forward's output leaves
    after the pair): with equal per-chunk times every rank idles the closed form's 2(p-1)·T_F."""
    from microbatch.run.pipeline.summary import predict
    from microbatch.schedules.closed_forms import dualpipev_idle_time

    cfg = PipelineConfig(schedule="dualpipev", stages=2, microbatches=4, virtual=2)
    times = {(s, k): 1.0 for s in range(4) for k in "FIW"}
    sim = predict(resolve(cfg), times, comm_s=0.0)
    idle = [sim.makespan - b for b in sim.busy]
    assert idle == pytest.approx([dualpipev_idle_time(2, 1.0, 1.0, 1.0)] * 2)  # 2.0; without the pairing 1.0


def test_after_op_terms_as_latency_take_no_core():
    """Measured under the run's own contention, the terms already hold the waits for a core: as
    latency they delay their rank but do not queue for a core. With a core each the two readings
    agree; with fewer cores than ranks the queued reading is longer."""
    cfg = PipelineConfig(schedule="gpipe", stages=4, microbatches=8)
    order = torch_order(cfg.schedule, 4, 8, 1)
    op_s = {(s, k): t for s, row in _flat(4).items() for k, t in row.items() if k in "FB"}
    terms = _terms(after_send_s={"fwd": 2e-3, "bwd": 2e-3}, after_local_s=1e-3)
    own_q = replay(resolve(cfg), order, op_s, terms)
    own_l = replay(resolve(cfg), order, op_s, terms, after_as_latency=True)
    assert own_l["step_time_s"] == pytest.approx(own_q["step_time_s"])
    two_q = replay(resolve(cfg), order, op_s, terms, cores=2, slice_s=4e-3)
    two_l = replay(resolve(cfg), order, op_s, terms, cores=2, slice_s=4e-3, after_as_latency=True)
    assert two_l["step_time_s"] < two_q["step_time_s"]
    assert sum(two_l["busy_s"]) == pytest.approx(sum(own_q["busy_s"]))  # busy is the ops alone either way
    # as latency, each rank's ops and its after-op terms chain: rank 0 runs 8 F and 8 B (3 ms a pair)
    # with a send after each forward, at least 8·3 + 8·2 ms
    assert two_l["step_time_s"] >= 8 * 3e-3 + 8 * 2e-3


def test_the_loaded_calibration_model_has_a_stage_per_unit_spinning_for_its_cpu_times():
    from microbatch.run.pipeline.calibrate import loaded_calibration_model
    from microbatch.run.pipeline.split import balanced_split, model_units, unit_param_counts

    spins = [[0.02, 0.03, 0.0], [0.0, 0.0, 0.0], [0.0, 0.01, 0.025]]
    model = loaded_calibration_model(16, spins)
    units = model_units(model)
    assert len(units) == 3 and balanced_split(unit_param_counts(units), 3) == [1, 1, 1]
    import time

    x = units[0](torch.tensor([[1, 2, 3]]))
    assert x.shape == (1, 3, 16)
    c0 = time.thread_time()
    h = units[2](units[1](x.detach().requires_grad_()))
    assert time.thread_time() - c0 < 0.02  # stages 1 and 2 spin no forward
    inp = x.detach().requires_grad_()
    # the least of three: a first call's set-up (autograd, allocator) on a loaded machine is not the spin (once
    # 21 ms over it beside another pytest worker)
    tries = []
    for _ in range(3):
        c0 = time.thread_time()
        y = units[2](units[1](inp))
        (g,) = torch.autograd.grad(y.sum(), [inp], retain_graph=True)  # input gradient: stage 2's I
        tries.append(time.thread_time() - c0)
    # stage 2's I (10 ms) and not its W (25 ms more): the input gradient does not run the weight's spin
    assert 0.01 <= min(tries) < 0.01 + 0.025 and g.shape == inp.shape
    c0 = time.thread_time()
    torch.autograd.grad(y.sum(), list(units[2].parameters())[:1])  # stage 2's own weight: its W
    assert time.thread_time() - c0 >= 0.025
    c0 = time.thread_time()
    units[0](torch.tensor([[1, 2, 3]]))
    assert time.thread_time() - c0 >= 0.02  # stage 0's forward
    assert h.shape[-1] == 32  # the head's vocabulary


def test_a_loaded_calibration_is_made_for_gloo_ranks_with_a_machine_reading():
    from microbatch.run.pipeline.calibrate import needs_loaded_calibration

    two = {"machine": {"cores": 2.0, "others": 0.0, "slice_s": 4e-3}}
    assert needs_loaded_calibration(PipelineConfig(stages=4, microbatches=8), two)
    assert needs_loaded_calibration(PipelineConfig(stages=2, microbatches=8), two)
    assert not needs_loaded_calibration(PipelineConfig(stages=4, microbatches=8), {"machine": None})
    assert not needs_loaded_calibration(PipelineConfig(stages=4, microbatches=8, backend="nccl"), two)


def test_the_loaded_calibration_is_bounded_by_the_users_wait_and_the_runs_timeout():
    """Its step is as long as the real one: a large model gets fewer steps (at least 5), and none
    when even 5 would take half the run's timeout (the bare calibration's terms are kept)."""
    from microbatch.run.pipeline.calibrate import (
        LOADED_BUDGET_S,
        MAX_LOADED_STEPS,
        MIN_LOADED_STEPS,
        loaded_steps,
    )

    assert loaded_steps(0.025, 120) == MAX_LOADED_STEPS  # tiny: all 61 steps (1.5 s)
    assert loaded_steps(0.0, 120) == MAX_LOADED_STEPS
    assert loaded_steps(0.5, 120) == 20  # small at p = 4: as many as 10 s hold
    assert loaded_steps(1.0, 120) == int(LOADED_BUDGET_S)  # 10 steps of 1 s
    assert loaded_steps(3.0, 120) == MIN_LOADED_STEPS  # 15 s, under half the timeout
    assert loaded_steps(20.0, 120) is None  # 5 steps would take 100 s of a 120 s timeout
    assert loaded_steps(20.0, 1000) == MIN_LOADED_STEPS


def test_the_prediction_charges_each_measured_term_once_on_the_critical_path():
    """Worked by hand. GPipe p = 2, m = 1 is one chain, F0 F1 B1 B0 (1, 3, 4, 2 s): the step is the
    ops (10 s, the runtime's 0.5 s inside stage 0's forward included) plus the step's start and
    end, both hand-offs and the cost after the two ops whose output stays on their rank (F1 feeds
    the loss and B1, B0 feeds nobody). At m = 2 rank 1's first gradient send goes into a rank that
    waits for it and holds rank 1 before its second backward: the step is 17 s plus that cost."""
    prof = {0: {"F": 1.0, "B": 2.0}, 1: {"F": 3.0, "B": 4.0}}
    one = PipelineConfig(schedule="gpipe", stages=2, microbatches=1)
    terms = _terms(
        hop_s={"fwd": 0.1, "bwd": 0.2}, start_s=0.3, end_s=0.5, after_local_s=0.01, in_op_s={"0F": 0.5}
    )
    pred = predict_before(resolve(one), prof, terms)
    step = 10.0 + 0.5 + (0.1 + 0.2) + (0.3 + 0.5) + 2 * 0.01
    assert pred.step_time_s == pytest.approx(step, abs=1e-9)
    assert pred.bubble_fraction == pytest.approx(1 - 10.5 / (2 * step), abs=1e-9)
    two = PipelineConfig(schedule="gpipe", stages=2, microbatches=2)
    waiting = _terms(after_send_s={"fwd": 0.02, "bwd": 0.04}, after_send_waiting_s={"fwd": 0.07, "bwd": 0.09})
    assert predict_before(resolve(two), prof, waiting).step_time_s == pytest.approx(17.0 + 0.09, abs=1e-9)


def test_with_a_machine_reading_the_ops_take_their_cpu_time_not_their_wall_time():
    """Profiled on a loaded machine an op's wall time holds other programs' turns; the replay shares
    the cores itself, so it takes the CPU time (GPipe p = 2, m = 1: the chain of the four CPU times
    with a core each and nobody else runnable)."""
    cfg = PipelineConfig(schedule="gpipe", stages=2, microbatches=1)
    prof = {s: {"F": 2e-3, "B": 4e-3, "cpuF": 1e-3, "cpuB": 2e-3} for s in range(2)}
    alone = _terms(machine={"cores": 2.0, "others": 0.0, "slice_s": 1e-6})
    assert predict_before(resolve(cfg), prof, alone).step_time_s == pytest.approx(6e-3, rel=1e-6)
    assert predict_before(resolve(cfg), prof, _terms()).step_time_s == pytest.approx(
        12e-3, rel=1e-6
    )  # no reading


def test_timed_reads_the_threads_cpu_time_beside_the_wall_time():
    """A sleep is wall time and no CPU time; a busy loop of 20 ms of the thread's CPU time is 20 ms
    of CPU whatever the load (the loop ends on the thread's own clock)."""
    import time

    from microbatch.run.pipeline.calibrate import _spin
    from microbatch.run.pipeline.stage_profile import _timed

    def work() -> None:
        time.sleep(0.03)
        _spin(0.02)

    wall, cpu = _timed(work, 0.0)
    assert 0.02 <= cpu < 0.025  # the spin alone: the wall clock would read at least 50 ms
    assert wall >= 0.05


def test_the_profile_reports_each_stages_median_wall_and_cpu_times(monkeypatch):
    """Every timed call answers 2 ms of wall and 1 ms of CPU time: each stage's F, B, I and W are
    those (the first stage's I too: an empty call), each cpu* column the CPU time — the profile
    neither scales nor swaps what it timed."""
    import microbatch.run.pipeline.stage_profile as sp

    def fake(fn, idle_s):
        fn()
        return 2e-3, 1e-3

    monkeypatch.setattr(sp, "_timed", fake)
    prof = sp.profile_stages(resolve(PipelineConfig(schedule="zb-h1", stages=2, microbatches=2)), repeats=3)
    assert sorted(prof) == [0, 1]
    for row in prof.values():
        assert row == {"F": 2e-3, "B": 2e-3, "I": 2e-3, "W": 2e-3,
                       "cpuF": 1e-3, "cpuB": 1e-3, "cpuI": 1e-3, "cpuW": 1e-3}  # fmt: skip


def test_predict_run_profiles_after_the_mean_gap_and_predicts_with_the_loaded_terms(monkeypatch):
    """The wiring of the prediction made before a run, with each measurement replaced by a known
    value: the profile idles for the bare calibration's mean gap between ops, the loaded
    calibration gets that profile and its terms (taken as latency) make the prediction."""
    import microbatch.run.pipeline.before_run as pp
    import microbatch.run.pipeline.calibrate as cal
    import microbatch.run.pipeline.fit as fit
    import microbatch.run.pipeline.launch as launch

    cfg = PipelineConfig(schedule="gpipe", stages=2, microbatches=1)
    prof = {0: {"F": 1.0, "B": 2.0}, 1: {"F": 3.0, "B": 4.0}}
    bare = {**_terms(), "mean_gap_s": 0.004, "machine": None}
    loaded = {**_terms(start_s=0.25), "machine": None, "loaded": True}
    seen: dict = {}

    def fake_profile(c, idle_s=0.0):
        seen["idle_s"] = idle_s
        return prof

    def fake_loaded(c, profile, runtime, steps):
        seen["loaded"] = (profile, runtime, steps)
        return loaded

    monkeypatch.setattr(launch, "check_splittable", lambda c: None)
    monkeypatch.setattr(fit, "check_fits", lambda c: None)
    monkeypatch.setattr(cal, "calibrate_runtime", lambda c: bare)
    monkeypatch.setattr(cal, "needs_loaded_calibration", lambda c, r: True)
    monkeypatch.setattr(cal, "calibrate_loaded", fake_loaded)
    monkeypatch.setattr(pp, "profile_stages", fake_profile)
    pred = pp.predict_run(cfg)
    assert seen["idle_s"] == 0.004
    assert seen["loaded"][0] is prof and seen["loaded"][1] is bare
    assert seen["loaded"][2] == cal.loaded_steps(10.0, cfg.timeout_s)  # from the bare terms' step
    assert pred.step_time_s == pytest.approx(10.25)  # the loaded terms' start, nothing else
    assert pred.runtime["loaded"] is True and "CPU load" in pred.source


def test_the_loaded_calibration_spins_for_the_profiled_cpu_times(monkeypatch):
    """The loaded calibration's stages spin for exactly the profile's CPU seconds (forward, then the
    input and weight gradients of a split schedule), not its wall times."""
    import json
    import os

    import microbatch.run.pipeline.calibrate as cal
    import microbatch.run.pipeline.launch as launch
    import microbatch.run.pipeline.replay as rp

    prof = {s: {"F": 9.0, "B": 9.0, "I": 9.0, "W": 9.0, "cpuF": 1e-3 * (s + 1), "cpuB": 5e-3,
                "cpuI": 2e-3 * (s + 1), "cpuW": 3e-3 * (s + 1)} for s in range(2)}  # fmt: skip
    got: dict = {}

    def fake_run(c, **kw):
        got["spins"] = json.loads(os.environ[cal.LOAD_ENV])
        got["model"] = c.cfg.model
        from types import SimpleNamespace as NS

        return NS(step_intervals=[], measured=NS(step_time_s=0.01, bubble_fraction=0.3))

    monkeypatch.setattr(launch, "run_resolved", fake_run)
    monkeypatch.setattr(rp, "runtime_terms", lambda c, steps: _terms(start_s=0.125))
    bare = {**_terms(), "machine": None}
    out = cal.calibrate_loaded(
        resolve(PipelineConfig(schedule="zb-h1", stages=2, microbatches=2)), prof, bare, 5
    )
    assert got["spins"] == [[1e-3, 2e-3, 3e-3], [2e-3, 4e-3, 6e-3]]
    assert "loaded_calibration_model" in got["model"]
    assert out["start_s"] == 0.125 and out["loaded"] is True and out["bare_terms"]["start_s"] == 0.0
    assert cal.LOAD_ENV not in os.environ or os.environ[cal.LOAD_ENV] != json.dumps(got["spins"])


@pytest.mark.timeout(120)
def test_the_bubble_predicted_before_a_run_is_held_to_the_bubble_the_run_measures():
    """tiny, 1F1B, p = 2, m = 4, gloo, 6 steps (5 measured): the prediction made before the ranks
    start (profile, bare and loaded calibrations, replay) against the bubble the run then measures:
    from 25 points under it to 45 points over it (the side a loaded machine pushes it). About 15 s
    on an idle 2-core machine, 30 s at load 6-8.

    Why so wide, from the numbers (19 runs of ``predict_run`` + ``run_pipeline`` on tiny p = 2,
    GPipe / 1F1B / ZB-H1, m = 2 and 4, on the 2-core dev machine shared with other test runs): the
    prediction's own error ran from -9.3 to +20.0 points at load 1-2 and from +5.6 to +32.0 points
    at load 4-6 (1F1B m = 4: predicted 86.6-93.4% against measured 61.4-69.1%; under load it
    over-predicts: it reads the other programs' threads as competing for the ranks' cores more than
    they do), and this very case, eight runs more at load 5.8-8.4, from +14.1 to +35.3 (predicted
    90.4-96.0%, measured 58.9-79.9%). Over the run the band is that bias and a margin: a prediction
    near 95% cannot be further over a measured bubble of 50% or more. What the listed mutations
    move the prediction by, on the same runs: the profiled forward time x1.5 by 0.8-2.6 points
    (tiny's step is mostly the runtime's work between ops, and with equal stages the 1F1B bubble does
    not depend on F: on the op times alone x1.5 moves it by 0.1 point), the runtime's between-op
    terms x1.5 by 0.1-8.3 points, the bare calibration instead of the loaded one by -18 to +6. So no
    band that a loaded CI machine passes can see a x1.5 on this case (nor on small, whose run alone
    takes ~30 s): this test holds the prediction to the run where it would go wrong wholesale (the
    op times alone replay to 25% here), and the x1.5 mutations are killed by the hand-worked tests
    above (terms, spins, F, the loaded calibration, the idle gap, CPU against wall time). Below the
    run it has 25 points: the most seen was 9.3, and the op times alone (25% against 45-70%
    measured) fall out there whenever the run measures over 50%."""
    from microbatch.run.pipeline.before_run import run_predicted

    under, over = 0.25, 0.45
    rep = run_predicted(
        PipelineConfig(schedule="1f1b", stages=2, microbatches=4, steps=6, timeout_s=60), deadline_s=100
    )
    before, measured = rep.before_run.bubble_fraction, rep.measured.bubble_fraction
    assert rep.before_run.runtime["loaded"] is True  # gloo ranks: the loaded calibration was made
    assert -under <= before - measured <= over, (before, measured)
    # the runtime's costs between ops are in it: above the replay of the profiled op times alone
    prof: dict[int, dict[str, float]] = {0: {}, 1: {}}
    for key, t in rep.before_run.profile_s.items():
        prof[int(key[:-1])][key[-1]] = t
    ops_only = predict_before(
        resolve(PipelineConfig(schedule="1f1b", stages=2, microbatches=4)), prof, _terms()
    )
    assert before > ops_only.bubble_fraction, (before, ops_only.bubble_fraction, measured)


@pytest.mark.parametrize(
    ("schedule", "virtual", "rule"),
    [("zb-h1", 1, "zb-h1"), ("zb-interleaved", 1, "zb-h1"), ("zb-interleaved", 2, None), ("1f1b", 1, "1f1b")],
)
def test_the_resolved_run_names_the_schedule_once_and_finds_its_in_flight_rule(schedule, virtual, rule):
    """zb-h1 runs as torch's interleaved zero bubble: the config keeps the name asked, the resolved run
    the entry whose class runs it; the in-flight rule is found through the registry's run_as (ZB-H1's
    rule at v = 1 only)."""
    from microbatch.run.pipeline.resolved import resolve
    from microbatch.schedules.registry import torch_spec

    cfg = PipelineConfig(schedule=schedule, stages=2, microbatches=4, virtual=virtual)
    run = resolve(cfg)
    assert cfg.schedule == schedule and run.spec.name == torch_spec(schedule).name
    assert run.torch_class == run.spec.torch_name
    assert (run.rule.name if run.rule else None) == rule
    assert resolve(cfg) is run  # derived once
    assert list(run.placement) == [s % 2 for s in range(2 * virtual)]
    assert run.order is not None and sorted(run.order) == [0, 1]
    assert run.stages_of(1) == [s for s in range(2 * virtual) if s % 2 == 1]
