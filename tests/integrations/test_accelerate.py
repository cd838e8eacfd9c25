"""knee_batch_size with a real Accelerator on the CPU: probes the function's own step, then trains at the knee."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
accelerate = pytest.importorskip("accelerate")

from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from microbatch.errors import ConfigError  # noqa: E402
from microbatch.integrations.accelerate import ProbeDone, StepProbe, knee_batch_size  # noqa: E402
from microbatch.measure.timing import TimingConfig  # noqa: E402

FAST = TimingConfig(warmup=1, min_repeats=3, max_repeats=3, max_time_s=0.5)

B = 32
g0 = torch.Generator().manual_seed(1)
DATA = TensorDataset(torch.randn(1024, 32, generator=g0), torch.randn(1024, generator=g0))


def _make(calls, *, oom_above=None, steps=2, **opts):
    @knee_batch_size(global_batch=B, max_micro_batch=16, timing=FAST, use_cache=False, **opts)
    def train(micro_batch, grad_accum, probe=None, tag="x"):
        calls.append((micro_batch, grad_accum, probe is not None, tag))
        if oom_above is not None and micro_batch > oom_above:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        acc = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=grad_accum)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, opt, loader = acc.prepare(model, opt, DataLoader(DATA, batch_size=micro_batch))
        seen, updates = [], 0
        for x, y in loader:
            with acc.accumulate(model):
                acc.backward(torch.nn.functional.mse_loss(model(x).squeeze(-1), y))
                seen.append(len(x))
                if acc.sync_gradients:
                    updates += 1
                opt.step()
                opt.zero_grad()
            if probe is not None:
                probe.step()
            elif updates == steps:
                break
        return seen, updates

    return train


def test_probes_then_trains_at_the_knee_with_global_batch_exact():
    calls = []
    train = _make(calls)
    seen, updates = train(tag="mine")  # extra arguments reach the function
    result = train.result
    b, g = (
        result.recommendation.knee.micro_batch,
        result.recommendation.grad_accum(result.recommendation.knee.micro_batch),
    )
    assert b * g * 1 == B
    probes = [c for c in calls if c[2]]
    searched = [p.micro_batch for p in result.points]
    assert [c[0] for c in probes][: len(searched)] == searched and len(probes) == result.probes
    assert set(c[0] for c in probes[len(searched) :]) <= set(
        searched
    )  # the knee confirmed: points re-measured
    assert all(gg == B // bb for bb, gg, _, _ in probes)  # each probe ran at the g of its b_m
    assert calls[-1] == (b, g, False, "mine")  # then one real call with (b_m, g)
    assert seen == [b] * (2 * g) and updates == 2
    best = max(p.throughput for p in result.points if not p.oom)
    assert result.recommendation.knee.throughput >= (1 - result.recommendation.tolerance) * best
    assert all(p.peak_memory_bytes and p.peak_memory_bytes > 0 for p in result.points)


def test_out_of_memory_marks_a_point_and_the_knee_fits():
    calls = []
    train = _make(calls, oom_above=4)
    train()
    res = train.result
    assert any(p.oom for p in res.points) and res.recommendation.knee.micro_batch <= 4
    assert calls[-1][:3] == (
        res.recommendation.knee.micro_batch,
        B // res.recommendation.knee.micro_batch,
        False,
    )


def test_bad_input():
    with pytest.raises(ConfigError, match=r"global_batch 0 must be a whole number"):
        knee_batch_size(lambda b, g, probe=None: None, global_batch=0)

    @knee_batch_size(global_batch=8, max_micro_batch=2)
    def too_short(micro_batch, grad_accum, probe=None):
        if probe is not None:
            probe.step()

    with pytest.raises(ConfigError, match=r"returned after 1 probe.step\(\) calls at micro_batch 1"):
        too_short()
    with pytest.raises(TypeError, match="unexpected option"):
        knee_batch_size(lambda b, g, probe=None: None, global_batch=8, tolerence=0.1)()
    # a probe setting that does not apply to the user's own step is refused, not ignored
    with pytest.raises(TypeError, match=r"unexpected option\(s\) 'precision'"):
        knee_batch_size(lambda b, g, probe=None: None, global_batch=8, precision="bf16-mixed")()
    with pytest.raises(ConfigError, match=r"timing 3 must be a microbatch.measure.timing.TimingConfig"):
        knee_batch_size(lambda b, g, probe=None: None, global_batch=8, timing=3)


def _steps(probe, n):
    """Call probe.step() up to n times; the number of calls made when it raised ProbeDone (None if not)."""
    for k in range(1, n + 1):
        try:
            probe.step()
        except ProbeDone:
            return k
    return None


def test_step_probe_stops_by_the_tools_timing_rule(monkeypatch):
    import microbatch.integrations.accelerate as acc

    clock = iter([0.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0] + [16.0 + k for k in range(40)])
    monkeypatch.setattr(acc.time, "process_time", lambda: next(clock))
    # warm-up 10 s (untimed), then 1 s per micro-step: the median is stable after the third timed gap
    t = TimingConfig(warmup=1, min_repeats=3, max_repeats=10, max_time_s=100.0, rel_tol=0.05, clock="process")
    probe = StepProbe(4, t)
    # calls: stamp 0 (warm-up start), stamp 10 (warm-up end, timing starts), then 11, 12, 13
    assert _steps(probe, 20) == 5 and probe.gaps_s == [1.0, 1.0, 1.0]
    # never stable: the cap of max_repeats timed gaps
    noisy = iter([0.0] + [float(2**k) for k in range(40)])
    monkeypatch.setattr(acc.time, "process_time", lambda: next(noisy))
    t2 = TimingConfig(warmup=1, min_repeats=3, max_repeats=4, max_time_s=1e9, rel_tol=0.0, clock="process")
    probe = StepProbe(4, t2)
    assert _steps(probe, 20) == 1 + 1 + 4 and len(probe.gaps_s) == 4


def test_step_probe_syncs_each_step_and_stops_together():
    synced, asked = [], []
    # another process wants to go on twice: this one keeps stepping until all agree
    answers = iter([False, False, False, True])

    def agree(stop):
        asked.append(stop)
        return next(answers)

    t = TimingConfig(warmup=0, min_repeats=1, max_repeats=1, max_time_s=100.0)
    probe = StepProbe(2, t, sync=lambda: synced.append(1), agree=agree)
    # every step agrees (a rank whose data ran out says so at the others' next step): the first, untimed, says
    # go on; then three decisions: False, False, True
    assert _steps(probe, 10) == 4
    assert asked == [False, True, True, True] and len(synced) == 4
    # the time limit (wall clock) ends a probe whose median never settles, after min_repeats
    t3 = TimingConfig(warmup=0, min_repeats=2, max_repeats=100, max_time_s=1e-9, rel_tol=0.0)
    assert _steps(StepProbe(2, t3), 10) == 3


_DDP_CHILD = """
import json, os
import torch, accelerate
from torch.utils.data import DataLoader, TensorDataset
from microbatch.integrations.accelerate import knee_batch_size
from microbatch.measure.timing import TimingConfig

