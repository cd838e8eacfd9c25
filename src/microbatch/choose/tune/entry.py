"""The two ways to tune: a described model (:func:`tune_model`) or the user's own step (:func:`tune`).

Each measures the throughput and peak-memory curve as b_m doubles (along the divisors of B_global / d
when B_global is given; :mod:`microbatch.choose.tune.search`),
chooses the knee (:mod:`microbatch.choose.knee`) and returns a :class:`~microbatch.choose.result.TuneResult`.
Settings are three config objects (:mod:`microbatch.choose.config`, :mod:`microbatch.choose.tune.config`): ``probe`` (how each point
is measured), ``search`` (how b_m is walked) and ``choice`` (how the curve becomes a choice);
their fields may also be given as keywords, which override them (``tune_model("small",
seq=128, tolerance=0.05)``). The configs are built once, here, and passed down whole.

**Cache.** Points are saved under ``$MICROBATCH_CACHE_DIR`` after every probe
(:mod:`microbatch.choose.tune.cache`): a repeated ``tune`` reuses them and an interrupted one keeps them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, MutableMapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from microbatch._json import loads
from microbatch.batch import grad_accum_for
from microbatch.choose.config import ChoiceConfig, apply_options, check_options_used
from microbatch.choose.result import TuneResult
from microbatch.choose.tune.cache import (
    CachedAnswer,
    callable_identity,
    class_name,
    module_fingerprint,
    optimizer_identity,
)
from microbatch.choose.tune.config import ProbeConfig, SearchConfig
from microbatch.choose.tune.driver import NOTHING_MEASURED, Setup, TuneInterrupted, run_search
from microbatch.choose.tune.probing import (
    check_cuda_budget,
    default_timing,
    open_prober,
    resolve_budget,
)
from microbatch.choose.tune.search import OnPoint
from microbatch.choose.tune.user_step import (
    NonFiniteLoss,
    batch_statistics_need_rows,
    batch_structures,
    check_step_args,
    check_trainable,
    in_process_timing,
    torch_threads,
    training_grad_mode,
    user_step_notes,
)
from microbatch.errors import ConfigError, check_instance
from microbatch.measure.snapshot import gc_frozen, leave_no_trace

__all__ = [
    "NOTHING_MEASURED",
    "NonFiniteLoss",
    "TuneInterrupted",
    "configs_from_options",
    "tune",
    "tune_model",
]


def configs_from_options(
    what: str,
    probe: ProbeConfig | None,
    search_config: SearchConfig | None,
    choice: ChoiceConfig | None,
    options: MutableMapping[str, Any],
) -> tuple[ProbeConfig, SearchConfig, ChoiceConfig]:
    """The three configs given (or the defaults), with the keyword ``options`` put in: a ConfigError
    for a bad value, a TypeError naming an option no config takes (``what`` names the caller)."""
    options = dict(options)
    for name, given, kind in (("probe", probe, ProbeConfig), ("search", search_config, SearchConfig),
                              ("choice", choice, ChoiceConfig)):  # fmt: skip
        if given is not None:
            check_instance(name, given, kind, f"build {kind.__name__}(...) or give its fields as keywords")
    p = apply_options(probe or ProbeConfig(), options)
    s = apply_options(search_config or SearchConfig(), options)
    c = apply_options(choice or ChoiceConfig(), options)
    check_options_used(options, what, ProbeConfig, SearchConfig, ChoiceConfig)
    return p, s, c


_SEQ_REQUIRED = "seq is required with hf_config: give the longest sequence the data holds"


def _describe(model: Any, hf_config: str | None, backend: str) -> tuple[Any, dict[str, Any], str]:
    """(registry shape or None, the ProbeSpec's model fields, the result's label) of what to tune."""
    from microbatch.model import ModelShape, get_model

    if (model is None) == (hf_config is None):
        raise ConfigError(
            "give exactly one of model (a name or a ModelShape) or hf_config (a path)",
            params=("model", "hf_config"),
        )
    if isinstance(model, ModelShape):
        shape_dict = {k: v for k, v in model.to_dict().items() if k != "param_count"}
        return model, {"shape": shape_dict}, model.name
    if model is not None:
        shape = get_model(str(model))
        return shape, {"model": str(model)}, shape.name if backend == "builtin" else f"hf:{shape.name}"
    return None, {"hf_config": hf_config}, str(hf_config)


def _model_fingerprint(shape: Any, hf_config: str | None, backend: str) -> dict[str, Any]:
    """The model part of the cache key: the shape (and backend), or the Hugging Face config's content."""
    if shape is not None:
        return {
            "shape": {k: v for k, v in shape.to_dict().items() if k not in ("name", "seq")},
            "backend": backend,
        }
    path = Path(str(hf_config))
    return {"hf_config": loads((path if path.is_file() else path / "config.json").read_text())}


