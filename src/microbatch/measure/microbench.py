"""Kernel microbenchmark of the current device: the measured terms a calibration gives the planner.

Times, on the current device, what the step-time model (:mod:`microbatch.predict.roofline`) charges:

- the layer GEMMs of a model shape (QKV, projection, the MLP's two, the output layer) at rows b_m·s for
  a few b_m, and a small grid of M, N, K so the GEMM efficiency curve can be read between them;
- causal attention (``torch.nn.functional.scaled_dot_product_attention``, forward) at a few sequence
  lengths with the model's heads and head dimension, b·s held at the tokens of the largest b_m;
- streaming kernels (copy, add, GeLU, LayerNorm, softmax, dropout) over a large tensor, and one AdamW step;
- the host's floor per eager kernel launch, bare and as a real layer's forward and backward pays it per kernel;
- on an NVIDIA GPU, the board's power limit and the SM clock it holds under a long square GEMM, read from the
  driver while the GEMM runs (:mod:`microbatch.measure.board`);
- all-reduce and all-gather over the initialised ``torch.distributed`` process group (skipped, and
  said, when none is), and a GEMM alone against the same GEMM while an all-reduce runs beside it: the
  slowdown of computation under an overlapped collective
  (:data:`microbatch.predict.collectives.OVERLAP_COMPUTE_SLOWDOWN` is the cited default).

Clock: CUDA events after warm-up on a GPU; on the CPU the calling thread's CPU clock
(``time.thread_time``) with torch at one thread (as ``tune`` probes a small CPU: steady where other work
shares the cores). Each figure is the median of its repeats; every item stops repeating after its share
of ``budget_s``, and items past the budget are skipped and named (``MicrobenchResult.notes``). A Ctrl-C
returns what was measured (``complete=False``). The record is :mod:`microbatch.microbench_record`;
:mod:`microbatch.predict.kernel_calibration` turns it into the planner's kernel terms.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from microbatch.errors import ConfigError
from microbatch.hardware import ACCELERATORS, Accelerator, match_accelerator
from microbatch.measure.board import BoardReading, clock_under_load, read_board
from microbatch.measure.microbench_config import Bench, MicrobenchConfig, cpu_clock, frac, peak, settled_rate
from microbatch.measure.microbench_shapes import attention_seqs, grid_gemm_shapes, layer_gemm_shapes
from microbatch.microbench_record import (
    ADAMW_RECORDED_BYTES,
    AttentionTiming,
    CollectiveTiming,
    GemmTiming,
    MicrobenchResult,
    StreamTiming,
)

__all__ = [
    "MicrobenchConfig",
    "MicrobenchResult",
    "layer_gemm_shapes",
    "grid_gemm_shapes",
    "attention_seqs",
    "run_microbench",
    "join_launched_group",
]


def _gemms(b: Bench, shapes: list[tuple[str, int, int, int]], dtype: Any, out: list[GemmTiming]) -> None:
    torch, dev = b.torch, b.cfg.device
    top = peak(b.acc, b.cfg.resolved_dtype)
    for i, (label, m, k, n) in enumerate(shapes):
        if b.past_budget(2.0 * m * k * n, f"GEMM {label} {m}×{k}×{n}"):
            continue
        x = torch.randn(m, k, device=dev, dtype=dtype)
        w = torch.randn(k, n, device=dev, dtype=dtype)
        s = b.time_s(partial(torch.matmul, x, w), 0.5 * b.left_s() / max(1, len(shapes) - i), soak=True)
        if s is None:
            b.skipped.append(f"GEMM {label} {m}×{k}×{n}")
            continue
        fl = 2.0 * m * k * n / s
        out.append(
            GemmTiming(
                label=label, rows=m, k=k, n=n, seconds=s, flops_per_s=fl, fraction_of_peak=frac(fl, top)
            )
        )


def _attention(b: Bench, dtype: Any, out: list[AttentionTiming]) -> None:
    torch, dev, sh = b.torch, b.cfg.device, b.cfg.shape
    top = peak(b.acc, b.cfg.resolved_dtype)
    tokens = max(b.cfg.micro_batches) * sh.seq
    seqs = attention_seqs(sh.seq, b.cfg.quick)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for i, s_len in enumerate(seqs):
        batch = max(1, tokens // s_len)
        if b.past_budget(2.0 * batch * sh.heads * s_len * s_len * sh.head_dim, f"attention s={s_len}"):
            continue
        q, k, v = (
            torch.randn(batch, sh.heads, s_len, sh.head_dim, device=dev, dtype=dtype) for _ in range(3)
        )
        s = b.time_s(partial(sdpa, q, k, v, is_causal=True), 0.3 * b.left_s() / (len(seqs) - i), soak=True)
        if s is None:
            b.skipped.append(f"attention s={s_len}")
            continue
        fl = 4.0 * batch * sh.heads * s_len * s_len * sh.head_dim / 2  # causal: half the blocks
        out.append(
            AttentionTiming(seq=s_len, heads=sh.heads, head_dim=sh.head_dim, batch=batch, seconds=s,
                            flops_per_s=fl / s, fraction_of_peak=frac(fl / s, top))
        )  # fmt: skip


def _stream(b: Bench, dtype: Any, out: list[StreamTiming]) -> None:
    torch, dev = b.torch, b.cfg.device
    n_el = (4 if b.cfg.quick else 64) * 2**20
    width = 1024
    x = torch.randn(n_el, device=dev, dtype=dtype)
    y = torch.randn(n_el, device=dev, dtype=dtype)
    xl = x.view(-1, width)
    e = x.element_size()
    bw = b.acc.memory_bandwidth_bytes_per_s if b.acc is not None else None
    ln = torch.nn.functional.layer_norm
    kernels = (
        ("copy", lambda: y.copy_(x), 2 * n_el * e),
        ("add", lambda: torch.add(x, y), 3 * n_el * e),
        ("gelu", lambda: torch.nn.functional.gelu(x), 2 * n_el * e),
        ("layernorm", lambda: ln(xl, (width,)), 2 * n_el * e),
        ("softmax", lambda: torch.softmax(xl, dim=-1), 2 * n_el * e),
        ("dropout", lambda: torch.nn.functional.dropout(x, 0.1, training=True), 3 * n_el * e),
        ("adamw", _adamw_step(torch, dev, n_el // 4), ADAMW_RECORDED_BYTES * (n_el // 4)),
    )
    for i, (name, fn, nbytes) in enumerate(kernels):
        s = b.time_s(fn, 0.5 * b.left_s() / (len(kernels) - i))
        if s is None:
            b.skipped.append(f"stream {name}")
            continue
        out.append(StreamTiming(kernel=name, nbytes=nbytes, seconds=s, bytes_per_s=nbytes / s,
                                fraction_of_bandwidth=frac(nbytes / s, bw)))  # fmt: skip


def _adamw_step(torch: Any, dev: str, numel: int) -> Callable[[], Any]:
    """One ``torch.optim.AdamW`` step (foreach) over ``numel`` fp32 parameters: 16 B read and 12 B written each
    (parameter, gradient, two moments; the gradient is not written)."""
    prm = torch.nn.Parameter(torch.zeros(numel, device=dev))
    prm.grad = torch.randn(numel, device=dev)
    return torch.optim.AdamW([prm], lr=1e-4, foreach=True).step  # type: ignore[no-any-return]


def _settle(b: Bench, dtype: Any) -> None:
    """Untimed matmuls for 50 ms (0.2 s on a GPU) before the first item: thread pools, clocks and the
    allocator settle, so the first GEMM timed is not the process's first."""
    torch = b.torch
    a = torch.randn(256, 256, device=b.cfg.device, dtype=dtype)
    t0 = time.perf_counter()
    t_end, n = t0 + (0.2 if b.cuda else 0.05), 0
    while time.perf_counter() < t_end:
        a @ a
        n += 1
    if b.cuda:
        torch.cuda.synchronize()
    # the rate a skip is judged at: on the CPU the warm-up's own (its small matmuls run near the large ones'
    # rate there); a GPU's small matmuls wait on launches, so its datasheet peak (unknown board: no skip)
    cpu_rate = n * 2.0 * 256**3 / max(time.perf_counter() - t0, 1e-9)
    b.warm_rate = (peak(b.acc, b.cfg.resolved_dtype) if b.cuda else cpu_rate) or None