g0 = torch.Generator().manual_seed(1)
DATA = TensorDataset(torch.randn(1024, 32, generator=g0), torch.randn(1024, generator=g0))
seen = []

@knee_batch_size(global_batch=int(os.environ["GLOBAL_BATCH"]), use_cache=False,
                 timing=TimingConfig(warmup=1, min_repeats=3, max_repeats=6, max_time_s=0.5, rel_tol=0.05))
def train(micro_batch, grad_accum, probe=None):
    # the Accelerator (and with it the process group) is made inside, as the protocol shows
    acc = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=grad_accum)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt, loader = acc.prepare(model, opt, DataLoader(DATA, batch_size=micro_batch))
    updates = 0
    for x, y in loader:
        with acc.accumulate(model):
            acc.backward(torch.nn.functional.mse_loss(model(x).squeeze(-1), y))
            if probe is None:
                seen.append(len(x))
            updates += int(acc.sync_gradients)
            opt.step(); opt.zero_grad()
        if probe is not None:
            probe.step()
        elif updates == 2:
            break
    return acc.num_processes, acc.process_index

world, rank = train()
res = train.result
knee = res.recommendation.knee.micro_batch
out = {"world": world, "b": knee, "g": res.recommendation.grad_accum(knee),
       "points": [p.micro_batch for p in res.points], "seen": seen}
