"""A redo after out-of-memory puts back every buffer a forward rewrote, and a micro-batch without items runs under
reentrant checkpointing (a read-only review, 2026-12-07 14:40 UTC on). References are computed without the library:
one clean pass at the size the redo ends at, or the whole batch at once, in float64."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from microbatch.run.accumulate import accumulate, retry


class Ema(torch.nn.Module):
    """A forward that keeps an exponential moving average of its input's mean in a buffer and uses it."""

    def __init__(self, width: int, *, reassign: bool = False) -> None:
        super().__init__()
        self.register_buffer("avg", torch.zeros(width, dtype=torch.float64))
        self.register_buffer("seen", torch.zeros((), dtype=torch.int64))
        self.reassign = reassign

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        new = 0.5 * self.avg + 0.5 * x.detach().mean(0)
        if self.reassign:
            self.avg = new  # a new tensor, as a module assigning its buffer does
        else:
            self.avg.copy_(new)
        self.seen += 1
        return x - self.avg


class Gate(torch.nn.Module):
    """Out of memory (raised as CUDA's allocator does) for a micro-batch of more than ``limit`` rows: after the
    buffers above it were updated."""

    def __init__(self, limit: int | None) -> None:
        super().__init__()
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.limit is not None and x.shape[0] > self.limit:
            raise torch.OutOfMemoryError(f"Tried to allocate {x.shape[0]} rows")
        return x


def model_with(limit: int | None, *, reassign: bool = False) -> torch.nn.Sequential:
    torch.manual_seed(3)
    return torch.nn.Sequential(
        torch.nn.Linear(5, 6), Ema(6, reassign=reassign), Gate(limit), torch.nn.Linear(6, 3)
    ).double()


def loss_fn(model, mb):
    x, y = mb
    return F.cross_entropy(model(x), y, reduction="sum"), y.shape[0]


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 5, generator=g, dtype=torch.float64) * 3, torch.randint(0, 3, (8,), generator=g)