def _launch_s(b: Bench) -> float | None:
    """Wall seconds per tiny eager kernel: 2,000 in-place adds on a one-element tensor."""
    if b.left_s() <= 0:
        b.skipped.append("launch floor")
        return None
    torch = b.torch
    one = torch.ones(1, device=b.cfg.device)
    for _ in range(100):
        one.add_(1.0)
    if b.cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(2000):
        one.add_(1.0)
    if b.cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / 2000


LAYER_PROBE_WIDTH = 64
"""The eager layer whose forward and backward :func:`_layer_host_s` times: the model's kind (norm, MLP, positions,
biases, grouped K/V) at 64 wide, 2 heads, 8 tokens: its device work is microseconds, its time the host's."""


def _layer_host_s(b: Bench, dtype: Any) -> float | None:
    """Seconds per kernel the planner counts (:func:`microbatch.predict.launch.layer_kernels`: the forward's, and
    twice that for the backward) of one eager layer of the model's kind run forward and backward
    (:data:`LAYER_PROBE_WIDTH`; under autocast to ``dtype`` with fp32 weights where ``dtype`` is half, as ``tune``'s
    mixed precision runs): Python, the dispatcher, autograd and autocast's casts together, what a small model or
    micro-batch waits on. The layer has no dropout (the built-in block applies none) and no experts."""
    from contextlib import nullcontext
    from dataclasses import replace

    from microbatch.layer_kernels import layer_kernels
    from microbatch.measure.gpt import Block

    torch, s = b.torch, b.cfg.shape
    if b.left_s() <= 0:
        b.skipped.append("layer launch floor")
        return None
    w = LAYER_PROBE_WIDTH
    small = replace(s, hidden=w, heads=2, seq=8, layers=1, kv_heads=min(s.kv, 2) if s.kv_heads else None,
                    head_size=None, ffn_hidden=(2 if s.gated_mlp else 4) * w, dropout=False, moe=None, mla=None,
                    sliding_window=None, sliding_layers=None)  # fmt: skip
    block = Block(small).to(b.cfg.device)
    x = torch.randn(1, small.seq, small.hidden, device=b.cfg.device, requires_grad=True)
    half = dtype != torch.float32
    device_type = "cuda" if b.cuda else "cpu"

    def step() -> None:
        with torch.enable_grad():  # the benchmark runs under no_grad
            with torch.autocast(device_type, dtype=dtype) if half else nullcontext():
                y = block(x)
            y.float().sum().backward()

    t = b.time_s(step, share_s=0.02 * b.cfg.budget_s)
    n = layer_kernels(small, flash=True, tensor_parallel=1, fused=False)
    return t / (3 * n) if t else None


