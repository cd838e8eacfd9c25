"""Gradient noise scale: estimators, smoothing, the accumulate hook, a problem with a known answer, CLI."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from microbatch.errors import ConfigError
from microbatch.run.accumulate import accumulate, batch_rows, grad_sq_norm, split
from microbatch.run.noise import GradientNoiseScale, b_simple, g_sq_estimate, trace_sigma_estimate
from microbatch.run.noise_measure import NoiseInterrupted, measure_noise_scale

# -- the estimators (McCandlish et al. 2018, appendix A.1) ---------------------------------------


@pytest.mark.parametrize(
    "g_sq,trace,b_small,b_big", [(1.0, 17.0, 8, 64), (0.3, 500.0, 1, 3), (2.0, 0.0, 5, 7)]
)
def test_estimators_invert_the_expectation(g_sq, trace, b_small, b_big):
    """Plug in E|G_B|² = |G|² + tr(Σ)/B at two sizes: the estimators give back |G|² and tr(Σ)."""
    small, big = g_sq + trace / b_small, g_sq + trace / b_big
    kw = dict(b_small=b_small, g_small_sq=small, b_big=b_big, g_big_sq=big)
    assert g_sq_estimate(**kw) == pytest.approx(g_sq, rel=1e-12, abs=1e-12)
    assert trace_sigma_estimate(**kw) == pytest.approx(trace, rel=1e-12, abs=1e-12)
    assert b_simple(trace_sigma=trace, g_sq=g_sq) == pytest.approx(trace / g_sq)


def test_estimator_errors_and_unresolved_gradient():
    with pytest.raises(ConfigError, match=r"0 < b_small < b_big"):
        g_sq_estimate(b_small=8, g_small_sq=1.0, b_big=8, g_big_sq=1.0)
    assert b_simple(trace_sigma=5.0, g_sq=-0.1) == math.inf
    with pytest.raises(ConfigError, match=r"decay 1.5 is outside \[0, 1\]"):
        GradientNoiseScale(decay=1.5)


def test_smoothing_divides_after_averaging():
    hook = GradientNoiseScale(decay=1.0)
    hook.add_estimates(g_sq=1.0, trace_sigma=10.0)
    est = hook.add_estimates(g_sq=3.0, trace_sigma=10.0)
    assert est.g_sq == 2.0 and est.trace_sigma == 10.0
    assert est.b_simple == 5.0  # 10/2, not mean(10/1, 10/3) = 6.67
    assert est.steps == 2 and est.last_g_sq == 3.0


def test_ema_weights_recent_steps_and_is_bias_corrected():
    hook = GradientNoiseScale(decay=0.5)
    est = hook.add_estimates(g_sq=4.0, trace_sigma=8.0)
    assert est.g_sq == 4.0  # bias-corrected: no pull toward 0 at the first step
    est = hook.add_estimates(g_sq=1.0, trace_sigma=8.0)
    assert est.g_sq == pytest.approx((0.5 * 4.0 + 1.0) / 1.5)
    assert GradientNoiseScale().estimate is None and GradientNoiseScale().b_simple is None


# -- a problem whose noise scale is known ------------------------------------------------------
#
# Linear regression, x ~ N(0, I_d), y = w*·x + σ·ε, loss per item ½(w·x − y)². With δ = w − w*,
# the per-item gradient is (δ·x − σε)·x, so G = δ and (Isserlis) E[g gᵀ] = (|δ|² + σ²)I + 2δδᵀ:
# Σ = (|δ|² + σ²)I + δδᵀ, tr(Σ) = d(|δ|² + σ²) + |δ|², B_simple = tr(Σ)/|δ|².

D = 8


def regression_problem(sigma: float, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w_star = torch.randn(D, generator=g, dtype=torch.float64)
    delta = torch.randn(D, generator=g, dtype=torch.float64)
    delta = delta / delta.norm()  # |δ| = 1
    model = nn.Linear(D, 1, bias=False).double()
    with torch.no_grad():
        model.weight.copy_((w_star + delta).view(1, D))
    d2 = float(delta @ delta)
    true_b = (D * (d2 + sigma**2) + d2) / d2
    return model, w_star, true_b, g


def make_batches(w_star, sigma, g, steps, rows, items_per_row=1):
    for _ in range(steps):
        x = torch.randn(rows, items_per_row, D, generator=g, dtype=torch.float64)
        y = x @ w_star + sigma * torch.randn(rows, items_per_row, generator=g, dtype=torch.float64)
        yield (x, y)


def reg_loss(model, mb):
    x, y = mb
    r = model(x).squeeze(-1) - y
    return 0.5 * (r**2).sum(), y.numel()


@pytest.mark.parametrize("sigma", [1.0, 3.0])
def test_known_noise_scale_within_10_percent_closed_form_gradients(sigma):
    """The estimators and the smoothing on 5000 steps of exact per-item gradients (vectorised)."""
    model, w_star, true_b, g = regression_problem(sigma, seed=1)
    delta = model.weight.detach().view(D) - w_star
    steps, b_small, b_big = 5000, 8, 64
    x = torch.randn(steps, b_big, D, generator=g, dtype=torch.float64)
    r = x @ delta - sigma * torch.randn(steps, b_big, generator=g, dtype=torch.float64)
    per_item = r.unsqueeze(-1) * x
    g_small = per_item[:, :b_small].mean(1).pow(2).sum(-1)
    g_big = per_item.mean(1).pow(2).sum(-1)
    hook = GradientNoiseScale(decay=1.0)
    for s_sq, b_sq in zip(g_small.tolist(), g_big.tolist(), strict=True):
        hook.update(b_small=b_small, g_small_sq=s_sq, b_big=b_big, g_big_sq=b_sq)
    est = hook.estimate
    assert est.b_simple == pytest.approx(true_b, rel=0.10), (est, true_b)
    assert est.g_sq == pytest.approx(1.0, rel=0.10)
    assert est.trace_sigma == pytest.approx(true_b, rel=0.10)


@pytest.mark.parametrize("items_per_row", [1, 4])
def test_known_noise_scale_within_10_percent_through_accumulate(items_per_row):
    """End to end: accumulate's hook on the model, B counted in items whatever the rows hold."""
    model, w_star, true_b, g = regression_problem(1.0, seed=1)
    final, history = measure_noise_scale(
        model,
        make_batches(w_star, 1.0, g, steps=1000, rows=64 // items_per_row, items_per_row=items_per_row),
        reg_loss,
        micro_batch_size=8 // items_per_row,
        count_fn=lambda mb: mb[1].numel(),
    )
    assert len(history) == 1000
    assert final.b_simple == pytest.approx(true_b, rel=0.10), (final, true_b)
    assert final.g_sq == pytest.approx(1.0, rel=0.10)


def test_one_step_estimate_is_far_noisier_than_the_smoothed_one():
    """Why we smooth: a single step's ratio is often far off (so the 10% test above can fail)."""
    model, w_star, true_b, g = regression_problem(1.0)
    _, history = measure_noise_scale(
        model, make_batches(w_star, 1.0, g, 40, 64), reg_loss, micro_batch_size=8
    )
    single = [h.last_trace_sigma / h.last_g_sq if h.last_g_sq > 0 else math.inf for h in history]
    assert max(abs(b - true_b) / true_b for b in single) > 0.10


# -- the hook inside accumulate -------------------------------------------------------------------


def test_a_step_of_one_micro_batch_is_counted_skipped_and_said_once():
    """One micro-batch gives one batch size: the hook learned nothing and said nothing (``estimate`` stayed None, and
    the README's ``hook.estimate.b_simple`` raised AttributeError). It counts the step as skipped and warns once."""
    model, w_star, _, g = regression_problem(1.0)
    hook = GradientNoiseScale()
    batches = make_batches(w_star, 1.0, g, 3, rows=8)
    with pytest.warns(UserWarning, match="B_simple needs two") as caught:
        for batch in batches:
            accumulate(model, batch, reg_loss, micro_batch_size=8, noise=hook)
    assert len(caught) == 1 and hook.skipped == 3 and hook.steps == 0 and hook.estimate is None
    accumulate(model, next(make_batches(w_star, 1.0, g, 1, rows=8)), reg_loss, micro_batch_size=4, noise=hook)
    assert hook.steps == 1 and hook.skipped == 3 and hook.estimate is not None  # two batch sizes: counted


@pytest.mark.parametrize("with_count", [False, True])
@pytest.mark.parametrize("pre_existing", [False, True])
def test_hook_averages_every_micro_batch_against_the_whole_batch(with_count, pre_existing):
    """Each micro-batch (6, 6, 6 and 2 rows of 20) pairs with the whole batch; the step's estimate is the mean of the
    four pairs' unbiased estimates (it used the first micro-batch alone: the other three were measured and lost)."""
    model, w_star, _, g = regression_problem(1.0)
    batch = next(make_batches(w_star, 1.0, g, 1, rows=20))
    # reference: every gradient computed separately, by hand
    mbs = split(batch, 6)
    grads = []
    for part in (*mbs, batch):
        model.zero_grad(set_to_none=True)
        loss_sum, n = reg_loss(model, part)
        (loss_sum / n).backward()
        grads.append(grad_sq_norm(model.parameters()))
    pairs = [
        dict(b_small=batch_rows(mb), g_small_sq=sq, b_big=20, g_big_sq=grads[-1])
        for mb, sq in zip(mbs, grads, strict=False)
    ]
    assert [p["b_small"] for p in pairs] == [6, 6, 6, 2]
    expect = GradientNoiseScale(decay=1.0)
    expect.add_estimates(
        g_sq=sum(g_sq_estimate(**p) for p in pairs) / 4,
        trace_sigma=sum(trace_sigma_estimate(**p) for p in pairs) / 4,
    )
    first = GradientNoiseScale().update(**pairs[0])
    assert abs(first.trace_sigma / expect.estimate.trace_sigma - 1) > 1e-3  # the first alone differs
    expect = expect.estimate

    model.zero_grad(set_to_none=True)
    if pre_existing:
        model.weight.grad = torch.full_like(model.weight, 5.0)
    hook = GradientNoiseScale()
    accumulate(
        model,
        batch,
        reg_loss,
        micro_batch_size=6,
        count_fn=(lambda mb: mb[1].numel()) if with_count else None,
        noise=hook,
    )
    assert hook.estimate.g_sq == pytest.approx(expect.g_sq, rel=1e-10)
    assert hook.estimate.trace_sigma == pytest.approx(expect.trace_sigma, rel=1e-10)


def test_measure_needs_two_micro_batches():
    model, w_star, _, g = regression_problem(1.0)
    with pytest.raises(
        ConfigError, match=r"all 2 batch\(es\) held at most micro_batch_size 8 rows, one micro-batch"
    ):
        measure_noise_scale(model, make_batches(w_star, 1.0, g, 2, rows=8), reg_loss, micro_batch_size=8)


def test_ctrl_c_keeps_the_steps_measured():
    """A KeyboardInterrupt in step 4 raises NoiseInterrupted holding steps 1-3, equal to a run of 3 steps."""
    model, w_star, _, g = regression_problem(1.0)
    data = list(make_batches(w_star, 1.0, g, 4, rows=32))
    seen: list[int] = []

    def loss(m, mb):
        if len(seen) == 3:  # in the 4th step, before its gradient norms are taken
            raise KeyboardInterrupt
        return reg_loss(m, mb)

    with pytest.raises(NoiseInterrupted) as e:
        measure_noise_scale(
            model, iter(data), loss, micro_batch_size=8, on_step=lambda est: seen.append(est.steps)
        )
    assert isinstance(e.value, KeyboardInterrupt) and seen == [1, 2, 3]
    assert [h.steps for h in e.value.history] == [1, 2, 3] and e.value.final == e.value.history[-1]
    model2, _, _, _ = regression_problem(1.0)
    whole, _ = measure_noise_scale(model2, iter(data[:3]), reg_loss, micro_batch_size=8)
    assert e.value.final.g_sq == pytest.approx(whole.g_sq, rel=1e-12)
    assert e.value.final.trace_sigma == pytest.approx(whole.trace_sigma, rel=1e-12)


def test_ctrl_c_before_a_step_finished_keeps_nothing():
    model, w_star, _, g = regression_problem(1.0)

    def batches():
        raise KeyboardInterrupt
        yield  # pragma: no cover

    with pytest.raises(NoiseInterrupted) as e:
        measure_noise_scale(model, batches(), reg_loss, micro_batch_size=8)
    assert e.value.final is None and e.value.history == []


# -- the CLI ---------------------------------------------------------------------------------------


def test_cli_json_values():
    from microbatch.cli import group

    res = CliRunner().invoke(
        group,
        [
            "noise",
            "--model",
            "tiny",
            "--seq",
            "8",
            "--global-batch",
            "6",
            "--micro-batch",
            "2",
            "--steps",
            "2",
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)  # progress goes to stderr, one line per measured step
    assert [x for x in res.stderr.splitlines() if x.startswith("noise: step")][-1].startswith(
        "noise: step 2/2"
    )
    assert out["steps"] == 2 and len(out["per_step"]) == 2
    assert out["tokens_per_sequence"] == 7
    assert out["g_sq"] == pytest.approx(sum(p["g_sq"] for p in out["per_step"]) / 2)
    assert out["trace_sigma"] == pytest.approx(sum(p["trace_sigma"] for p in out["per_step"]) / 2)
    if out["b_simple_tokens"] is not None:
        assert out["b_simple_tokens"] == pytest.approx(out["trace_sigma"] / out["g_sq"])
        assert out["b_simple_sequences"] == pytest.approx(out["b_simple_tokens"] / 7)
    assert "random" in out["data"]


def test_cli_bad_input_exit_2():
    from microbatch.cli import main

    assert main(["noise", "--global-batch", "4", "--micro-batch", "4", "--steps", "1"]) == 2
    assert main(["noise", "--steps", "0"]) == 2
    assert main(["noise", "--model", "llama-2-7b"]) == 2  # too big to build for a CPU demonstration


# -- the seam: the arithmetic needs no torch ------------------------------------------------------


def test_the_arithmetic_imports_no_torch():
    """noise.py is pure maths (no import of accumulate or torch); the control shows the probe sees torch."""

    def torch_loaded(module: str) -> bool:
        code = f"import sys, {module}; print('torch' in sys.modules)"
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
        )
        return out.stdout.strip() == "True"

    assert not torch_loaded("microbatch.run.noise")
    assert torch_loaded("microbatch.run.noise_measure")


def test_b_simple_standard_error_by_hand_and_against_its_own_scatter():
    """The delta method on the ratio of the means: with |G|² constant it is tr(Σ)'s standard error over its mean; on
    correlated synthetic steps it matches the spread of the ratio over 4,000 repeats within 10%."""
    import random

    from microbatch.run.noise import b_simple_rel_se

    ts = [10.0, 12.0, 8.0, 11.0, 9.0]
    mean = sum(ts) / 5
    se = (sum((t - mean) ** 2 for t in ts) / 4 / 5) ** 0.5
    assert b_simple_rel_se([(2.0, t) for t in ts]) == pytest.approx(se / mean, rel=1e-12)
    assert b_simple_rel_se([(2.0, 10.0)]) is None and b_simple_rel_se([(-1.0, 1.0), (-2.0, 1.0)]) is None
    rng = random.Random(3)

    def steps(n: int) -> list[tuple[float, float]]:
        out = []
        for _ in range(n):
            z = rng.gauss(0, 1)
            out.append((1.0 + 0.2 * z + 0.1 * rng.gauss(0, 1), 50.0 - 6.0 * z + 4.0 * rng.gauss(0, 1)))
        return out

    ratios = []
    for _ in range(4000):
        s = steps(20)
        ratios.append(sum(t for _, t in s) / sum(g for g, _ in s))
    m = sum(ratios) / len(ratios)
    spread = (sum((r - m) ** 2 for r in ratios) / (len(ratios) - 1)) ** 0.5 / m
    predicted = sum(b_simple_rel_se(steps(20)) or 0.0 for _ in range(400)) / 400
    assert predicted == pytest.approx(spread, rel=0.10)


# -- each micro-batch's gradient read by hooks (microbatch.run.accumulate.grad_hooks) -----------------------------


class TiedThroughCheckpoint(nn.Module):
    """A weight used inside a reentrant checkpoint and outside it: its gradient reaches the leaf in two pieces."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.a = nn.Parameter(torch.randn(4, 4, generator=g, dtype=torch.float64))
        self.w = nn.Parameter(torch.randn(4, 4, generator=g, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = checkpoint(lambda t: torch.tanh(t @ self.w), x @ self.a, use_reentrant=True)
        return h @ self.w.T


def tied_loss(model, mb):
    x, y = mb
    return (model(x) - y).pow(2).sum(), x.shape[0]


def test_hooks_read_each_micro_batchs_own_gradient_and_refuse_one_in_pieces():
    from microbatch.run.accumulate.grad_hooks import MicroBatchNorms, settled

    model, w_star, _, g = regression_problem(1.0)
    x, y = next(make_batches(w_star, 1.0, g, 1, rows=8))
    params = list(model.parameters())
    model.zero_grad(set_to_none=True)
    with MicroBatchNorms(params) as norms:
        with norms.arming():
            reg_loss(model, (x[:3], y[:3]))[0].backward()
        first = norms.take()
        assert isinstance(first, list) and all(
            isinstance(t, torch.Tensor) for t in first
        )  # not read back yet
        first = settled(first)
        reg_loss(model, (x[:3], y[:3]))[0].backward()  # not armed: not counted
        assert norms.take() == []
        model.zero_grad(set_to_none=True)
        with norms.arming():
            reg_loss(model, (x[3:], y[3:]))[0].backward()
        second = settled(norms.take())
        assert norms.take() == []  # nothing since
    model.zero_grad(set_to_none=True)
    reg_loss(model, (x[3:], y[3:]))[0].backward()  # the second micro-batch's gradient alone
    assert second == pytest.approx(grad_sq_norm(params), rel=1e-12) and first != pytest.approx(second)
    assert all(not p._backward_hooks for p in params)  # removed on exit

    tied = TiedThroughCheckpoint()
    with MicroBatchNorms(list(tied.parameters())) as norms, norms.arming():
        tied_loss(tied, (torch.randn(2, 4, dtype=torch.float64), torch.zeros(2, 4, dtype=torch.float64)))[
            0
        ].backward()
        assert norms.take() is None  # w's hook ran twice: Σ|piece|² is not |Σ pieces|²


def test_a_gradient_in_pieces_falls_back_to_the_first_micro_batch():
    """Where the hooks cannot read a micro-batch, the step uses the first micro-batch's .grad, as before the hooks."""
    g = torch.Generator().manual_seed(5)
    x, y = (
        torch.randn(12, 4, generator=g, dtype=torch.float64),
        torch.randn(12, 4, generator=g, dtype=torch.float64),
    )
    sq = []
    for part in ((x[:4], y[:4]), (x, y)):
        model = TiedThroughCheckpoint()
        loss_sum, n = tied_loss(model, part)
        (loss_sum / n).backward()
        sq.append(grad_sq_norm(model.parameters()))
    expect = GradientNoiseScale().update(b_small=4, g_small_sq=sq[0], b_big=12, g_big_sq=sq[1])
    hook = GradientNoiseScale()
    accumulate(TiedThroughCheckpoint(), (x, y), tied_loss, micro_batch_size=4, noise=hook)
    assert hook.steps == 1
    assert hook.estimate.g_sq == pytest.approx(expect.g_sq, rel=1e-10)
    assert hook.estimate.trace_sigma == pytest.approx(expect.trace_sigma, rel=1e-10)


def test_cli_says_a_long_step_is_running(monkeypatch, capsys):
    """One line a step: a step of many micro-batches (-B 1000 -b 1: 29 s on a small CPU) said nothing until it
    ended; now a line every HEARTBEAT_S while it runs."""
    from microbatch.cli import main
    from microbatch.commands import _heartbeat

    monkeypatch.setattr(_heartbeat, "HEARTBEAT_S", 0.004)  # far below the step's ~0.1 s on an idle core
    assert main(["noise", "--model", "tiny", "--seq", "16", "-B", "96", "-b", "1", "--steps", "1"]) == 0
    assert "noise: measuring step 1/1 (96 micro-batches of 1) [" in capsys.readouterr().err


def test_a_gradient_the_loss_function_takes_itself_is_not_a_micro_batchs():
    """A loss with a gradient penalty (``torch.autograd.grad`` of a parameter inside loss_fn) passed the same hooks:
    the readings came out 19.52, 34.17, 14.98 against 17.71, 32.07, 13.38 (a helper's run). Only the micro-batch's
    own backward is read now."""
    from microbatch.run.noise import g_sq_estimate, trace_sigma_estimate

    def penalised(model, mb):
        loss_sum, n = reg_loss(model, mb)
        (side,) = torch.autograd.grad(loss_sum, model.weight, retain_graph=True)  # a side gradient, not kept
        return loss_sum + 0.0 * side.sum(), n

    model, w_star, _, g = regression_problem(1.0)
    batch = next(make_batches(w_star, 1.0, g, 1, rows=12))
    sq = []
    for part in (*split(batch, 4), batch):
        model.zero_grad(set_to_none=True)
        loss_sum, n = reg_loss(model, part)
        (loss_sum / n).backward()
        sq.append(grad_sq_norm(model.parameters()))
    pairs = [dict(b_small=4, g_small_sq=s, b_big=12, g_big_sq=sq[-1]) for s in sq[:3]]
    model.zero_grad(set_to_none=True)
    hook = GradientNoiseScale(decay=1.0)
    accumulate(model, batch, penalised, micro_batch_size=4, noise=hook)
    assert hook.estimate.g_sq == pytest.approx(sum(g_sq_estimate(**p) for p in pairs) / 3, rel=1e-9)
    assert hook.estimate.trace_sigma == pytest.approx(
        sum(trace_sigma_estimate(**p) for p in pairs) / 3, rel=1e-9
    )


def test_a_half_precision_gradient_is_read_without_a_float64_copy():
    """vector_norm(dtype=float64) copied every gradient to float64 at the backward's peak (4x a bf16 one); the norm is
    taken in float32 and summed in float64, within bf16's own rounding of the hand value."""
    from microbatch.run.accumulate.grad_hooks import MicroBatchNorms, settled

    w = nn.Parameter(torch.randn(64, 64, dtype=torch.bfloat16))
    seen = []
    real = torch.linalg.vector_norm
    with MicroBatchNorms([w]) as norms, norms.arming():
        torch.linalg.vector_norm = lambda x, *a, **k: (
            seen.append((x.dtype, k.get("dtype"))),
            real(x, *a, **k),
        )[1]
        try:
            (w.float() ** 2).sum().backward()
        finally:
            torch.linalg.vector_norm = real
        got = settled(norms.take())
    assert seen == [(torch.bfloat16, torch.float32)]
    assert got == pytest.approx(float((2 * w.detach().double()).pow(2).sum()), rel=1e-2)
