"""What a pipeline sweep found: the saved-tensor hooks keep autograd's in-place check, the launcher's own run of
the model (the profile before a run) has the run's deadline and says a model's error in one line, a run past its
deadline keeps the steps every rank finished, and a second Ctrl-C does not throw them away while they are
summarised."""

from __future__ import annotations

import os
import signal
import time
from types import SimpleNamespace

import pytest

from microbatch.errors import PipelineError
from microbatch.run.pipeline.config import PipelineConfig
from microbatch.run.pipeline.instrument import _saved_bytes_hooks
from microbatch.run.pipeline.kept import second_interrupt_ignored
from microbatch.run.pipeline.launch import run_pipeline
from microbatch.run.pipeline.progress import PipelineDeadline
from microbatch.run.pipeline.stage_profile import in_launcher

torch = pytest.importorskip("torch")


def test_the_measuring_hooks_keep_autograds_in_place_check():
    """sigmoid saves its output; changing it in place makes its backward wrong: torch raises, and so must the
    hooks (returning the tensor itself turned the check off: grad [-0.38, ...] where [0.49, ...] is right)."""
    w = torch.randn(3, requires_grad=True)

    def broken():
        y = torch.sigmoid(w)
        y.mul_(2)
        return y.sum()

    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        broken().backward()  # torch's own check
    with _saved_bytes_hooks(set(), {}), pytest.raises(RuntimeError, match="modified by an inplace operation"):
        broken().backward()
    with _saved_bytes_hooks(set(), {}):  # a model that changes nothing saved is untouched
        torch.sigmoid(w).sum().backward()
    assert torch.allclose(w.grad, torch.sigmoid(w) * (1 - torch.sigmoid(w)))


def _fake_run(deadline_s: float) -> SimpleNamespace:
    return SimpleNamespace(
        cfg=SimpleNamespace(timeout_s=deadline_s, deadline=lambda given_s=None: (given_s or deadline_s, ""))
    )


def test_the_launchers_own_run_of_the_model_has_the_deadline_and_one_line_errors():
    before = signal.getitimer(signal.ITIMER_REAL)[0]  # a test runner's timer, where it uses one
    t0 = time.monotonic()
    with pytest.raises(PipelineError, match=r"profiling passed its deadline of 1 s"):
        with in_launcher(_fake_run(1.0), "profiling"):  # type: ignore[arg-type]
            time.sleep(30)
    assert time.monotonic() - t0 < 10
    after = signal.getitimer(signal.ITIMER_REAL)[
        0
    ]  # the timer and handler put back, with what was left of it
    assert after == 0.0 if before == 0.0 else 0.0 < after <= before
    with pytest.raises(
        PipelineError, match=r"profiling failed \(ValueError: bad layer\): the model's forward"
    ):
        with in_launcher(_fake_run(30.0), "profiling"):  # type: ignore[arg-type]
            raise ValueError("bad layer")


def test_a_second_interrupt_while_summarising_is_ignored():
    with second_interrupt_ignored():
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.1)  # a KeyboardInterrupt would land here
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_run_past_its_deadline_keeps_the_steps_every_rank_finished():
    cfg = PipelineConfig(
        schedule="1f1b", stages=2, microbatches=2, steps=2_000, timeout_s=60
    )  # ~20 ms a step: ~40 s
    with pytest.raises(PipelineDeadline) as caught:
        run_pipeline(cfg, deadline_s=15)
    e = caught.value
    assert isinstance(e, PipelineError) and "passed its deadline of 15 s" in str(e)
    assert 0 < e.steps < 2_000 and e.asked == 2_000
    assert e.report.steps == e.steps and e.report.measured.step_time_s > 0
