"""Accelerate: :func:`knee_batch_size`, the decorator that replaces ``find_executable_batch_size``.

It probes the decorated function's own step, chooses the knee, and calls the function for real
with ``(b_m, g)`` such that ``b_m × g × num_processes == global_batch`` exactly. The protocol
(``probe.step()``, :class:`ProbeDone`), what a probe measures and what it leaves behind:
``docs/integrations.md`` (Accelerate).
"""

from __future__ import annotations

import functools
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from microbatch.batch import grad_accum_for
from microbatch.choose.config import DEFAULT_TOLERANCE, ChoiceConfig, apply_options, check_options_used
from microbatch.choose.tune.config import ProbeConfig, SearchConfig
from microbatch.choose.tune.driver import Setup, TuneInterrupted, run_search
from microbatch.choose.tune.probing import CPU_TIMING
from microbatch.choose.tune.search import StopSearch
from microbatch.choose.tune.user_step import in_process_timing, torch_threads
from microbatch.errors import ConfigError
from microbatch.integrations.common import (
    check_global_batch,
    choice_lines,
    choice_of,
    curve_lines,
    emit_lines,
    options_with_cap,
)
from microbatch.measure.probes import Measurement
from microbatch.measure.snapshot import gc_frozen, restore_rng, save_rng
from microbatch.measure.timing import TimingConfig, enough_repeats, spread

__all__ = ["knee_batch_size", "StepProbe", "ProbeDone"]


class ProbeDone(BaseException):
    """Raised by :meth:`StepProbe.step` to end a probing call (a BaseException: ``except Exception`` passes it)."""


class StepProbe:
    """Times the gaps between ``step()`` calls of one probing call, by the rule of every probe
    (:func:`microbatch.measure.timing.enough_repeats`): ``timing.warmup`` untimed micro-steps, then
    timed ones until the median is stable, ``timing.max_repeats`` or ``timing.max_time_s``.

    ``sync``: called before each stamp (the device's synchronize: on CUDA the loop would otherwise
    run ahead of the kernels it queued); ``agree(stop)``: the stop decision taken together by every
    process (each process then leaves its loop at the same micro-step, which collective ops need)."""

    def __init__(
        self,
        micro_batch: int,
        timing: TimingConfig | None = None,
        *,
        sync: Callable[[], None] | None = None,
        agree: Callable[[bool], bool] | None = None,
        window: int = 1,
    ) -> None:
        self.micro_batch = micro_batch
        self.window = max(1, window)
        """g: micro-steps per optimizer step; the probe times at least one whole window of g (one optimizer step)."""
        """b_m of this call."""
        self.timing = timing or CPU_TIMING
        self._clock = time.process_time if self.timing.clock == "process" else time.perf_counter
        self._sync, self._agree = sync, agree
        self._start = 0.0
        self.stamps: list[float] = []
        """The clock (``time.perf_counter``, or ``time.process_time`` with ``clock="process"``) at
        each ``step()``."""

    def step(self, tokens: int | None = None) -> None:
        """Mark the end of one micro-step; raises :class:`ProbeDone` when enough are timed. ``tokens`` is accepted
        and not used: the throughput is counted in rows (b_m a micro-step), as the knee is chosen."""
        if self._sync is not None:
            self._sync()
        self.stamps.append(self._clock())
        warm = self.timing.warmup
        if len(self.stamps) == warm + 1:
            self._start = time.perf_counter()  # the timed micro-steps start (max_time_s: wall clock)
        # not before one whole accumulation window: its optimizer step is not in a timed gap
        timed = len(self.stamps) >= warm + 2 and len(self.stamps) >= warm + 1 + self.window
        stop = timed and enough_repeats(self.gaps_s, self.timing, time.perf_counter() - self._start)
        if (
            self._agree is not None
        ):  # every step: a rank whose function ended tells the others here (end_probe)
            stop = self._agree(stop)
        if stop:
            raise ProbeDone

    @property
    def gaps_s(self) -> list[float]:
        """Seconds of each timed micro-step (after the warm-up)."""
        s = self.stamps[self.timing.warmup :]
        return [b - a for a, b in zip(s, s[1:], strict=False)]


def _launched(name: str, default: int) -> int:
    """``name`` (``WORLD_SIZE`` or ``RANK``) as the launcher set it (``accelerate launch`` and
    ``torchrun`` both do), or ``default``."""
    import os

    value = os.environ.get(name, "")
    return int(value) if value.isdigit() else default


def _num_processes() -> int:
    """The processes training together: the process group's size once one is initialised, else
    the launcher's ``WORLD_SIZE``. The decorated function usually makes its ``Accelerator`` (which
    initialises the group) inside, after the decorator has to know the world: read as 1 there, each
    process would train with B_global of its own and leave its probe loop alone, out of step with
    the others' collectives."""
    from microbatch.measure.device import distributed

    dist = distributed()
    return int(dist.get_world_size()) if dist is not None else _launched("WORLD_SIZE", 1)


