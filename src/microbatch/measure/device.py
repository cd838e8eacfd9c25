"""One device as a probe sees it: its clock, peak memory and freeing; out-of-memory; several ranks.

**Memory on CUDA.** ``torch.cuda.reset_peak_memory_stats`` before the probe, then
``max_memory_allocated`` and ``max_memory_reserved`` after. The number compared with a budget
is the reserved peak plus the CUDA context's own memory (total − free − reserved, read once when
the probe starts; it includes other processes on the device).

**Memory on the CPU.** The peak resident set size of the process (:mod:`microbatch.measure.hostmem`),
reset before each probe; where the reset is not allowed the method falls back to
``ru_maxrss`` (the method used is recorded).

**Out of memory.** On CUDA, ``torch.OutOfMemoryError`` (``torch.cuda.OutOfMemoryError``) is
caught by type (:func:`oom_types`) and everything is freed (gradients, the batch, caches, ``gc``,
``empty_cache``). On the CPU an allocation failure is a plain ``RuntimeError`` and an
over-committed host kills the process outright: see :mod:`microbatch.measure.childprobe`.

**Several processes.** When ``torch.distributed`` is initialised (DDP, FSDP under torchrun),
probes are synchronised: the decision to stop repeating is taken together (:func:`agree_any`),
an OOM on any rank is an OOM for all, and the slowest rank's time and the largest rank's memory
count (:func:`reduce_max`).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

from microbatch.measure.hostmem import (
    malloc_trim,
    peak_rss_bytes,
    replug,
    reset_peak_rss,
    steady_heap,
    tracking_heap,
)
from microbatch.measure.timing import cuda_timer, process_timer, wall_timer

if TYPE_CHECKING:
    import torch

__all__ = [
    "Device",
    "CPU_ALLOC_FAILURE",
    "is_out_of_memory",
    "oom_text",
    "oom_types",
    "torch_oom_types",
    "short_error",
    "distributed",
    "reduce_max",
    "agree_any",
    "PeerOutOfMemory",
    "raise_if_a_peer_failed",
    "gc_frozen",
    "exit_past_teardown",
    "steady_timing",
]

_T = TypeVar("_T")

_frozen_depth = [0]
"""How many :func:`gc_frozen` blocks are open in this process."""


@contextmanager
def gc_frozen() -> Iterator[None]:
    """Run the block with the objects that exist now moved out of the garbage collector's scans,
    and, inside it, the survivors of each :meth:`Device.free` collection too.

    Each probe calls ``gc.collect()`` to free the last one's tensors; in a process that has
    imported Lightning or transformers a full collection walks millions of objects (0.56 s a call
    measured with Lightning, 11 calls: 6.1 s of a 4.9 s-probe tune's ~7 s; ``gc.freeze``, CPython
    ≥ 3.7). What a probe itself brings in stays too: the first ``AdamW`` built in a process imports
    ``torch._dynamo`` (1.9 s, tens of thousands of objects), and with only the objects from before
    the block frozen the 22 collections of an Accelerate search still took 1.27 s (0.057 s each,
    the bench's CPU model). So each collection inside the block freezes what it leaves: the next
    one walks only what was made since. Frozen objects are only skipped, not freed: a cycle that
    became garbage after it was frozen is collected after the block (``gc.unfreeze`` when the
    outermost block ends), as it would have been at the next collection.
    """
    gc.freeze()
    _frozen_depth[0] += 1
    try:
        yield
    finally:
        _frozen_depth[0] -= 1
        if _frozen_depth[0] == 0:
            gc.unfreeze()


def torch_oom_types() -> tuple[type[BaseException], ...]:
    """torch's out-of-memory exception types (``torch.OutOfMemoryError``, ``torch.cuda.OutOfMemoryError``,
    one class in recent torch), those this torch has: the one table of them."""
    import torch

    types: list[type[BaseException]] = []
    for t in (getattr(torch, "OutOfMemoryError", None), getattr(torch.cuda, "OutOfMemoryError", None)):
        if isinstance(t, type) and issubclass(t, BaseException) and t not in types:
            types.append(t)
    return tuple(types)


def oom_types() -> tuple[type[BaseException], ...]:
    """Exception types that mean out of memory: torch's (CUDA, and CPU where torch raises it) and MemoryError."""
    return (MemoryError, *torch_oom_types())


CPU_ALLOC_FAILURE = "DefaultCPUAllocator: can't allocate memory"
"""The words of torch's CPU allocator when an allocation fails (``c10/core/impl/alloc_cpu.cpp``)."""


def is_out_of_memory(e: BaseException, ooms: tuple[type[BaseException], ...] | None = None) -> bool:
    """True for torch's out-of-memory types and ``MemoryError``, and for the CPU allocator's ``RuntimeError``.
    ``ooms``: :func:`oom_types` resolved before (nothing lazy may allocate at the limit)."""
    if isinstance(e, oom_types() if ooms is None else ooms):
        return True
    return type(e) is RuntimeError and CPU_ALLOC_FAILURE in str(e)


