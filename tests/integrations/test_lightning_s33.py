"""What a Lightning user's walk-through found (2026-12-07, evening): each fixed with a test that fails without it."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
L = pytest.importorskip("lightning.pytorch")

from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from microbatch.integrations.lightning import KneeBatchSize  # noqa: E402
from microbatch.measure.timing import TimingConfig  # noqa: E402

FAST = TimingConfig(warmup=1, min_repeats=2, max_repeats=3, max_time_s=0.3, rel_tol=0.9)


def _trainer(tmp_path, *callbacks, **kw):
    base = dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=str(tmp_path))  # fmt: skip
    return L.Trainer(callbacks=list(callbacks), **{**base, **kw})


class _Shuffled(L.LightningModule):
    """Shuffled data, dropout, and OneCycleLR sized from trainer.estimated_stepping_batches (Lightning's docs)."""

    def __init__(self, batch_size: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.batch_size = batch_size
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                       torch.nn.Linear(32, 1))  # fmt: skip
        self.ds = TensorDataset(torch.arange(64.0).unsqueeze(1).repeat(1, 16),
                                torch.randn(64, generator=torch.Generator().manual_seed(1)))  # fmt: skip
        self.seen: list[list[float]] = []

    def train_dataloader(self):
        return DataLoader(self.ds, batch_size=self.batch_size, shuffle=True)

    def on_train_batch_start(self, batch, i):
        self.seen.append(batch[0][:, 0].tolist())

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x / 64).squeeze(-1), y)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=1e-2)
        total = int(self.trainer.estimated_stepping_batches)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=total)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def test_an_epoch_run_sized_from_estimated_stepping_batches_draws_the_hand_run_s_data_order(tmp_path):
    """configure_optimizers (inside the strategy's setup, before on_fit_start) built and iterated the train loader:
    the generators saved at on_fit_start were one sampler seed later, so the fit loop's loader shuffled otherwise
    than a run set by hand to the knee, from the first batch on."""
    knee = KneeBatchSize(32, timing=FAST, use_cache=False, max_micro_batch=8)
    torch.manual_seed(123)
    tuned = _Shuffled(8)
    _trainer(tmp_path, knee, accumulate_grad_batches=4, max_epochs=2).fit(tuned)
    b, g = knee.micro_batch, knee.grad_accum
    assert b is not None and g is not None and b * g == 32
    torch.manual_seed(123)
    by_hand = _Shuffled(b)
    _trainer(tmp_path, accumulate_grad_batches=g, max_epochs=2).fit(by_hand)
    assert tuned.seen == by_hand.seen and len(tuned.seen) == 2 * 64 // b
    for (k, v), w in zip(tuned.state_dict().items(), by_hand.state_dict().values(), strict=True):
        assert torch.equal(v, w), k
    assert "configure_optimizers" not in tuned.__dict__  # the recording wrapper is gone after the fit starts


class _Tokens(L.LightningModule):
    """A per-token mean loss over -100-padded labels, logged as an epoch mean; out of memory above ``limit`` rows."""

    def __init__(self, data, limit=None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(20, 20, dtype=torch.float64)
        self.data, self.limit = data, limit

    def training_step(self, batch, i):
        if self.limit and len(batch["input_ids"]) > self.limit:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        logits = self.emb(batch["input_ids"]).flatten(0, 1)
        loss = torch.nn.functional.cross_entropy(logits, batch["labels"].flatten(), ignore_index=-100)
        self.log("loss", loss, on_step=False, on_epoch=True)
        return loss

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=len(self.data))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


@pytest.mark.parametrize("empty_half", [False, True])
def test_a_split_step_logs_the_epoch_mean_the_unsplit_one_logs(tmp_path, empty_half):
    """Pieces weighted by rows in the result collection while the gradient weighs them by count_fn's tokens: 16 rows
    of one token and 16 of six logged 3.4581 for the unsplit 3.3314. A piece with no tokens (its mean over none is
    nan) logs nothing."""
    from microbatch.integrations.lightning import SplitOnOOM

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 20, (32, 6), generator=g)
    labels = ids.clone()
    labels[:16, 0 if empty_half else 1 :] = -100  # the first half: one token a row, or none
    data = [dict(input_ids=ids[i], labels=labels[i]) for i in range(32)]
    whole = _Tokens(data)
    t1 = _trainer(tmp_path, max_epochs=1)
    t1.fit(whole)
    split = _Tokens(data, limit=16)
    t2 = _trainer(tmp_path, SplitOnOOM(count_fn=lambda b: (b["labels"] != -100).sum()), max_epochs=1)
    t2.fit(split)
    unsplit, pieces = float(t1.callback_metrics["loss"]), float(t2.callback_metrics["loss"])
    assert unsplit == pytest.approx(pieces, rel=1e-12, abs=0.0) and unsplit == unsplit  # finite, and equal