def grads(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def steps(
    model, micro: int, seeds=(1, 2), on_oom: str | None = None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for seed in seeds:
        model.zero_grad(set_to_none=True)
        accumulate(model, batch(seed), loss_fn, micro_batch_size=micro, on_oom=on_oom)
        out.append((grads(model).clone(), model[1].avg.clone()))
    return out


@pytest.mark.parametrize("reassign", [False, True])
def test_a_redo_puts_back_a_buffer_the_forward_rewrote(reassign):
    clean = steps(model_with(None, reassign=reassign), 2)  # a clean run at the size the redo ends at
    model = model_with(2, reassign=reassign)  # 8 and 4 rows run out of memory: two failed attempts a step
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn of: every buffer was taken
        split = steps(model, 8, on_oom="split")
    for (g, avg), (g0, avg0) in zip(split, clean, strict=True):
        assert torch.equal(avg, avg0)  # updated by the redo's forwards only, not also by the failed attempts'
        assert torch.allclose(g, g0, rtol=0, atol=1e-15)
    assert (
        int(model[1].seen) == 8
    )  # four micro-batches a step, two steps: the failed attempts' counts put back


def test_over_the_first_steps_cap_the_buffer_is_named_then_taken_from_the_next_step(monkeypatch):
    monkeypatch.setattr(retry, "FIRST_STEP_BYTES", 0)  # no buffer copied before a step has shown which move
    clean = steps(model_with(None), 2)
    model = model_with(2)
    with pytest.warns(UserWarning, match=r"changed the buffer\(s\) avg, seen.*counted twice"):
        first = steps(model, 8, seeds=(1,), on_oom="split")[0]
    assert not torch.equal(first[1], clean[0][1])  # counted twice, as the warning says
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        second = steps(model, 8, seeds=(2,), on_oom="split")[0]
    clean_after_the_same_first = model_with(None)
    clean_after_the_same_first[1].avg.copy_(first[1])
    clean_after_the_same_first[1].seen.fill_(int(model[1].seen) - 4)
    g0, avg0 = steps(clean_after_the_same_first, 2, seeds=(2,))[0]
    assert torch.equal(second[1], avg0) and torch.allclose(second[0], g0, rtol=0, atol=1e-15)


class Checkpointed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.a, self.mid, self.b = torch.nn.Linear(4, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 3)

    def forward(
        self, x: torch.Tensor
    ) -> torch.Tensor:  # the checkpointed block's input requires grad, as in an LM
        return self.b(checkpoint(lambda t: torch.tanh(self.mid(t)), self.a(x), use_reentrant=True))


def test_a_micro_batch_without_items_runs_under_reentrant_checkpointing():
    model = Checkpointed().double()
    g = torch.Generator().manual_seed(7)
    x = torch.randn(6, 4, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (6,), generator=g)
    y[2:4] = -100  # the second micro-batch of two rows has no item

    def masked(m, mb):
        xx, yy = mb
        return F.cross_entropy(m(xx), yy, ignore_index=-100, reduction="sum"), (yy != -100).sum()

    loss, n = masked(model, (x, y))
    (loss / n).backward()
    ref = grads(model).clone()
    model.zero_grad(set_to_none=True)
    accumulate(model, (x, y), masked, micro_batch_size=2, count_fn=lambda mb: (mb[1] != -100).sum())
    assert torch.allclose(grads(model), ref, rtol=0, atol=1e-15)


class Detector(torch.nn.Module):
    """Takes a list of images of their own sizes, as torchvision's detection models do."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(11)
        self.conv, self.head = torch.nn.Conv2d(3, 4, 3), torch.nn.Linear(4, 1)

    def forward(self, images: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([self.head(self.conv(im[None]).mean((2, 3))) for im in images]).squeeze(1)


def detection_loss(model, mb):
    images, targets = mb
    goal = torch.stack([t["labels"].double().mean() for t in targets])
    return ((model(images) - goal) ** 2).sum(), len(images)


@pytest.mark.parametrize("rows", [3, 4])
def test_a_detection_batch_splits_by_image(rows):
    g = torch.Generator().manual_seed(rows)
    images = [torch.randn(3, 8 + i, 9, generator=g, dtype=torch.float64) for i in range(rows)]
    targets = [{"boxes": torch.rand(i + 1, 4, generator=g), "labels": torch.randint(0, 5, (i + 1,), generator=g)}
               for i in range(rows)]  # fmt: skip
    model = Detector().double()
    loss, n = detection_loss(model, (images, targets))
    (loss / n).backward()
    ref = grads(model).clone()
    model.zero_grad(set_to_none=True)
    accumulate(model, (images, targets), detection_loss, micro_batch_size=2)
    assert torch.allclose(grads(model), ref, rtol=0, atol=1e-14)


def test_sparse_and_nested_tensors_in_a_batch_are_refused_with_the_fix():
    from microbatch.errors import ConfigError
    from microbatch.run.accumulate import split

    sparse = torch.sparse_coo_tensor(torch.tensor([[0, 1, 2], [0, 1, 0]]), torch.ones(3), (4, 3))
    with pytest.raises(ConfigError, match=r"batch\[1\] is a sparse_coo \(sparse\) tensor.*to_dense"):
        split((torch.zeros(4, 2), sparse), 2)
    jagged = torch.nested.nested_tensor([torch.zeros(2, 3), torch.zeros(3, 3)], layout=torch.jagged)
    with pytest.raises(ConfigError, match=r"batch\[1\] is a nested \(jagged\) tensor.*to_padded_tensor"):
        split((torch.zeros(2, 2), jagged), 1)


def test_a_redo_puts_back_per_channel_observers_resized_in_place():
    import copy

    from torch.ao.quantization import get_default_qat_qconfig, prepare_qat

    torch.manual_seed(0)
    base = torch.nn.Sequential(
        torch.nn.Linear(5, 6), torch.nn.ReLU(), Gate(None), torch.nn.Linear(6, 3)
    ).train()
    base.qconfig = get_default_qat_qconfig("x86")  # per-channel weight observers: min/max start empty
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao's deprecation notes
        base = prepare_qat(base)
    x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))
    clean, failing = copy.deepcopy(base), copy.deepcopy(base)
    failing[2].limit = 2  # out of memory above 2 rows: 4 fails part-way, then 2
    accumulate(clean, (x, y), loss_fn, micro_batch_size=2)
    accumulate(failing, (x, y), loss_fn, micro_batch_size=4, on_oom="split")
    for a, b in zip(clean.parameters(), failing.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
    for (name, a), (_, b) in zip(clean.named_buffers(), failing.named_buffers(), strict=True):
        assert torch.equal(a, b), name


class Rotary(torch.nn.Module):
    """A cache rebuilt for a longer input, as Hugging Face's dynamic rotary embedding does: a new tensor and a plain
    attribute with its length."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.ones(4, dtype=torch.float64), persistent=False)
        self.cached = 4

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] > self.cached:
            self.table = torch.linspace(1, 2, x.shape[1], dtype=torch.float64)
            self.cached = x.shape[1]
        return x * self.table[: x.shape[1]]


def test_a_redo_puts_back_a_rebuilt_cache_with_the_attribute_beside_it():
    def make(limit):
        torch.manual_seed(2)
        return torch.nn.Sequential(
            torch.nn.Linear(6, 6), Rotary(), Gate(limit), torch.nn.Linear(6, 3)
        ).double()

    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(8, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (8,), generator=g)
    clean, failing = make(None), make(2)
    accumulate(clean, (x, y), loss_fn, micro_batch_size=2)
    accumulate(failing, (x, y), loss_fn, micro_batch_size=8, on_oom="split")
    assert failing[1].cached == clean[1].cached == 6 and torch.equal(failing[1].table, clean[1].table)
    assert torch.equal(grads(failing), grads(clean))


@pytest.mark.parametrize("rows", [2, 4])
def test_a_tuple_of_fields_beside_records_still_splits_by_rows(rows):
    from microbatch.run.accumulate import split

    x, mask = torch.randn(rows, 5), torch.ones(rows, 5)
    targets = [
        {"boxes": torch.rand(2 * i + 3, 4)} for i in range(rows)
    ]  # records: their own numbers of boxes
    parts = split({"inputs": (x, mask), "targets": targets}, 1)
    assert len(parts) == rows
    for i, part in enumerate(parts):
        assert torch.equal(part["inputs"][0], x[i : i + 1]) and torch.equal(
            part["inputs"][1], mask[i : i + 1]
        )
        assert part["targets"][0]["boxes"].shape[0] == 2 * i + 3


def test_images_of_one_size_split_by_image_and_the_ambiguous_case_is_said():
    from microbatch.run.accumulate import split

    def batch(n):
        images = [torch.randn(3, 32, 32) for _ in range(n)]
        return images, [{"boxes": torch.rand(i + 1, 4)} for i in range(n)]

    parts = split(batch(4), 2)  # images of 3 rows each cannot be fields of a 4-row batch: one a row
    assert [len(p[0]) for p in parts] == [2, 2] and all(im.shape == (3, 32, 32) for p in parts for im in p[0])
    with pytest.warns(RuntimeWarning, match="list of 3 tensors, as many as its rows, each with 3 rows"):
        split(batch(3), 2)  # 3 images of 3 channels beside 3 targets: either reading fits, fields taken


class Resized(torch.nn.Module):
    """A statistic that follows its input's width: resized in place, or (``assign``) a new tensor, then updated in
    place."""

    def __init__(self, assign: bool) -> None:
        super().__init__()
        self.register_buffer("stat", torch.tensor([1.0, 2.0]))
        self.assign = assign

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stat.shape != x.shape[1:]:
            if self.assign:
                self.stat = torch.zeros(x.shape[1:])
            else:
                self.stat.resize_(x.shape[1:]).zero_()
        self.stat.mul_(0.5).add_(x.mean(0))
        return x


@pytest.mark.parametrize("assign", [False, True])
def test_a_second_redo_finds_the_buffers_as_the_step_started(assign):
    module = Resized(assign)
    state = retry.StepState.take(module)
    module(torch.ones(4, 3))  # the first attempt changes the buffer's shape, then fails
    state.restore()
    module(torch.full((2, 2), 100.0))  # the redo writes in place at the saved shape, then fails too
    state.restore()
    assert module.stat.tolist() == [1.0, 2.0]