def oom_text(e: BaseException, ooms: tuple[type[BaseException], ...] | None = None) -> str:
    """:func:`short_error` of an out-of-memory ``e`` (:func:`is_out_of_memory`); anything else raised again."""
    if not is_out_of_memory(e, ooms):
        raise e
    return short_error(e)


def short_error(e: BaseException) -> str:
    """An exception as one short line: its type and the first line of its message."""
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first[:200]}"


# -- several processes ------------------------------------------------------------------
def distributed() -> ModuleType | None:
    """``torch.distributed`` when a process group is initialised, else None."""
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def reduce_max(values: list[float]) -> list[float]:
    """Element-wise max over ranks (identity without torch.distributed)."""
    dist = distributed()
    if dist is None:
        return values
    import torch

    backend = dist.get_backend()
    dev = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    t = torch.tensor(values, dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    out: list[float] = t.tolist()
    return out


def agree_any(flag: bool) -> bool:
    """True on every rank if ``flag`` is True on any rank (``flag`` itself in one process)."""
    return bool(reduce_max([1.0 if flag else 0.0])[0])


class PeerOutOfMemory(Exception):
    """Another rank's forward ran out of memory in this micro-step: every rank leaves before the backward, whose
    gradient all-reduce the failed rank would never join (a review, 2026-12-08: rank 0 waited in DDP's all-reduce
    while rank 1 agreed on its error, and gloo aborted on the mismatched sizes; NCCL would hang). An out-of-memory in
    the backward itself still strands the others there, as in any DDP loop."""


def raise_if_a_peer_failed() -> None:
    """:class:`PeerOutOfMemory` on every rank where another rank's forward failed (it agrees with ``agree_any(True)``
    in place of this call); nothing in one process."""
    if distributed() is not None and agree_any(False):
        raise PeerOutOfMemory("out of memory on another rank (in its forward)")


# -- one device -----------------------------------------------------------------------
class Device:
    """Timer, synchronisation, peak memory and freeing for one device."""

    def __init__(self, device: str | torch.device, clock: str = "wall") -> None:
        import torch

        self.device = torch.device(device)
        """The torch device probed."""
        self.cuda = self.device.type == "cuda"
        """Whether it is a CUDA device (events, allocator statistics)."""
        self.clock = "cuda-events" if self.cuda else clock
        """How time is measured: ``cuda-events``, ``wall`` or ``process``."""
        self.context_bytes = 0
        """CUDA: memory held outside torch's allocator (context, other processes); 0 on the CPU."""
        self.method = "cuda-reserved+context" if self.cuda else "vmhwm"
        """How peak memory is measured (``cuda-reserved+context``, ``vmhwm``, ``ru_maxrss``)."""
        if self.cuda:
            free, total = torch.cuda.mem_get_info(self.device)
            self.context_bytes = max(0, total - free - torch.cuda.memory_reserved(self.device))

    def timer(self, fn: Callable[[], Any]) -> float:
        """Seconds of one call of ``fn`` by this device's clock."""
        if self.cuda:
            return cuda_timer(fn)
        return process_timer(fn) if self.clock == "process" else wall_timer(fn)

    def now(self) -> float:
        """The clock of one-off timings (the optimizer step, the prefill)."""
        return time.process_time() if self.clock == "process" else time.perf_counter()

    def sync(self) -> None:
        """Wait for the device's queued work (CUDA); nothing on the CPU."""
        if self.cuda:
            import torch

            torch.cuda.synchronize(self.device)

    def reset_peak(self) -> None:
        """Start a new peak-memory window."""
        if self.cuda:
            import torch

            torch.cuda.reset_peak_memory_stats(self.device)
        elif not reset_peak_rss():
            self.method = "ru_maxrss"

    @property
    def tracks_heap(self) -> bool:
        """Whether this CPU process fixed glibc's heap to track memory (the probe child): its timed repeats then
        run on glibc's steady heap (:func:`~microbatch.measure.hostmem.steady_heap`), after the step whose peak is
        read."""
        return not self.cuda and tracking_heap() is not None

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
        """Give freed memory back: ``gc``, then the CUDA cache or glibc's heap (inside
        :func:`gc_frozen`, what the collection leaves is frozen)."""
        gc.collect()
        if _frozen_depth[0]:
            gc.freeze()
        if self.cuda:
            import torch

            torch.cuda.empty_cache()
        else:
            malloc_trim()
            replug()  # the probe child: large tensors mapped afresh after what the heap freed


def exit_past_teardown(code: int = 0) -> NoReturn:
    """End this process now that its work is done and written, skipping the interpreter's teardown.

    Native threads that torch's gloo (and its pipelining runtime) leave behind can abort a process at
    shutdown ("terminate called without an active exception", exit −6) after a successful run, which
    torchrun would report as a failure: flush and leave with ``code``.
    """
    import os
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def steady_timing(
    dev: Device, memory_phase: Callable[[], Any], timed: Callable[[], _T]
) -> tuple[_T, tuple[int, int | None] | None, str | None]:
    """``timed()``, the peak memory where it is read before it (else None: read after, over the timing), and the
    heap it was timed on (``steady``, ``tracking``; None outside the probe child).

    In the probe child (``Device.tracks_heap``), whose heap maps each large tensor afresh to track memory,
    ``memory_phase()`` runs untimed on that heap and sets the peak; ``timed()`` then runs on glibc's steady heap
    (:func:`~microbatch.measure.hostmem.steady_heap`), as the user's process runs (mapping and faulting in each tensor every step
    made the tiny model's CPU micro-step 1.7× and gpt2's optimizer step 1.8× longer). If that heap's slack
    does not fit under the memory limit (an allocation refused: the CPU allocator's ``RuntimeError`` there,
    :func:`is_out_of_memory`), ``timed()`` runs again on the tracking heap, where the memory phase fitted.
    """
    if not dev.tracks_heap:
        return timed(), None, None
    memory_phase()
    peak = dev.peak()
    ooms = oom_types()  # resolved before: nothing lazy may run at the limit
    try:
        with steady_heap() as steady:
            return timed(), peak, "steady" if steady else "tracking"
    except Exception as e:  # noqa: BLE001 - out of memory by meaning (a CPU allocation is a RuntimeError)
        if not is_out_of_memory(e, ooms):
            raise
        # leaving this clause releases the failed attempt's frames, and their tensors
    dev.free()  # and holds the heap's freed chunks, so the retry maps afresh
    return timed(), peak, "tracking"


LAUNCH_JOIN_TIMEOUT_S = 300.0
"""How long a process started with ``WORLD_SIZE`` > 1 in its environment waits for the other ranks (as ``pipeline``'s
default ``--timeout``): a shell that kept torchrun's or SLURM's variables made ``bench-gpu`` wait in torch's store
for its 30 minutes, deaf to Ctrl-C (a review: killed with SIGKILL after 15 minutes)."""


def launch_env(env: Any = None) -> tuple[int, int, str] | None:
    """(rank, world size, "MASTER_ADDR:MASTER_PORT") of an outside launch (torchrun) read from ``env`` (the process's
    own by default), None where ``WORLD_SIZE`` is unset or 1; ConfigError naming the variable, its value and the fix
    where they cannot describe one (torch raised a traceback, or waited, on ``WORLD_SIZE=8`` alone, ``RANK=abc``,
    ``MASTER_PORT=99999``, ``RANK=5 WORLD_SIZE=2``)."""
    import os

    from microbatch.errors import ConfigError

    env = os.environ if env is None else env
    fix = "launch it with torchrun, or unset WORLD_SIZE and RANK to run alone"
    raw = env.get("WORLD_SIZE", "1").strip()
    if not (raw.isascii() and raw.isdigit()) or int(raw) < 1:  # "²" is a digit to isdigit, not to int
        raise ConfigError(f"WORLD_SIZE={raw!r} in the environment is not a whole number >= 1; {fix}")
    world = int(raw)
    if world == 1:
        return None
    values = {}
    for name in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        if not env.get(name, "").strip():
            raise ConfigError(f"WORLD_SIZE={world} is set but {name} is not: no launch to join; {fix}")
        values[name] = env[name].strip()
    rank, port = values["RANK"], values["MASTER_PORT"]
    if not (rank.isascii() and rank.isdigit()) or int(rank) >= world:
        raise ConfigError(f"RANK={rank!r} must be a whole number below WORLD_SIZE={world}; {fix}")
    if not (port.isascii() and port.isdigit()) or not 1 <= int(port) <= 65535:
        raise ConfigError(f"MASTER_PORT={port!r} must be a port number from 1 to 65535; {fix}")
    return int(rank), world, f"{values['MASTER_ADDR']}:{port}"


def init_group_interruptibly(backend: str, timeout_s: float = LAUNCH_JOIN_TIMEOUT_S) -> None:
    """``torch.distributed.init_process_group(backend)`` from the environment, waiting at most ``timeout_s`` for the
    other ranks, run in a helper thread so that Ctrl-C and SIGTERM reach this one (torch's store retries in C++,
    where no Python signal handler runs). Its error is raised here; a wait that ends by the timeout as
    ``TimeoutError``."""
    import datetime
    import threading

    import torch.distributed

    done: list[BaseException | None] = []
    # the caller's CUDA device, which is per thread: NCCL's group is made for the device the caller set
    cuda = (
        torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None  # type: ignore[no-untyped-call]
    )

    def join() -> None:
        try:
            if cuda is not None:
                torch.cuda.set_device(cuda)
            torch.distributed.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
            done.append(None)
        except BaseException as e:  # handed to the caller's thread
            done.append(e)

    worker = threading.Thread(target=join, name="microbatch-join", daemon=True)
    worker.start()
    while worker.is_alive():
        worker.join(0.2)  # short waits: a KeyboardInterrupt lands between them
    if done and done[0] is not None:
        raise done[0]