def test_the_probes_leave_the_module_s_torchmetrics_as_they_were(tmp_path):
    """training_step's metric updates during the probes were counted into the first epoch's accuracy (0.164 for the
    0.281 of a run set by hand)."""
    torchmetrics = pytest.importorskip("torchmetrics")

    class Acc(L.LightningModule):
        def __init__(self, batch_size: int) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.batch_size = batch_size
            self.net = torch.nn.Linear(16, 3)
            g = torch.Generator().manual_seed(1)
            self.ds = TensorDataset(torch.randn(64, 16, generator=g), torch.randint(0, 3, (64,), generator=g))
            self.acc = torchmetrics.classification.MulticlassAccuracy(num_classes=3, average="micro")
            self.tp_at_start = -1

        def train_dataloader(self):
            return DataLoader(self.ds, batch_size=self.batch_size)

        def training_step(self, batch, i):
            x, y = batch
            logits = self.net(x)
            self.acc.update(logits, y)
            self.log("acc", self.acc, on_step=False, on_epoch=True)
            return torch.nn.functional.cross_entropy(logits, y)

        def on_train_epoch_start(self):
            self.tp_at_start = int(self.acc.tp.sum())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    knee = KneeBatchSize(16, timing=FAST, use_cache=False, max_micro_batch=8)
    tuned = Acc(4)
    t1 = _trainer(tmp_path, knee, accumulate_grad_batches=4, max_epochs=1)
    t1.fit(tuned)
    by_hand = Acc(knee.micro_batch)
    t2 = _trainer(tmp_path, accumulate_grad_batches=knee.grad_accum, max_epochs=1)
    t2.fit(by_hand)
    assert tuned.tp_at_start == 0
    assert float(t1.callback_metrics["acc"]) == float(t2.callback_metrics["acc"])


class _Counted(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(8, 1)
        self.batch_size = 8
        self.rows = self.validations = 0

    def training_step(self, batch, i):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x).squeeze(-1), y)

    def on_train_batch_start(self, batch, i):
        self.rows += len(batch[0])

    def validation_step(self, batch, i):
        pass

    def on_validation_epoch_end(self):
        self.validations += 1

    def train_dataloader(self):
        g = torch.Generator().manual_seed(2)
        return DataLoader(TensorDataset(torch.randn(512, 8, generator=g), torch.randn(512, generator=g)),
                          batch_size=self.batch_size)  # fmt: skip

    def val_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(16, 8), torch.randn(16)), batch_size=8)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_batch_counts_given_as_ints_keep_their_rows_at_the_knee(tmp_path):
    """limit_train_batches=10 and val_check_interval=5 count loader batches: at b_m 4 for the user's 8 the run trained
    80 rows for 160 and took 4 optimizer steps for 6, silently."""
    runs = []
    for knee in (None, KneeBatchSize(32, timing=FAST, use_cache=False, max_micro_batch=4)):
        module = _Counted()
        trainer = _trainer(tmp_path, *([knee] if knee else []), max_epochs=2, limit_train_batches=10,
                           val_check_interval=5, accumulate_grad_batches=4)  # fmt: skip
        trainer.fit(module)
        runs.append((module.batch_size, trainer.global_step, module.rows, module.validations))
    (b0, steps0, rows0, vals0), (b1, steps1, rows1, vals1) = runs
    assert b1 != b0  # the knee moved b_m (capped at 4): the counts had to follow
    assert (steps1, rows1, vals1) == (steps0, rows0, vals0) == (6, 160, 4)


class _Twenty(_Counted):
    """20 rows in batches of 8: 8, 8 and a partial 4."""

    def train_dataloader(self):
        g = torch.Generator().manual_seed(2)
        return DataLoader(TensorDataset(torch.randn(20, 8, generator=g), torch.randn(20, generator=g)),
                          batch_size=self.batch_size)  # fmt: skip


def test_val_check_interval_stays_within_the_epoch_a_partial_batch_makes(tmp_path):
    """val_check_interval 3 (every batch of 8, 8, 4: the epoch's end) became 6 batches of 4 where 20 rows make 5, and
    Lightning refused the fit; fast_dev_run's one batch is Lightning's, not rescaled."""
    knee = KneeBatchSize(8, timing=FAST, use_cache=False, max_micro_batch=4)
    module = _Twenty()
    trainer = _trainer(tmp_path, knee, max_epochs=1, val_check_interval=3)
    trainer.fit(module)
    assert knee.micro_batch == 4 and trainer.val_check_interval == 5
    assert module.rows == 20 and module.validations == 1
    quick = _trainer(
        tmp_path, KneeBatchSize(8, timing=FAST, use_cache=False, max_micro_batch=4), fast_dev_run=True
    )
    quick.fit(_Twenty())
    assert quick.limit_train_batches == 1


def test_a_fit_that_fails_before_it_starts_leaves_the_module_s_configure_optimizers(tmp_path):
    """The recording wrapper went on in setup and came off only at on_fit_start: a fit that failed in between (a
    missing checkpoint) left it, and a deepcopy of the module then built an optimizer over the original's weights."""
    import copy

    module = _Counted()
    with pytest.raises(FileNotFoundError):
        _trainer(tmp_path, KneeBatchSize(32, timing=FAST, use_cache=False)).fit(
            module, ckpt_path="/nonexistent.ckpt"
        )
    assert "configure_optimizers" not in module.__dict__
    twin = copy.deepcopy(module)
    held = {id(p) for g in twin.configure_optimizers().param_groups for p in g["params"]}
    assert held == {id(p) for p in twin.parameters()}
