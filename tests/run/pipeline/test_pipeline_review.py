"""A review of ``microbatch pipeline``: what it accepts, how it labels and ends a run, what its figures are.

zb-h1 is refused, accepted and labelled by one rule that ``bubble`` shares (torch's own class's, checked by
constructing it); the ranks end with a launcher killed by SIGKILL; a failed gradient check exits 1 and names
dropout; messages name what pipeline takes and the phase an interrupt came in; the layer rule comes before
m's; a busy host is said; the JSON names which bubble is which; host memory is measured against its
prediction; a long sequence's attention is in the deadline check. Real runs: two, tiny, bounded.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest

from microbatch.cli import main
from microbatch.errors import ConfigError, ScheduleError
from microbatch.run.pipeline import fit
from microbatch.run.pipeline.config import PipelineConfig
from microbatch.run.pipeline.report import BeforeRun, PipelineReport, host_load
from microbatch.run.pipeline.resolved import resolve
from microbatch.schedules.registry import check_servable

torch = pytest.importorskip("torch")

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture
def no_process(monkeypatch):
    """Any process started fails the test: refused before any rank, calibration or profile starts."""

    from _helpers import refuse_processes  # here: the ranks import this module as a factory

    refuse_processes(monkeypatch)


def dropout_stack():
    """A factory whose stack drops in training mode: its masks differ in the unsplit reference."""
    nn = torch.nn
    return nn.Sequential(nn.Embedding(64, 16), nn.Dropout(0.5), nn.Linear(16, 16), nn.Linear(16, 64))


def _cli(*args: str, timeout: float = 150) -> subprocess.CompletedProcess[str]:
    """``python -m microbatch ARGS`` from this folder (the ranks import this module's factories)."""
    env = {**os.environ, "PYTHONPATH": HERE + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run(
        [sys.executable, "-m", "microbatch", *args], capture_output=True, text=True, timeout=timeout,
        cwd=HERE, env=env,
    )  # fmt: skip


_RUN: dict[str, object] = {}


def _zb_h1_dropout_run() -> tuple[subprocess.CompletedProcess[str], dict]:
    """One real run shared by the tests below: zb-h1 at p = 2, m = 1 (m < p: a size torch's class takes)
    on a model with dropout, gradients checked, 2 steps, no prediction."""
    if "run" not in _RUN:
        r = _cli(
            "pipeline", "--schedule", "zb-h1", "-p", "2", "-m", "1", "--model", "test_pipeline_review:dropout_stack",
            "--check-gradients", "--no-predict", "--steps", "2", "--timeout", "60", "--json",
        )  # fmt: skip
        _RUN["run"] = (r, json.loads(r.stdout))
    return _RUN["run"]  # type: ignore[return-value]


# -- A. zb-h1: one rule with bubble, torch's class's, and its own label ----------------------------


def test_zb_h1_with_two_stages_per_rank_is_refused_by_pipeline_as_by_bubble(capsys, no_process):
    said = []
    for cmd in (
        ["bubble", "-s", "zb-h1", "-p", "2", "-m", "4"],
        ["pipeline", "--schedule", "zb-h1", "-p", "2"],
    ):
        assert main([*cmd, "-v", "2"]) == 2
        err = capsys.readouterr().err
        said.append(re.search(r"zb-h1 runs one stage per rank \(([^)]*)\)", err)[1])  # type: ignore[index]
    assert said[0] == said[1] and "ScheduleInterleavedZeroBubble" in said[0]
    with pytest.raises(ScheduleError, match="zb-h1 runs one stage per rank"):
        PipelineConfig(schedule="zb-h1", stages=2, microbatches=4, virtual=2)


def _torch_accepts(p: int, m: int) -> bool:
    """Whether torch's ScheduleInterleavedZeroBubble (what runs zb-h1) is built for p ranks and m
    micro-batches with one stage per rank: its constructor run on a stand-in stage."""
    from torch.distributed.pipelining.schedules import ScheduleInterleavedZeroBubble

    stage = SimpleNamespace(
        submod=torch.nn.Linear(1, 1), num_stages=p, group_size=p, group_rank=0, stage_index=0, is_first=True,
        is_last=False,
    )  # fmt: skip
    try:
        ScheduleInterleavedZeroBubble([stage], m, scale_grads=False)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize(("p", "m"), [(2, 1), (2, 3), (2, 4), (2, 5), (3, 2), (3, 7), (4, 6), (4, 9)])
def test_zb_h1_takes_the_m_torchs_class_takes_in_pipeline_and_bubble(p, m):
    """Before: p = 2, m = 1 ran in pipeline and was refused by bubble (m < p); m = 5 the other way."""
    torch_says = _torch_accepts(p, m)
    assert torch_says == ((m % max(1, m // p)) == 0)  # what torch 2.13's class does, by running it
    for check in (
        lambda: check_servable("zb-h1", p, m),  # bubble's (and simulate's, plan's) rule
        lambda: PipelineConfig(schedule="zb-h1", stages=p, microbatches=m, model="gpt2"),  # pipeline's
    ):
        try:
            check()
            accepted = True
        except ScheduleError:
            accepted = False
        assert accepted == torch_says, (p, m)


@pytest.mark.timeout(200)
def test_zb_h1_runs_labelled_zb_h1_and_says_torchs_class():
    r, out = _zb_h1_dropout_run()
    assert out["schedule"] == "zb-h1" and out["torch_class"] == "ScheduleInterleavedZeroBubble"
    assert out["order_matches_torch"] is True and out["microbatches"] == 1
    assert any("zb-h1 has no torch class of its own" in n and "one stage per rank" in n for n in out["notes"])
    rep = PipelineReport.from_json(out)
    from microbatch.show.pipeline_report import render

    assert render(rep).startswith("pipeline zb-h1: p = 2 ranks, m = 1 micro-batches")


# -- C. a failed gradient check exits 1 and names dropout ----------------------------------------


@pytest.mark.timeout(200)
def test_a_gradient_mismatch_exits_1_and_names_dropout():
    r, out = _zb_h1_dropout_run()
    assert out["gradients_match"] is False and out["max_grad_rel_error"] > out["grad_tolerance"]
    assert r.returncode == 1, r.stderr
    assert "error: the gradients do not match the unsplit model" in r.stderr
    assert out["dropout_modules"] == ["stage 0 1"]  # stage 0's second layer: the nn.Dropout
    assert any(
        "dropout or batch-statistic norms in training mode (stage 0 1)" in n and "masks differ" in n
        for n in out["notes"]
    )


# -- H. the JSON names which bubble is which; I. host memory against its prediction -------------------


@pytest.mark.timeout(200)
def test_the_json_says_which_bubble_each_figure_is():
    _, out = _zb_h1_dropout_run()
    pred, meas = out["predicted"], out["measured"]
    assert "no hand-off" in pred["bubble_fraction_is"]
    assert "'replay (measured ops)' column" in pred["with_comm"]["bubble_fraction_is"]
    assert "mean over the measured steps" in meas["bubble_fraction_is"]
    busy = sum(s["busy_s"] for s in meas["stage_stats"])
    assert meas["bubble_of_mean_times"] == pytest.approx(1 - busy / (2 * meas["step_time_s"]))
    assert any(f"share is {meas['bubble_of_mean_times']:.1%}" in n for n in out["notes"])


@pytest.mark.timeout(200)
def test_host_memory_is_measured_against_the_prediction_made_before_the_run():
    _, out = _zb_h1_dropout_run()
    host = out["host_memory"]
    peaks = [row["host_peak_bytes"] for row in out["memory"]]
    assert host["measured_bytes"] == sum(peaks) > 0  # the ranks' VmHWM, read by the kernel
    cfg = PipelineConfig(
        schedule="zb-h1", stages=2, microbatches=1, model="test_pipeline_review:dropout_stack",
        check_gradients=True, steps=2, timeout_s=60,
    )  # fmt: skip
    run = resolve(cfg)
    from microbatch.run.pipeline.split import inspect_factory

    info = inspect_factory(cfg.model)
    predicted = fit.predicted_host_bytes(run, info.params, largest=info.largest)
    assert host["predicted_bytes"] == pytest.approx(predicted["total"])
    assert host["error_pct"] == pytest.approx(100 * (sum(peaks) - predicted["total"]) / predicted["total"])
    assert any("host memory: the ranks' peak resident memory (VmHWM)" in n for n in out["notes"])
    assert any("checks the walk of torch's order" in n and "not the bytes" in n for n in out["notes"])


def test_a_host_peak_over_the_prediction_shows_as_error():
    """The comparison can disagree: measured 3 GiB against 2 GiB predicted is +50%."""
    from microbatch.run.pipeline.memory import host_memory

    rows = [SimpleNamespace(host_peak_bytes=2 * 1024**3), SimpleNamespace(host_peak_bytes=1024**3)]
    got = host_memory(SimpleNamespace(memory=rows), {"total": 2.0 * 1024**3, "processes": 1.0})  # type: ignore[arg-type]
    assert got is not None and got.measured_bytes == 3 * 1024**3 and got.error_pct == pytest.approx(50.0)
    assert (
        host_memory(SimpleNamespace(memory=[SimpleNamespace(host_peak_bytes=None)]), {"total": 1.0}) is None
    )  # type: ignore[arg-type]


# -- B. the ranks end with a launcher killed by SIGKILL -------------------------------------------------


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.timeout(150)
def test_the_ranks_end_when_the_launcher_is_killed():
    """Before: both ranks were re-parented to PID 1 and ran every step of a long run."""
    from _helpers import alive, rank_pids  # here: the ranks import this module as a factory

    proc = subprocess.Popen(
        [sys.executable, "-m", "microbatch", "pipeline", "--no-predict", "-p", "2", "-m", "4", "--steps", "2000",
         "--timeout", "600"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    ranks: list[int] = []
    try:
        end = time.monotonic() + 120
        assert proc.stderr is not None
        for line in proc.stderr:  # the first finished step: the ranks are running
            if line.startswith("pipeline:   step ") or time.monotonic() > end:
                break
        ranks = rank_pids(proc.pid)
        assert len(ranks) == 2 and all(alive(r) for r in ranks), ranks
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 5
        while any(alive(r) for r in ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(alive(r) for r in ranks), "ranks outlived their launcher"
    finally:
        for pid in [proc.pid, *ranks]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(timeout=10)


# -- D, F, J: messages and help ------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["huge", "./config.json"])
def test_an_unknown_model_lists_what_pipeline_takes(model, capsys, no_process):
    assert main(["pipeline", "--model", model]) == 2
    err = capsys.readouterr().err
    assert "give a built-in preset (tiny, small, gpt2" in err and "or module:function" in err
    assert "--hf-config" not in err and "--layers" not in err  # options pipeline does not have


def test_the_layer_rule_comes_before_the_microbatch_rule(capsys, no_process):
    """Before: -p 5 on tiny said "use --microbatches 5 or more", and that then said "only 4 layers"."""
    assert main(["pipeline", "-p", "5"]) == 2
    err = capsys.readouterr().err
    assert "model tiny has only 4 layers to split" in err and "--microbatches" not in err


def test_help_says_what_each_option_is(capsys):
    from click.testing import CliRunner

    from microbatch.commands.pipeline import cmd

    text = " ".join(CliRunner().invoke(cmd, ["--help"], terminal_width=200).output.split())
    for said in (
        "every preset of microbatch.model", "takes no arguments", "starts with an nn.Embedding",
        "Seed of the weights", "torch.distributed backend", "each collective of the process group",
        "at least 10", "plus 60 s", "a multiple of m", "ScheduleInterleavedZeroBubble", "p·v <=",
    ):  # fmt: skip
        assert said in text, said
    assert "Seconds before a stuck run is killed" not in text and "(tiny, small) or" not in text


# -- E. an interrupt says the phase it came in ---------------------------------------------------------


def _interrupt_in(monkeypatch, phases: list[tuple[str, dict]], error: BaseException, predict: bool) -> str:
    """The message a Ctrl-C ends ``pipeline`` with after ``phases`` were announced, the interrupt ``error``
    raised by the work (the prediction when ``predict``, else the run)."""
    from microbatch.commands import pipeline as command
    from microbatch.run.pipeline import before_run, launch
    from microbatch.run.pipeline.progress import announce

    def work(*args, **kwargs):
        for phase, fields in phases:
            announce(phase, **fields)
        raise error

    monkeypatch.setattr(
        before_run if predict else launch, "predict_resolved" if predict else "run_resolved", work
    )
    with pytest.raises(KeyboardInterrupt) as caught:
        command._run_local(resolve(PipelineConfig(steps=3)), predict_first=predict)
    return str(caught.value)


def test_an_interrupt_in_the_loaded_calibration_says_so_once(monkeypatch, capsys):
    from microbatch.run.pipeline.progress import PipelineInterrupted

    said = _interrupt_in(
        monkeypatch,
        [("calibrate", {}), ("profile", {}), ("calibrate_loaded", {}), ("start", {"total": 46, "ranks": 2})],
        PipelineInterrupted(None, 4, 46),
        predict=True,
    )
    assert said == (
        "during the loaded calibration run (4 of the loaded calibration run's 46 steps had finished); none of "
        "the run's 3 step(s) was measured"
    )
    assert "interrupted during the loaded calibration run" in capsys.readouterr().err


def test_an_interrupt_before_the_ranks_start_says_the_checks(monkeypatch):
    """--no-predict: a Ctrl-C in the run's checks (before its ranks started) said "as the run's ranks started"."""
    said = _interrupt_in(monkeypatch, [], KeyboardInterrupt(), predict=False)
    assert said.startswith("during the run's checks, before its ranks started;")
    said = _interrupt_in(
        monkeypatch, [("start", {"total": 3, "ranks": 2})], KeyboardInterrupt(), predict=False
    )
    assert said.startswith("as the run's ranks started;")


# -- G. a busy host is said ------------------------------------------------------------------------------


def _before(others: float, cpu_share: float) -> BeforeRun:
    return BeforeRun(
        bubble_fraction=0.93, step_time_s=0.0987, overhead_s=0.0, comm_time_s=0.0, cpu_share=cpu_share,
        runtime={"machine": {"cores": 2.0, "others": others, "slice_s": 0.004}}, profile_s={}, source="test",
    )  # fmt: skip


@pytest.mark.timeout(200)
def test_a_prediction_made_on_a_busy_host_says_so():
    """At load 5.5 the JSON held others 3.96 and cpu_share 0.59, and notes []."""
    from microbatch.run.pipeline.summary import figure_notes

    assert host_load(_before(0.1, 1.0)) is None
    load = host_load(_before(3.96, 0.59))
    assert load is not None and (load.others, load.cores, load.cpu_share) == (3.96, 2, 0.59)
    assert host_load(_before(0.2, 0.5)) is not None  # contended even with few other threads
    _, out = _zb_h1_dropout_run()
    rep = PipelineReport.from_json(out)
    busy = [n for n in figure_notes(replace(rep, before_run=_before(3.96, 0.59))) if "host was busy" in n]
    assert len(busy) == 1 and "3.96 threads runnable on 2 cores" in busy[0] and "59% of a core" in busy[0]
    assert not [n for n in figure_notes(replace(rep, before_run=_before(0.1, 1.0))) if "host was busy" in n]


# -- K. a long sequence's attention is in the deadline check --------------------------------------------


def test_attentions_s_squared_work_is_timed_at_attentions_rate(monkeypatch):
    """tiny at s = 100,000, one step: 6.1e13 of its 6.2e13 FLOPs are attention. At a 150 GFLOP/s
    matrix-product rate alone the bound was 103 s, under the 360 s deadline; a step took about 800 s."""
    monkeypatch.setattr(fit, "usable_cores", lambda: 2)
    run = resolve(PipelineConfig(seq=100_000, steps=1, timeout_s=300))
    assert fit.attention_flops(run) == pytest.approx(3 * 2 * 2 * (4 * 100_000) * 100_000 * 128)
    fit.check_duration(run, flops_per_s=1.5e11, attention_per_s=1.5e11)  # attention as fast as a GEMM: passes
    with pytest.raises(
        ConfigError, match=r"at least 38\d s on 2 cores .*\(80 GFLOP/s for attention's 6.14e\+13"
    ):
        fit.check_duration(run, flops_per_s=1.5e11, attention_per_s=8e10)
    assert 0 < fit.attention_flops_per_s(16, 256, repeats=1)