def _preflight(
    shape: Any,
    hf_config: str | None,
    probe: ProbeConfig,
    search_config: SearchConfig,
    choice: ChoiceConfig,
    budget_source: str,
) -> None:
    """Every check that needs no model built: the walk, transformers, the sequence, the static memory."""
    from microbatch.choose.tune.preflight import (
        KEYWORD_NAMES,
        check_smallest_fits,
        check_smallest_time,
        check_static_fits,
        check_walk,
    )
    from microbatch.choose.tune.probing import check_host_budget
    from microbatch.measure.hf import check_hf_buildable, require_transformers
    from microbatch.model import check_seq, from_hf_config

    check_walk(search_config, choice, KEYWORD_NAMES)
    described = shape if shape is not None else from_hf_config(str(hf_config), seq=probe.seq)
    if hf_config is not None:
        require_transformers("hf_config", params=("hf_config",))
        check_hf_buildable(str(hf_config))
    elif probe.backend == "hf":
        require_transformers("backend hf", params=("backend",))
    check_seq(described, probe.seq or described.seq)
    check_static_fits(described, probe.mode, choice.memory_budget_bytes, budget_source)
    if probe.mode == "train":
        check_smallest_fits(
            described, seq=probe.seq or described.seq, start=search_config.start,
            checkpointing=search_config.checkpointing, precision=probe.precision,
            budget=choice.memory_budget_bytes, budget_source=budget_source,
        )  # fmt: skip
    if (probe.device or "cpu") == "cpu" and not probe.in_process:  # a child probe's timeout; after the memory
        from microbatch.cpu_quota import usable_cores

        check_smallest_time(
            described, seq=probe.seq or described.seq, start=search_config.start, mode=probe.mode,
            timeout_s=probe.probe_timeout_s, cores=usable_cores(),
        )  # fmt: skip
    if budget_source == "given":  # after the checks of the model itself: those say more
        check_host_budget(choice.memory_budget_bytes, probe)


def _resolved_probe(probe: ProbeConfig, shape: Any) -> tuple[ProbeConfig, str]:
    """``probe`` with its sequence (the shape's where not given), device (the CPU), timing and threads set, and the
    line saying how the timing was chosen: on a CPU the command line's rule (one thread and the process clock on a
    small one: torch's threads on the wall clock read sub-millisecond decode steps 100-700x slow when another
    process took a core, a review found), CUDA events on a GPU."""
    seq = probe.seq
    if seq is None:
        if shape is None:
            raise ConfigError(_SEQ_REQUIRED, params=("seq", "hf_config"))
        seq = shape.seq
    device = probe.device or "cpu"
    cuda = device.startswith("cuda")
    timing, threads, timing_choice = in_process_timing(probe, "cuda" if cuda else "cpu")
    in_process = cuda if probe.in_process is None else probe.in_process
    resolved = replace(probe, seq=seq, device=device, timing=timing, threads=threads, in_process=in_process)
    return resolved, "" if cuda else timing_choice


def _walk_for_mode(mode: str, search: SearchConfig) -> SearchConfig:
    """The search as ``mode`` can run it: decoding has no backward pass, so nothing to recompute (checkpointing
    off; 'on' asked for is refused, not dropped without a word)."""
    if mode != "decode" or search.checkpointing == "off":
        return search
    if search.checkpointing == "on":
        raise ConfigError(
            "checkpointing 'on' recomputes activations in the backward pass, and decoding has none; "
            "leave checkpointing at auto or off when mode is decode",
            params=("checkpointing", "mode"),
        )
    return replace(search, checkpointing="off")


