"""An empty micro-batch whose loss_fn returns NaN (a masked mean × its count: 0/0) instead of 0.

Under DDP or FSDP such a micro-batch still runs (every rank runs the same forwards), and on one process
without ``count_fn`` too: its NaN would poison every gradient of the step. :func:`accumulate_micro_batches`
now refuses, on every rank together, with the gradients put back as they were; a non-finite loss where
the micro-batch has items (fp16 overflow, divergence) still passes through for a GradScaler to skip."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _helpers import WORKER_END, WORKER_START, two_rank_results
from test_accumulate import V, flat_grad, make_batch, make_model, set_pre_grads

from microbatch.errors import ConfigError
from microbatch.run.accumulate import accumulate_micro_batches


def mean_times_n(model, mb):
    """The foot-gun: a masked mean times the count, 0/0 = NaN where no label is valid."""
    logits = model(mb["input_ids"])[:, :-1]
    target = mb["labels"][:, 1:]
    n = (target != -100).sum()
    mean = F.cross_entropy(logits.reshape(-1, V), target.reshape(-1), ignore_index=-100, reduction="mean")
    return mean * n, n


def _pieces() -> list[dict[str, torch.Tensor]]:
    batch = make_batch(rows=4)
    empty = {k: v[:2].clone() for k, v in batch.items()}
    empty["labels"][:] = -100
    return [{k: v[2:] for k, v in batch.items()}, empty]


def test_an_empty_micro_batch_with_a_nan_loss_is_refused_and_the_gradients_kept():
    model = make_model()
    before = set_pre_grads(model)
    with pytest.raises(ConfigError, match=r"micro-batch 1 of this rank, which has 0 items") as e:
        accumulate_micro_batches(model, _pieces(), mean_times_n)
    assert "reduction='sum'" in str(e.value)
    after = [p.grad for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))  # put back, not NaN


def test_a_nan_loss_with_items_still_passes_through():
    model = make_model()

    def nan_loss(m, mb):
        loss, n = mean_times_n(m, mb)
        return loss * float("nan"), n

    loss = accumulate_micro_batches(model, _pieces()[:1], nan_loss)
    assert (
        torch.isnan(loss) and torch.isnan(flat_grad(model)).any()
    )  # unchanged behaviour: the scaler's to skip


def masked_sum(model, mb):
    """A correct summed loss (0 over no items while the logits are finite), written as a masked sum."""
    logits = model(mb["input_ids"])[:, :-1]
    target = mb["labels"][:, 1:]
    mask = target != -100
    per = F.cross_entropy(logits.reshape(-1, V), target.clamp(min=0).reshape(-1), reduction="none")
    return (per * mask.reshape(-1)).sum(), mask.sum()


def test_a_diverged_step_with_an_empty_micro_batch_passes_through_for_the_scaler():
    """With non-finite weights a correct masked sum is NaN on the empty micro-batch too (inf × 0): the step has
    non-finite losses where there are items, so it is divergence, not the loss's form, and it passes through."""
    model = make_model()
    assert float(accumulate_micro_batches(model, _pieces(), masked_sum)) > 0  # finite: 0 on the empty one
    with torch.no_grad():
        next(model.parameters()).fill_(float("nan"))
    model.zero_grad()
    loss = accumulate_micro_batches(model, _pieces(), masked_sum)
    assert torch.isnan(loss) and torch.isnan(flat_grad(model)).any()


WORKER = (
    WORKER_START
    + r"""
from test_accumulate import make_model
from test_accumulate_empty import _pieces, mean_times_n
from microbatch.errors import ConfigError
from microbatch.run.accumulate import accumulate_micro_batches

pieces = _pieces()
if rank == 0:  # rank 0's pieces both hold items; only rank 1 has the empty one
    pieces = [pieces[0], pieces[0]]
model = torch.nn.parallel.DistributedDataParallel(make_model())
results = {{}}
try:
    accumulate_micro_batches(model, pieces, mean_times_n)
    results["error"] = "no error"
except ConfigError as e:
    results["error"] = str(e)
results["finite"] = all(p.grad is None or bool(torch.isfinite(p.grad).all()) for p in model.parameters())
"""
    + WORKER_END
)