def _configs(options: dict[str, Any], world: int) -> tuple[SearchConfig, ChoiceConfig]:
    """The search and choice settings ``options`` give on ``world`` processes; a ConfigError for a bad
    value, a TypeError for an option neither takes."""
    o = dict(options)
    s = apply_options(SearchConfig(), o)
    c = apply_options(ChoiceConfig(), o).resolve(reference="bound", data_parallel=world)
    check_options_used(o, "knee_batch_size", SearchConfig, ChoiceConfig)
    return s, c


def knee_batch_size(
    function: Callable[..., Any] | None = None,
    *,
    global_batch: int,
    memory_budget_bytes: int | None = None,
    tolerance: float = DEFAULT_TOLERANCE,
    timing: TimingConfig | None = None,
    device: str | None = None,
    **options: Any,
) -> Any:
    """Decorate ``function(micro_batch, grad_accum, probe=None, ...)`` (see the module's protocol).

    Calling the decorated function probes b_m = start, 2·start, ... (``max_micro_batch``, capped at
    ``global_batch / num_processes``; ``patience``; ``memory_budget_bytes``), then calls
    ``function(b_m, g, None, ...)`` with the knee and returns what it returns. The decorated
    function's ``result`` attribute holds the :class:`~microbatch.choose.result.TuneResult`.
    ``timing``: warm-up, repeats, time limit and clock of each probe
    (:class:`~microbatch.measure.timing.TimingConfig`; default
    :func:`microbatch.choose.tune.probing.default_timing` of the device, and on a CPU :func:`~microbatch.choose.tune`'s
    rule: one thread and the process clock on a CPU of 4 cores or fewer, the threads put back for the real call;
    the result's ``timing_choice`` says which). ``device``: where peak memory
    is read and the step synchronised (default: ``cuda`` when available, else ``cpu``).
    """
    if function is None:
        return functools.partial(
            knee_batch_size, global_batch=global_batch, memory_budget_bytes=memory_budget_bytes,
            tolerance=tolerance, timing=timing, device=device, **options,
        )  # fmt: skip
    check_global_batch(global_batch, 1)
    opts = dict(
        options, memory_budget_bytes=memory_budget_bytes, tolerance=tolerance, global_batch=global_batch
    )
    _configs(opts, 1)  # every option checked at decoration, not at the first call
    if timing is not None and not isinstance(timing, TimingConfig):
        raise ConfigError(
            f"timing {timing!r} must be a microbatch.measure.timing.TimingConfig or None, e.g. "
            "TimingConfig(warmup=1, min_repeats=3, max_repeats=10, max_time_s=3.0)"
        )

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        import torch

        world = _num_processes()
        check_global_batch(global_batch, world)
        s, c = _configs(options_with_cap(opts, global_batch, world), world)
        dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
        # tune()'s rule on a CPU: one thread and the process clock on a small one unless a timing is given (the wall
        # clock and torch's threads on 2 loaded cores read b_m 2 at a fifth of b_m 1's rate, and chose 1)
        times, threads, why = in_process_timing(ProbeConfig(device=dev, timing=timing), dev.split(":")[0])
        if not dev.startswith("cpu"):  # StepProbe: the wall clock, the device synchronised at each step()
            why = "timing: wall clock, the device synchronised at each probe.step()"
        measure = _measurer(function, args, kwargs, global_batch, world, dev, times)
        probe = ProbeConfig(device=dev)  # the device is all a decorated function's probe config says
        setup = _setup(function, c, dev)
        # the random generators as they were: the real call draws what it would have drawn without
        # the probes before it (its model's initialisation, its data order), whatever the probes did
        rng = save_rng()
        if dev.startswith("cuda") and "cuda" not in rng:
            rng["cuda"] = torch.cuda.get_rng_state_all()  # initialises CUDA, which the probes would
        try:
            with gc_frozen(), torch_threads(threads):  # gc.collect() skips the objects that existed before
                no_cache = replace(s, use_cache=False)
                result = run_search(_FunctionProber(measure), probe, no_cache, c, setup, None)
        finally:
            restore_rng(rng)
        result = replace(result, timing_choice=why)
        wrapper.result = result  # type: ignore[attr-defined]
        if result.interrupted:  # as tune(): the points measured go with the interrupt
            raise TuneInterrupted(result)
        b, g = choice_of(result, global_batch, world)
        emit_lines(curve_lines(result, b, g, world), _rank())
        emit_lines(choice_lines(result, b, g, world), _rank(), say=_accelerate_print)
        return function(b, g, None, *args, **kwargs)

    wrapper.result = None  # type: ignore[attr-defined]
    return wrapper


def _setup(function: Callable[..., Any], c: ChoiceConfig, dev: str) -> Setup:
    """The run's naming for the driver: the function's name, no cache key (a function's step cannot be keyed)."""
    return Setup(
        model_label=getattr(function, "__qualname__", "function"),
        fingerprint_fields=None,
        budget_source="given" if c.memory_budget_bytes else "none",
        t_start=time.perf_counter(),
        device_name=dev,
        precision="as the function runs",
    )


