"""Loops a review wrote: fp16 under a GradScaler without ``count_fn`` (the backward carries a mean's size, not the
sum's, so the scaler skips no step the mean loop would not), and an ``optimizer.step()`` inside ``loss_fn`` (refused,
the gradients put back)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

from microbatch.errors import ConfigError  # noqa: E402
from microbatch.run.accumulate import accumulate  # noqa: E402


def _data(rows: int = 2048, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return torch.randn(rows, 16, generator=g, dtype=dtype), torch.randn(rows, 1, generator=g, dtype=dtype)


def _model(dtype=torch.float32):
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1)).to(dtype)


def _fp16_skips(mode: str) -> int:
    """Steps a CPU GradScaler skipped in 20 fp16 steps of 2,048 rows (micro-batches of 512 for ``accumulate``)."""
    x, y = _data()
    m = _model()
    opt = torch.optim.SGD(m.parameters(), 1e-2)
    scaler = torch.amp.GradScaler("cpu")
    skipped = 0

    def loss_fn(mm, mb):
        return scaler.scale(((mm(mb[0]).float() - mb[1]) ** 2).sum()), len(mb[0])

    for _ in range(20):
        opt.zero_grad(set_to_none=True)
        before = scaler.get_scale()
        with torch.autocast("cpu", dtype=torch.float16):
            if mode == "mean":
                scaler.scale(((m(x).float() - y) ** 2).mean()).backward()
            else:
                count = (lambda mb: len(mb[0])) if mode == "count_fn" else None
                accumulate(m, (x, y), loss_fn, micro_batch_size=512, count_fn=count)
        scaler.step(opt)
        scaler.update()
        skipped += scaler.get_scale() < before
    return skipped


def test_fp16_under_a_grad_scaler_skips_no_more_steps_without_count_fn_than_the_mean_loop():
    # before: the backward of each 512-row sum overflowed fp16 where the mean's did not (7 of 20 steps skipped)
    mean = _fp16_skips("mean")
    assert mean == 0
    assert _fp16_skips("count_fn") == mean
    assert _fp16_skips("none") == mean


def test_without_count_fn_the_gradient_is_the_mean_whatever_the_first_micro_batchs_count():
    # tensor counts, the first micro-batch with none (its factor 1/max(1, 0)): the mean gradient of the valid rows
    x, y = _data(12, torch.float64)
    valid = torch.ones(12, dtype=torch.bool)
    valid[:4] = False

    def loss_fn(m, mb):
        keep = mb[2]
        return (((m(mb[0]) - mb[1]) ** 2).sum(1) * keep).sum(), keep.sum()

    ref = _model(torch.float64)
    (((ref(x) - y) ** 2).sum(1)[valid]).mean().backward()
    m = _model(torch.float64)
    loss = accumulate(m, (x, y, valid), loss_fn, micro_batch_size=4)
    for p, q in zip(m.parameters(), ref.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, rtol=1e-12, atol=1e-15)
    assert float(loss) == pytest.approx(float((((ref(x) - y) ** 2).sum(1)[valid]).mean()), rel=1e-12)


def test_an_optimizer_step_inside_loss_fn_is_refused_and_the_gradients_put_back():
    x, y = _data(8, torch.float64)
    m = _model(torch.float64)
    opt = torch.optim.SGD(m.parameters(), 0.1)
    old = [torch.full_like(p, 0.5) for p in m.parameters()]
    for p, g in zip(m.parameters(), old, strict=True):
        p.grad = g.clone()

    def loss_fn(mm, mb):
        opt.step()
        return ((mm(mb[0]) - mb[1]) ** 2).sum(), len(mb[0])

    with pytest.raises(
        ConfigError, match=r"changed all 4 of the model's trainable parameters.*after accumulate"
    ):
        accumulate(m, (x, y), loss_fn, micro_batch_size=4)
    assert all(torch.equal(p.grad, g) for p, g in zip(m.parameters(), old, strict=True))
    # a loss_fn that only reads the weights passes
    accumulate(m, (x, y), lambda mm, mb: (((mm(mb[0]) - mb[1]) ** 2).sum(), len(mb[0])), micro_batch_size=4)


def test_a_forward_that_renormalises_its_own_weights_is_not_taken_for_a_step():
    # nn.Embedding(max_norm=...) renormalises the rows it looks up, in place, at every forward
    torch.manual_seed(0)
    m = nn.Sequential(nn.Embedding(10, 4, max_norm=0.5), nn.Linear(4, 1))
    ids, y = torch.randint(0, 10, (8,)), torch.randn(8, 1)
    accumulate(m, (ids, y), lambda mm, mb: (((mm(mb[0]) - mb[1]) ** 2).sum(), len(mb[0])), micro_batch_size=4)
    assert all(p.grad is not None for p in m.parameters())


def test_the_first_count_s_factor_is_undone_exactly():
    # the first micro-batch holds 3 valid items (a factor of 1/3 on every sum), the others 4 and 1
    x, y = _data(12, torch.float64)
    valid = torch.tensor([1, 1, 1, 0, 1, 1, 1, 1, 0, 0, 0, 1], dtype=torch.bool)

    def loss_fn(m, mb):
        return (((m(mb[0]) - mb[1]) ** 2).sum(1) * mb[2]).sum(), mb[2].sum()

    ref = _model(torch.float64)
    (((ref(x) - y) ** 2).sum(1)[valid]).mean().backward()
    for n_of in (lambda keep: keep.sum(), lambda keep: int(keep.sum())):  # a tensor count, then a Python one
        m = _model(torch.float64)
        accumulate(
            m, (x, y, valid), lambda mm, mb, n_of=n_of: (loss_fn(mm, mb)[0], n_of(mb[2])), micro_batch_size=4
        )
        for p, q in zip(m.parameters(), ref.parameters(), strict=True):
            assert torch.allclose(p.grad, q.grad, rtol=1e-12, atol=1e-15)


def _mse(m, mb):
    return ((m(mb[0]) - mb[1]) ** 2).sum(), len(mb[0])


def test_a_list_of_samples_not_collated_is_told_to_collate_in_a_short_message():
    m = nn.Linear(4, 1)
    samples = [{"x": torch.randn(4), "y": torch.randn(1)} for _ in range(256)]
    with pytest.raises(ConfigError, match=r"list of 256 samples \(dicts.*default_collate") as e:
        accumulate(m, samples, lambda mm, mb: (mm(mb["x"]).sum(), 1), micro_batch_size=32)
    assert len(str(e.value)) < 400  # it listed every sample's tensor: 11,744 characters
    # a collated batch whose tensors disagree still names them, six at most
    bad = {f"t{i}": torch.zeros(2 + i, 1) for i in range(9)}
    with pytest.raises(ConfigError, match=r"t5'\] has 7 and 3 more\)"):
        accumulate(m, bad, lambda mm, mb: (mm(mb["t0"]).sum(), 1), micro_batch_size=2)


def test_a_dataclass_batch_is_told_how_to_become_a_dict():
    import dataclasses

    @dataclasses.dataclass
    class Pair:
        x: torch.Tensor
        y: torch.Tensor

    x, y = _data(8)
    with pytest.raises(ConfigError, match=r"type Pair is not supported.*dataclasses\.asdict\(batch\)"):
        accumulate(_model(), Pair(x, y), lambda mm, mb: _mse(mm, (mb.x, mb.y)), micro_batch_size=4)


def test_none_in_a_tuple_goes_whole_to_every_micro_batch_and_the_gradient_is_exact():
    x, y = _data(8, torch.float64)
    seen = []

    def loss_fn(mm, mb):
        seen.append(mb[2])
        return _mse(mm, mb[:2])

    ref, m = _model(torch.float64), _model(torch.float64)
    (((ref(x) - y) ** 2).sum() / 8).backward()
    accumulate(m, (x, y, None), loss_fn, micro_batch_size=3)
    assert seen == [None, None, None]
    assert all(
        torch.allclose(p.grad, q.grad, rtol=1e-12)
        for p, q in zip(m.parameters(), ref.parameters(), strict=True)
    )


def test_a_loss_fn_returning_its_pair_swapped_is_told_the_order():
    x, y = _data(8)
    with pytest.raises(ConfigError, match=r"is a int.*look swapped.*\(loss_sum, n_items\) in that order"):
        accumulate(
            _model(),
            (x, y),
            lambda mm, mb: (len(mb[0]), ((mm(mb[0]) - mb[1]) ** 2).sum()),
            micro_batch_size=4,
        )


def test_a_loss_on_a_second_models_parameters_names_freezing_it():
    x, y = _data(8)
    g, d = _model(), nn.Linear(1, 1)
    with pytest.raises(ConfigError, match=r"not the model's.*requires_grad_\(False\)"):
        accumulate(g, (x, y), lambda mm, mb: (d(mm(mb[0])).sum(), len(mb[0])), micro_batch_size=4)
    d.requires_grad_(False)
    accumulate(g, (x, y), lambda mm, mb: (d(mm(mb[0])).sum(), len(mb[0])), micro_batch_size=4)
    assert all(p.grad is None for p in d.parameters()) and all(p.grad is not None for p in g.parameters())
