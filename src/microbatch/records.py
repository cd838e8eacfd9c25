"""Reading result files: the one reader of what the commands write.

Every layer that reads results back — the calibration (:mod:`microbatch.predict.calibrate`), the
knee (:mod:`microbatch.choose.knee`), the report (:mod:`microbatch.show.html`) — reads them here:

- :func:`load_json`: a path (a directory means its ``result.json``) or an already-loaded value;
- :func:`classify` and :func:`load_results`: which command wrote a result, from its envelope's
  ``command`` field (``{"command": ..., "version": ..., ...}``), or, for files written before the
  envelope existed, guessed from its keys;
- the field checks every reader applies to a measured point (:func:`number`, :func:`positive`,
  :func:`flag`, :func:`true_or_false`), defined in :mod:`microbatch.fields` and handed on here;
- :func:`read_measurements`: the measured points of a ``tune`` (or ``recommend``) result plus what
  they were measured with (model, sequence length, precision, checkpointing, device), as the
  calibration fits use them.

Core: no torch, no layer above.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from microbatch._json import load_json
from microbatch.errors import ConfigError, whole_number
from microbatch.fields import MAX_EXACT_WHOLE, flag, number, positive, short_repr, true_or_false
from microbatch.model import ModelShape, get_model
from microbatch.precision import PRECISIONS
from microbatch.records_fields import check_fields

__all__ = [
    "GUESSED_KINDS",
    "on_gpu",
    "load_json",
    "classify",
    "load_results",
    "MAX_EXACT_WHOLE",
    "check_fields",
    "number",
    "positive",
    "flag",
    "true_or_false",
    "result_points",
    "MeasuredPoint",
    "Measurements",
    "read_measurements",
]

GUESSED_KINDS = ("tune", "plan", "pipeline", "simulate", "validate")
"""The kinds :func:`classify` can recognise from the keys alone (files written before the envelope)."""


# -- JSON ----------------------------------------------------------------------------------------
def classify(result: Any) -> str:
    """Which command wrote ``result``: the envelope's ``command`` field (any command), or, for a
    file written before the envelope existed, one of :data:`GUESSED_KINDS` recognised by its keys."""
    if not isinstance(result, dict):
        raise ConfigError(
            f"a result must be a JSON object, got {type(result).__name__}; give the JSON output of tune, plan, "
            "pipeline, simulate or validate"
        )
    command = result.get("command")
    if isinstance(command, str) and command:
        return command
    if "points" in result and "micro_batch" in result:
        return "tune"
    if ("recommended" in result and "candidates" in result) or isinstance(result.get("plans"), list):
        return "plan"
    if "measured" in result and "predicted" in result:
        return "pipeline"
    if "makespan" in result and "stage_stats" in result:
        return "simulate"
    if "rows" in result:
        return "validate"
    raise ConfigError(
        "cannot tell which command wrote this result (keys: "
        + ", ".join(sorted(result)[:12])
        + "); give the JSON output of tune, plan, pipeline, simulate or validate"
    )


def load_results(paths: Iterable[str | Path]) -> list[tuple[str, dict[str, Any]]]:
    """Read result files (JSON; a directory means its ``result.json``), each with its kind.

    A file may hold one result or a list of them; a multi-GPU ``plan`` (``{"plans": [...]}``)
    gives one result per accelerator.
    """
    out: list[tuple[str, dict[str, Any]]] = []
    for p in paths:
        data = load_json(p)
        items = data if isinstance(data, list) else [data]
        if not items:
            raise ConfigError(
                f"{p} holds an empty list: no result in it; give the JSON output of tune, plan, pipeline, "
                "simulate or validate"
            )
        for item in items:
            try:
                kind = classify(item)
            except ConfigError as e:  # say which file
                raise ConfigError(f"{p}: {e}") from None
            check_fields(kind, item, source=str(p))
            if kind == "plan" and isinstance(item.get("plans"), list):
                for j, sub in enumerate(
                    item["plans"]
                ):  # each checked; kept together: the report compares them
                    try:
                        classify(sub)
                    except ConfigError as e:  # say which file and which of its plans
                        raise ConfigError(f"{p}: plans[{j}]: {e}") from None
            out.append((kind, item))
    if not out:
        raise ConfigError("no results given; pass one or more JSON files from tune, plan or pipeline")
    return out


def result_points(data: Any, *, source: str) -> list[Any]:
    """The measured points of a result: its ``points`` list (``tune``, ``recommend``), or ``data``
    itself when it is a bare list of points."""
    if isinstance(data, list):
        return data
    command = data.get("command") if isinstance(data, dict) else None
    if command not in (None, "tune", "recommend", "demo") and isinstance(data.get("points"), list):
        raise ConfigError(
            f"{source} holds a {command} result (written by `microbatch {command}`), whose points are not "
            "measurements to choose from; give a tune's result.json or a list of measured points"
        )
    if isinstance(data, dict) and isinstance(data.get("points"), list):
        return list(data["points"])
    raise ConfigError(
        f"{source}: expected an object with a 'points' list (a tune's result.json) or a list of "
        "points with micro_batch, throughput, peak_memory_bytes, step_time_s"
    )


# -- measured points with their provenance ----------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class MeasuredPoint:
    """One measured b_m, as the fits use it."""

    micro_batch: int
    """b_m."""
    peak_memory_bytes: float | None
    """Measured peak memory (the key chosen by ``memory_key``); None when not measured."""
    step_time_s: float | None
    """Measured time of one micro-step (forward + backward); None when not measured."""


@dataclass(frozen=True, kw_only=True)
class Measurements:
    """Measured points plus what they were measured with."""

    shape: ModelShape
    """The model, at the measured sequence length."""
    model: str
    """The model's label in the file."""
    precision: str
    """``fp32``, ``bf16-mixed`` or ``fp16-mixed``."""
    checkpointing: bool
    """Activation checkpointing (full recompute per layer) was on."""
    device: str
    """``cpu`` or ``cuda``."""
    device_name: str = ""
    """The device's name (GPU model), when the file says."""
    points: tuple[MeasuredPoint, ...]
    """Points that did not run out of memory, ascending b_m, one per b_m."""
    oom: tuple[int, ...] = ()
    """b_m that ran out of memory."""
    memory_key: str = "peak_memory_bytes"
    """Which measured memory figure the points hold."""
    time_key: str = "step_time_s"
    """Which measured time the points hold (``micro_step_s`` when given: without the optimizer)."""
    source: str = ""
    """Where the points came from (a path), for messages."""
    notes: tuple[str, ...] = ()
    """What reading the file assumed."""
    label: str = ""
    """The file's own ``model`` label as tune wrote it (``gpt2`` for the built-in GPT, ``hf:gpt2`` or a config's path
    for a model transformers built), "" where it gives none."""

    @property
    def seq(self) -> int:
        """The measured sequence length."""
        return self.shape.seq

    @property
    def is_cuda(self) -> bool:
        """Measured on a GPU."""
        return on_gpu(self.device)


