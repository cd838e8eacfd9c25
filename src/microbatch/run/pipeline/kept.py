"""What a pipeline run stopped before its last step keeps: the report of the steps every rank finished, read from
the ranks' step logs (:func:`kept_steps`, after Ctrl-C, SIGTERM or the deadline), summarised with a second Ctrl-C
ignored (:func:`microbatch.interrupts.second_interrupt_ignored`), and the ranks' host peak set against the prediction
(:func:`with_host`). Split from :mod:`microbatch.run.pipeline.launch`, which raises what these return."""

from __future__ import annotations

import shutil

from microbatch.interrupts import second_interrupt_ignored
from microbatch.run.pipeline.config import PipelineConfig
from microbatch.run.pipeline.progress import PipelineInterrupted, read_partial, step_log_path
from microbatch.run.pipeline.report import PipelineReport
from microbatch.run.pipeline.resolved import ResolvedRun
from microbatch.run.pipeline.summary import summarize

__all__ = ["device_name", "kept_steps", "second_interrupt_ignored", "with_host"]


def device_name(cfg: PipelineConfig) -> str:
    """The device rank 0 ran on, as the worker names it (``cpu``, ``cuda:0``)."""
    return "cuda:0" if cfg.backend == "nccl" else "cpu"


def with_host(report: PipelineReport, predicted: dict[str, float]) -> PipelineReport:
    """``report`` with its ranks' host peak set against the host memory predicted before the run."""
    from dataclasses import replace

    from microbatch.run.pipeline.memory import host_memory

    return replace(report, host_memory=host_memory(report, predicted))


def kept_steps(
    run: ResolvedRun, tmp: str, host: dict[str, float], keep_logs: bool = False
) -> PipelineInterrupted:
    """The report of the steps every rank finished before an interrupt (from the ranks' step logs in
    ``tmp``, which is then removed unless ``keep_logs``), as a :class:`PipelineInterrupted` to raise."""
    import torch

    cfg = run.cfg
    head = {"config": cfg.to_dict(), "torch_version": torch.__version__, "device": device_name(cfg)}
    raw = read_partial([step_log_path(tmp, r) for r in range(cfg.stages)], head)
    if raw is None:
        if not keep_logs:
            shutil.rmtree(tmp, ignore_errors=True)
        return PipelineInterrupted(None, 0, cfg.steps, "no step was finished by every rank")
    steps = len(raw["ranks"][0]["steps"])
    try:
        with second_interrupt_ignored():  # a second Ctrl-C while summarising lost every step kept
            report = summarize(raw, run)
    except Exception as e:  # the interrupt still ends the run: say why nothing is shown
        return PipelineInterrupted(
            None, steps, cfg.steps, f"the {steps} step(s) kept could not be summarised: {e}"
        )
    if not keep_logs:
        shutil.rmtree(tmp, ignore_errors=True)
    return PipelineInterrupted(with_host(report, host), steps, cfg.steps)
