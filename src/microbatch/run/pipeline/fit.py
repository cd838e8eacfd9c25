"""Will a local pipeline run fit this machine: its memory, and its deadline? Predicted before any process starts.

:func:`predicted_host_bytes`: the host memory of p ranks on one machine (the model built on every rank, the
gradients and Adam moments of its stages and the step's temporaries, the reference model with ``check_gradients``,
each process's interpreter and libraries, forked or new, the batch, the in-flight activations and the receive
buffers). :func:`min_run_s`: a lower bound of the run's time, so that a run that cannot finish before its deadline
is refused rather than killed. What each term counts and why: ``docs/pipeline-fit.md``.
"""

from __future__ import annotations

import functools
from typing import Any

from microbatch.errors import ConfigError, MicrobatchError, PipelineError
from microbatch.hardware import usable_cores
from microbatch.measure.hostmem import available_host_bytes
from microbatch.run.pipeline.config import FACTORY_SEQ, PipelineConfig
from microbatch.run.pipeline.host_terms import (
    ADAM_TEMPORARIES,
    largest_param,
    process_bytes,
    rank_largest,
    rank_params,
)
from microbatch.run.pipeline.resolved import ResolvedRun
from microbatch.units import format_bytes, format_count

__all__ = [
    "ATTENTION_PROBE_SEQ",
    "MAX_SEED",
    "MAX_TIMEOUT_S",
    "MIN_TIMEOUT_S",
    "check_factory_forward",
    "check_seed",
    "check_timeout",
    "attention_flops",
    "attention_flops_per_s",
    "available_host_bytes",
    "check_duration",
    "check_fits",
    "gemm_flops_per_s",
    "min_run_s",
    "predicted_host_bytes",
]

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_TOKEN_BYTES = 8  # torch.randint's int64 token ids
_BATCH_ARRAYS = 5  # the example inputs and targets + a step's drawn tokens and its two shifted copies

_STATE_TERMS = ("model_copies", "gradients_and_adam", "step_temporaries", "reference_model")
_LABELS = {
    "batch": "token ids of the batch on every rank",
    "activations": "activations in flight",
    "receive_buffers": "per-micro-batch receive buffers",
    "model_copies": "the model built on every rank",
    "gradients_and_adam": "gradients and Adam",
    "step_temporaries": "the optimizer step's temporaries",
    "reference_model": "reference model",
    "processes": "the processes",
}


def predicted_host_bytes(
    run: ResolvedRun, params: int, shape: Any = None, largest: int = 0
) -> dict[str, float]:
    """Bytes the p local ranks hold together on the host for a model of ``params`` parameters, by
    term (see the module's docstring) and ``total``. ``shape``: the built-in model's
    :class:`~microbatch.model.ModelShape` (activations and receive buffers are counted only with it);
    the sequence length is ``cfg.seq``, else the shape's, else a factory model's :data:`FACTORY_SEQ`; ``largest``: a
    factory's largest parameter tensor (:func:`largest_param`)."""
    cfg = run.cfg
    e = _DTYPE_BYTES[cfg.dtype]
    p = cfg.stages
    host = cfg.backend == "gloo"  # with nccl, gradients, optimizer and activations live on the GPUs
    seq = _seq(cfg, shape)
    held = rank_params(run, shape) or [params]  # unknown split: the model once over the ranks, as before
    biggest = rank_largest(run, shape) or [largest_param(shape, largest or params)] * p
    out = {
        "model_copies": float(p * params * e),
        "gradients_and_adam": float(3 * sum(held) * e) if host else 0.0,
        "step_temporaries": float(ADAM_TEMPORARIES * sum(biggest) * e) if host else 0.0,
        "reference_model": float(2 * p * params * e) if cfg.check_gradients and host else 0.0,
        "batch": float(p * _BATCH_ARRAYS * cfg.batch * (seq + 1) * _TOKEN_BYTES),
        "activations": _activation_bytes(run, shape, seq) if host and shape is not None else 0.0,
        "receive_buffers": _receive_bytes(run, shape, seq) if host and shape is not None else 0.0,
        "processes": float(p * process_bytes(cfg.backend)),
    }
    out["total"] = sum(out.values())
    return out


def _seq(cfg: PipelineConfig, shape: Any) -> int:
    """Tokens per sequence of the run: ``cfg.seq``, else the built-in shape's, else :data:`FACTORY_SEQ`."""
    return cfg.seq or (shape.seq if shape is not None else FACTORY_SEQ)


