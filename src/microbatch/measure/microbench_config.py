"""The kernel microbenchmark's settings and its running state: clock, budget, and the soak before each compute
item (:mod:`microbatch.measure.microbench` runs the items).

A compute-bound kernel timed in a short burst runs at the clock a GPU holds before its power limit pulls it
down; a training step is sustained load. Each GEMM and attention item is therefore timed after ``soak_s`` of
back-to-back calls (:meth:`Bench.soak`), and the square GEMM's burst and sustained rates are both kept
(:func:`settled_rate`), whose ratio is what :data:`microbatch.hardware_clocks.HOPPER_BURST_TO_SUSTAINED` cites.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from microbatch.errors import ConfigError, check_positive_int, plain_numbers
from microbatch.hardware import Accelerator
from microbatch.model import ModelShape

__all__ = ["DTYPES", "MicrobenchConfig", "Bench", "peak", "frac", "settled_rate", "SOAK_S", "SOAK_SHARE"]

SOAK_S = 0.1
"""Seconds of back-to-back calls before a GPU compute item is timed: a B200 ran FlashAttention-4 at its burst
rate for ~20 ms of back-to-back calls and reached its power-limited rate after ~55 ms (github.com/flashinfer-ai/
flashinfer PR 2899: ~0.8 ms calls, throttling from the 30th, held from the 70th); 0.1 s is past that."""

SOAK_SHARE = 0.3
"""Share of the budget the soaks may take together; the items past it are timed in bursts and the result says so
(then it counts as burst-timed: ``MicrobenchResult.soak_s`` 0)."""

DTYPES = ("auto", "bf16", "fp16", "fp32")


@dataclass(frozen=True, kw_only=True)
class MicrobenchConfig:
    """What to measure and how long it may take."""

    shape: ModelShape
    """The model whose layer GEMMs, heads and head dimension are measured (at its ``seq``)."""
    micro_batches: tuple[int, ...] = (1, 2, 4, 8)
    """b_m whose rows b_m·s the layer GEMMs are measured at."""
    device: str = "cpu"
    """``cpu`` or ``cuda`` (``cuda:N``)."""
    dtype: str = "auto"
    """``bf16``, ``fp16``, ``fp32``, or ``auto`` (bf16 on CUDA, fp32 on the CPU)."""
    quick: bool = False
    """Small grid and tensors (a CPU run in seconds); the layer GEMMs stay the model's."""
    repeats: int = 10
    """Timed repeats per item (fewer when its share of the budget runs out)."""
    warmup: int = 3
    """Untimed calls before the repeats."""
    budget_s: float = 20.0
    """Wall seconds for the whole benchmark; items past it are skipped and named."""
    threads: int = 1
    """torch threads on the CPU: at 1 the calling thread's CPU clock times the kernels (it counts that thread only),
    at more the wall clock (:func:`cpu_clock`)."""
    extra_gemms: tuple[tuple[str, int, int, int], ...] = ()
    """More GEMMs (label, rows, k, n) to time after the grid (``bench/gpu_microbench.py``: the development
    set's layer shapes, a square GEMM, a row ramp)."""
    soak_s: float | None = None
    """Seconds of back-to-back calls before each GEMM and attention item is timed, so that it is timed at the
    clock a training step's sustained load holds rather than a burst's; None: :data:`SOAK_S` on a GPU, 0 on the
    CPU (whose thread clock counts work, not a clock). 0 times bursts, as the H200 table was."""

    def __post_init__(self) -> None:
        plain_numbers(self)
        if not self.micro_batches:
            raise ConfigError("micro_batches is empty; give at least one b_m, e.g. (1, 2, 4)")
        for b in self.micro_batches:
            check_positive_int("micro_batches", b)
        check_positive_int("repeats", self.repeats)
        check_positive_int("threads", self.threads)
        if self.warmup < 0:
            raise ConfigError(f"warmup must be >= 0, got {self.warmup}")
        if not self.budget_s > 0:
            raise ConfigError(f"budget_s must be > 0 seconds, got {self.budget_s}; e.g. 20")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.soak_s is not None and not 0 <= self.soak_s <= 10:
            raise ConfigError(
                f"soak_s {self.soak_s!r} must be in [0, 10] seconds: the back-to-back calls before each compute "
                f"item is timed; {SOAK_S:g} reaches a GPU's power-limited clock, 0 times bursts",
                params=("soak_s",),
            )
        if self.device.split(":")[0] not in ("cpu", "cuda"):
            raise ConfigError(f"device {self.device!r} is neither cpu nor cuda (cuda:N)")
        if self.device == "cpu" and self.dtype in ("bf16", "fp16"):
            raise ConfigError(
                f"dtype {self.dtype} on the CPU times emulated half precision, not the planner's kernels; "
                "use fp32 (or auto) on the CPU"
            )

    @property
    def resolved_soak_s(self) -> float:
        """The soak that runs: ``soak_s``, or :data:`SOAK_S` on a GPU and 0 on the CPU when None."""
        if self.soak_s is not None:
            return self.soak_s
        return SOAK_S if self.device.startswith("cuda") else 0.0

    @property
    def resolved_dtype(self) -> str:
        """The dtype that runs: ``auto`` is bf16 on CUDA, fp32 on the CPU."""
        if self.dtype != "auto":
            return self.dtype
        return "bf16" if self.device.startswith("cuda") else "fp32"


