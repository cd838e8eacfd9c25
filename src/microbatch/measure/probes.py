"""Measure one training micro-step or one decode step at a given micro-batch size b_m, in steady state.

**Training.** The probe first runs one full step (forward, backward, optimizer step), so the
optimizer's state is allocated before anything is measured. A probe then builds one batch of b_m
sequences and repeats forward + backward on it, accumulating gradients as gradient accumulation
does; finally it times one optimizer step. The time per micro-step is

    t_step(b) = t_micro(b) + t_opt / g      (g = B_global / (b_m·d) when a global batch is given)

With no global batch the optimizer step is left out of the throughput (its cost per sample,
t_opt·d / B_global, does not depend on b_m once B_global is fixed) and reported alone.

**Decoding.** The probe prefills a prompt of ``seq − new_tokens`` tokens once into a key/value
cache sized for ``seq`` positions (so the cache is counted at its largest), then times decode
steps of one token for each of the b_m sequences: per-token latency is the median step time,
and tokens/s = b_m / latency.

**Timing.** ``warmup`` untimed calls (they also absorb ``torch.compile``'s compilation and
recompilation for a new shape), then repeats until the median is stable (the median of all
repeats and that of all but the last differ by less than ``rel_tol``) or a count or time limit
is reached. CUDA events on a GPU, ``time.perf_counter`` on the CPU. The spread is kept as the
relative interquartile range (q75 − q25) / median.

**Memory on CUDA.** ``torch.cuda.reset_peak_memory_stats`` before the probe, then
``max_memory_allocated`` and ``max_memory_reserved`` after. The number compared with a budget
(``peak_memory_bytes``) is the reserved peak plus the CUDA context's own memory (total − free −
reserved, read once when the probe starts; it includes other processes on the device).

**Memory on the CPU.** The peak resident set size of the process (``VmHWM`` in
``/proc/self/status``), reset before each probe by writing ``5`` to ``/proc/self/clear_refs``
(Linux ≥ 4.0), so one process can measure several probes in any order. Where the reset is not
allowed the method falls back to ``getrusage(RUSAGE_SELF).ru_maxrss``, a high-water mark that
only rises (the method used is recorded). The figure includes the Python interpreter and torch's
libraries (about 0.2–0.4 GB); the per-sample slope does not.

**Out of memory.** On CUDA, ``torch.OutOfMemoryError`` (``torch.cuda.OutOfMemoryError``) is
caught by type and everything is freed (gradients, the batch, caches, ``gc``, ``empty_cache``).
On the CPU an allocation failure is a plain ``RuntimeError`` and an over-committed host kills
the process outright, so the CLI's CPU probes run in a child process under a hard address-space
limit (``RLIMIT_AS``): see :class:`microbatch.measure.childprobe.ChildProber`. Either way the point is
recorded as out of memory and the search goes on.

**Several processes.** When ``torch.distributed`` is initialised (DDP, FSDP under torchrun),
probes are synchronised: the decision to stop repeating is taken together, an OOM on any rank
is an OOM for all, and the slowest rank's time and the largest rank's memory count. Limitation:
an OOM that strikes one rank *inside* a collective (say in DDP's backward all-reduce) cannot be
recovered on the other ranks; in practice shapes are equal on every rank, so ranks run out of
memory at the same point.
"""

from __future__ import annotations

import gc
import json
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from microbatch.errors import ConfigError

__all__ = [
    "TimingConfig",
    "Measurement",
    "ProbeSpec",
    "TrainProbe",
    "DecodeProbe",
    "InProcessProber",
    "time_until_stable",
    "peak_rss_bytes",
    "reset_peak_rss",
    "build_probe",
    "oom_types",
]

MODES = ("train", "decode")
PRECISIONS = ("fp32", "bf16-mixed")