def _activation_bytes(run: ResolvedRun, shape: Any, seq: int) -> float:
    """Activations the ranks hold together at their peaks (the module's docstring)."""
    from microbatch.predict.activations import (
        blocks_activation_bytes,
        embedding_activation_bytes,
        output_activation_bytes,
    )

    cfg, rule = run.cfg, run.rule
    p, m, v = cfg.stages, cfg.microbatches, cfg.virtual
    if rule is not None and rule.in_flight is not None:
        chunks = sum(rule.in_flight(r, p, m, v) for r in range(p))
    else:
        chunks = p * v
    e, b = _DTYPE_BYTES[cfg.dtype], cfg.micro_batch
    one = (
        blocks_activation_bytes(shape, b, 0, shape.layers, seq=seq, dtype_bytes=e)
        + embedding_activation_bytes(shape, b, seq=seq)
        + output_activation_bytes(shape, b, seq=seq, dtype_bytes=e)
    )  # one micro-batch through the whole model
    return float(one * chunks / (p * v))


def _receive_bytes(run: ResolvedRun, shape: Any, seq: int) -> float:
    """torch's receive buffers: an activation and a gradient per micro-batch per link between ranks."""
    cfg, placement = run.cfg, run.placement
    links = sum(1 for s in range(1, len(placement)) if placement[s] != placement[s - 1])
    boundary = cfg.micro_batch * seq * shape.hidden * _DTYPE_BYTES[cfg.dtype]
    return float(2 * links * cfg.microbatches * boundary)


MIN_TIMEOUT_S = 10.0
"""Shortest ``--timeout`` a local run takes. It is the process group's timeout, so the ranks' rendezvous
must fit in it: every rank imports torch before it connects (1.2 s measured on this 2-core VM, idle,
2026-12-03), and a host loaded 8 processes deep on 2 cores runs each about 4 times slower. ``--timeout
0.001`` failed at the connect ("client socket has timed out after 1ms") after the ranks had started;
1 s worked for tiny p = 2 on the idle VM, so this minimum keeps a margin of about 8 over an idle start."""

MAX_TIMEOUT_S = 1e6
"""Longest ``--timeout`` (11.6 days): far past any local run, and inside what torch's process group
takes (a ``datetime.timedelta``, at most 999,999,999 days; milliseconds in a 64-bit count); 1e300
overflowed there on every rank."""


def check_timeout(cfg: PipelineConfig) -> None:
    """Refuse, before anything starts, a ``timeout_s`` the ranks cannot start up in (under
    :data:`MIN_TIMEOUT_S`) or torch cannot hold (over :data:`MAX_TIMEOUT_S`)."""
    t = cfg.timeout_s
    if t < MIN_TIMEOUT_S:
        raise ConfigError(
            f"timeout_s {t:g} is too short for the ranks to start: it is the process group's timeout, and "
            f"every rank imports torch and connects within it; give timeout_s {MIN_TIMEOUT_S:g} or more "
            "(the command's default is 300, the library's 120)",
            params=("timeout_s",),
        )
    if t > MAX_TIMEOUT_S:
        raise ConfigError(
            f"timeout_s {t:.15g} is over the limit of {MAX_TIMEOUT_S:,.0f} s (11.6 days) that torch's process group "
            f"can hold; give timeout_s {MAX_TIMEOUT_S:.0f} or less",
            params=("timeout_s",),
        )


MAX_SEED = 2**32 - 1
"""Largest ``--seed``: the ranks seed torch with it and each step's batch generator with
1,000,003·(seed + 1) + step, which torch holds in 64 bits (a seed of 10^20 overflowed in every rank
after they had started); 2^32 − 1 is the usual range of a seed (NumPy's legacy seeds)."""


def check_seed(cfg: PipelineConfig) -> None:
    """Refuse a seed outside 0 .. :data:`MAX_SEED` before the ranks start."""
    if not 0 <= cfg.seed <= MAX_SEED:
        raise ConfigError(
            f"seed {cfg.seed} is outside 0 .. {MAX_SEED:,} (2^32 − 1): the ranks derive 64-bit generator seeds "
            f"from it; give seed between 0 and {MAX_SEED}",
            params=("seed",),
        )


