"""The typed report of a pipeline run, and its one JSON form.

:class:`PipelineReport` is what :func:`microbatch.run.pipeline.launch.run_pipeline` returns:
measured (:class:`Measured`, one :class:`RankStats` per rank), predicted by the simulator on the
measured op times (:class:`Predicted`), predicted before the run (:class:`BeforeRun`), memory per
rank (:class:`RankMemory`) and the timelines. :meth:`PipelineReport.to_json` writes the result file
(the keys of ``microbatch pipeline --json`` since it was first written) and
:meth:`PipelineReport.from_json` reads one back, also one written before this module existed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

__all__ = [
    "BUSY_HOST_OTHERS",
    "LOW_CPU_SHARE",
    "BeforeRun",
    "HostLoad",
    "HostMemory",
    "Measured",
    "PipelineReport",
    "Predicted",
    "PredictedOp",
    "RankMemory",
    "RankStats",
    "StepIntervals",
    "TimelineOp",
    "WithComm",
    "host_load",
]

T = TypeVar("T")

OMIT_IF_NONE = {"omit_if_none": True}
"""Field metadata: left out of the JSON form when None (a field that result files of earlier versions lack)."""

MEASURED_BUBBLE_IS = (
    "mean over the measured steps of each step's idle share, 1 - sum of the ranks' busy / (p x step wall "
    "time); bubble_of_mean_times is the share the mean busy/idle ms per rank give"
)
REPLAY_WITHOUT_HANDOFF_IS = (
    "the simulator on torch's order with the measured mean op times and no hand-off latency between ranks "
    "(the text's 'without it')"
)
REPLAY_WITH_HANDOFF_IS = (
    "the simulator on torch's order with the measured mean op times and the measured hand-off latency "
    "between ranks (comm_time_s): the text's 'replay (measured ops)' column"
)


def _plain(cls: type[T], d: Mapping[str, Any]) -> T:
    """An instance of the flat dataclass ``cls`` from the keys of ``d`` that it has (missing: default)."""
    names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    return cls(**{k: v for k, v in d.items() if k in names})


@dataclass(frozen=True, kw_only=True)
class RankStats:
    """One rank's measured busy and idle time, in-flight counts and saved-activation bytes."""

    stage: int
    """The rank (one pipeline position)."""
    virtual_stages: list[int]
    """The virtual stages it holds."""
    busy_s: float
    """Mean seconds per step inside forward/backward calls (the loss counted with the forward)."""
    idle_s: float
    """Mean step wall time less busy."""
    counted_in_flight: float
    """The schedule's count of micro-batches in flight at the peak (chunks / v)."""
    activation_bytes_per_microbatch: float
    """Mean bytes autograd saved for one (stage, micro-batch)."""
    peak_activation_bytes: int
    """Measured peak of saved storages alive."""
    counted_activation_bytes: int
    """The in-flight count times the bytes per micro-batch."""
    cuda_peak_bytes: int | None = None
    """``torch.cuda.max_memory_allocated`` (GPU only)."""
    cuda_reserved_bytes: int | None = None
    """``torch.cuda.max_memory_reserved`` (GPU only)."""
    counted_in_flight_chunks: int | None = None
    """The raw in-flight count in chunks (one micro-batch × one virtual stage)."""


@dataclass(frozen=True, kw_only=True)
class Measured:
    """The measured steps (the first warms up and is left out when there are more)."""

    bubble_fraction: float
    """Σ_ranks idle / (p × step wall time) of each measured step, averaged over the steps (the mean of
    per-step ratios: the headline "measured" bubble)."""
    bubble_steps: list[float]
    """Each measured step's bubble."""
    bubble_se: float | None
    """Standard error of the mean bubble (None with one step)."""
    step_time_s: float
    """Mean step wall time."""
    stage_stats: list[RankStats]
    """Per rank."""
    op_time_s: dict[str, float]
    """Mean seconds of each stage's F/B/I/W (``"1F"``)."""
    cpu_share: float | None = None
    """CPU seconds / wall seconds inside the ops (None on a GPU or without CPU times)."""
    bubble_of_mean_times: float | None = field(default=None, metadata=OMIT_IF_NONE)
    """1 − Σ_ranks mean busy / (p × mean step wall time): the idle share the per-rank busy and idle ms
    (means over the steps) give; it differs from :attr:`bubble_fraction` when steps differ in length."""
    bubble_fraction_is: str | None = field(default=None, metadata=OMIT_IF_NONE)
    """What :attr:`bubble_fraction` is, in words (:data:`MEASURED_BUBBLE_IS`; None in older files)."""

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Measured:
        return _plain(cls, {**d, "stage_stats": [_plain(RankStats, s) for s in d.get("stage_stats", [])]})


@dataclass(frozen=True, kw_only=True)
class WithComm:
    """The simulator's prediction with the measured hand-off latency paid between ranks."""

    comm_time_s: float
    bubble_fraction: float
    step_time_s: float
    bubble_fraction_is: str | None = field(default=None, metadata=OMIT_IF_NONE)
    """:data:`REPLAY_WITH_HANDOFF_IS` (None in older files)."""


