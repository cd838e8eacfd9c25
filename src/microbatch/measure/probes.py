"""Measure one training micro-step or one decode step at a given micro-batch size b_m, in steady state.

**Training** (:class:`TrainProbe`). One full step first (forward, backward, optimizer step) allocates the
optimizer's state. A probe then builds one batch of b_m sequences (``make_batch`` must grow with b:
:mod:`.batch_check`) and repeats forward + backward on it, accumulating gradients; then it times one optimizer step:

    t_step(b) = t_micro(b) + t_opt / g      (g = B_global / (b_m·d) when a global batch is given)

With no global batch the optimizer step is left out of the throughput (its cost per sample, t_opt·d / B_global,
does not depend on b_m once B_global is fixed) and reported alone.

**Decoding** (:class:`DecodeProbe`). The probe prefills a prompt of ``seq − new_tokens`` tokens once into a
key/value cache sized for ``seq`` positions (so the cache is counted at its largest), then times decode steps of one
token for each of the b_m sequences, centred on the generation's middle token (:func:`decode_lead`): per-token
latency is the median step time, and tokens/s = b_m / latency — generated tokens, the prefill not counted.

Timing is :mod:`microbatch.measure.timing`'s; peak memory, out-of-memory handling and the synchronisation of several
ranks are :mod:`microbatch.measure.device`'s. A probe records an out-of-memory as a :class:`Measurement` with
``oom=True`` and the search goes on; one rank's in its forward stops every rank before the backward
(:class:`~microbatch.measure.device.PeerOutOfMemory`). Limitation: one that strikes a rank *inside* a collective (DDP's
backward all-reduce, FSDP's gathers) cannot be recovered on the others. A probe as plain data is
:mod:`microbatch.measure.spec`'s.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from microbatch.errors import ConfigError, plain_numbers
from microbatch.measure.batch_check import GrowingBatches
from microbatch.measure.batch_loss import _tokens_in, default_loss
from microbatch.measure.device import (
    Device,
    PeerOutOfMemory,
    agree_any,
    distributed,
    oom_text,
    oom_types,
    raise_if_a_peer_failed,
    reduce_max,
    steady_timing,
)
from microbatch.measure.hf import HFDecoder
from microbatch.measure.timing import TimingConfig, spread, time_until_stable
from microbatch.precision import get_precision

if TYPE_CHECKING:
    import torch

__all__ = [
    "Measurement",
    "TrainProbe",
    "DecodeProbe",
    "decode_lead",
    "default_loss",
    "set_checkpointing",
]

_TORCH_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
"""torch's dtype names of the precision table's half-precision compute dtypes."""


def _contract_broken(error: TypeError, loss_fn: Any, model: Any) -> bool:
    """Whether the first step's TypeError is loss_fn(model, batch)'s contract broken, not a bug in the model or a
    step of the user's: a criterion (an ``nn.Module``) given as ``loss_fn``, a call that failed on its own arguments
    (the traceback ends in :meth:`TrainProbe._micro`, no frame of ``loss_fn``'s), or torch saying it got the model
    where it wanted a tensor ("... must be Tensor, not Sequential")."""
    import torch

    if isinstance(loss_fn, torch.nn.Module):
        return True
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is not None and tb.tb_frame.f_code is TrainProbe._micro.__code__:
        return True
    return f"not {type(model).__name__}" in str(error)


def decode_lead(new_tokens: int, timing: TimingConfig) -> int:
    """Untimed decode steps before the timed ones, so that the first timed steps (after the warm-up, the ``min_repeats``
    the timing takes at least) straddle the middle of the ``new_tokens`` generated: a step's attention reads the whole
    cache, so its time grows with the position, and the middle step is the generation's mean (timed from the prompt's
    end, a 1,984-token decode on a CPU read 3.0 ms a step for a mean of 7.5 ms). Never negative; the lead and the most
    the timing takes (warm-up + ``max_repeats``) fit in ``new_tokens``, which holds at least that many."""
    window = timing.warmup + timing.max_repeats
    return max(0, min(new_tokens - window, new_tokens // 2 - timing.warmup - timing.min_repeats // 2))


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
    throughput_se: float | None = None
    """Standard error of ``throughput`` relative to it, where a point was measured more than once
    (the knee's confirmation: the larger of the repeats' and the re-measurements' own); None: from
    ``spread`` and ``repeats`` (:func:`microbatch.choose.noise.relative_se`)."""
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
    timed_heap: str | None = None
    """The CPU probe child's heap its repeats were timed on: ``steady`` (as a training process holds it) or
    ``tracking`` (its steady heap did not fit under the memory limit: each tensor mapped afresh, 1.4-1.7x a
    training process's step on the models measured); None elsewhere (and where glibc lacks ``mallinfo2``)."""

    def __post_init__(self) -> None:
        plain_numbers(self)  # NumPy or torch scalars as Python's: to_dict writes JSON

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Measurement:
        if not isinstance(d, dict):
            raise ConfigError(f"a measurement is a dict of its fields (Measurement.to_dict()), got {d!r}")
        names = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in names})