def check_factory_forward(cfg: PipelineConfig) -> None:
    """Run a ``module:function`` model's layers once, in order, on one micro-batch of token ids
    (b_m × s), in this process before any rank starts: on the meta device (shapes only, no memory, no
    time) when the factory builds there, else for real. Refuses, naming the layer, its output and the
    fix, a layer that raises on its predecessor's output (layers that do not chain), a layer whose
    output is not one tensor (a tuple: torch's pipelining passes one tensor between stages), and a last
    layer whose output is not logits (b_m, s, ≥ vocab) that the loss reads. Cached per factory and
    micro-batch shape. Built-in models: nothing to check."""
    if ":" not in cfg.model:
        return
    from microbatch.run.pipeline.split import load_factory

    _forward_once(cfg.model, load_factory(cfg.model), cfg.micro_batch, cfg.seq or FACTORY_SEQ)


@functools.lru_cache(maxsize=16)
def _forward_once(spec: str, factory: Any, batch: int, seq: int) -> None:
    import torch

    from microbatch.run.pipeline.chain_check import check_forward_is_chain, check_position_tables
    from microbatch.run.pipeline.split import model_units, token_embedding, working_folder_first

    def build(meta: bool) -> Any:
        with torch.random.fork_rng(devices=[]), working_folder_first():
            if meta:
                with torch.device("meta"):
                    return factory()
            return factory()

    try:
        model, device = build(meta=True), "meta"
    except PipelineError:  # the deadline (in_launcher), not a factory that cannot build on meta
        raise
    except Exception:  # noqa: BLE001 - it cannot build there: build it for real, as the ranks do
        model, device = build(meta=False), "cpu"
    emb = token_embedding(model)  # inspect_factory checked there is one
    units = model_units(model)
    x: Any = torch.zeros((batch, seq), dtype=torch.long, device=device)
    tokens = x
    check_position_tables(spec, units, seq, emb)
    with torch.no_grad():
        for i, unit in enumerate(units):
            where = f"model factory {spec}: layer {i} ({type(unit).__name__})"
            got = "the token ids" if i == 0 else f"layer {i - 1}'s output"
            try:
                y = unit(x)
            except MicrobatchError:  # the deadline's (in_launcher), not the layer's fault
                raise
            except Exception as e:  # noqa: BLE001 - the user's layer: any failure is named
                if device == "meta" and (isinstance(e, NotImplementedError) or "meta" in str(e).lower()):
                    return  # it needs data (nonzero, .item(): a MoE router): only the ranks can run it; not a fault
                fix = (
                    "each layer must take the previous layer's output (the first the token ids (b, s)): make "
                    "consecutive layers' sizes match, or, where a layer holds a table of positions (rotary, "
                    f"learned), give seq no longer than that table (seq is {seq} here)"
                    if type(e)
                    in (RuntimeError, IndexError, AssertionError)  # torch's words for sizes that differ
                    else "if it is not a mismatch of sizes (the previous layer's output feeds it), fix the layer: "
                    "its forward runs once here, on one micro-batch, before any rank starts"
                )
                raise ConfigError(
                    f"{where} fails on {got}, a tensor of shape {tuple(x.shape)} ({_one_line(e)}); {fix}",
                    params=("seq",),
                ) from None
            if not isinstance(y, torch.Tensor):
                raise ConfigError(
                    f"{where} returns a {type(y).__name__}, not one tensor; pipelining passes one tensor "
                    "between stages: wrap the layer so it returns the tensor the next layer takes (e.g. out[0])"
                )
            x = y
    shape, vocab = tuple(x.shape), int(emb.num_embeddings)
    if len(shape) < 2 or shape[:2] != (batch, seq) or shape[-1] < vocab:
        raise ConfigError(
            f"model factory {spec}: the last layer returns shape {shape} for token ids ({batch}, {seq}); the "
            f"loss needs logits ({batch}, {seq}, {vocab}), one score per token of the vocabulary "
            f"(nn.Embedding's {vocab}): end the model with a layer such as nn.Linear(hidden, {vocab})"
        )
    check_forward_is_chain(spec, model, units, tokens)


def _one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"


