"""Layers whose forward depends on the rows it sees together, or rewrites a buffer, and batches that are not tensors:
a spectral norm's power iteration (both torch APIs) is put back before a redo and warned about; a BatchNorm on batch
statistics warns whatever its running-stats flag, an InstanceNorm (per sample, exact) does not; a lazy BatchNorm
survives a redo; a tuple of NumPy arrays is refused, not taken as two rows."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn
np = pytest.importorskip("numpy")

from microbatch.errors import ConfigError  # noqa: E402
from microbatch.run.accumulate import MicroBatchController, accumulate  # noqa: E402
from microbatch.run.accumulate.microbatches import batch_rows  # noqa: E402
from microbatch.run.accumulate.retry import spectral_norms  # noqa: E402

ROWS = 8


class RowLimit(nn.Module):
    """Out of memory past ``rows`` rows (0: never)."""

    def __init__(self, rows: int = 0) -> None:
        super().__init__()
        self.rows, self.failures = rows, 0

    def forward(self, x):
        if self.rows and x.shape[0] > self.rows:
            self.failures += 1
            raise torch.OutOfMemoryError(f"{x.shape[0]} rows; this test device holds {self.rows}")
        return x


def _data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(ROWS, 4, generator=g, dtype=torch.float64), torch.randn(
        ROWS, 3, generator=g, dtype=torch.float64
    )


def _loss(m, mb):
    return ((m(mb[0]) - mb[1]) ** 2).sum(), mb[0].shape[0]


def _run(make, size, limit=0, **kw):
    torch.manual_seed(3)
    model = nn.Sequential(*make(), RowLimit(limit)).double()  # out of memory after every layer ran
    with (
        torch.no_grad()
    ):  # vectors far from converged (torch starts them 15 iterations in): each iteration counts
        for _, vectors in spectral_norms(model):
            for v in vectors:
                v.copy_(nn.functional.normalize(torch.randn_like(v), dim=0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        accumulate(model, _data(), _loss, **kw) if kw else accumulate(
            model, _data(), _loss, micro_batch_size=size
        )
    buffers = [b.detach().clone() for b in model.buffers()]
    return (
        [p.grad.detach().clone() for p in model.parameters()],
        buffers,
        [str(w.message) for w in caught],
        model,
    )


def _spectral_new():
    return [nn.Linear(4, 5), nn.utils.parametrizations.spectral_norm(nn.Linear(5, 3))]


def _spectral_old():
    return [nn.Linear(4, 5), nn.utils.spectral_norm(nn.Linear(5, 3))]


@pytest.mark.parametrize("make", [_spectral_new, _spectral_old], ids=["parametrization", "hook"])
def test_a_spectral_norm_redo_equals_a_clean_run_and_warns(make):
    """The failed attempt at 8 rows ran a power iteration; the redo at 4 starts from the vectors the step found, so
    its gradient and vectors are a clean run's at 4 (without the restore they differ by ~1%), and the call warns."""
    clean, clean_buf, said, _ = _run(make, 4)
    redo, redo_buf, _, model = _run(make, 8, limit=4, micro_batch_size=8, on_oom="split")
    assert model[-1].failures == 1
    for a, b in zip(clean + clean_buf, redo + redo_buf, strict=True):
        assert torch.equal(a, b)
    assert any("spectral norm" in w and "power iteration" in w for w in said), said
    whole, _, quiet, _ = _run(make, ROWS)
    assert not any(
        "spectral norm" in w for w in quiet
    )  # one micro-batch is the full batch: exact, no warning
    # the iteration per micro-batch does change the gradient
    assert any(not torch.allclose(a, b, rtol=1e-3) for a, b in zip(whole, clean, strict=True))


def test_batch_statistics_warn_whatever_the_running_stats_flag_and_instance_norm_does_not():
    instance = [
        nn.Linear(4, 6),
        nn.Unflatten(1, (2, 3)),
        nn.InstanceNorm1d(2, track_running_stats=True),
        nn.Flatten(),
    ]
    for layers, warned in (
        ([nn.Linear(4, 5), nn.BatchNorm1d(5, track_running_stats=False), nn.Linear(5, 3)], True),
        ([nn.Linear(4, 5), nn.BatchNorm1d(5), nn.Linear(5, 3)], True),
        ([*instance, nn.Linear(6, 3)], False),
    ):
        _, _, said, _ = _run(lambda layers=layers: layers, 2)
        assert any("normalise each micro-batch" in w for w in said) == warned, (layers, said)
    # eval mode without running stats still normalises by the batch: warned
    model = nn.Sequential(
        nn.Linear(4, 5), nn.BatchNorm1d(5, track_running_stats=False), nn.Linear(5, 3)
    ).double()
    model.eval()
    with pytest.warns(UserWarning, match="normalise each micro-batch"):
        accumulate(model, _data(), _loss, micro_batch_size=2)


def test_instance_norm_is_exact_in_micro_batches():
    def make():
        return [
            nn.Linear(4, 6),
            nn.Unflatten(1, (2, 3)),
            nn.InstanceNorm1d(2, track_running_stats=True),
            nn.Flatten(),
            nn.Linear(6, 3),
        ]

    whole, _, _, _ = _run(make, ROWS)
    parts, _, _, _ = _run(make, 2)
    for a, b in zip(whole, parts, strict=True):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)


def test_a_lazy_batch_norm_survives_a_redo_with_a_clean_runs_statistics():
    make = lambda: [nn.Linear(4, 5), nn.LazyBatchNorm1d(), nn.Linear(5, 3)]  # noqa: E731
    clean, clean_buf, _, _ = _run(make, 4)
    redo, redo_buf, _, model = _run(make, 8, limit=4, controller=MicroBatchController(initial=8))
    assert model[-1].failures == 1
    for a, b in zip(clean + clean_buf, redo + redo_buf, strict=True):
        assert torch.equal(a, b)


def test_a_tuple_of_numpy_arrays_is_refused_not_taken_as_two_rows():
    x, y = np.zeros((ROWS, 4), dtype=np.float32), np.zeros((ROWS, 1), dtype=np.float32)
    for batch in ((x, y), [x, y], {"x": x}):
        with pytest.raises(ConfigError, match=r"ndarray, not a tensor; convert it with torch.as_tensor"):
            batch_rows(batch)
    assert batch_rows(["a text", "another", "a third"]) == 3  # a list of plain values stays one value per row
    assert batch_rows((torch.zeros(3, 2), ["a", "b", "c"])) == 3