def _collectives(b: Bench, dtype: Any, out: list[CollectiveTiming], notes: list[str]) -> float | None:
    """All-reduce and all-gather over the initialised process group, then the GEMM slowdown beside an
    all-reduce (:func:`_overlap_slowdown`, returned); a note when there is no group."""
    from microbatch.measure.device import distributed

    dist = distributed()
    if dist is None:
        notes.append("no torch.distributed process group is initialised: collectives not measured")
        return None
    torch, n = b.torch, dist.get_world_size()
    if n < 2:
        notes.append("the process group has one rank: collectives not measured")
        return None
    go = torch.tensor([1.0 if b.left_s() > 0 else 0.0], device=b.cfg.device)  # NCCL reduces device tensors
    dist.all_reduce(go, op=dist.ReduceOp.MIN)  # every rank measures the collectives, or none does
    if go.item() == 0.0:
        b.skipped.append("collectives")
        return None
    numel = (2 if b.cfg.quick else 64) * 2**20 // 2
    x = torch.randn(numel, device=b.cfg.device, dtype=dtype)
    parts = [torch.empty(numel // n, device=b.cfg.device, dtype=dtype) for _ in range(n)]
    link = b.acc.intra_node_bytes_per_s if b.acc is not None else None
    nbytes = numel * x.element_size()
    for op, fn, factor in (
        ("all_reduce", lambda: dist.all_reduce(x), 2.0 * (n - 1) / n),
        ("all_gather", lambda: dist.all_gather(parts, parts[0]), (n - 1) / n),
    ):
        s = b.time_s(fn, None)  # a fixed count of calls on every rank (time limits would differ between them)
        if s is None:  # never with a fixed count: for the type checker
            continue
        bus = factor * nbytes / s
        out.append(CollectiveTiming(op=op, nbytes=nbytes, world_size=n, seconds=s, bus_bytes_per_s=bus,
                                    fraction_of_link=frac(bus, link)))  # fmt: skip
    reduce_s = next((c.seconds for c in out if c.op == "all_reduce"), None)
    slowdown = _overlap_slowdown(b, dtype, dist, reduce_s)
    if slowdown is None:
        b.skipped.append("GEMM beside an all-reduce")
    return slowdown


def _overlap_slowdown(b: Bench, dtype: Any, dist: Any, allreduce_s: float | None) -> float | None:
    """Median seconds of a GEMM while an all-reduce runs beside it over its seconds alone, minus 1.

    The GEMM is timed alone (:meth:`Bench.time_s`), then each repeat starts an asynchronous all-reduce of a
    buffer sized to outlast the GEMM twice (from the all-reduce just measured, at most 1 GiB) and times the
    GEMM alone on the compute stream (CUDA events; the thread clock on the CPU) before waiting for the
    collective. None past the budget."""
    torch, dev = b.torch, b.cfg.device
    side = (1024 if b.cfg.quick else 4096) if b.cuda else (192 if b.cfg.quick else 384)
    x, w = torch.randn(side, side, device=dev, dtype=dtype), torch.randn(side, side, device=dev, dtype=dtype)
    alone = b.time_s(partial(torch.matmul, x, w), None)
    if alone is None or not allreduce_s:
        return None
    elem = torch.empty((), dtype=dtype).element_size()
    numel = (2 if b.cfg.quick else 64) * 2**20 // 2
    want = torch.tensor(
        [min(2**30 // elem, max(numel, numel * 2.0 * alone / allreduce_s))], device=dev, dtype=torch.float64
    )
    dist.all_reduce(want, op=dist.ReduceOp.MAX)  # one buffer size on every rank (each timed its own GEMM)
    buf = torch.zeros(int(want.item()), device=dev, dtype=dtype)
    times: list[float] = []
    for _ in range(b.cfg.repeats):  # a fixed count: every rank makes the same collective calls
        work = dist.all_reduce(buf, async_op=True)
        if b.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.matmul(x, w)
            end.record()
            work.wait()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            clock = cpu_clock(b.cfg.threads)
            t0 = clock()
            torch.matmul(x, w)
            times.append(clock() - t0)
            work.wait()
    return statistics.median(times) / alone - 1.0


def join_launched_group(device: str) -> tuple[str, int, bool]:
    """Under ``torchrun`` (``WORLD_SIZE`` > 1 in the environment) with no process group yet, initialise one
    from the environment — NCCL on CUDA, each rank on ``cuda:LOCAL_RANK``; gloo on the CPU — so the
    collectives and the GEMM beside an all-reduce are measured. Returns (device, rank, whether this call
    initialised the group: the caller destroys it then)."""
    import os
    import sys

    from microbatch.errors import MeasurementError
    from microbatch.measure.device import (
        LAUNCH_JOIN_TIMEOUT_S,
        distributed,
        init_group_interruptibly,
        launch_env,
    )

    dist = distributed()
    if dist is not None:
        return device, dist.get_rank(), False
    launch = launch_env()  # ConfigError where the variables cannot describe a launch, before any wait
    if launch is None:
        return device, 0, False
    rank, world, where = launch
    import torch.distributed

    cuda = device.startswith("cuda")
    if cuda:
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0') or 0)}"
    if rank == 0:
        print(f"bench-gpu: WORLD_SIZE={world} is set: joining the process group at {where} as rank {rank}, waiting up "
              f"to {LAUNCH_JOIN_TIMEOUT_S:g} s for the others", file=sys.stderr, flush=True)  # fmt: skip
    try:
        init_group_interruptibly("nccl" if cuda else "gloo")
    except Exception as e:  # the store's timeout, a refused connection, an address that does not resolve
        raise MeasurementError(
            f"rank {rank} of {world} could not join the process group at {where} ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:200] if str(e) else 'no message'}); start the other ranks with torchrun, "
            "or unset WORLD_SIZE and RANK to measure this process alone"
        ) from None
    return device, torch.distributed.get_rank(), True


BOARD_SHARE = 0.05
"""Share of the budget (at most 2 s) the board's clock is sampled for, under a square 8,192 GEMM."""


@dataclass(frozen=True)
class _Square:
    """The square GEMM timed in a burst and under load, and the board's reading under that load."""

    board: BoardReading | None = None
    burst: float | None = None
    sustained: float | None = None


def _board(b: Bench, dtype: Any, notes: list[str]) -> _Square:
    """A square 8,192 GEMM (CUDA only): timed first in a burst (warm-up and repeats, as the kernels of the H200
    table were), then back to back for ``min(2 s, BOARD_SHARE × budget)``, each call on CUDA events, the rate of the
    calls in the window's second half kept (:func:`~microbatch.measure.microbench_config.settled_rate`) while a thread reads the driver's power limit
    and SM clock (when ``nvidia-smi`` answers for this GPU); a note for what could not be read."""
    if not b.cuda or b.left_s() <= 0:
        return _Square()
    torch, dev = b.torch, b.cfg.device
    uuid = getattr(torch.cuda.get_device_properties(torch.device(dev)), "uuid", None)
    ident = f"GPU-{uuid}"  # the UUID: CUDA_VISIBLE_DEVICES does not renumber it
    readable = bool(uuid) and read_board(ident) is not None
    if not readable:
        notes.append("the board's power limit and clock were not read (no nvidia-smi answer for this GPU)")
    n, ends, took = 8192, [], []
    try:
        x = torch.randn(n, n, device=dev, dtype=dtype)
        burst_s = b.time_s(partial(torch.matmul, x, x), None)

        def work() -> (
            None
        ):  # each call timed on the device (CUDA events, as the burst), ended on the wall clock
            go, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            go.record()
            torch.matmul(x, x)
            done.record()
            done.synchronize()
            ends.append(time.perf_counter())
            took.append(go.elapsed_time(done) / 1e3)

        seconds, start = min(2.0, BOARD_SHARE * b.cfg.budget_s), time.perf_counter()
        if readable:
            reading = clock_under_load(work, seconds, ident)
        else:
            reading = None
            while time.perf_counter() < start + seconds:
                work()
    except RuntimeError as e:  # torch.OutOfMemoryError among them: an extra, not the benchmark
        notes.append(f"the square GEMM under load was not measured ({type(e).__name__})")
        return _Square()
    if readable and reading is None:
        notes.append("the board's clock under load was not read (too few driver readings)")
    flops = 2.0 * n**3
    return _Square(board=reading, burst=flops / burst_s if burst_s else None,
                   sustained=settled_rate(ends, start, flops, seconds=took))  # fmt: skip


def _device(cfg: MicrobenchConfig, torch: Any) -> tuple[bool, str, Accelerator | None]:
    cuda = cfg.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        raise ConfigError(
            f"device {cfg.device} was asked for but torch sees no CUDA GPU; use device cpu",
            params=("device",),
        )
    name = torch.cuda.get_device_name(torch.device(cfg.device)) if cuda else "cpu"
    key = match_accelerator(name) if cuda else None
    return cuda, name, ACCELERATORS[key] if key else None


def run_microbench(cfg: MicrobenchConfig, on_phase: Callable[[str], None] | None = None) -> MicrobenchResult:
    """Measure the kernels (module docstring) and return the typed result; Ctrl-C returns what was measured.
    ``on_phase``: told the name of each group of kernels as it starts (a command's progress line)."""
    import torch

    say = on_phase or (lambda _: None)

    cuda, name, acc = _device(cfg, torch)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[cfg.resolved_dtype]
    before = torch.get_num_threads()
    if not cuda:
        torch.set_num_threads(cfg.threads)
    if cuda:
        torch.cuda.set_device(torch.device(cfg.device))
    b = Bench(cfg=cfg, torch=torch, cuda=cuda, acc=acc)
    gemms: list[GemmTiming] = []
    attn: list[AttentionTiming] = []
    stream: list[StreamTiming] = []
    coll: list[CollectiveTiming] = []
    notes: list[str] = []
    launch: float | None = None
    layer_host: float | None = None
    overlap: float | None = None
    square = _Square()
    complete = True
    layer = [g for bm in cfg.micro_batches for g in layer_gemm_shapes(cfg.shape, bm * cfg.shape.seq)]
    try:
        with torch.no_grad():
            say("settle and the square GEMM")
            _settle(b, dtype)
            square = _board(b, dtype, notes)
            say(f"the layer GEMMs of {cfg.shape.name} at b_m {', '.join(map(str, cfg.micro_batches))}")
            _gemms(b, layer, dtype, gemms)
            say("attention")
            _attention(b, dtype, attn)
            say("streaming kernels and the launch floor")
            _stream(b, dtype, stream)
            launch = _launch_s(b)
            layer_host = _layer_host_s(b, dtype)
            say("the GEMM grid")
            _gemms(b, grid_gemm_shapes(cfg.quick) + list(cfg.extra_gemms), dtype, gemms)
            say("collectives")
            overlap = _collectives(b, dtype, coll, notes)
    except KeyboardInterrupt:
        complete = False
        notes.append("interrupted: the items listed were measured, the rest were not")
    finally:
        torch.set_num_threads(before)
    if b.skipped:
        notes.append(f"past the {cfg.budget_s:g} s budget, not measured: {', '.join(b.skipped)}")
    if b.unsoaked:
        notes.append(
            f"{b.unsoaked} of {b.soaked + b.unsoaked} GEMM and attention kernels were timed without the "
            f"{cfg.resolved_soak_s:g} s soak (the budget): the file counts as timed in bursts (soak_s 0)"
        )
    if acc is None:
        notes.append(f"{name} is not in the accelerator table: no fractions of peak")
    board = square.board
    return MicrobenchResult(
        device="cuda" if cuda else "cpu", device_name=name, accelerator=acc.name if acc else None,
        torch_version=str(torch.__version__), dtype=cfg.resolved_dtype,
        timer="CUDA events" if cuda else (
            "thread CPU clock (time.thread_time), 1 torch thread" if cfg.threads == 1
            else f"wall clock (time.perf_counter), {cfg.threads} torch threads"
        ),
        model=cfg.shape.name, seq=cfg.shape.seq, micro_batches=tuple(cfg.micro_batches), gemms=tuple(gemms),
        attention=tuple(attn), stream=tuple(stream), collectives=tuple(coll), launch_s_per_kernel=launch,
        layer_host_s_per_kernel=layer_host, overlap_slowdown=overlap, seconds_total=time.perf_counter() - b.t_start, complete=complete, notes=tuple(notes),
        power_limit_w=board.power_limit_w if board else None, sm_clock_mhz=board.sm_clock_mhz if board else None,
        max_sm_clock_mhz=board.max_sm_clock_mhz if board else None, soak_s=0.0 if b.unsoaked else cfg.resolved_soak_s,
        burst_square_flops_per_s=square.burst, sustained_square_flops_per_s=square.sustained,
    )  # fmt: skip