def check_fits(
    run: ResolvedRun,
    *,
    available: int | None = None,
    flops_per_s: float | None = None,
    deadline_s: float | None = None,
) -> dict[str, float]:
    """Refuse, before any process starts, a run whose predicted host memory
    (:func:`predicted_host_bytes`) exceeds the host's available memory, then one that cannot finish
    before its deadline (:func:`check_duration`); return the memory prediction.

    A ``module:function`` model is built once here on the meta device
    (:func:`microbatch.run.pipeline.split.inspect_factory`) for its parameter count; its activations
    are unknown and not counted. ``flops_per_s``: the rate :func:`check_duration` assumes (default:
    measured)."""
    cfg = run.cfg
    check_timeout(cfg)
    check_seed(cfg)
    from microbatch.run.pipeline.stage_profile import in_launcher

    with in_launcher(run, "checking the model's layers on one micro-batch", deadline_s, "fix the model"):
        check_factory_forward(cfg)  # the model's layers chain, on one micro-batch: before any process
    shape = run.shape
    if shape is None:
        from microbatch.run.pipeline.split import inspect_factory

        info = inspect_factory(cfg.model)
        params, largest, what = info.params, info.largest, f"model factory {cfg.model}"
    else:
        params, largest, what = shape.param_count(), 0, f"model {cfg.model}"
    pred = predicted_host_bytes(run, params, shape, largest)
    avail = available_host_bytes() if available is None else available
    # a factory under nccl may build straight on its GPU: its host share is not known, so not refused
    unknown_host = ":" in cfg.model and cfg.backend != "gloo"
    if avail is not None and pred["total"] > avail and not unknown_host:
        one = _DTYPE_BYTES[cfg.dtype] * params
        seq = _seq(cfg, shape)
        terms = sorted(((k, v) for k, v in pred.items() if k != "total" and v > 0), key=lambda kv: -kv[1])
        grows = sum(v for k, v in pred.items() if k in ("batch", "activations", "receive_buffers"))
        state = sum(v for k, v in pred.items() if k in _STATE_TERMS)
        named: tuple[str, ...] = ()
        if grows >= state:
            named = ("microbatches", "global_batch", "seq")
            fix = (
                "use fewer micro-batches (microbatches), a smaller global_batch or a shorter seq: the "
                "batch, the activations and the receive buffers grow with m·b_m·s"
            )
        else:
            fix = (
                "use a smaller model (the built-in tiny or small) or run one rank per machine under torchrun"
            )
        raise ConfigError(
            f"{what} ({format_count(params)} parameters, {format_bytes(one)} in {cfg.dtype}) on {cfg.stages} "
            f"local ranks with m = {cfg.microbatches}, b_m = {cfg.micro_batch}, s = {seq} needs about "
            f"{format_bytes(pred['total'])} of host memory ("
            + ", ".join(f"{_LABELS[k]} {format_bytes(v)}" for k, v in terms)
            + f") but {format_bytes(avail)} is available; {fix}",
            params=named,
        )
    check_duration(run, flops_per_s=flops_per_s, deadline_s=deadline_s)
    return pred


def gemm_flops_per_s(n: int = 384, repeats: int = 5) -> float:
    """This machine's single-thread fp32 matrix-product rate: the best of ``repeats`` timed n×n
    products (2·n³ FLOPs each; about 20 ms in all on a laptop core). An upper bound on what a rank's
    one thread computes, so times derived from it are lower bounds."""
    import time

    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):  # the caller's random stream left as it was
            a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b  # warm-up
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return 2.0 * n**3 / max(best, 1e-9)


ATTENTION_PROBE_SEQ = 8192
"""Longest sequence :func:`attention_flops_per_s` times (one head). Causal attention's rate on a CPU grows
with s towards a plateau: forward and backward at head size 16 on one core of the 2-core dev VM ran
66, 76, 82 and 84 GFLOP/s (full-matrix count) at s = 2,048, 4,096, 8,192 and 16,384 (2026-12-04), so at
this length the rate is within a few percent of a longer sequence's; one repeat at head size 128 is
1e11 FLOPs, about a second, spent only by runs that long."""


def attention_flops_per_s(head_dim: int, seq: int, repeats: int = 2) -> float:
    """This machine's single-thread rate of causal attention (``F.scaled_dot_product_attention``, forward
    and backward), in the FLOPs :func:`microbatch.predict.roofline.model_flops_per_step` counts for it
    (the full s×s matrix: 3 × 4·n²·d per head): one head of ``head_dim`` at n = min(``seq``,
    :data:`ATTENTION_PROBE_SEQ`), the best of ``repeats``. Much under the matrix-product rate of
    :func:`gemm_flops_per_s` (a quarter to two thirds of it on the dev VM), which is why a long sequence's
    attention is timed at this rate, not at that one."""
    import time

    import torch
    import torch.nn.functional as F

    n, d = max(16, min(int(seq), ATTENTION_PROBE_SEQ)), max(1, int(head_dim))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            q, k, v = (torch.randn(1, 1, n, d, requires_grad=True) for _ in range(3))
        best = float("inf")
        for _ in range(repeats + 1):  # the first warms up
            t0 = time.perf_counter()
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            torch.autograd.backward(y, torch.ones_like(y))
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return 12.0 * n * n * d / max(best, 1e-9)