open(os.path.join(os.environ["OUT_DIR"], f"rank{rank}.json"), "w").write(json.dumps(out))
"""


def test_two_gloo_processes_agree_when_the_accelerator_is_made_inside(tmp_path):
    """accelerate launch / torchrun set WORLD_SIZE before the function makes its Accelerator: the
    decorator reads the world from there (read as 1, each process held B_global alone and left its
    probe loop at its own step: a collective mismatch crashed gloo), and the ranks stop each probe
    together. B_global 48 on 2 processes: every b_m probed divides 24."""
    from _helpers import run_launched

    r0, r1 = run_launched(_DDP_CHILD, tmp_path, GLOBAL_BATCH="48")
    assert r0["world"] == r1["world"] == 2
    assert r0["b"] == r1["b"] and r0["g"] == r1["g"] and r0["points"] == r1["points"]
    assert r0["b"] * r0["g"] * 2 == 48 and all(24 % b == 0 for b in r0["points"])
    assert r0["seen"] == [r0["b"]] * (2 * r0["g"]) == r1["seen"]


def test_the_real_call_draws_what_it_would_have_drawn_without_the_probes():
    """The probes draw random numbers (model initialisation, shuffling); the generators are put
    back before the real call, so a seeded script trains exactly as it would without the decorator."""
    import random

    import numpy as np

    drawn = {}

    def body(micro_batch, grad_accum, probe=None):
        first = (torch.rand(3).tolist(), random.random(), float(np.random.rand()))
        if probe is None:
            drawn["real"] = first
            return "trained"
        for _ in range(20):
            torch.randn(64, 64)  # the probe's own work draws too
            probe.step()

    torch.manual_seed(7), random.seed(7), np.random.seed(7)
    expected = (torch.rand(3).tolist(), random.random(), float(np.random.rand()))
    torch.manual_seed(7), random.seed(7), np.random.seed(7)
    f = knee_batch_size(body, global_batch=8, timing=FAST, use_cache=False)
    assert f() == "trained" and f.result.probes >= 2
    assert drawn["real"] == expected


def test_data_too_short_for_a_large_b_m_ends_the_search_and_keeps_its_points():
    """64 samples: b_m 32 gives 2 micro-steps (the warm-up, then no timed gap), too few to time. The
    search stops there, keeps 1..16 and trains at their knee, instead of losing every point to an error."""
    import time as _time

    def body(micro_batch, grad_accum, probe=None):
        for _start in range(0, 64, micro_batch):
            _time.sleep(0.002 + 0.0005 * micro_batch)  # a step whose throughput keeps rising with b_m
            if probe is not None:
                probe.step()
        return micro_batch, grad_accum

    f = knee_batch_size(body, global_batch=64, timing=FAST, use_cache=False, reference="measured", patience=9)
    b, g = f()
    res = f.result
    assert [p.micro_batch for p in res.points if not p.oom][:5] == [1, 2, 4, 8, 16]
    assert "probe.step() calls at micro_batch 32" in res.stop_reason and b * g == 64 and b <= 16


def test_world_size_set_for_one_process_without_a_group_is_refused(monkeypatch):
    """Issue 32: WORLD_SIZE=2 for one process whose function makes no process group; the decorator
    halved B_global (8 × 4 = 32 for 64 asked). Now the world is read from the group after the first call."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    calls = []

    @knee_batch_size(global_batch=B, max_micro_batch=16, timing=FAST)
    def train(micro_batch, grad_accum, probe=None):
        calls.append((micro_batch, grad_accum))
        for _ in range(6):
            if probe is not None:
                probe.step()

    with pytest.raises(
        ConfigError, match=r"WORLD_SIZE says 2 processes.*in no process group.*unset WORLD_SIZE"
    ):
        train()
    assert calls == [(1, B // 2)]  # refused after the first probing call, before any real call


def test_the_choice_is_printed_once_in_accelerates_own_way(capsys):
    calls = []
    train = _make(calls)
    train()
    out = capsys.readouterr().out
    b = train.result.recommendation.knee.micro_batch
    g = B // b
    assert out.count("microbatch: use b_m") == 1
    assert f"microbatch: use b_m = {b}, g = {g} (b_m x g x world = {b} x {g} x 1 = {B})" in out


def test_a_point_costs_its_share_of_the_optimizer_step():
    """The median gap between probe.step() calls left the optimizer step out once g >= 3 (it falls in one gap in g):
    b_m 8 at g 4 read 1,291/s where it ran 727/s, and was chosen. Each whole window of g gaps holds it once."""
    from microbatch.integrations.accelerate import with_optimizer_s

    gaps = [1.0, 1.0, 1.0, 5.0] * 3  # micro-steps of 1 s, an optimizer step of 4 s once in 4
    assert with_optimizer_s(gaps, 4) == pytest.approx(2.0)  # 1 + 4/4; the median gap said 1.0
    assert with_optimizer_s(gaps[1:] + gaps[:1], 4) == pytest.approx(2.0)  # wherever the windows start
    assert with_optimizer_s([3.0, 1.0] * 5, 2) == pytest.approx(
        2.0
    )  # g = 2: the median of a 50/50 mixture was not
    assert with_optimizer_s([2.0, 2.0, 9.0], 1) == 2.0 and with_optimizer_s([1.0, 1.0], 4) == 1.0


def test_the_probe_times_a_whole_accumulation_window_before_it_stops():
    t = TimingConfig(warmup=1, min_repeats=2, max_repeats=2, max_time_s=1e9, clock="process")
    probe = StepProbe(8, t, window=5)
    calls = 0
    with pytest.raises(ProbeDone):
        for _ in range(100):
            calls += 1
            probe.step()
    assert (
        len(probe.gaps_s) == 5 and calls == 7
    )  # a warm-up step, then 5 gaps; max_repeats 2 alone stopped at 2 gaps, before any optimizer step


def test_on_a_small_cpu_the_decorator_times_as_tune_does(monkeypatch):
    """One thread and the process clock on a CPU of 4 cores or fewer (tune's rule), where a timing is not given: the
    decorator timed with the wall clock and torch's threads, and on 2 loaded cores chose b_m 1 where tune chose 32."""
    import microbatch.hardware as hardware

    monkeypatch.setattr(hardware, "usable_cores", lambda: 2)
    threads: list[tuple[bool, int]] = []

    @knee_batch_size(global_batch=B, max_micro_batch=4, use_cache=False)
    def train(micro_batch, grad_accum, probe=None):
        threads.append((probe is not None, torch.get_num_threads()))
        model = torch.nn.Linear(32, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x, y in DataLoader(DATA, batch_size=micro_batch):
            torch.nn.functional.mse_loss(model(x).squeeze(-1), y).backward()
            opt.step()
            opt.zero_grad()
            if probe is not None:
                probe.step()
            else:
                break

    before = torch.get_num_threads()
    train()
    assert {p.clock for p in train.result.points} == {"process"}
    assert {n for probing, n in threads if probing} == {1} and threads[-1] == (False, before)
    assert "1 thread, process clock" in train.result.timing_choice