@dataclass(frozen=True, kw_only=True)
class Predicted:
    """The simulator on torch's order, fed the measured mean op times."""

    bubble_fraction: float
    peak_in_flight: list[float]
    peak_in_flight_chunks: list[int]
    step_time_s: float
    source: str
    with_comm: WithComm
    """The same with the measured hand-off latency (the text's "replay (measured ops)" column)."""
    bubble_fraction_is: str | None = field(default=None, metadata=OMIT_IF_NONE)
    """:data:`REPLAY_WITHOUT_HANDOFF_IS` (None in older files)."""

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Predicted:
        return _plain(cls, {**d, "with_comm": _plain(WithComm, d["with_comm"])})


@dataclass(frozen=True, kw_only=True)
class BeforeRun:
    """The prediction made before the ranks start (:func:`microbatch.run.pipeline.before_run.predict_before`)."""

    bubble_fraction: float
    step_time_s: float
    overhead_s: float
    """Mean runtime cost after an op (after a forward send, a backward send, a local op)."""
    comm_time_s: float
    """Mean hand-off latency between ranks."""
    cpu_share: float
    """Share of a core the ops got in the replay."""
    runtime: dict[str, Any]
    """The calibration's measured terms (:func:`microbatch.run.pipeline.replay.runtime_terms`)."""
    profile_s: dict[str, float]
    """The one-process profile: seconds of each stage's F/B/I/W (``"1F"``)."""
    source: str


BUSY_HOST_OTHERS = 1.0
"""Other programs' runnable threads (the mean over :func:`~microbatch.run.pipeline.calibrate.machine_load`'s
samples) from which the host counts as busy: one thread that keeps a core's worth of work waiting beside
the ranks. At load 5.5 on the 2-core dev VM (others 3.96) the prediction said 93.0% bubble and 98.7 ms
per step; the run measured 67.3% and 40.4 ms."""

LOW_CPU_SHARE = 0.8
"""Share of a core the replayed ops got (:attr:`BeforeRun.cpu_share`) below which the ranks were
predicted to wait for cores: the replay's model of contention, which moves with the load."""


@dataclass(frozen=True, kw_only=True)
class HostLoad:
    """How busy the host was when the prediction was made (:func:`host_load`)."""

    others: float
    """Other programs' runnable threads."""
    cores: int
    """Cores the ranks could use."""
    cpu_share: float
    """Share of a core the replayed ops got."""


def host_load(before: BeforeRun) -> HostLoad | None:
    """The host's load behind ``before`` when it was busy — other programs' runnable threads at least
    :data:`BUSY_HOST_OTHERS`, or the replayed ops getting under :data:`LOW_CPU_SHARE` of a core — else
    None (an idle host, or no machine reading: a GPU run). A prediction made then assumes the load it
    measured stays as it was, and its model of sharing cores is rough: it can be far off."""
    machine = before.runtime.get("machine") if before.runtime else None
    if not machine:
        return None
    others = float(machine.get("others") or 0.0)
    if others < BUSY_HOST_OTHERS and before.cpu_share >= LOW_CPU_SHARE:
        return None
    return HostLoad(others=others, cores=int(machine.get("cores") or 0), cpu_share=float(before.cpu_share))


@dataclass(frozen=True, kw_only=True)
class RankMemory:
    """One rank's measured saved-activation peak beside the two predictions."""

    rank: int
    measured_peak_bytes: int
    predicted_bytes: float | None
    """Walked along torch's order with each stage's measured bytes (:mod:`~microbatch.run.pipeline.memory`)."""
    error_pct: float | None
    uncalibrated_bytes: float | None
    """predict/memory's estimate (v = 1, a built-in model)."""
    uncalibrated_error_pct: float | None
    counted_bytes: int
    live_bytes_after_step: int
    host_peak_bytes: int | None = None


@dataclass(frozen=True, kw_only=True)
class HostMemory:
    """The p local ranks' host memory: what the machine measured against what the check before the run
    predicted (:func:`microbatch.run.pipeline.fit.predicted_host_bytes`). Unlike the activation table's
    calibrated column, the two come from different sources and can disagree."""

    measured_bytes: int
    """Σ over the ranks of each one's peak resident set over the measured steps (``VmHWM``, reset before
    each step): the model, gradients, Adam, activations, buffers and the interpreter, as the kernel counts them."""
    predicted_bytes: float
    """The prediction's total, by term in :attr:`predicted_terms`."""
    error_pct: float
    """100 × (measured − predicted) / predicted."""
    predicted_terms: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class TimelineOp:
    """One measured op of the last step, seconds from its start."""

    rank: int
    stage: int
    kind: str
    microbatch: int
    start_s: float
    end_s: float