def attention_flops(run: ResolvedRun) -> float:
    """FLOPs of the run's steps in attention's s² work (QKᵀ and ·V, forward and backward), in
    :func:`microbatch.predict.roofline.model_flops_per_step`'s count: steps × 3 × L × 2·B·s·span·(qk + v)."""
    from microbatch.predict.attention_core import attention_span
    from microbatch.predict.experts import attention_widths

    cfg, shape = run.cfg, run.shape
    if shape is None:
        return 0.0
    qk, v = attention_widths(shape)
    rows = cfg.batch * shape.seq
    return cfg.steps * 3.0 * shape.layers * 2.0 * rows * attention_span(shape, shape.seq) * (qk + v)


def min_run_s(
    run: ResolvedRun, flops_per_s: float, attention_per_s: float | None = None
) -> tuple[float, float, int] | None:
    """A lower bound on the run's compute seconds: (seconds, FLOPs, cores) for a built-in model on the
    CPU, None otherwise, over min(p, usable cores) cores: half the steps' matrix-product FLOPs
    (:func:`microbatch.predict.roofline.model_flops_per_step` less :func:`attention_flops`) at
    ``flops_per_s`` each, plus the attention's s² FLOPs at ``attention_per_s`` (default ``flops_per_s``):
    attention runs far slower than a matrix product, and at s = 100,000 on tiny it is almost all the
    work (a step took about 800 s where the matrix-product rate alone bounded it at 149 s)."""
    cfg, shape = run.cfg, run.shape
    if shape is None or cfg.backend != "gloo":
        return None
    from microbatch.predict.roofline import model_flops_per_step

    flops = cfg.steps * model_flops_per_step(shape, cfg.batch, shape.seq)
    attention = min(flops, attention_flops(run))
    cores = max(1, min(cfg.stages, usable_cores()))
    rate = attention_per_s or flops_per_s
    return ((flops - attention) / 2 / flops_per_s + attention / rate) / cores, flops, cores


def check_duration(
    run: ResolvedRun,
    *,
    flops_per_s: float | None = None,
    deadline_s: float | None = None,
    attention_per_s: float | None = None,
) -> None:
    """Refuse a run whose compute alone (:func:`min_run_s`) would pass its deadline (``deadline_s``,
    default ``--timeout`` plus the launcher's start-up allowance): it would be killed there, after
    that long, with nothing. Rates not given are measured (:func:`gemm_flops_per_s`,
    :func:`attention_flops_per_s`); with ``flops_per_s`` given alone, attention is taken at it too."""
    cfg, shape = run.cfg, run.shape
    if shape is None or cfg.backend != "gloo":
        return
    if flops_per_s is None:
        flops_per_s = gemm_flops_per_s()
        attention_per_s = attention_per_s or attention_flops_per_s(shape.head_dim, shape.seq)
    rate = attention_per_s or flops_per_s
    est = min_run_s(run, flops_per_s, rate)
    if est is None:
        return
    seconds, flops, cores = est
    deadline, why = cfg.deadline(deadline_s)
    if seconds > deadline:
        raise ConfigError(
            f"{cfg.steps} step(s) of model {cfg.model} (B = {cfg.batch}, s = {shape.seq}) are "
            f"{flops:.3g} FLOPs: at least {seconds:.3g} s on {cores} cores at the measured {flops_per_s / 1e9:.3g} "
            f"GFLOP/s each ({rate / 1e9:.3g} GFLOP/s for attention's {attention_flops(run):.3g} FLOPs), past the "
            f"deadline of {deadline:.0f} s ({why or 'given'}); lower steps, seq or global_batch, or raise "
            f"timeout_s well above {_round_up(seconds)} s",
            params=("steps", "seq", "global_batch", "timeout_s"),
        )


def _round_up(x: float) -> int:
    """``x`` rounded up to two significant digits (a --timeout to suggest)."""
    import math

    if x <= 0:
        return 1
    scale = 10 ** max(0, math.floor(math.log10(x)) - 1)
    return int(math.ceil(x / scale) * scale)