@dataclass
class Bench:
    """The running benchmark: its clock, its budget and what it has measured so far."""

    cfg: MicrobenchConfig
    torch: Any
    cuda: bool
    acc: Accelerator | None
    t_start: float = field(default_factory=time.perf_counter)
    skipped: list[str] = field(default_factory=list)
    warm_rate: float | None = None
    """FLOP/s a kernel's time is predicted at before it runs (:func:`_settle`): the CPU's warm-up matmuls, a
    GPU's datasheet peak; None: no prediction, nothing skipped."""
    soaked: int = 0
    """Compute items timed after a soak."""
    unsoaked: int = 0
    """Compute items timed without one though a soak was asked for (the budget left, or the soaks' share spent)."""
    soak_spent_s: float = 0.0
    """Seconds the soaks took so far."""

    def past_budget(self, flops: float, what: str) -> bool:
        """Whether the fewest calls :meth:`time_s` makes of a kernel of ``flops`` (:attr:`min_calls`) would outlast
        the budget left at :attr:`warm_rate`: then it is skipped and said, not run (a 70B layer's CPU GEMM ran 54 s
        of a 5 s budget; a 7B layer's, 11.8 s a call on a loaded CPU, four calls where one was judged: 53 s of 20)."""
        t = flops / self.warm_rate if self.warm_rate else 0.0
        left = self.left_s()
        if self.min_calls * t > left:
            budget = (
                f"past the {left:.3g} s left"
                if left > 0
                else f"the budget already spent ({-left:.3g} s over)"
            )
            self.skipped.append(
                f"{what} (predicted {t:.3g} s a call, {self.min_calls} calls at the least, {budget})"
            )
            return True
        return False

    @property
    def min_calls(self) -> int:
        """The fewest calls :meth:`time_s` makes of a kernel under a share of the budget: one warm-up (when any is
        asked; the others are left out once the share is spent) and one timed."""
        return min(self.cfg.warmup, 1) + 1

    def left_s(self) -> float:
        return self.cfg.budget_s - (time.perf_counter() - self.t_start)

    def soak(self, fn: Callable[[], Any]) -> int:
        """Call ``fn`` back to back for :attr:`MicrobenchConfig.resolved_soak_s` (waiting for the device every 8
        calls, so the queue stays short), unless twice that is past the budget left or the soaks have spent their
        share (:data:`SOAK_SHARE`): then the item is counted unsoaked. Returns the calls made."""
        soak, n = self.cfg.resolved_soak_s, 0
        if soak <= 0:
            return 0
        if self.left_s() < 2 * soak or self.soak_spent_s + soak > SOAK_SHARE * self.cfg.budget_s:
            self.unsoaked += 1
            return 0
        t0 = time.perf_counter()
        t_end = t0 + soak
        while time.perf_counter() < t_end:
            fn()
            n += 1
            if self.cuda and n % 8 == 0:
                self.torch.cuda.synchronize()
        if self.cuda:
            self.torch.cuda.synchronize()
        self.soaked += 1
        self.soak_spent_s += time.perf_counter() - t0
        return n

    def time_s(self, fn: Callable[[], Any], share_s: float | None, soak: bool = False) -> float | None:
        """Median seconds of ``fn`` after warm-up, repeating until ``repeats`` or ``share_s`` (the warm-up too stops
        after its first call once the share is spent); None past the budget. ``share_s`` None: exactly ``warmup`` +
        ``repeats`` calls whatever the clock says (a collective: every rank must make the same calls). ``soak``:
        :meth:`soak` first (a compute-bound kernel)."""
        if share_s is not None and self.left_s() <= 0:
            return None
        if soak:
            self.soak(fn)
        torch, t_end = self.torch, time.perf_counter() + max(share_s or 0.0, 0.0)
        for _ in range(self.cfg.warmup):
            fn()
            if share_s is not None and not self.cuda and time.perf_counter() >= t_end:
                break  # a long kernel (seconds on a CPU): one warm-up call is enough, the share is spent
                # (on CUDA the calls return at launch: the clock says nothing of them until a sync)
        if self.cuda:
            torch.cuda.synchronize()
        times: list[float] = []
        while len(times) < self.cfg.repeats and (not times or share_s is None or time.perf_counter() < t_end):
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                clock = cpu_clock(self.cfg.threads)
                t0 = clock()
                fn()
                times.append(clock() - t0)
        return statistics.median(times)


def cpu_clock(threads: int) -> Any:
    """The CPU's timer at ``threads`` torch threads: the calling thread's CPU clock at one (steady where other
    work shares the cores), else the wall clock (the thread clock misses the other threads' work: 8 threads on 2
    cores read 7x too fast)."""
    return time.thread_time if threads == 1 else time.perf_counter


def peak(acc: Accelerator | None, dtype: str) -> float | None:
    return acc.flops(dtype) if acc is not None else None


def frac(value: float, ref: float | None) -> float | None:
    return value / ref if ref else None


def settled_rate(
    ends: Sequence[float],
    start: float,
    flops_per_call: float,
    settle: float = 0.5,
    seconds: Sequence[float] | None = None,
) -> float | None:
    """FLOP/s over the calls that ended in the last ``1 − settle`` of a load window that began at ``start``
    (``ends``: when each back-to-back call ended, on one clock): the rate the clock settled at, the window's first
    part left to the power limit's response. With ``seconds`` (each call's own device time, as the burst is timed)
    the rate is their FLOPs over their device seconds, the host's gaps between calls left out; else over the wall
    time between the first and the last kept call. None with fewer than 2 calls in that part."""
    if not ends:
        return None
    cut = start + settle * (ends[-1] - start)
    kept = [i for i, t in enumerate(ends) if t >= cut]
    if len(kept) < 2:
        return None
    if seconds is not None:
        busy = sum(seconds[i] for i in kept)
        return len(kept) * flops_per_call / busy if busy > 0 else None
    span = ends[kept[-1]] - ends[kept[0]]
    return (len(kept) - 1) * flops_per_call / span if span > 0 else None