@dataclass(frozen=True, kw_only=True)
class PredictedOp:
    """One op of the simulator's timeline."""

    rank: int
    label: str
    microbatch: int
    start_s: float
    end_s: float


@dataclass(frozen=True, kw_only=True)
class StepIntervals:
    """One measured step: start and end (wall clock) and each rank's raw ``(kind, stage,
    microbatch, start, end)`` intervals."""

    start: float
    end: float
    ranks: list[list[Any]]


_PARTS: dict[str, Any] = {
    "measured": Measured.from_json,
    "predicted": Predicted.from_json,
    "before_run": lambda d: _plain(BeforeRun, d),
    "host_memory": lambda d: _plain(HostMemory, d),
    "memory": lambda rows: [_plain(RankMemory, r) for r in rows],
    "timeline": lambda rows: [_plain(TimelineOp, r) for r in rows],
    "predicted_timeline": lambda rows: [_plain(PredictedOp, r) for r in rows],
    "step_intervals": lambda rows: [_plain(StepIntervals, r) for r in rows],
}


@dataclass(frozen=True, kw_only=True)
class PipelineReport:
    """A pipeline run measured, predicted and counted (see the module's docstring)."""

    schedule: str
    stages: int
    microbatches: int
    virtual: int
    model: str
    global_batch: int
    micro_batch: int
    steps: int
    """Steps the ranks finished."""
    measured_steps: int
    layers_per_stage: list[int]
    torch_version: str | None
    device: str | None
    measured: Measured
    memory: list[RankMemory]
    predicted: Predicted
    gradients_match: bool | None
    max_grad_rel_error: float | None
    grad_tolerance: float
    losses: list[float]
    order_matches_torch: bool
    executed_order: dict[str, list[str]]
    timeline: list[TimelineOp]
    step_intervals: list[StepIntervals]
    predicted_timeline: list[PredictedOp]
    interrupted: bool = False
    """Stopped by Ctrl-C, SIGTERM or the deadline: the figures are those of the steps every rank finished."""
    steps_asked: int | None = None
    """Steps asked for (an interrupted run)."""
    stop_reason: str | None = field(default=None, metadata=OMIT_IF_NONE)
    """Why a run stopped that no one interrupted: the deadline passed (None after Ctrl-C or SIGTERM)."""
    before_run: BeforeRun | None = None
    torch_class: str | None = field(default=None, metadata=OMIT_IF_NONE)
    """The ``torch.distributed.pipelining`` class that ran ``schedule`` (zb-h1:
    ``ScheduleInterleavedZeroBubble`` with one stage per rank)."""
    dropout_modules: list[str] | None = field(default=None, metadata=OMIT_IF_NONE)
    """Dropout layers that drop in training mode (``stage S name``): with them the gradient check's
    reference draws other masks, so its gradients cannot match."""
    host_memory: HostMemory | None = field(default=None, metadata=OMIT_IF_NONE)
    """The ranks' host peak against the host memory predicted before the run (a local run)."""
    notes: list[str] = field(default_factory=list)
    """What the command noted on the way (written by the command, not the run)."""
    outputs: dict[str, str] = field(default_factory=dict)
    """Files written: ``trace``, ``svg``, ``png`` -> path."""

    def to_json(self) -> dict[str, Any]:
        """The result file's form: the fields in order, nested parts as objects; ``interrupted``
        and ``steps_asked`` only for an interrupted run, ``outputs`` as top-level keys."""

        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("interrupted", "steps_asked") and not self.interrupted:
                continue
            if f.name == "outputs":
                out.update(value)
                continue
            if (
                f.metadata.get("omit_if_none") and value is None
            ):  # before_run stays: null without a prediction
                continue
            out[f.name] = _json_value(value)
        return out

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> PipelineReport:
        """A report from :meth:`to_json`'s form, or from a result file of an earlier version (the
        ``microbatch pipeline --json`` envelope's ``command`` and ``version`` are ignored)."""
        names = {f.name for f in fields(cls)}
        kw: dict[str, Any] = {}
        for k, v in d.items():
            if k in _PARTS and v is not None:
                kw[k] = _PARTS[k](v)
            elif k in names and k != "outputs":
                kw[k] = v
        kw["outputs"] = {k: str(d[k]) for k in ("trace", "svg", "png") if d.get(k)}
        kw.setdefault("memory", [])
        kw.setdefault("notes", [])
        return cls(**kw)


def _json_value(value: Any) -> Any:
    """``value`` in JSON form: dataclasses as objects, their :data:`OMIT_IF_NONE` fields left out when
    None (added after result files were first written: an old file writes back as it was read)."""
    if isinstance(value, list):
        return [_json_value(v) for v in value]
    if isinstance(value, dict):
        return {k: _json_value(v) for k, v in value.items()}
    if hasattr(value, "__dataclass_fields__"):
        return {
            f.name: _json_value(getattr(value, f.name))
            for f in fields(value)
            if not (f.metadata.get("omit_if_none") and getattr(value, f.name) is None)
        }
    return value