def _autocast(device: torch.device, precision: str) -> AbstractContextManager[Any]:
    """torch autocast to the precision's compute dtype; no change for fp32."""
    import contextlib

    import torch

    dtype = _TORCH_DTYPES.get(get_precision(precision, measurable=True).compute_dtype)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=getattr(torch, dtype))


def set_checkpointing(model: Any, on: bool) -> None:
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
            "gradient_checkpointing_enable); turn checkpointing off or apply torch.utils.checkpoint yourself",
            params=("checkpointing",),
        )


class TrainProbe:
    """Forward + backward micro-steps of a model in this process (any model: DDP, FSDP, compiled)."""

    def __init__(
        self,
        model: Any,
        make_batch: Callable[[int], Any],
        *,
        loss_fn: Callable[[Any, Any], Any] | None = None,
        optimizer: Any = None,
        device: str | torch.device | None = None,
        precision: str = "fp32",
        timing: TimingConfig = TimingConfig(),
        grad_accum_for: Callable[[int], int | None] | None = None,
    ) -> None:
        import torch

        get_precision(precision, measurable=True)
        self.model, self.make_batch = model, GrowingBatches(make_batch)  # refuses a batch that does not grow
        self.loss_fn: Callable[[Any, Any], Any] = loss_fn or default_loss
        params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = optimizer or torch.optim.AdamW(params, lr=1e-4)
        if device is None:
            device = next(iter(params)).device if params else "cpu"
        self.dev = Device(device, timing.clock)
        self.precision, self.timing = precision, timing
        self.grad_accum_for: Callable[[int], int | None] = grad_accum_for or (lambda b: None)
        self.ready = False
        self.checkpointing = False
        self.first_loss: float | None = None
        """The loss of the set-up step (None before it)."""

    def set_checkpointing(self, on: bool) -> None:
        if on != self.checkpointing:
            set_checkpointing(self.model, on)
            self.checkpointing = on

    def _micro(self, batch: Any) -> Any:
        with _autocast(self.dev.device, self.precision):
            loss = self.loss_fn(self.model, batch)
        if not callable(getattr(loss, "backward", None)):
            raise ConfigError(
                f"tune's loss_fn(model, batch) must return the loss tensor, got {type(loss).__name__}"
                + (
                    " (accumulate's (loss_sum, items) pair?); return loss_sum / items"
                    if isinstance(loss, tuple)
                    else ""
                )
            )
        if getattr(loss, "dim", lambda: 0)() != 0:
            raise ConfigError(
                f"tune's loss_fn(model, batch) must return one number (a 0-dim tensor), got a tensor of shape "
                f"{tuple(loss.shape)} (reduction='none'?); reduce it: loss.mean() or loss.sum()"
            )
        if getattr(loss, "requires_grad", True) is False:
            raise ConfigError(
                "tune's loss_fn(model, batch) returned a loss that does not require grad: computed under "
                "torch.no_grad(), from a detached output (.detach(), .item()), or with every parameter frozen; "
                "compute it from the model's output with the parameters to train left trainable"
            )
        raise_if_a_peer_failed()  # a rank whose forward ran out of memory says so before any backward
        loss.backward()
        return loss

    def setup(self, micro_batch: int = 1) -> None:
        """One full step (forward, backward, optimizer step) so the optimizer's state exists; its loss
        is read once (``first_loss``: a NaN or infinite loss is reported, not timed around)."""
        self.model.train()
        batch = self.make_batch(micro_batch)
        try:
            loss = self._micro(batch)
        except TypeError as e:  # the first call: the contract, where the error says so
            if not _contract_broken(e, self.loss_fn, self.model):
                raise
            raise ConfigError(
                f"the first training step raised TypeError: {e}; tune calls loss_fn(model, batch) with a batch "
                "from make_batch(b) and backpropagates the loss it returns: a criterion of (output, target) such "
                "as nn.CrossEntropyLoss() needs wrapping, e.g. loss_fn=lambda model, batch: "
                "criterion(model(batch[0]), batch[1])"
            ) from e
        self.first_loss = float(loss.detach().float().item())
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        del batch
        self.dev.sync()
        self.dev.free()
        self.ready = True

    def _timed(self, batch: Any) -> tuple[list[float], float]:
        """Seconds of the timed micro-steps, and of one optimizer step after them."""
        times = time_until_stable(
            lambda: self._micro(batch),
            self.timing,
            timer=self.dev.timer,
            agree=agree_any if distributed() is not None else None,
        )
        t0 = self.dev.now()
        self.optimizer.step()
        self.dev.sync()
        return times, self.dev.now() - t0

    def _time_steps(self, batch: Any) -> tuple[list[float], float, tuple[int, int | None] | None, str | None]:
        """:meth:`_timed`, and the peak memory where it is read before the timing (:func:`~microbatch.measure.device.steady_timing`): in
        the probe child, two untimed micro-steps (the second adds into the gradients the first left, as the
        timed repeats do: its transient is the peak where a gradient is large) and an optimizer step."""

        def memory_phase() -> None:
            self._micro(batch)
            self._micro(batch)
            self.optimizer.step()

        (times, t_opt), peak, heap = steady_timing(self.dev, memory_phase, lambda: self._timed(batch))
        return times, t_opt, peak, heap

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
        read: tuple[int, int | None] | None = None
        heap: str | None = None
        try:
            held["batch"] = self.make_batch(micro_batch)
            self.dev.sync()
        except Exception as e:  # noqa: BLE001 - out of memory by meaning (the CPU allocator's is a RuntimeError)
            err = oom_text(e, ooms)
        failed = agree_any(err is not None)
        if not failed:
            agreed = False
            try:
                times, t_opt, read, heap = self._time_steps(held["batch"])
            except PeerOutOfMemory as e:  # agreed already, before this rank's backward: no second agreement
                err, agreed = str(e), True
            except Exception as e:  # noqa: BLE001 - as above
                err = oom_text(e, ooms)
            failed = agreed or agree_any(err is not None)
        tokens = _tokens_in(held["batch"]) if "batch" in held else None
        self.optimizer.zero_grad(set_to_none=True)
        held.clear()
        peak, alloc = read or self.dev.peak()
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
        # every rank reads the same numbers: the choice (and the knee's noise, from the spread) must agree
        peak_all, t_micro_all, t_opt_all, spread_all = reduce_max(
            [float(peak), t_micro, t_opt, spread(times)]
        )
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
            spread=spread_all,
            repeats=len(times),
            peak_memory_bytes=int(peak_all),
            peak_allocated_bytes=alloc,
            checkpointing=self.checkpointing,
            memory_method=self.dev.method,
            clock=self.dev.clock,
            timed_heap=heap,
        )


