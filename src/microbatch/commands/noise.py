"""``microbatch noise``: measure the gradient noise scale B_simple, a suggestion for B_global."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import click

from microbatch.commands._common import emit, json_option, model_options, progress, resolve_model
from microbatch.show.answers import render_noise

if TYPE_CHECKING:
    import torch

    from microbatch.run.noise import NoiseEstimate
    from microbatch.shape import ModelShape

__all__ = ["cmd", "MAX_PARAMS", "predicted_bytes"]

MAX_PARAMS = 500_000_000
"""Largest model this CPU demonstration builds (fp32 weights, gradients and a copy: about 6 GB)."""


def predicted_bytes(shape: Any, global_batch: int, micro_batch: int) -> dict[str, float]:
    """What the demonstration holds at its peak, by part, before anything is built.

    fp32 weights, gradients and the first micro-batch's gradient copy (12 B/param); the batch of
    token ids and the sampler's buffer of the same size (2 × 8 B per token); the activations of
    one micro-batch at fp32 with plain attention (Korthikanti et al. 2022 per layer, plus the logits,
    :mod:`microbatch.predict.activations`).
    """
    from microbatch.predict.activations import blocks_activation_bytes, output_activation_bytes

    acts = blocks_activation_bytes(
        shape, micro_batch, 0, shape.layers, dtype_bytes=4, flash_attention=False
    ) + output_activation_bytes(shape, micro_batch, dtype_bytes=4)
    return {
        "model_state": 12.0 * shape.param_count(),
        "tokens": 2.0 * 8 * global_batch * shape.seq,
        "activations": float(acts),
    }


def _check_memory(shape: Any, global_batch: int, micro_batch: int) -> None:
    """ConfigError, before the model is built, when the run is predicted not to fit 80% of the host's
    available memory (the same limit ``tune`` puts on its probes)."""
    from microbatch.choose.tune.probing import cpu_default_limit
    from microbatch.errors import ConfigError
    from microbatch.units import format_bytes

    limit = cpu_default_limit()
    parts = predicted_bytes(shape, global_batch, micro_batch)
    need = sum(parts.values())
    if limit is not None and need > limit:
        big = max(parts, key=lambda k: parts[k])
        fix = {
            "tokens": "lower --global-batch (the token ids of one step are held at once)",
            "activations": "lower --micro-batch or --seq",
            "model_state": "use a smaller model",
        }[big]
        raise ConfigError(
            f"noise on {shape.name} (seq {shape.seq}, B_global {global_batch}, b_m {micro_batch}) needs about "
            f"{format_bytes(need, unit='GiB')} ("
            + ", ".join(f"{k.replace('_', ' ')} {format_bytes(v, unit='GiB')}" for k, v in parts.items())
            + f"), over 80% of the available memory, {format_bytes(limit, unit='GiB')}; {fix}"
        )


@click.command("noise")
@model_options
@click.option(
    "--global-batch", "-B", type=int, default=32, show_default=True, help="B_global: sequences per step."
)
@click.option(
    "--micro-batch", "-b", type=int, default=4, show_default=True, help="b_m: sequences per micro-batch."
)
@click.option("--steps", type=int, default=10, show_default=True, help="Steps (fresh random batch each).")
@click.option(
    "--decay", type=float, default=1.0, show_default=True, help="EMA weight of the past; 1 = plain mean."
)
@click.option(
    "--seed", type=click.IntRange(0, 2**32 - 1), default=0, show_default=True,
    help="Seed of the weights and the data, 0 to 2^32 − 1.",
)  # fmt: skip
@json_option
def cmd(
    model_spec: dict[str, Any],
    global_batch: int,
    micro_batch: int,
    steps: int,
    decay: float,
    seed: int,
    as_json: bool,
) -> None:
    """Estimate the gradient noise scale B_simple = tr(Σ)/|G|² (McCandlish et al. 2018).

    \b
    Runs the built-in GPT on the CPU at initialisation, on RANDOM tokens drawn from a Zipf
    unigram distribution: the number is the noise scale of that random data, a demonstration.
    For your model and data use the Python hook:
        hook = microbatch.run.noise.GradientNoiseScale()
        microbatch.accumulate(model, batch, loss_fn, micro_batch_size=b, noise=hook)
    Each step compares every micro-batch's gradient with the whole batch's (read in the same
    backward, no copy); |G|² and tr(Σ) are smoothed separately, then divided.
    Example: microbatch noise --model tiny --seq 32 --global-batch 32 --micro-batch 4 --steps 10
    (default model: tiny; any registry name, --hf-config or shape flags work, up to 500M parameters).
    """
    shape = _checked_shape(model_spec, global_batch, micro_batch, steps)
    _check_memory(shape, global_batch, micro_batch)
    # torch is imported after the checks: bad input is refused before torch's import
    from microbatch.measure.gpt import build_model
    from microbatch.run.noise_measure import NoiseInterrupted, measure_noise_scale

    model = build_model(shape, seed=seed)
    s = shape.seq
    batches, loss_fn = _random_tokens(shape, global_batch, steps, seed)
    t0 = time.perf_counter()

    from microbatch.commands._heartbeat import Heartbeat

    g = -(-global_batch // micro_batch)  # micro-batches a step
    beat = Heartbeat(  # a step of many micro-batches runs minutes: said while it runs, not only when it ends
        f"noise: measuring step 1/{steps} ({g:,} micro-batches of {micro_batch})",
        f"noise: measuring the next step ({g:,} micro-batches)",
    )

    def on_step(est: NoiseEstimate) -> None:  # one line per step on stderr, a terminal or not
        beat.news()
        b = f"{est.b_simple:,.0f} tokens" if math.isfinite(est.b_simple) else "not resolved yet"
        progress(f"noise: step {est.steps}/{steps} measured, B_simple {b} [{time.perf_counter() - t0:.1f} s]")

    setting = {"model": shape.name, "seq": s, "global_batch": global_batch, "micro_batch": micro_batch}
    try:
        with beat:
            final, history = measure_noise_scale(
                model,
                batches,
                loss_fn,
                micro_batch_size=micro_batch,
                count_fn=lambda tokens: tokens.shape[0] * (s - 1),
                decay=decay,
                on_step=on_step,
            )
    except NoiseInterrupted as e:  # Ctrl-C: the steps measured are kept and printed, exit 130
        result = _result(setting, decay, e.final, e.history, steps_asked=steps)
        emit(result, as_json, lambda: render_noise(result, steps="--steps"))
        progress(f"interrupted: kept the {len(e.history)} step(s) measured of {steps}")
        raise click.exceptions.Exit(130) from None
    result = _result(setting, decay, final, history)
    emit(result, as_json, lambda: render_noise(result, steps="--steps"))


def _checked_shape(model_spec: dict[str, Any], global_batch: int, micro_batch: int, steps: int) -> ModelShape:
    """The model's shape, with every setting checked before torch is imported."""
    from microbatch.errors import ConfigError, check_positive_int

    check_positive_int("--global-batch", global_batch)
    check_positive_int("--micro-batch", micro_batch)
    check_positive_int("--steps", steps)
    if micro_batch >= global_batch:
        raise ConfigError(
            f"micro-batch {micro_batch} is not smaller than global batch {global_batch}; the noise scale needs "
            "two batch sizes: "
            + (
                f"use --micro-batch at most {global_batch - 1}"
                if global_batch >= 2
                else f"raise --global-batch to {2 * micro_batch} or more"
            )
        )
    if global_batch % micro_batch:
        divisors = [d for d in range(1, global_batch) if global_batch % d == 0]
        raise ConfigError(
            f"micro-batch {micro_batch} does not divide global batch {global_batch} (the last would hold "
            f"{global_batch % micro_batch}, and the small batch's size is what the estimate divides by); use "
            f"--micro-batch {', '.join(map(str, divisors[-6:]))}"
            + (" or another divisor" if len(divisors) > 6 else "")
        )
    shape = resolve_model(model_spec, default="tiny")
    if shape.param_count() > MAX_PARAMS:
        raise ConfigError(
            f"model {shape.name} at seq {shape.seq} has {shape.param_count():,} parameters, over the {MAX_PARAMS:,} "
            "this CPU demonstration builds; use a smaller model (tiny, small) or a shorter --seq, or the Python "
            "hook on your own hardware"
        )
    if shape.seq < 2:
        raise ConfigError(f"--seq {shape.seq} leaves no next-token target; use --seq 2 or more")
    return shape