# -- timing ---------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class TimingConfig:
    """How long to time one probe."""

    warmup: int = 2
    """Untimed calls first (they absorb lazy allocation and compilation)."""
    min_repeats: int = 3
    """Timed calls before the stability test may stop."""
    max_repeats: int = 20
    """Timed calls at most."""
    max_time_s: float = 5.0
    """Wall time at most for the timed calls of one probe (at least ``min_repeats`` run)."""
    rel_tol: float = 0.03
    """Stop when the median of all repeats and that of all but the last differ by less than this."""
    clock: str = "wall"
    """CPU only: ``wall`` (``perf_counter``) or ``process`` (``process_time``: the CPU time of the
    probe process, steadier on a machine shared with other jobs; meaningful with one thread, where
    it is the time the work would take alone). CUDA always uses events."""

    def __post_init__(self) -> None:
        if self.warmup < 0 or self.min_repeats < 1 or self.max_repeats < self.min_repeats:
            raise ConfigError(
                f"timing warmup={self.warmup}, min_repeats={self.min_repeats}, max_repeats={self.max_repeats}: "
                "need warmup >= 0 and 1 <= min_repeats <= max_repeats"
            )
        if self.clock not in ("wall", "process"):
            raise ConfigError(f"timing clock {self.clock!r} is not known; use wall or process")
        if not (self.max_time_s > 0 and self.rel_tol >= 0):
            raise ConfigError(
                f"timing max_time_s={self.max_time_s} must be > 0 and rel_tol={self.rel_tol} >= 0"
            )


def spread(times: list[float]) -> float:
    """Relative interquartile range (q75 − q25) / median; 0 for fewer than two times."""
    if len(times) < 2:
        return 0.0
    q = statistics.quantiles(times, n=4, method="inclusive")
    med = statistics.median(times)
    return (q[2] - q[0]) / med if med > 0 else 0.0


def time_until_stable(
    fn: Callable[[], Any],
    timing: TimingConfig,
    *,
    timer: Callable[[Callable[[], Any]], float] | None = None,
    agree: Callable[[bool], bool] | None = None,
) -> list[float]:
    """Times of ``fn`` in seconds: ``warmup`` untimed calls, then repeats until the median is stable.

    ``timer(fn)`` returns one call's seconds (default ``perf_counter``); ``agree(stop)`` lets
    several processes take the stop decision together (default: each alone).
    """
    timer = timer or _cpu_timer
    for _ in range(timing.warmup):
        fn()
    times: list[float] = []
    start = time.perf_counter()
    while True:
        times.append(timer(fn))
        n = len(times)
        stop = n >= timing.max_repeats or (
            n >= timing.min_repeats and time.perf_counter() - start >= timing.max_time_s
        )
        if not stop and n >= timing.min_repeats and n >= 2:
            m_all, m_prev = statistics.median(times), statistics.median(times[:-1])
            stop = m_all > 0 and abs(m_all - m_prev) / m_all < timing.rel_tol
        if agree is not None:
            stop = agree(stop)
        if stop:
            return times