@pytest.mark.timeout(120)
def test_both_ranks_refuse_when_one_rank_has_the_empty_micro_batch(tmp_path):
    # a rank left waiting in an all_reduce fails here
    res = two_rank_results(WORKER.format(tests=str(Path(__file__).parent)), tmp_path, timeout_s=90)
    assert "a micro-batch of another rank" in res[0]["error"], res[0]["error"]
    assert "micro-batch 1 of this rank, which has 0 items" in res[1]["error"], res[1]["error"]
    assert res[0]["finite"] and res[1]["finite"]


def with_z_loss(model, mb):
    """A masked summed loss plus a term over every row (a z-loss on the logits): a micro-batch with no valid
    label still adds to the gradient."""
    logits = model(mb["input_ids"])[:, :-1]
    target = mb["labels"][:, 1:]
    ce = F.cross_entropy(logits.reshape(-1, V), target.reshape(-1), ignore_index=-100, reduction="sum")
    z = 1e-2 * torch.logsumexp(logits, dim=-1).pow(2).sum()
    return ce + z, (target != -100).sum()


def _labelled(mb):
    return (mb["labels"][:, 1:] != -100).sum()


@pytest.mark.parametrize("loss_fn", [with_z_loss, mean_times_n])
def test_with_count_fn_an_empty_micro_batch_still_runs_its_terms_not_per_item(loss_fn):
    # a fuzzing helper's finding: with count_fn, micro-batches with no items were skipped, and a z-loss or
    # auxiliary loss over their rows was lost (3.4e-2 off, and different after an out-of-memory split); the
    # masked mean × n (NaN there) is still taken as the 0 a sum over no items is
    import torch.nn as nn

    from microbatch.run.accumulate import accumulate

    batch = make_batch(rows=4)
    batch["labels"][:2] = -100  # two rows with no valid label
    grads = []
    for count_fn, size in ((None, 4), (_labelled, 1), (_labelled, 2), (None, 1)):
        model = make_model()
        if loss_fn is mean_times_n and (count_fn is None and size < 4):
            continue  # its NaN on an empty micro-batch is refused without count_fn (the test above)
        accumulate(model, batch, loss_fn, micro_batch_size=size, count_fn=count_fn)
        grads.append(flat_grad(model))
    assert isinstance(make_model(), nn.Module) and len(grads) >= 3
    for g in grads[1:]:
        assert torch.allclose(g, grads[0], rtol=1e-5, atol=1e-7), (g - grads[0]).abs().max()


def where_mean_times_n(model, mb):
    """A guarded masked mean: torch.where's forward is 0 with no valid label, its backward 0/0 = NaN."""
    logits = model(mb["input_ids"])[:, :-1]
    target = mb["labels"][:, 1:]
    n = (target != -100).sum()
    mean = F.cross_entropy(logits.reshape(-1, V), target.reshape(-1), ignore_index=-100, reduction="mean")
    return torch.where(n > 0, mean * n, torch.zeros_like(mean)), n


def test_an_empty_micro_batch_whose_backward_is_not_finite_adds_nothing():
    # a reviewer's finding: running empty micro-batches (for a z-loss's rows) let this loss's NaN backward into
    # every .grad; its gradient is now added only where finite, as the 0 a sum over no items is
    from microbatch.run.accumulate import accumulate

    batch = make_batch(rows=4)
    batch["labels"][:2] = -100
    ref = make_model()
    accumulate(ref, batch, masked_sum, micro_batch_size=4)
    model = make_model()
    accumulate(model, batch, where_mean_times_n, micro_batch_size=1, count_fn=_labelled)
    g = flat_grad(model)
    assert torch.isfinite(g).all() and torch.allclose(g, flat_grad(ref), rtol=1e-5, atol=1e-7)