def _check_world(world: int) -> None:
    """ConfigError unless the processes training together are ``world``: read from the process group
    once the function has made its Accelerator. ``WORLD_SIZE=2`` set for one process without a group
    would have the decorator split B_global over a second process that does not exist (issue 32:
    8 × 4 = 32 for 64 asked)."""
    from microbatch.measure.device import distributed

    dist = distributed()
    actual = int(dist.get_world_size()) if dist is not None else 1
    if actual != world:
        where = "in no process group" if dist is None else f"in a process group of {actual}"
        raise ConfigError(
            f"the launcher's WORLD_SIZE says {world} processes, but after the function's first call this "
            f"process trains {where}: B_global = b_m × g × {world} would not hold; launch every process with "
            "`accelerate launch` or torchrun (the function's Accelerator joins them), or unset WORLD_SIZE "
            "to train in one process"
        )


def _accelerate_print(line: str) -> None:
    """Accelerate's own way to tell the user (``PartialState().print``: the main process only), where
    Accelerate is installed; else standard error (the decorator is called on rank 0 only)."""
    try:
        from accelerate.state import PartialState

        PartialState().print(line)
    except ImportError:
        print(line, file=sys.stderr)


def _rank() -> int:
    from microbatch.measure.device import distributed

    dist = distributed()
    return int(dist.get_rank()) if dist is not None else _launched("RANK", 0)


class _FunctionProber:
    """The driver's prober (:class:`~microbatch.choose.tune.probing.Prober`) over one probing call of the
    decorated function per point: nothing to start or close."""

    def __init__(self, measure: Callable[[int, bool], Measurement]) -> None:
        self._measure = measure

    def start(self) -> None:
        pass

    def measure(self, micro_batch: int, *, checkpointing: bool = False) -> Measurement:
        return self._measure(micro_batch, checkpointing)

    def close(self) -> None:
        pass


def with_optimizer_s(gaps: list[float], g: int) -> float:
    """Seconds one micro-step costs with its share of the optimizer step: the median, over the whole windows of g
    consecutive gaps between ``step()`` calls, of each window's mean (each window holds the one gap the optimizer step
    fell in, wherever the windows start); g = 1: the median gap. The median gap alone left the optimizer step out once
    g ≥ 3 (one gap in g holds it): b_m 8 at g 4 read 1,291/s where it ran 727/s, and was chosen. Fewer gaps than a
    window (the data ran out): the median gap."""
    if g <= 1 or len(gaps) < g:
        return statistics.median(gaps)
    return statistics.median(statistics.fmean(gaps[i : i + g]) for i in range(0, len(gaps) - g + 1, g))


def _measurer(
    function: Callable[..., Any], args: Any, kwargs: Any, global_batch: int, world: int, dev: str,
    timing: TimingConfig,
) -> Callable[[int, bool], Measurement]:  # fmt: skip
    """measure(b, checkpointing): one probing call of ``function`` at b_m = b."""
    from microbatch.measure.device import Device, agree_any, oom_text, reduce_max

    device = Device(dev)
    checked: list[bool] = []

    def measure(b: int, ckpt: bool) -> Measurement:
        g = max(1, grad_accum_for(global_batch, b, world))
        probe = StepProbe(b, timing, sync=device.sync, agree=agree_any if world > 1 else None, window=g)
        device.free()
        device.reset_peak()
        err: str | None = None
        ended = True  # the function returned or raised on this rank, not stopped by an agreement
        try:
            function(b, g, probe, *args, **kwargs)
        except ProbeDone:
            ended = False
        except Exception as e:  # noqa: BLE001 - out of memory by meaning (the CPU allocator's is a RuntimeError)
            err = oom_text(e)
        if ended and world > 1:  # the ranks still stepping agree at their next step() to stop (a review: the
            agree_any(
                True
            )  # data ran out on one rank a step early, and the other waited in its agreement forever)
        if not checked:  # the function has made its Accelerator (and the process group) by now
            _check_world(world)
            checked.append(True)
        device.sync()
        peak, alloc = device.peak()
        device.free()
        gaps = probe.gaps_s
        if agree_any(err is None and len(gaps) < 2):  # on every rank together, not on one alone
            # too few micro-steps to time: where a smaller b_m was timed, the data holds too few
            # batches of this size (and of any larger one): the search stops, its points kept
            raise StopSearch(
                f"the function returned after {len(probe.stamps)} probe.step() calls at micro_batch {b}: it must "
                f"call probe.step() after each micro-step ({timing.warmup} warm-up + at least 2 timed, "
                f"{timing.min_repeats} or more for a steady median); give it more data"
            )
        if agree_any(err is not None):
            return replace(Measurement(micro_batch=b, oom=True, memory_method=device.method),
                           error=err or "out of memory on another process")  # fmt: skip
        t, peak_all, spread_all = reduce_max(
            [with_optimizer_s(gaps, g), float(peak), spread(gaps)]
        )  # ranks agree
        return Measurement(
            micro_batch=b, throughput=b / t, samples_per_s=b / t, step_time_s=t, micro_step_s=t,
            repeats=len(gaps), spread=spread_all, peak_memory_bytes=int(peak_all), peak_allocated_bytes=alloc,
            memory_method=device.method, clock=timing.clock,  # StepProbe times with it on every device
        )  # fmt: skip

    return measure