class DecodeProbe:
    """Prefill once, then time one-token decode steps with a KV cache."""

    def __init__(
        self,
        model: Any,
        *,
        vocab: int,
        seq: int,
        new_tokens: int = 32,
        device: str | torch.device | None = None,
        precision: str = "fp32",
        timing: TimingConfig = TimingConfig(),
    ) -> None:
        import torch

        get_precision(precision, measurable=True)
        self.model = model.eval()
        self.decoder: Any = model if hasattr(model, "decode_step") else HFDecoder(model)
        self.vocab, self.seq = vocab, seq
        # steps needed: warm-up + at most max_repeats
        steps = timing.warmup + timing.max_repeats
        self.new_tokens = max(new_tokens, steps)
        if self.new_tokens >= seq:
            why = f" (the timing's warm-up {timing.warmup} + most repeats {timing.max_repeats})"
            raise ConfigError(
                f"decoding {self.new_tokens} new tokens after a prompt{why if steps > new_tokens else ''} needs "
                f"seq > {self.new_tokens}, got seq {seq}; give a longer seq"
                + (" or fewer repeats" if steps > new_tokens else ""),
                params=("seq",),
            )
        if device is None:
            device = next(model.parameters()).device
        self.dev = Device(device, timing.clock)
        self.precision, self.timing = precision, timing
        self.checkpointing = False
        self._gen = torch.Generator().manual_seed(0)

    def set_checkpointing(self, on: bool) -> None:  # no backward pass: nothing to checkpoint
        pass

    def setup(self, micro_batch: int = 1) -> None:
        self.measure(micro_batch)

    def _decode(self, micro_batch: int, steps: int | None) -> tuple[list[float], float]:
        """(decode step seconds, prefill seconds): prefill a prompt of ``seq − new_tokens`` tokens, then ``steps``
        untimed decode steps (the memory phase: every step the timing can take, the cache at its largest) or, with
        None, decode steps timed until stable, centred on the generation's middle token (:func:`decode_lead`)."""
        import torch

        prompt_len = self.seq - self.new_tokens
        prompt = torch.randint(0, self.vocab, (micro_batch, prompt_len), generator=self._gen).to(
            self.dev.device
        )
        state: dict[str, Any] = {}
        with _autocast(self.dev.device, self.precision), torch.no_grad():
            t0 = self.dev.now()
            logits, state["cache"] = self.decoder.prefill(prompt, capacity=self.seq)
            self.dev.sync()
            t_prefill = self.dev.now() - t0
            state["tok"] = logits.argmax(-1)

            def step() -> None:
                logits, state["cache"] = self.decoder.decode_step(state["tok"], state["cache"])
                state["tok"] = logits.argmax(-1)

            if steps is not None:
                for _ in range(steps):
                    step()
                self.dev.sync()
                return [], t_prefill
            agree = agree_any if distributed() is not None else None
            lead = decode_lead(self.new_tokens, self.timing)
            for _ in range(lead):
                step()
            times = time_until_stable(step, self.timing, timer=self.dev.timer, agree=agree)
            # the cache to its largest, as the memory phase leaves it: where no phase ran first (CUDA), the peak is
            # read after these steps
            for _ in range(self.new_tokens - lead - self.timing.warmup - len(times)):
                step()
            self.dev.sync()
            return times, t_prefill

    def measure(self, micro_batch: int) -> Measurement:
        """Per-token latency and peak memory of decoding ``micro_batch`` sequences; OOM recorded. In the probe
        child the peak is read over an untimed decode of every step (on the heap that tracks it) and the steps are
        timed on the steady heap, as a user's process runs (:func:`~microbatch.measure.device.steady_timing`:
        timed on the tracking heap, a Hugging Face model's decode ran 1.5-1.7x slower, the built-in GPT's 1.1x)."""
        ooms = oom_types()
        self.dev.free()
        self.dev.reset_peak()
        err, heap, read = None, None, None
        times: list[float] = []
        t_prefill = float("nan")
        try:
            (times, t_prefill), read, heap = steady_timing(
                self.dev,
                lambda: self._decode(micro_batch, self.new_tokens),
                lambda: self._decode(micro_batch, None),
            )
        except Exception as e:  # noqa: BLE001 - out of memory by meaning (the CPU allocator's is a RuntimeError)
            err = oom_text(e, ooms)
        peak, alloc = read or self.dev.peak()
        self.dev.free()
        failed = agree_any(err is not None)
        if failed:
            return Measurement(
                micro_batch=micro_batch,
                oom=True,
                memory_method=self.dev.method,
                error=err or "out of memory on another rank",
            )
        lat = statistics.median(times)
        peak_all, lat_all = reduce_max([float(peak), lat])
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
            timed_heap=heap,
        )