def test_the_parameter_check_walks_the_graph_once_per_model_and_loss(monkeypatch):
    import microbatch.run.accumulate.scaling as scaling
    from microbatch.run.accumulate import accumulate

    walks = []
    real = scaling.check_params_in_model
    monkeypatch.setattr(scaling, "check_params_in_model", lambda *a: walks.append(1) or real(*a))
    model, batch = make_model(), make_batch(rows=4)
    for _ in range(3):
        accumulate(model, batch, masked_sum, micro_batch_size=2)
    assert len(walks) == 1  # then once more for another loss function
    accumulate(model, batch, with_z_loss, micro_batch_size=2)
    assert len(walks) == 2


def _sum_and_count(model, mb, sign=1):
    logits = model(mb["input_ids"])[:, :-1]
    target = mb["labels"][:, 1:]
    loss = F.cross_entropy(logits.reshape(-1, V), target.reshape(-1), ignore_index=-100, reduction="sum")
    return loss, sign * (target != -100).sum()  # a tensor count, as (labels != -100).sum() gives


@pytest.mark.parametrize("where", ["loss_fn", "count_fn"])
def test_a_negative_tensor_count_is_refused_as_a_negative_number_is(where):
    """A count that is a tensor was summed unchecked (a Python number was refused): a negative one in one
    micro-batch gave a wrong mean silently (a user-loop sweep's finding). Refused, naming the micro-batch, with the
    gradients put back."""
    model = make_model()
    before = set_pre_grads(model)
    pieces = _pieces()[:1] + [{k: v[:2] for k, v in make_batch(rows=4).items()}]

    def loss_fn(m, mb):
        return _sum_and_count(m, mb, sign=-1 if (where == "loss_fn" and mb is pieces[1]) else 1)

    def count_fn(mb):
        return (-1 if mb is pieces[1] else 1) * (mb["labels"][:, 1:] != -100).sum()

    kwargs = {"count_fn": count_fn} if where == "count_fn" else {}
    name = "loss_fn's n_items" if where == "loss_fn" else r"count_fn\(micro_batch\)"
    with pytest.raises(
        ConfigError, match=name + r" must be a finite number >= 0, got -\d+ \(a tensor\) for micro-batch 1"
    ):
        accumulate_micro_batches(model, pieces, loss_fn, **kwargs)
    after = [p.grad for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))


def test_an_empty_micro_batch_on_a_sparse_embedding_adds_its_finite_gradient():
    """A user-loop helper's finding: with count_fn, a micro-batch with no valid label on Embedding(sparse=True) ran
    into torch's NotImplementedError (no sparse isfinite); its rows are checked as a sparse gradient's values."""
    import torch.nn as nn

    from microbatch.run.accumulate import accumulate

    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Embedding(20, 6, sparse=True), nn.Linear(6, 20)).double()

    ids = torch.randint(0, 20, (4, 3), generator=torch.Generator().manual_seed(3))
    labels = ids.clone()
    labels[2:] = -100  # the second micro-batch of 2 rows has no valid label

    def loss_fn(model, mb):
        x, y = mb
        loss = F.cross_entropy(model(x).reshape(-1, 20), y.reshape(-1), ignore_index=-100, reduction="sum")
        return loss, (
            y != -100
        ).sum()  # the embedding's gradient sparse (rows of ids), 0 rows' worth when empty

    got, ref = build(), build()
    accumulate(got, (ids, labels), loss_fn, micro_batch_size=2, count_fn=lambda mb: (mb[1] != -100).sum())
    loss, n = loss_fn(ref, (ids, labels))
    (loss / n).backward()
    for a, b in zip(got.parameters(), ref.parameters(), strict=True):
        a_dense = a.grad.to_dense() if a.grad.is_sparse else a.grad
        b_dense = b.grad.to_dense() if b.grad.is_sparse else b.grad
        assert torch.allclose(a_dense, b_dense, rtol=1e-10, atol=1e-12)
