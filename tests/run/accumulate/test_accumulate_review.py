"""Accumulation where a review of users' loops found it inexact or crashing (2026-12-05).

A redone step draws the dropout masks and keeps the BatchNorm statistics of a clean run at the smaller size;
a micro-batch with no valid items does not poison the step with 0/0; a sparse embedding's gradient feeds the
noise scale; a BatchNorm in training mode is named as the one thing a split cannot make exact; under DDP
a call inside ``no_sync`` or on a static graph is refused before any forward; under FSDP2 the valid items
are summed over the ranks as under DDP. Each test fails without its fix.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _helpers import WORKER_END, AllocationLimit, two_rank_results
from torch import nn

from microbatch.run.accumulate import accumulate
from microbatch.run.noise import GradientNoiseScale

D, W, ROWS = 6, 40, 8


def bn_dropout_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, D), nn.BatchNorm1d(D), nn.Dropout(0.5), nn.Linear(D, W)).double()


def mse_sum(model, mb):
    x, y = mb
    return ((model(x).sum(-1) - y) ** 2).sum(), y.numel()


def _run(split_from: int | None):
    """(grads, BatchNorm buffers, the CPU generator's state after) of one step: at 4 rows, or at ``split_from``
    rows with every tensor over 6 rows' output refused, so the first attempt fails after BatchNorm and dropout."""
    model = bn_dropout_model()
    g = torch.Generator().manual_seed(3)
    batch = (
        torch.randn(ROWS, D, generator=g, dtype=torch.float64),
        torch.randn(ROWS, generator=g, dtype=torch.float64),
    )
    torch.manual_seed(7)
    if split_from is None:
        accumulate(model, batch, mse_sum, micro_batch_size=4)
    else:
        limit = AllocationLimit(
            D * W * 8
        )  # 8 rows' output of the last Linear is over; every other tensor fits
        with limit:
            accumulate(model, batch, mse_sum, micro_batch_size=split_from, on_oom="split")
        assert limit.failures == 1
    grads = [p.grad.clone() for p in model.parameters()]
    bn = model[1]
    return (
        grads,
        (bn.running_mean.clone(), bn.running_var.clone(), int(bn.num_batches_tracked)),
        torch.get_rng_state(),
    )


def test_a_redone_step_is_the_clean_step_at_the_smaller_size():
    with pytest.warns(UserWarning, match="BatchNorm1d layer"):
        clean, clean_bn, clean_rng = _run(None)
    with pytest.warns(UserWarning, match="depends on the micro-batch size"):
        redone, redone_bn, redone_rng = _run(8)
    # the first attempt drew 8 rows of dropout masks and updated the statistics once: both put back
    assert max((a - b).abs().max().item() for a, b in zip(clean, redone, strict=True)) == 0.0
    assert redone_bn[2] == clean_bn[2] == 2  # two micro-batches counted, not three
    assert torch.equal(redone_bn[0], clean_bn[0]) and torch.equal(redone_bn[1], clean_bn[1])
    assert torch.equal(redone_rng, clean_rng)


def test_no_warning_without_norm_layers_or_at_the_whole_batch(recwarn):
    model = bn_dropout_model()
    batch = (torch.randn(ROWS, D, dtype=torch.float64), torch.randn(ROWS, dtype=torch.float64))
    accumulate(model, batch, mse_sum, micro_batch_size=ROWS)  # one micro-batch: the batch's own statistics
    model.eval()
    accumulate(model, batch, mse_sum, micro_batch_size=2)  # statistics frozen
    assert not [w for w in recwarn if "BatchNorm" in str(w.message)]


def masked_mean_times_n(model, mb):
    """A per-token loss written as a masked mean × n: 0/0 = NaN for a micro-batch with no valid token."""
    x, y, mask = mb
    err = ((model(x) - y) ** 2).sum(-1)
    n = mask.sum()
    return (err * mask).sum() / n * n, n


def test_a_micro_batch_without_items_does_not_poison_the_step():
    torch.manual_seed(0)
    model = nn.Linear(D, 3).double()
    x, y = torch.randn(ROWS, D, dtype=torch.float64), torch.randn(ROWS, 3, dtype=torch.float64)
    mask = torch.tensor([1, 1, 0, 0, 1, 0, 1, 1], dtype=torch.float64)  # rows 2-3: a micro-batch of none
    loss = accumulate(
        model, (x, y, mask), masked_mean_times_n, micro_batch_size=2, count_fn=lambda mb: mb[2].sum()
    )
    ref = nn.Linear(D, 3).double()
    ref.load_state_dict(model.state_dict())
    ref.zero_grad()
    full = (((ref(x) - y) ** 2).sum(-1) * mask).sum() / mask.sum()
    full.backward()
    assert torch.isfinite(loss) and abs(float(loss) - full.item()) < 1e-12
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert (p.grad - q.grad).abs().max().item() < 1e-12


def test_a_sparse_embedding_feeds_the_noise_scale_as_a_dense_one():
    ids = torch.randint(0, 20, (ROWS, 5), generator=torch.Generator().manual_seed(1))
    estimates = []
    for sparse in (True, False):
        torch.manual_seed(0)
        model = nn.Embedding(20, 4, sparse=sparse).double()
        noise = GradientNoiseScale()
        accumulate(
            model, ids, lambda m, mb: ((m(mb) ** 2).sum(), mb.numel()), micro_batch_size=2, noise=noise
        )
        estimates.append(noise._last)
        assert model.weight.grad.is_sparse == sparse
    assert estimates[0] == pytest.approx(estimates[1], rel=1e-12)


WORKER = (
    """
import sys
sys.path.insert(0, {tests!r})
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from microbatch.run.accumulate import accumulate

rank, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{{port}}", rank=rank, world_size=2)

def make():
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(20, 8), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 20))

def lf(m, mb):
    logits = m(mb[0])
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), mb[1].flatten(), ignore_index=-100,
                                             reduction="sum"), (mb[1] != -100).sum()

g = torch.Generator().manual_seed(2)
ids, labels = torch.randint(0, 20, (8, 5), generator=g), torch.randint(0, 20, (8, 5), generator=g)
labels[4:, 1:] = -100  # rank 0 holds 20 valid tokens, rank 1 holds 4
mine = slice(rank * 4, rank * 4 + 4)
results = {{}}
for label, kw in (("count_fn", dict(count_fn=lambda mb: (mb[1] != -100).sum())), ("no count_fn", {{}})):
    model = make()
    fully_shard(model[1])
    fully_shard(model)
    accumulate(model, (ids[mine], labels[mine]), lf, micro_batch_size=2, **kw)
    results[label] = [p.grad.full_tensor() for p in model.parameters()]
ddp = torch.nn.parallel.DistributedDataParallel(make())
try:
    with ddp.no_sync():
        accumulate(ddp, (ids[mine], labels[mine]), lf, micro_batch_size=2)
    results["no_sync"] = "accepted"
except Exception as e:
    results["no_sync"] = f"{{type(e).__name__}}: {{e}}"
static = torch.nn.parallel.DistributedDataParallel(make(), static_graph=True)
try:
    accumulate(static, (ids[mine], labels[mine]), lf, micro_batch_size=2)
    results["static"] = "accepted"
except Exception as e:
    results["static"] = f"{{type(e).__name__}}: {{e}}"
results["grads_untouched"] = all(p.grad is None for p in ddp.parameters()) and all(
    p.grad is None for p in static.parameters())
results["ids"], results["labels"] = ids, labels
"""
    + WORKER_END
)


@pytest.mark.timeout(180)
def test_fsdp2_sums_items_over_ranks_and_ddp_misuse_is_refused(tmp_path):
    res = two_rank_results(WORKER.format(tests=str(Path(__file__).parent)), tmp_path, weights_only=False)
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Embedding(20, 8), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 20))
    ids, labels = res[0]["ids"], res[0]["labels"]
    F.cross_entropy(ref(ids).flatten(0, 1), labels.flatten(), ignore_index=-100).backward()
    for r in range(2):
        for label in ("count_fn", "no count_fn"):  # was 0.083 / 0.134 off: per-rank means averaged
            diff = max(
                (a - p.grad).abs().max().item() for a, p in zip(res[r][label], ref.parameters(), strict=True)
            )
            assert diff < 1e-6, (r, label, diff)
        assert res[r]["no_sync"].startswith("ConfigError") and "inside DDP's no_sync()" in res[r]["no_sync"]
        assert res[r]["static"].startswith("ConfigError") and "static_graph=True" in res[r]["static"]
        assert res[r]["grads_untouched"]