def on_gpu(device: str) -> bool:
    """Whether a result file's ``device`` is a GPU's (``cuda``, ``cuda:1``, or ``gpu``)."""
    return device.startswith("cuda") or device == "gpu"


def _shape_of(model: Any, seq: int | None, source: str) -> tuple[ModelShape | None, str]:
    """A shape from the file's ``model`` (registry name, ``hf:name``, or a ModelShape dict)."""
    if isinstance(model, dict):
        fields = {k: v for k, v in model.items() if k in ModelShape.__dataclass_fields__}
        try:
            shape = ModelShape(**fields)
        except (TypeError, ConfigError) as e:
            raise ConfigError(f"{source}: 'model' is not a model shape ({e})") from None
        return (shape.with_seq(seq) if seq else shape), shape.name
    if isinstance(model, str) and model:
        name = model[3:] if model.startswith("hf:") else model
        try:
            shape = get_model(name)
        except ConfigError:
            return None, model
        try:  # a registry model at a sequence no model runs is the file's error, not an unknown name
            return (get_model(name, seq=seq) if seq else shape), model
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None
    return None, str(model or "")


def read_measurements(
    source: str | Path | dict[str, Any] | list[Any],
    *,
    shape: ModelShape | None = None,
    memory_key: str = "peak_memory_bytes",
    precision: str | None = None,
    device: str | None = None,
    checkpointing: bool | None = None,
    label: str | None = None,
) -> Measurements:
    """Measured points and their provenance from a path or an already-loaded JSON value.

    Reads a ``tune --out`` ``result.json`` (or ``tune --json``), or an object ``{"points": [...],
    "model", "seq", "precision", "checkpointing", "device"}``, or a bare list of points (then the
    provenance must come from the keyword arguments). ``shape`` is used when the file names no
    model the registry knows, and its sequence length when the file gives none. Keyword values
    fill in what the file lacks; they never override it. ``memory_key`` chooses the memory
    figure (``peak_memory_bytes``, or ``peak_allocated_bytes`` for CUDA's tensors only). ``label`` names an
    already-loaded value's file in errors.
    """
    label = label or (str(source) if isinstance(source, (str, Path)) else "calibration data")
    data = load_json(source, what="calibration file", fix="give a tune's result.json")
    rows = result_points(data, source=label)
    if not isinstance(data, dict):
        data = {"points": rows}
    if data.get("kind") == "calibration":
        raise ConfigError(f"{label}: holds a fitted calibration, not measured points; give a tune result")
    if data.get("mode", "train") != "train":
        raise ConfigError(
            f"{label}: measured in mode {data.get('mode')!r}; calibration models training micro-steps: "
            "measure with a tune in mode 'train'"
        )
    notes: list[str] = []
    fshape, model = _model_of(data, shape, label, notes)
    prec, dev = _precision_and_device(data, precision, device, memory_key, label)
    ckpt = _checkpointing(data, rows, checkpointing, notes)
    time_key = (
        "micro_step_s" if any(isinstance(r, dict) and r.get("micro_step_s") for r in rows) else "step_time_s"
    )
    clocks = sorted({str(r["clock"]) for r in rows if isinstance(r, dict) and r.get("clock")})
    if clocks and clocks != ["wall"]:
        notes.append(f"step times measured with clock {', '.join(clocks)} (process = the probe's CPU time)")
    points, oom = _points(rows, label, ckpt, (memory_key, time_key), fshape)
    notes += _partial_notes(points, rows, memory_key, time_key)
    other = [r for r in rows if isinstance(r, dict) and bool(r.get("checkpointing", ckpt)) != ckpt]
    if not points and other:  # dropped without a word, then "measure 3 more" (which would not help)
        raise ConfigError(
            f"{label}: its {len(other)} point(s) were measured with checkpointing {'off' if ckpt else 'on'}, and the file "
            f"says checkpointing {'on' if ckpt else 'off'}; make the file's checkpointing match its points"
        )
    return Measurements(
        shape=fshape,
        model=model,
        precision=prec,
        checkpointing=bool(ckpt),
        device=dev,
        device_name=str(data.get("device_name") or data.get("gpu") or ""),
        points=tuple(points[b] for b in sorted(points)),
        oom=tuple(sorted(set(oom))),
        memory_key=memory_key,
        time_key=time_key,
        source=label,
        notes=tuple(notes),
        label=data["model"] if isinstance(data.get("model"), str) else "",
    )