def _random_tokens(
    shape: ModelShape, global_batch: int, steps: int, seed: int
) -> tuple[Iterator[torch.Tensor], Callable[[Any, torch.Tensor], tuple[torch.Tensor, int]]]:
    """``steps`` batches of random tokens from a Zipf unigram distribution, and the next-token loss
    (summed, with its count of targets)."""
    import torch

    vocab, s = shape.vocab, shape.seq
    gen = torch.Generator().manual_seed(seed + 1)
    zipf = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64)

    def batches() -> Iterator[torch.Tensor]:
        for _ in range(steps):
            yield torch.multinomial(zipf, global_batch * s, replacement=True, generator=gen).view(
                global_batch, s
            )

    def loss_fn(m: Any, tokens: torch.Tensor) -> tuple[torch.Tensor, int]:
        logits = m(tokens)[:, :-1]
        target = tokens[:, 1:]
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, vocab).float(), target.reshape(-1), reduction="sum"
        )
        return loss, target.numel()

    return batches(), loss_fn


def _result(
    setting: dict[str, Any],
    decay: float,
    final: NoiseEstimate | None,
    history: list[NoiseEstimate],
    steps_asked: int | None = None,
) -> dict[str, Any]:
    """The command's result: ``setting`` (model, seq, B, b_m), the smoothed and per-step estimates;
    with ``steps_asked`` an interrupted run's (``final`` None when no step finished)."""
    from microbatch.run.noise import b_simple_lower, b_simple_rel_se, g_sq_resolved

    pairs = [(h.last_g_sq, h.last_trace_sigma) for h in history]  # each step's (|G|², tr(Σ))
    tokens_per_seq = setting["seq"] - 1
    b_tokens = final.b_simple if final is not None else math.nan
    b_seqs = b_tokens / tokens_per_seq if math.isfinite(b_tokens) else math.inf
    out = {
        **setting,
        "steps": final.steps if final is not None else 0,
        "decay": decay,
        "data": "random tokens, Zipf unigram distribution (a demonstration, not your data)",
        "tokens_per_sequence": tokens_per_seq,
        "g_sq": final.g_sq if final is not None else None,
        "trace_sigma": final.trace_sigma if final is not None else None,
        "b_simple_tokens": b_tokens if final is not None else None,
        "b_simple_sequences": b_seqs if final is not None else None,
        "per_step": [{"g_sq": g, "trace_sigma": t} for g, t in pairs],
        # the scatter of B_simple over the steps (delta method on the ratio of the means)
        "b_simple_rel_se": b_simple_rel_se(pairs, decay),
        # |G|² t's two-sided-97.7% standard errors above 0 (None under MIN_STEPS): else a lower bound at best
        "g_sq_resolved": g_sq_resolved(pairs, decay),
        "b_simple_lower_tokens": b_simple_lower(pairs, decay),
        "source": "McCandlish et al. 2018, arXiv:1812.06162, sec. 2.2 and appendix A.1",
    }
    if steps_asked is not None:
        out.update(interrupted=True, steps_asked=steps_asked)
    return out