class RowLimit(nn.Module):
    """Out of memory past ``rows`` rows, as a device with room for that many would be."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.rows, self.failures = rows, 0

    def forward(self, x):
        if x.shape[0] > self.rows:
            self.failures += 1
            raise torch.OutOfMemoryError(f"{x.shape[0]} rows; this test device holds {self.rows}")
        return x


def test_a_grad_scaler_sees_one_step_through_a_split():
    """The documented fp16 pattern: loss_fn returns scaler.scale(loss_sum); the unscaled gradient is the plain
    one, and an overflow met twice in a split step skips the step and halves the scale once."""
    torch.manual_seed(0)
    x, y = torch.randn(ROWS, D), torch.randn(ROWS)
    grads = []
    for scaled in (False, True):
        torch.manual_seed(1)
        model = nn.Sequential(RowLimit(4), nn.Linear(D, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)

        def lf(m, mb, scaled=scaled, scaler=scaler):
            s = ((m(mb[0]).squeeze(-1) - mb[1]) ** 2).sum()
            return (scaler.scale(s) if scaled else s), mb[1].numel()

        accumulate(model, (x, y), lf, micro_batch_size=ROWS, on_oom="split")
        assert model[0].failures == 1
        if scaled:
            scaler.unscale_(opt)
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    assert (grads[0] - grads[1]).abs().max().item() < 1e-6 * grads[0].abs().max().item()

    model = nn.Sequential(RowLimit(4), nn.Linear(D, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    before = [p.detach().clone() for p in model.parameters()]
    bad = x.clone()
    bad[0, 0] = float("inf")
    accumulate(model, (bad, y), lambda m, mb: (scaler.scale(((m(mb[0]).squeeze(-1) - mb[1]) ** 2).sum()), 8),
               micro_batch_size=ROWS, on_oom="split")  # fmt: skip
    assert model[0].failures == 1
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 512.0  # one update, not one per attempt
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))  # step skipped


def test_nested_batches_and_per_row_values_split_with_the_rows():
    """default_collate of ({"x": tensor}, y, text) samples gives [{"x": ...}, y, [texts]]: split together."""
    from microbatch.errors import ConfigError
    from microbatch.run.accumulate import split

    torch.manual_seed(0)
    x, y = torch.randn(ROWS, D, dtype=torch.float64), torch.randn(ROWS, dtype=torch.float64)
    texts = [f"row {i}" for i in range(ROWS)]
    batch = [{"x": x}, y, texts]
    parts = split(batch, 3)
    assert [p[2] for p in parts] == [texts[0:3], texts[3:6], texts[6:8]]
    assert all(torch.equal(p[0]["x"], x[i * 3 : i * 3 + 3]) for i, p in enumerate(parts))
    seen = []

    def lf(m, mb):
        seen.extend(mb[2])
        return ((m(mb[0]["x"]).squeeze(-1) - mb[1]) ** 2).sum(), len(mb[2])

    model = nn.Linear(D, 1).double()
    accumulate(model, batch, lf, micro_batch_size=3)
    ref = nn.Linear(D, 1).double()
    ref.load_state_dict(model.state_dict())
    ((ref(x).squeeze(-1) - y) ** 2).mean().backward()
    assert seen == texts
    assert (
        max(
            (p.grad - q.grad).abs().max().item()
            for p, q in zip(model.parameters(), ref.parameters(), strict=True)
        )
        < 1e-12
    )
    with pytest.raises(ConfigError, match=r"batch\[2\] has 7"):
        split([{"x": x}, y, texts[:7]], 3)
    with pytest.raises(ConfigError, match=r"batch\['task'\] is a str, not a tensor"):
        split({"x": x, "task": "qa"}, 3)


def test_per_row_lists_of_lists_split_by_rows_not_inside():
    """A row's own list (its answer choices) is one value of that row: [["a", "b"], ["c", "d"]] at 2 rows splits
    into [["a", "b"]] and [["c", "d"]] (the inner lists were cut before)."""
    from microbatch.run.accumulate import split

    x = torch.zeros(2, 1)
    parts = split({"x": x, "choices": [["a", "b"], ["c", "d"]]}, 1)
    assert [p["choices"] for p in parts] == [[["a", "b"]], [["c", "d"]]]


def test_per_row_records_split_with_the_rows_where_they_do_not_hold_the_rows():
    """torchvision's detection batch: images and one target dict per image, each with its own number of boxes (a list,
    or the tuple its collate makes): was refused, split by records now. default_collate of samples holding a list of
    dicts (two views a sample) gives dicts that hold the rows: fields, as before. Where both readings agree (every
    image with as many boxes as the batch has images) it stays fields, with a warning (a user-loop sweep's finding:
    read silently then)."""
    import warnings

    from microbatch.run.accumulate import batch_rows, split

    images = torch.randn(4, 3, 5, 5)
    boxes = [1, 3, 0, 2]
    for wrap in (list, tuple):
        targets = wrap(
            {"boxes": torch.full((n, 4), float(i)), "labels": torch.full((n,), i)}
            for i, n in enumerate(boxes)
        )
        parts = split((images, targets), 2)
        assert [[int(t["labels"].numel()) for t in p[1]] for p in parts] == [boxes[:2], boxes[2:]]
        assert [type(p[1]) for p in parts] == [wrap, wrap]
        assert all(torch.equal(p[0], images[2 * k : 2 * k + 2]) for k, p in enumerate(parts))
    views = {"x": torch.zeros(4, 2), "views": [{"v": torch.arange(4.0)}, {"v": -torch.arange(4.0)}]}
    assert batch_rows(views) == 4
    two = split(views, 2)  # fields: each view's rows
    assert [p["views"][1]["v"].tolist() for p in two] == [[-0.0, -1.0], [-2.0, -3.0]]
    square = (
        images,
        [{"boxes": torch.zeros(4, 4)} for _ in range(4)],
    )  # 4 images of 4 boxes: both readings agree
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert batch_rows(square) == 4
    assert any("holds 4 dicts, as many as the batch's rows" in str(w.message) for w in caught)
    fields = [{"x": torch.zeros(6, 2)}, {"y": torch.ones(6)}]  # the whole batch as a list of dicts: fields
    assert batch_rows(fields) == 6 and [p[1]["y"].shape[0] for p in split(fields, 4)] == [4, 2]


def test_fsdp_on_children_only_is_refused():
    """fully_shard on the children but not the root: the root's parameters are never reduced and accumulate
    saw one process (gradients 1.91x the full batch's on two ranks); refused where a process group is up."""
    import torch.distributed as dist

    from microbatch.errors import ConfigError

    class FSDPModule(nn.Module):  # the class name fully_shard's modules derive from
        pass

    model = nn.Sequential(nn.Linear(D, 1))
    model.add_module("sharded", FSDPModule())
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with pytest.raises(ConfigError, match="not its root"):
            accumulate(model, (torch.zeros(2, D), torch.zeros(2)), lambda m, mb: (m[0](mb[0]).sum(), 2),
                       micro_batch_size=1)  # fmt: skip
    finally:
        dist.destroy_process_group()


def test_a_list_of_as_many_images_as_rows_warns_that_it_is_read_as_fields():
    """Three RGB images in a list beside three labels (a helper's user loop, 2026-12-07): each image's 3 channels
    agree with the 3 rows, so the list is read as fields and each image cut along its channels, silently (a per-image
    loss's gradient 0.74 off at b_m 1). It stays fields (the rule the docs give), now with a warning naming the fix; 4
    images of 3 channels are one a row, without one."""
    import warnings

    from microbatch.run.accumulate import batch_rows, split

    def caught(batch):
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            rows = batch_rows(batch)
        return rows, [str(w.message) for w in got]

    three = {"images": [torch.randn(3, 4, 4) for _ in range(3)], "labels": torch.tensor([0, 1, 2])}
    rows, said = caught(three)
    assert rows == 3 and any(
        "holds 3 tensors, as many as the batch's rows" in m and "torch.stack" in m for m in said
    )
    four = {"images": [torch.randn(3, 4, 4) for _ in range(4)], "labels": torch.tensor([0, 1, 2, 3])}
    rows, said = caught(four)
    assert rows == 4 and not said
    assert [tuple(t.shape) for t in split(four, 2)[0]["images"]] == [(3, 4, 4), (3, 4, 4)]  # one image a row
    fields = (
        (torch.zeros(2, 5, dtype=torch.long), torch.ones(2, 5)),
        torch.tensor([0, 1]),
    )  # (ids, mask), labels
    rows, said = caught(fields)
    assert rows == 2 and not said  # fields of tokens, not images: nothing to warn of