def _partial_notes(
    points: dict[int, MeasuredPoint], rows: list[Any], memory_key: str, time_key: str
) -> list[str]:
    """Notes naming the points a fit leaves out because they lack the figure the others give (a step time taken as
    ``step_time_s`` where the rest give ``micro_step_s``, or no memory)."""
    notes = []
    no_mem = sorted(b for b, p in points.items() if p.peak_memory_bytes is None)
    no_time = sorted(b for b, p in points.items() if p.step_time_s is None)
    if no_mem and len(no_mem) < len(points):
        notes.append(f"b_m {', '.join(map(str, no_mem))} give no {memory_key}: left out of the memory fit")
    if no_time and len(no_time) < len(points):
        other = " (they give step_time_s, the optimizer step included)" if time_key == "micro_step_s" and any(
            isinstance(r, dict) and r.get("micro_batch") in no_time and r.get("step_time_s") for r in rows
        ) else ""  # fmt: skip
        notes.append(
            f"b_m {', '.join(map(str, no_time))} give no {time_key}{other}: left out of the step-time fit"
        )
    return notes


def _model_of(
    data: dict[str, Any], shape: ModelShape | None, label: str, notes: list[str]
) -> tuple[ModelShape, str]:
    """The shape and name of the model the points were measured with (the file's, else ``shape``)."""
    raw_seq = data.get("seq")
    seq = None
    if raw_seq is not None:  # the length the points were measured at: a wrong one is an error, not a default
        seq = int(raw_seq) if isinstance(raw_seq, float) and raw_seq.is_integer() else whole_number(raw_seq)
        if seq is None or seq < 1:
            raise ConfigError(
                f"{label}: seq {raw_seq!r} is not a sequence length; give the whole number of tokens the points "
                "were measured at (or leave seq out to take the model's)"
            )
    written = data.get("model_shape")
    if seq is not None and isinstance(written, dict) and written.get("seq") not in (None, seq):
        # tune writes the two equal: one edited without the other says two lengths, and either may be the measured
        raise ConfigError(
            f"{label}: seq {seq} and model_shape.seq {written['seq']!r} disagree (tune writes them equal); set both to "
            "the length the points were measured at"
        )
    fshape, model = _shape_of(
        data.get("model_shape") or data.get("model"), seq or (shape.seq if shape else None), label
    )
    if seq is None and fshape is not None:
        notes.append(
            f"the file gives no seq: the points are taken as measured at s = {fshape.seq} (the seq given, else "
            f"{model}'s)"
        )
    if fshape is None:
        if shape is None:
            raise ConfigError(
                (f"{label}: model {model!r} is not in the registry" if model else f"{label} names no model")
                + "; give shape, the model it was measured with",
                params=("shape",),
            )
        fshape = shape.with_seq(seq) if seq else shape
        if model:
            notes.append(f"the file's model {model!r} is not in the registry; assumed it is {shape.name}")
        model = model or shape.name
    return fshape, model