def tune_model(
    model: Any = None,
    *,
    hf_config: str | None = None,
    probe: ProbeConfig | None = None,
    search: SearchConfig | None = None,
    choice: ChoiceConfig | None = None,
    on_point: OnPoint | None = None,
    **options: Any,
) -> TuneResult:
    """Tune a registry model (name or :class:`~microbatch.model.ModelShape`) or a Hugging Face config.

    ``probe``, ``search`` and ``choice`` hold the settings (:mod:`microbatch.choose.config`, :mod:`microbatch.choose.tune.config`);
    keywords named like their fields override them. ``seq`` is the longest sequence the data
    holds (memory is set by the longest sequence; default: the shape's). On the CPU each probe
    runs in a child process under a hard memory limit (the budget, or 80% of the available
    memory); ``in_process=True`` probes in this process instead (faster to start, no protection).
    On CUDA probes run in this process and OOM is caught by type. ``threads`` sets torch's
    threads in the child only. With no budget the search uses the device's total memory on CUDA
    and 80% of the available memory on the CPU; ``memory_budget_source`` in the result says
    which. ``reference`` defaults to ``bound`` here: the knee is within τ of max(best measured,
    T̂) and the search stops once that knee is settled (``docs/knee.md``).
    ``on_point(m, from_cache)`` is called after each point.
    """
    from microbatch.measure.spec import ProbeSpec

    t_start = time.perf_counter()
    probe_config, search_config, choice = configs_from_options("tune_model", probe, search, choice, options)
    choice = choice.resolve(reference="bound")
    shape, target, label = _describe(model, hf_config, probe_config.backend)
    search_config = _walk_for_mode(probe_config.mode, search_config)
    probe_config, timing_choice = _resolved_probe(probe_config, shape)
    seq, device = probe_config.seq, probe_config.device
    assert seq is not None and device is not None
    if search_config.use_cache is None:
        search_config = replace(search_config, use_cache=True)
    spec = ProbeSpec(
        **target,
        backend=probe_config.backend,
        seq=seq,
        mode=probe_config.mode,
        device=device,
        precision=probe_config.precision,
        timing=probe_config.timing or default_timing(device),
        new_tokens=probe_config.new_tokens,
        global_batch=choice.global_batch,
        data_parallel=choice.data_parallel or 1,
        threads=probe_config.threads,
    )
    if device.startswith("cuda"):
        _check_cuda_device(device)
    choice, budget_source = resolve_budget(choice, probe_config)
    _preflight(shape, hf_config, probe_config, search_config, choice, budget_source)
    try:
        prober = open_prober(spec, probe_config, choice.memory_budget_bytes)
    except KeyboardInterrupt:
        raise KeyboardInterrupt(NOTHING_MEASURED) from None
    fp = {
        **_model_fingerprint(shape, hf_config, probe_config.backend),
        "timing": spec.timing.__dict__,
        "in_process": probe_config.in_process,
        "threads": probe_config.threads,
        "new_tokens": probe_config.new_tokens,
    }
    setup = Setup(model_label=label, fingerprint_fields=fp, budget_source=budget_source, t_start=t_start)
    result = _with_heap_note(run_search(prober, probe_config, search_config, choice, setup, on_point))
    _say_cached(result)
    return replace(result, timing_choice=timing_choice) if timing_choice else result


def _with_heap_note(result: TuneResult) -> TuneResult:
    """``result`` with a note naming the points the probe child timed on its tracking heap (its steady heap did
    not fit under the memory limit): what that means for their times."""
    slow = [p.micro_batch for p in result.points if p.timed_heap == "tracking"]
    if not slow:
        return result
    note = (
        f"b_m {', '.join(map(str, slow))} timed with each tensor mapped afresh (the steady heap did not fit under the "
        "memory limit): their steps may read up to 1.7x a training process's; a larger memory budget times them as "
        "it runs"
    )
    return replace(result, notes=(*result.notes, note))