def _cpu_timer(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _process_timer(fn: Callable[[], Any]) -> float:
    t0 = time.process_time()
    fn()
    return time.process_time() - t0


def _cuda_timer(fn: Callable[[], Any]) -> float:
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


# -- CPU memory -------------------------------------------------------------------------
def _status_kib(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def reset_peak_rss() -> bool:
    """Reset the process's peak RSS (``echo 5 > /proc/self/clear_refs``); False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """Peak resident set size of this process since start or the last :func:`reset_peak_rss`."""
    kib = _status_kib("VmHWM")
    if kib is None:
        import resource

        kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return kib * 1024


def malloc_trim() -> bool:
    """Return freed heap memory to the system (glibc ``malloc_trim(0)``), so that the resident set
    after a probe is not inflated by what an earlier, larger probe freed. False where unavailable."""
    try:
        import ctypes

        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False


def current_rss_bytes() -> int:
    return (_status_kib("VmRSS") or 0) * 1024


def virtual_bytes() -> int:
    return (_status_kib("VmSize") or 0) * 1024


# -- results ----------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Measurement:
    """One probe at one micro-batch size."""

    micro_batch: int
    """b_m."""
    oom: bool = False
    """The probe ran out of memory (every other field but ``micro_batch`` may be None)."""
    throughput: float | None = None
    """Tokens per second (training: b_m·s / t_step; decoding: b_m / per-token latency)."""
    samples_per_s: float | None = None
    """Sequences per second (training); for decoding, sequences advanced by one token per second."""
    tokens_per_s: float | None = None
    """Same as ``throughput`` (kept under its own name for reports)."""
    step_time_s: float | None = None
    """Median time of one micro-step (training, with t_opt/g when g is known) or one decode step."""
    micro_step_s: float | None = None
    """Training: median forward + backward time alone."""
    optimizer_step_s: float | None = None
    """Training: one optimizer step, timed once."""
    prefill_s: float | None = None
    """Decoding: time of the prefill."""
    spread: float | None = None
    """Relative interquartile range of the timed repeats."""
    repeats: int = 0
    """Timed repeats."""
    peak_memory_bytes: int | None = None
    """Peak memory compared with a budget (CUDA: reserved + context; CPU: peak RSS of the process)."""
    peak_allocated_bytes: int | None = None
    """CUDA: ``max_memory_allocated`` (tensors only)."""
    checkpointing: bool = False
    """Activation checkpointing was on."""
    memory_method: str = ""
    """How memory was measured (``cuda-reserved+context``, ``vmhwm``, ``ru_maxrss``)."""
    clock: str = ""
    """How time was measured (``cuda-events``, ``wall``, ``process``)."""
    error: str | None = None
    """The exception that ended the probe (type and first line), when it did not finish."""

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Measurement:
        names = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in names})


def oom_types() -> tuple[type[BaseException], ...]:
    """Exception types that mean out of memory: torch's (CUDA, and CPU where torch raises it) and MemoryError."""
    import torch

    types: list[type[BaseException]] = [MemoryError]
    for t in (getattr(torch, "OutOfMemoryError", None), getattr(torch.cuda, "OutOfMemoryError", None)):
        if isinstance(t, type) and t not in types:
            types.append(t)
    return tuple(types)


def _short(e: BaseException) -> str:
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first[:200]}"


# -- distributed helpers ----------------------------------------------------------------
def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _reduce_max(values: list[float]) -> list[float]:
    """Element-wise max over ranks (identity without torch.distributed)."""
    dist = _dist()
    if dist is None:
        return values
    import torch

    backend = dist.get_backend()
    dev = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    t = torch.tensor(values, dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _agree_any(flag: bool) -> bool:
    return bool(_reduce_max([1.0 if flag else 0.0])[0])


# -- the in-process probes --------------------------------------------------------------
class _Device:
    """Timer, synchronisation, peak memory and freeing for one device."""

    def __init__(self, device, clock: str = "wall"):
        import torch

        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.clock = "cuda-events" if self.cuda else clock
        self.context_bytes = 0
        self.method = "cuda-reserved+context" if self.cuda else "vmhwm"
        if self.cuda:
            free, total = torch.cuda.mem_get_info(self.device)
            self.context_bytes = max(0, total - free - torch.cuda.memory_reserved(self.device))

    def timer(self, fn):
        if self.cuda:
            return _cuda_timer(fn)
        return _process_timer(fn) if self.clock == "process" else _cpu_timer(fn)

    def now(self) -> float:
        """The clock of one-off timings (the optimizer step, the prefill)."""
        return time.process_time() if self.clock == "process" else time.perf_counter()

    def sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize(self.device)

    def reset_peak(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.reset_peak_memory_stats(self.device)
        elif not reset_peak_rss():
            self.method = "ru_maxrss"

    def peak(self) -> tuple[int, int | None]:
        """(peak compared with the budget, peak allocated or None)."""
        if self.cuda:
            import torch

            return (
                int(torch.cuda.max_memory_reserved(self.device)) + self.context_bytes,
                int(torch.cuda.max_memory_allocated(self.device)),
            )
        return peak_rss_bytes(), None

    def free(self) -> None:
        gc.collect()
        if self.cuda:
            import torch

            torch.cuda.empty_cache()
        else:
            malloc_trim()


def _autocast(device, precision: str):
    import contextlib

    import torch

    if precision == "bf16-mixed":
        return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def default_loss(model, batch):
    """Loss of one batch: a tensor of token ids → next-token cross-entropy of ``model(batch)``;
    a dict → ``model(**batch)`` and its ``.loss`` (Hugging Face with ``labels``), or the output if a scalar."""
    import torch

    from microbatch.measure.gpt import next_token_loss

    out = model(**batch) if isinstance(batch, dict) else model(batch)
    loss = getattr(out, "loss", None)
    if loss is not None:
        return loss
    if isinstance(out, torch.Tensor) and out.dim() == 0:
        return out
    logits = getattr(out, "logits", out)
    if isinstance(batch, torch.Tensor) and isinstance(logits, torch.Tensor) and logits.dim() == 3:
        return next_token_loss(logits, batch)
    if isinstance(out, torch.Tensor):
        return out.float().mean()
    raise ConfigError(
        "cannot find a loss in the model's output; pass loss_fn=lambda model, batch: <scalar loss tensor>"
    )


def _tokens_in(batch) -> int | None:
    import torch

    t = batch.get("input_ids") if isinstance(batch, dict) else batch
    if isinstance(t, torch.Tensor) and t.dim() >= 2:
        return int(t.shape[0] * t.shape[1])
    return None


def set_checkpointing(model, on: bool) -> None:
    """Turn activation checkpointing on or off for the built-in GPT, a Hugging Face model, or a wrapper of one."""
    inner = model
    for attr in ("_orig_mod", "module"):  # torch.compile, DDP / FSDP
        while hasattr(inner, attr) and not hasattr(inner, "checkpointing"):
            inner = getattr(inner, attr)
    if hasattr(inner, "checkpointing"):
        inner.checkpointing = on
    elif hasattr(inner, "gradient_checkpointing_enable"):
        if on:
            inner.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            inner.gradient_checkpointing_disable()
    elif on:
        raise ConfigError(
            "the model has no activation checkpointing switch (no .checkpointing attribute or "
            "gradient_checkpointing_enable); use --checkpointing off or apply torch.utils.checkpoint yourself"
        )


class TrainProbe:
    """Forward + backward micro-steps of a model in this process (any model: DDP, FSDP, compiled)."""

    def __init__(
        self,
        model,
        make_batch: Callable[[int], Any],
        *,
        loss_fn: Callable[[Any, Any], Any] | None = None,
        optimizer=None,
        device=None,
        precision: str = "fp32",
        timing: TimingConfig = TimingConfig(),
        grad_accum_for: Callable[[int], int | None] | None = None,
    ):
        import torch

        if precision not in PRECISIONS:
            raise ConfigError(f"precision {precision!r} is not known; use one of {', '.join(PRECISIONS)}")
        self.model, self.make_batch = model, make_batch
        self.loss_fn = loss_fn or default_loss
        params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = optimizer or torch.optim.AdamW(params, lr=1e-4)
        if device is None:
            device = next(iter(params)).device if params else "cpu"
        self.dev = _Device(device, timing.clock)
        self.precision, self.timing = precision, timing
        self.grad_accum_for = grad_accum_for or (lambda b: None)
        self.ready = False
        self.checkpointing = False

    def set_checkpointing(self, on: bool) -> None:
        if on != self.checkpointing:
            set_checkpointing(self.model, on)
            self.checkpointing = on

    def _micro(self, batch) -> None:
        with _autocast(self.dev.device, self.precision):
            loss = self.loss_fn(self.model, batch)
        loss.backward()

    def setup(self, micro_batch: int = 1) -> None:
        """One full step (forward, backward, optimizer step) so the optimizer's state exists."""
        self.model.train()
        batch = self.make_batch(micro_batch)
        self._micro(batch)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        del batch
        self.dev.sync()
        self.dev.free()
        self.ready = True

    def measure(self, micro_batch: int) -> Measurement:
        """Time and peak memory of micro-steps at ``micro_batch``; OOM recorded, not raised."""
        ooms = oom_types()
        if not self.ready:
            self.setup(1)
        self.dev.free()
        self.dev.reset_peak()
        held: dict[str, Any] = {}
        times: list[float] = []
        err: str | None = None  # the text only: a kept exception would keep its frames' tensors alive
        t_opt = float("nan")
        try:
            held["batch"] = self.make_batch(micro_batch)
            self.dev.sync()
        except ooms as e:
            err = _short(e)
        failed = _agree_any(err is not None)
        if not failed:
            try:
                times = time_until_stable(
                    lambda: self._micro(held["batch"]),
                    self.timing,
                    timer=self.dev.timer,
                    agree=_agree_any if _dist() is not None else None,
                )
                t0 = self.dev.now()
                self.optimizer.step()
                self.dev.sync()
                t_opt = self.dev.now() - t0
            except ooms as e:
                err = _short(e)
            failed = _agree_any(err is not None)
        tokens = _tokens_in(held["batch"]) if "batch" in held else None
        self.optimizer.zero_grad(set_to_none=True)
        held.clear()
        peak, alloc = self.dev.peak()
        self.dev.free()
        if failed:
            return Measurement(
                micro_batch=micro_batch,
                oom=True,
                checkpointing=self.checkpointing,
                memory_method=self.dev.method,
                error=err or "out of memory on another rank",
            )
        t_micro = statistics.median(times)
        peak_all, t_micro_all, t_opt_all = _reduce_max([float(peak), t_micro, t_opt])
        g = self.grad_accum_for(micro_batch)
        t_step = t_micro_all + (t_opt_all / g if g else 0.0)
        samples = micro_batch / t_step
        tps = tokens / t_step if tokens else None
        return Measurement(
            micro_batch=micro_batch,
            throughput=tps if tps is not None else samples,
            samples_per_s=samples,
            tokens_per_s=tps,
            step_time_s=t_step,
            micro_step_s=t_micro_all,
            optimizer_step_s=t_opt_all,
            spread=spread(times),
            repeats=len(times),
            peak_memory_bytes=int(peak_all),
            peak_allocated_bytes=alloc,
            checkpointing=self.checkpointing,
            memory_method=self.dev.method,
            clock=self.dev.clock,
        )


class _HFDecoder:
    """prefill/decode_step over a Hugging Face causal LM's ``past_key_values``."""

    def __init__(self, model):
        self.model = model

    def prefill(self, tokens, *, capacity=None):
        import torch

        with torch.no_grad():
            try:
                out = self.model(input_ids=tokens, use_cache=True, logits_to_keep=1)
            except TypeError:
                out = self.model(input_ids=tokens, use_cache=True)
        return out.logits[:, -1], out.past_key_values

    def decode_step(self, token, cache):
        import torch

        with torch.no_grad(), warnings.catch_warnings():
            # transformers >= 5.2x renames past_key_values to cache (with a FutureWarning); older
            # releases (a GPU machine's) only know past_key_values
            warnings.simplefilter("ignore", FutureWarning)
            out = self.model(input_ids=token.view(-1, 1), past_key_values=cache, use_cache=True)
        return out.logits[:, -1], out.past_key_values


class DecodeProbe:
    """Prefill once, then time one-token decode steps with a KV cache."""

    def __init__(
        self,
        model,
        *,
        vocab: int,
        seq: int,
        new_tokens: int = 32,
        device=None,
        precision="fp32",
        timing: TimingConfig = TimingConfig(),
    ):
        import torch

        self.model = model.eval()
        self.decoder = model if hasattr(model, "decode_step") else _HFDecoder(model)
        self.vocab, self.seq = vocab, seq
        # steps needed: warm-up + at most max_repeats
        self.new_tokens = max(new_tokens, timing.warmup + timing.max_repeats)
        if self.new_tokens >= seq:
            raise ConfigError(
                f"decoding {self.new_tokens} tokens needs seq > {self.new_tokens}, got seq {seq}; "
                "give a longer --seq or fewer repeats"
            )
        if device is None:
            device = next(model.parameters()).device
        self.dev = _Device(device, timing.clock)
        self.precision, self.timing = precision, timing
        self.checkpointing = False
        self._gen = torch.Generator().manual_seed(0)

    def set_checkpointing(self, on: bool) -> None:  # no backward pass: nothing to checkpoint
        pass

    def setup(self, micro_batch: int = 1) -> None:
        self.measure(micro_batch)

    def measure(self, micro_batch: int) -> Measurement:
        import torch

        ooms = oom_types()
        self.dev.free()
        self.dev.reset_peak()
        prompt_len = self.seq - self.new_tokens
        state: dict[str, Any] = {}
        err = None
        times: list[float] = []
        t_prefill = float("nan")
        try:
            prompt = torch.randint(0, self.vocab, (micro_batch, prompt_len), generator=self._gen).to(
                self.dev.device
            )
            with _autocast(self.dev.device, self.precision), torch.no_grad():
                t0 = self.dev.now()
                logits, state["cache"] = self.decoder.prefill(prompt, capacity=self.seq)
                self.dev.sync()
                t_prefill = self.dev.now() - t0
                state["tok"] = logits.argmax(-1)

                def step():
                    logits, state["cache"] = self.decoder.decode_step(state["tok"], state["cache"])
                    state["tok"] = logits.argmax(-1)

                times = time_until_stable(
                    step, self.timing, timer=self.dev.timer, agree=_agree_any if _dist() is not None else None
                )
        except ooms as e:
            err = _short(e)
        state.clear()
        peak, alloc = self.dev.peak()
        self.dev.free()
        failed = _agree_any(err is not None)
        if failed:
            return Measurement(
                micro_batch=micro_batch,
                oom=True,
                memory_method=self.dev.method,
                error=err or "out of memory on another rank",
            )
        lat = statistics.median(times)
        peak_all, lat_all = _reduce_max([float(peak), lat])
        tps = micro_batch / lat_all
        return Measurement(
            micro_batch=micro_batch,
            throughput=tps,
            samples_per_s=tps,
            tokens_per_s=tps,
            step_time_s=lat_all,
            prefill_s=t_prefill,
            spread=spread(times),
            repeats=len(times),
            peak_memory_bytes=int(peak_all),
            peak_allocated_bytes=alloc,
            memory_method=self.dev.method,
            clock=self.dev.clock,
        )


# -- models from a description ----------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class ProbeSpec:
    """What to probe, as plain data (so a child process can rebuild it)."""

    model: str | None = None
    """A registry name (``tiny``, ``small``, ``gpt2``…); None with ``hf_config`` or ``shape``."""
    shape: dict | None = None
    """A :class:`~microbatch.model.ModelShape` as a dict (its ``to_dict()``), instead of a name."""
    hf_config: str | None = None
    """Path to a Hugging Face ``config.json`` (or its folder): built with random weights, nothing downloaded."""
    backend: str = "builtin"
    """``builtin`` (microbatch.measure.gpt) or ``hf`` (a transformers model of the registry shape) for ``model``."""
    seq: int
    """Sequence length: the longest the data holds (memory is set by the longest sequence)."""
    mode: str = "train"
    """``train`` (forward + backward) or ``decode`` (KV-cache decoding)."""
    device: str = "cpu"
    """``cpu`` or ``cuda`` (or ``cuda:N``)."""
    precision: str = "fp32"
    """``fp32`` or ``bf16-mixed`` (autocast to bfloat16, fp32 weights)."""
    timing: TimingConfig = field(default_factory=TimingConfig)
    """Warm-up and repeat limits."""
    new_tokens: int = 32
    """Decoding: tokens decoded after the prefill (at least warm-up + max repeats)."""
    global_batch: int | None = None
    """B_global, to amortise the optimizer step over g = B / (b_m·d)."""
    data_parallel: int = 1
    """d."""
    seed: int = 0
    """Weights and data seed."""
    threads: int | None = None
    """torch intra-op threads in the probe process (None: torch's default). One thread gives
    steadier timings on a CPU shared with other jobs."""

    def __post_init__(self) -> None:
        if sum(x is not None for x in (self.model, self.hf_config, self.shape)) != 1:
            raise ConfigError("give exactly one of --model NAME or --hf-config PATH")
        if isinstance(self.seq, bool) or not isinstance(self.seq, int) or self.seq < 1:
            raise ConfigError(
                f"seq {self.seq!r} must be a whole number >= 1: the longest sequence the data holds"
            )
        if self.mode not in MODES:
            raise ConfigError(f"mode {self.mode!r} is not known; use train or decode")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision {self.precision!r} is not known; use fp32 or bf16-mixed")
        if self.backend not in ("builtin", "hf"):
            raise ConfigError(f"backend {self.backend!r} is not known; use builtin or hf")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ConfigError(f"device {self.device!r} is not known; use cpu or cuda")
        if self.mode == "decode" and self.seq <= 2:
            raise ConfigError(f"decoding needs seq > 2, got {self.seq}")

    def grad_accum(self, micro_batch: int) -> int | None:
        if self.global_batch is None:
            return None
        return max(1, self.global_batch // (micro_batch * self.data_parallel))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ProbeSpec:
        d = dict(d)
        d["timing"] = TimingConfig(**d.get("timing", {}))
        return cls(**d)


def hf_config_from_shape(shape):
    """A transformers config of a registry shape (GPT-2 layout for learned positions, Llama otherwise)."""
    if shape.learned_positions:
        from transformers import GPT2Config

        return GPT2Config(
            n_layer=shape.layers,
            n_embd=shape.hidden,
            n_head=shape.heads,
            vocab_size=shape.vocab,
            n_positions=shape.positions,
            n_inner=shape.ffn_hidden,
            tie_word_embeddings=shape.tied_embeddings,
            bos_token_id=0,
            eos_token_id=0,
        )
    from transformers import LlamaConfig

    return LlamaConfig(
        num_hidden_layers=shape.layers,
        hidden_size=shape.hidden,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv,
        intermediate_size=shape.ffn,
        vocab_size=shape.vocab,
        max_position_embeddings=max(shape.positions, shape.seq),
        tie_word_embeddings=shape.tied_embeddings,
        bos_token_id=0,
        eos_token_id=0,
    )


def load_hf_config(path: str):
    """A transformers config from ``config.json`` or its folder (local files only)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ConfigError(
            f"--hf-config {path!r}: no such file; give a Hugging Face config.json or its folder"
        )
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"--hf-config {path!r} is not valid JSON ({e.msg}); give a Hugging Face config.json"
        ) from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise ConfigError(f"--hf-config {path!r} has no 'model_type'; give a Hugging Face config.json")
    from transformers import AutoConfig

    try:
        return AutoConfig.for_model(**data)
    except (ValueError, KeyError) as e:
        raise ConfigError(f"--hf-config {path!r}: transformers cannot read it ({e})") from None


def _hf_model(config, dtype, device, seed):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):  # initialise where it will run (large models are slow to initialise on a CPU)
        model = AutoModelForCausalLM.from_config(config)
    return model.to(dtype=dtype)


def build_probe(spec: ProbeSpec):
    """The in-process probe (TrainProbe or DecodeProbe) of ``spec``: model built with random weights."""
    import torch

    from microbatch.model import get_model

    device = torch.device(spec.device)
    if spec.model is not None or spec.shape is not None:
        if spec.shape is not None:
            from microbatch.model import ModelShape

            fields = {k: v for k, v in spec.shape.items() if k in ModelShape.__dataclass_fields__}
            shape = ModelShape(**fields).with_seq(spec.seq)
        else:
            shape = get_model(spec.model, seq=spec.seq)
        if shape.learned_positions and spec.seq > shape.positions:
            raise ConfigError(
                f"seq {spec.seq} is longer than {shape.name}'s {shape.positions} learned positions; "
                f"use --seq <= {shape.positions}"
            )
        vocab = shape.vocab
        if spec.backend == "hf":
            model = _hf_model(hf_config_from_shape(shape), torch.float32, device, spec.seed)
        else:
            from microbatch.measure.gpt import build_model

            model = build_model(shape, seed=spec.seed, device=device)
    else:
        config = load_hf_config(spec.hf_config)
        vocab = int(getattr(config, "vocab_size", 0) or 0)
        if vocab < 1:
            raise ConfigError(f"--hf-config {spec.hf_config!r} has no vocab_size")
        model = _hf_model(config, torch.float32, device, spec.seed)
    gen = torch.Generator().manual_seed(spec.seed + 1)
    if spec.mode == "decode":
        return DecodeProbe(
            model,
            vocab=vocab,
            seq=spec.seq,
            new_tokens=spec.new_tokens,
            device=device,
            precision=spec.precision,
            timing=spec.timing,
        )
    hf = not hasattr(model, "decode_step")

    def make_batch(b: int):
        t = torch.randint(0, vocab, (b, spec.seq), generator=gen).to(device)
        return {"input_ids": t, "labels": t} if hf else t

    return TrainProbe(
        model,
        make_batch,
        device=device,
        precision=spec.precision,
        timing=spec.timing,
        grad_accum_for=spec.grad_accum,
    )


def static_bytes(probe) -> int:
    """Bytes a training probe holds before any activation: weights + gradients + Adam's two moments."""
    n = sum(p.numel() * p.element_size() for p in probe.model.parameters())
    return n * (4 if isinstance(probe, TrainProbe) else 1)


# -- probers: what tune calls -----------------------------------------------------------
class InProcessProber:
    """Probes in this process (CUDA, where OOM is an exception, or a user's own model)."""

    def __init__(self, probe):
        self.probe = probe
        self.peak_before_bytes: int | None = None

    def start(self) -> None:
        if not getattr(self.probe, "ready", True):
            self.probe.setup(1)

    def measure(self, micro_batch: int, *, checkpointing: bool = False) -> Measurement:
        self.probe.set_checkpointing(checkpointing)
        return self.probe.measure(micro_batch)

    def close(self) -> None:
        pass


def measure_once(spec: ProbeSpec, micro_batch: int, *, checkpointing: bool = False) -> Measurement:
    """One probe of ``spec`` in this process (for scripts and tests)."""
    probe = build_probe(spec)
    probe.set_checkpointing(checkpointing)
    return probe.measure(micro_batch)