_WRAP = (
    ' (a bare list of points has nowhere to say it: write {"points": [...], "model": ..., "seq": ..., "precision": '
    '..., "device": ...}, as tune writes its result.json)'
)


def _precision_and_device(
    data: dict[str, Any], precision: str | None, device: str | None, memory_key: str, label: str
) -> tuple[str, str]:
    """The precision and device the points were measured in (the file's, else the keywords'), checked."""
    prec = data.get("precision") or precision
    if prec is None:
        raise ConfigError(
            f"{label}: no 'precision'; say which (fp32, bf16-mixed) the points were measured in: add "
            '"precision": ... to the file' + _WRAP
        )
    if not isinstance(prec, str) or prec not in PRECISIONS:
        raise ConfigError(f"{label}: precision {prec!r} is not known; use {', '.join(PRECISIONS)}")
    dev = str(data.get("device") or device or "")
    if not dev:
        raise ConfigError(
            f"{label}: no 'device'; say where (cpu, cuda) the points were measured: add \"device\": ..."
            + _WRAP
        )
    if memory_key == "peak_allocated_bytes" and not dev.startswith("cuda"):
        raise ConfigError(
            f"{label}: measured on {dev}, which has no allocator count of tensors (peak_allocated_bytes is "
            "CUDA's); use memory_key 'peak_memory_bytes' (the process's peak RSS)",
            params=("memory_key",),
        )
    return prec, dev


def _checkpointing(
    data: dict[str, Any], rows: list[Any], checkpointing: bool | None, notes: list[str]
) -> bool:
    """Whether the points to use were measured with activation checkpointing: the file's, else the
    keyword's, else the larger group of points (ties: off)."""
    ckpt = flag(data.get("checkpointing"))
    if ckpt is None and checkpointing is not None:
        ckpt = checkpointing
    if ckpt is None:  # "auto", or not given: the points say; keep the larger group (ties: off)
        flags = [bool(r.get("checkpointing")) for r in rows if isinstance(r, dict) and not r.get("oom")]
        ckpt = flags.count(True) > flags.count(False)
        if len(set(flags)) > 1:
            notes.append(
                f"points measured with and without checkpointing; used those with it {'on' if ckpt else 'off'}"
            )
    return bool(ckpt)


def _points(
    rows: list[Any], label: str, ckpt: bool, keys: tuple[str, str], shape: ModelShape
) -> tuple[dict[int, MeasuredPoint], list[int]]:
    """The measured points by b_m (those with checkpointing as ``ckpt``), and the b_m that ran out of memory;
    ``keys`` = (memory key, time key). A point's memory holds at least its micro-batch's hidden state, b_m·s·h
    elements of at least a byte each (the embedding's output): a file whose seq or model says more measured
    something else."""
    memory_key, time_key = keys
    points: dict[int, MeasuredPoint] = {}
    oom: list[int] = []
    for i, r in enumerate(rows):
        if not isinstance(r, dict) or "micro_batch" not in r:
            raise ConfigError(f"{label}: point {i + 1} has no 'micro_batch'")
        b = r["micro_batch"]
        if (
            isinstance(b, bool)
            or not isinstance(b, (int, float))
            or not (1 <= b <= MAX_EXACT_WHOLE)
            or b != int(b)
        ):
            raise ConfigError(
                f"{label}: point {i + 1}: micro_batch {short_repr(b)} must be a whole number from 1 to 2^53 "
                f"({MAX_EXACT_WHOLE:,}, the largest a float holds exactly)"
            )
        if "checkpointing" in r and bool(r["checkpointing"]) != ckpt:
            continue
        if r.get("oom"):
            oom.append(int(b))
            continue
        where = f"{label}: point {i + 1}:"
        mem = positive(r.get(memory_key), where=f"{where} {memory_key}")
        t = positive(r.get(time_key), where=f"{where} {time_key}")
        if int(b) in points:  # one measurement per b_m: which one to fit on is not ours to guess
            raise ConfigError(
                f"{where} micro_batch {int(b)} is measured twice; keep one point per micro_batch (the median of "
                "repeats, as tune writes)"
            )
        if mem is not None and mem < (least := int(b) * shape.seq * shape.hidden):
            raise ConfigError(
                f"{where} {memory_key} {mem:.4g} bytes is less than micro_batch {int(b)}'s hidden state at the file's "
                f"seq {shape.seq} and hidden {shape.hidden} (b_m·s·h = {least:.4g} elements); give the seq and model "
                "the points were measured at"
            )
        points[int(b)] = MeasuredPoint(micro_batch=int(b), peak_memory_bytes=mem, step_time_s=t)
    return points, oom
