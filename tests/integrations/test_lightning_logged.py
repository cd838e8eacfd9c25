"""SplitOnOOM and what a step logs: an out-of-memory in the backward, after ``training_step`` logged and updated a
torchmetrics metric, leaves neither counted twice; each piece's logged mean counts for its rows."""

from __future__ import annotations

import logging
import warnings

import pytest

torch = pytest.importorskip("torch")
L = pytest.importorskip("lightning.pytorch")
torchmetrics = pytest.importorskip("torchmetrics")
nn = torch.nn

from microbatch.integrations.lightning import SplitOnOOM  # noqa: E402


class BackwardLimit(torch.autograd.Function):
    """Out of memory in the backward past ``rows`` rows (0: never)."""

    rows = 0

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if BackwardLimit.rows and g.shape[0] > BackwardLimit.rows:
            raise torch.OutOfMemoryError(
                f"{g.shape[0]} rows in the backward; this test holds {BackwardLimit.rows}"
            )
        return g


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3)).double()
        self.acc = torchmetrics.classification.MulticlassAccuracy(num_classes=3, average="micro")

    def training_step(self, batch, i):
        x, y = batch
        logits = BackwardLimit.apply(self.net(x))
        loss = nn.functional.cross_entropy(logits, y)
        self.acc.update(logits.detach(), y)
        self.log("loss", loss, on_step=False, on_epoch=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(rows: int, callback, batch_size: int = 6):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(12, 8, generator=g, dtype=torch.float64), torch.randint(0, 3, (12,), generator=g)
    BackwardLimit.rows = rows
    module = Net()
    trainer = L.Trainer(
        max_epochs=1, callbacks=[callback] if callback else [], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
    )  # fmt: skip
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch_size)
    logging.getLogger("lightning").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, data)
    BackwardLimit.rows = 0
    return module, float(trainer.callback_metrics["loss"])


def test_a_redo_after_an_out_of_memory_in_the_backward_counts_each_row_once():
    ref, ref_loss = _fit(0, None)
    cb = SplitOnOOM()
    split, split_loss = _fit(3, cb)
    assert cb.controller.splits == 1  # the first step failed in its backward at 6 rows and was redone at 3
    for p, q in zip(split.parameters(), ref.parameters(), strict=True):
        assert torch.allclose(p, q, rtol=1e-12, atol=1e-15)
    counted = int(split.acc.tp + split.acc.fp)
    assert counted == int(ref.acc.tp + ref.acc.fp) == 12  # 18: the failed attempt's six rows again
    assert split_loss == pytest.approx(ref_loss, rel=1e-12)  # 1.2194 against 1.1923 before


def test_pieces_of_unequal_rows_log_a_mean_that_counts_each_for_its_rows():
    # batches of 5 rows cut in 2, 2 and 1 after the first fails: each piece's logged loss weighs its own rows, not the
    # whole batch's five (the result collection read the size from the loop's batch)
    ref, ref_loss = _fit(0, None, batch_size=5)
    split, split_loss = _fit(3, SplitOnOOM(), batch_size=5)
    assert split_loss == pytest.approx(ref_loss, rel=1e-12)
    assert int(split.acc.tp + split.acc.fp) == 12