def tune(
    model: Any,
    make_batch: Callable[[int], Any],
    *,
    loss_fn: Callable[[Any, Any], Any] | None = None,
    optimizer: Any = None,
    probe: ProbeConfig | None = None,
    search: SearchConfig | None = None,
    choice: ChoiceConfig | None = None,
    on_point: OnPoint | None = None,
    **options: Any,
) -> TuneResult:
    """Tune the user's own training step, in this process.

    ``make_batch(b)`` returns one micro-batch of b samples (a tensor of token ids, a dict for
    ``model(**batch)``, or anything ``loss_fn(model, batch)`` accepts; default loss: the output's
    ``.loss``, or next-token cross-entropy of logits for a tensor of tokens). ``optimizer``
    defaults to AdamW over the trainable parameters; its state is allocated by one full step before
    measuring. The model may be wrapped in DDP or FSDP or compiled with ``torch.compile``
    (compilation happens in the setup and warm-up calls, outside the timings). Under
    ``torch.distributed`` every rank must call ``tune`` with the same arguments: probes are
    synchronised (see :mod:`microbatch.measure.probes`), d defaults to the world size, and the cache
    is off.

    Settings: ``probe`` (``device``: default, the parameters' device; ``precision``; ``timing``),
    ``search`` and ``choice`` (:mod:`microbatch.choose.config`, :mod:`microbatch.choose.tune.config`), or keywords named like their
    fields (``memory_budget_bytes=70 * 2**30, global_batch=1024``); ``device`` may be a
    ``torch.device``.

    **No trace**: the model's parameters, buffers and gradients, the optimizer's state, the random
    generators, ``model.training`` and the activation checkpointing switches are restored bitwise when
    ``tune`` returns or raises
    (:mod:`microbatch.measure.snapshot`; the copies are kept in host memory).

    Peak memory: CUDA allocator statistics on a GPU; on the CPU the process's peak RSS, reset
    before each probe (``/proc/self/clear_refs``), so the figure includes the whole process. There
    is no child process here: on the CPU an over-committed host can kill this process, so give a
    ``max_micro_batch``. ``reference``: as in :func:`tune_model`.

    **Ctrl-C** (or SIGTERM): the state is put back, then :class:`TuneInterrupted` (a ``KeyboardInterrupt``) is raised
    with the points measured so far in its ``result``; before the first point, a plain ``KeyboardInterrupt``.
    """

    from microbatch.measure.inprocess import InProcessProber

    t_start = time.perf_counter()
    probe_config, search_config, choice = _tune_configs(probe, search, choice, options)
    check_trainable(model, optimizer)
    check_step_args(make_batch, optimizer, loss_fn, on_point)
    device = _user_device(model, probe_config)
    timing, threads, timing_choice = in_process_timing(probe_config, device.type)
    probe_config = replace(probe_config, device=device.type, timing=timing, in_process=True, threads=threads)
    step = _train_probe(
        model, make_batch, (loss_fn, optimizer), device, (probe_config.precision, timing), choice
    )
    choice, budget_source = resolve_budget(choice, replace(probe_config, device=str(device)))
    if device.type == "cuda":
        check_cuda_budget(step, choice.memory_budget_bytes, str(device))
    inner, fp = _in_process_fingerprint(model, timing, threads, loss_fn, optimizer)
    setup = Setup(
        model_label=class_name(inner), fingerprint_fields=fp, budget_source=budget_source, t_start=t_start
    )
    # under the caller's no_grad or inference_mode too: training steps, their state put back as it was
    with (
        batch_statistics_need_rows(search_config.start),
        training_grad_mode(),
        leave_no_trace(model, optimizer),
    ):
        with gc_frozen(), torch_threads(threads):
            if search_config.use_cache:  # the key only: may draw from the generators (restored)
                fp["batch"] = batch_structures(make_batch, search_config)
            prober = InProcessProber(step, setup_size=search_config.start)
            result = run_search(prober, probe_config, search_config, choice, setup, on_point)
    notes = user_step_notes(model, step.first_loss)
    result = replace(result, timing_choice=timing_choice, notes=(*result.notes, *notes))
    _say_cached(result)
    if result.interrupted:  # the state is back as it was; the caller's loop stops, as without the tune
        raise TuneInterrupted(result)
    return result


def _check_cuda_device(device: str) -> None:
    """Refuse a CUDA device this machine does not have. torch is first imported here on this path: a Ctrl-C in its
    start-up is kept (:func:`~microbatch.interrupts.imported_keeping_interrupts`)."""
    from microbatch.interrupts import imported_keeping_interrupts

    torch = imported_keeping_interrupts("torch")

    if not torch.cuda.is_available():
        raise ConfigError(
            f"device {device}: no CUDA GPU is available here; use device cpu", params=("device",)
        )
    index = int(device.split(":")[1]) if ":" in device and device.split(":")[1].isdigit() else 0
    if index >= torch.cuda.device_count():
        raise ConfigError(
            f"device {device}: this machine has {torch.cuda.device_count()} CUDA GPU(s), "
            f"cuda:0 to cuda:{torch.cuda.device_count() - 1}; pick one of them",
            params=("device",),
        )


def _torch_device(value: Any) -> Any:
    """``torch.device(value)``, or a ConfigError naming the value (torch's RuntimeError named no parameter)."""
    import torch

    try:
        return torch.device(value)
    except (RuntimeError, TypeError, ValueError):
        raise ConfigError(
            f"device {value!r} is not a torch device; use cpu, cuda or cuda:N", params=("device",)
        ) from None


def _user_device(model: Any, probe_config: ProbeConfig) -> Any:
    """The torch device to probe on: the one given, else the model's parameters', else the CPU."""
    import torch

    if probe_config.device is not None:
        device = _torch_device(probe_config.device)
        if device.type == "cuda":
            _check_cuda_device(str(device))
        return device
    params = list(model.parameters())
    return params[0].device if params else torch.device("cpu")


def _tune_configs(
    probe: ProbeConfig | None,
    search: SearchConfig | None,
    choice: ChoiceConfig | None,
    options: dict[str, Any],
) -> tuple[ProbeConfig, SearchConfig, ChoiceConfig]:
    """:func:`tune`'s settings resolved: training only, d = the world size under torch.distributed
    (where the cache is off by default), the walk checked."""
    import torch

    options = dict(options)
    for key, why in (
        ("seq", "the batches make_batch returns set the sequence length"),
        ("in_process", "it probes the user's model in this process, always"),
    ):
        if key in options and not (key == "in_process" and options[key] is True):
            raise ConfigError(
                f"tune() takes no {key} ({options[key]!r}): {why}; leave it out (microbatch.choose.tune.tune_model "
                f"takes {key} for a built-in model)",
                params=(key,),
            )
    if options.get("device") is not None:
        options["device"] = str(_torch_device(options["device"]))
    probe_config, search_config, choice = configs_from_options("tune", probe, search, choice, options)
    if probe_config.mode != "train":
        raise ConfigError(
            f"tune() measures the user's training step: mode {probe_config.mode!r} must be train"
        )
    dist = torch.distributed.is_available() and torch.distributed.is_initialized()
    choice = choice.resolve(
        reference="bound", data_parallel=torch.distributed.get_world_size() if dist else 1
    )
    if search_config.use_cache is None:
        search_config = replace(search_config, use_cache=not dist)
    from microbatch.choose.tune.preflight import KEYWORD_NAMES, check_walk

    check_walk(search_config, choice, KEYWORD_NAMES)
    return probe_config, search_config, choice


def _in_process_fingerprint(
    model: Any, timing: Any, threads: int | None, loss_fn: Any, optimizer: Any
) -> tuple[Any, dict[str, Any]]:
    """The model under its DDP/FSDP/compile wrappers, and the fields of the cache key of an
    in-process tune."""
    import torch

    inner = model
    while hasattr(inner, "module") or hasattr(inner, "_orig_mod"):
        inner = getattr(inner, "_orig_mod", None) or inner.module
    fp = {
        "module": module_fingerprint(inner),
        "class": type(model).__name__,
        "timing": timing.__dict__,
        "in_process": True,
        "threads": threads or torch.get_num_threads(),
        "interop_threads": torch.get_num_interop_threads(),
        "loss_fn": callable_identity(loss_fn),
        "optimizer": optimizer_identity(optimizer),
    }
    return inner, fp


def _train_probe(
    model: Any,
    make_batch: Any,
    step: tuple[Any, Any],
    device: Any,
    how: tuple[str, Any],
    choice: ChoiceConfig,
) -> Any:
    """The user's step as a probe: g micro-batches a step where a global batch is given (B / (b·d))."""
    from microbatch.measure.probes import TrainProbe

    global_batch, data_parallel = choice.global_batch, choice.data_parallel or 1

    def g_for(b: int) -> int | None:
        return None if global_batch is None else max(1, grad_accum_for(global_batch, b, data_parallel))

    (loss_fn, optimizer), (precision, timing) = step, how
    return TrainProbe(
        model, make_batch, loss_fn=loss_fn, optimizer=optimizer, device=device, precision=precision,
        timing=timing, grad_accum_for=g_for,
    )  # fmt: skip


def _say_cached(result: TuneResult) -> None:
    """Warn (:class:`~microbatch.choose.tune.cache.CachedAnswer`) when points of the answer came from the cache."""
    if result.cache is not None:
        import warnings

        warnings.warn(f"microbatch.tune: {result.cache.message()}", CachedAnswer, stacklevel=3)
