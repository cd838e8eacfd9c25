"""Lightning loops as users write them (a helper's review, 2026-12-07): SplitOnOOM with count_fn stopped the fit at a
batch with no real tokens though nothing ran out of memory; a per-token mean over an ``(x, y)`` tuple batch was split
inexactly without the warning a dict batch gets; KneeBatchSize moving a per-token mean loss from 1 to g accumulated
micro-batches (a mean of means: 59% off here) said nothing."""

from __future__ import annotations

import logging
import warnings

import pytest

torch = pytest.importorskip("torch")
L = pytest.importorskip("lightning.pytorch")

from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from microbatch.integrations.lightning import KneeBatchSize, SplitOnOOM  # noqa: E402
from microbatch.integrations.lightning_oom import _per_token_labels  # noqa: E402
from microbatch.measure.timing import TimingConfig  # noqa: E402

F = torch.nn.functional
logging.getLogger("lightning").setLevel(logging.ERROR)
G = torch.Generator().manual_seed(1)
IDS = torch.randint(0, 40, (16, 10), generator=G)
LABELS = IDS.masked_fill(torch.arange(10)[None] >= torch.tensor([1] * 4 + [10] * 12)[:, None], -100)


class LM(L.LightningModule):
    def __init__(self, data, oom_over=None):
        super().__init__()
        torch.manual_seed(0)
        self.data, self.oom_over, self.batch_size = data, oom_over, 16
        self.net = torch.nn.Sequential(torch.nn.Embedding(40, 16), torch.nn.Linear(16, 40)).double()

    def training_step(self, b, i):
        x, y = (b["ids"], b["labels"]) if isinstance(b, dict) else b
        if self.oom_over and len(x) > self.oom_over:
            raise torch.OutOfMemoryError("injected: CUDA out of memory.")
        n = (y != -100).sum().clamp(min=1)  # a token mean that is 0, not nan, on a batch with no labels
        return F.cross_entropy(self.net(x).flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum") / n

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=self.batch_size)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1.0)


def _fit(model, callbacks, **kw):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        L.Trainer(accelerator="cpu", callbacks=callbacks, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False, **kw).fit(model)  # fmt: skip
    return [str(w.message) for w in caught]


def test_a_batch_with_no_counted_items_trains_as_the_unsplit_step():
    masked = LABELS.clone()
    masked[8:] = -100  # the second batch: prompts only
    data = [{"ids": a, "labels": b} for a, b in zip(IDS, masked, strict=True)]
    ref, run = LM(data), LM(data)
    ref.batch_size = run.batch_size = 8
    _fit(ref, [], max_epochs=1)
    _fit(
        run, [SplitOnOOM(count_fn=lambda b: (b["labels"] != -100).sum())], max_epochs=1
    )  # raised ConfigError
    for a, b in zip(ref.parameters(), run.parameters(), strict=True):
        assert torch.allclose(a, b, rtol=0, atol=1e-12)


def test_a_tuple_batch_with_per_token_labels_is_warned_of():
    assert _per_token_labels((IDS, LABELS)) and not _per_token_labels((IDS, IDS))  # inputs hold no -100
    assert not _per_token_labels((IDS.double(), LABELS[:, 0]))
    said = _fit(LM(TensorDataset(IDS, LABELS), oom_over=8), [SplitOnOOM()], max_steps=1)
    assert any("SplitOnOOM split a step whose batch has per-token labels" in s for s in said)


def test_knee_batch_size_says_a_per_token_mean_becomes_a_mean_of_means():
    data = [{"ids": a, "labels": b} for a, b in zip(IDS, LABELS, strict=True)]
    fast = TimingConfig(warmup=1, min_repeats=2, max_repeats=3, max_time_s=0.3, rel_tol=0.9)
    knee = KneeBatchSize(global_batch=16, max_micro_batch=4, use_cache=False, timing=fast)
    said = _fit(LM(data), [knee], max_steps=1)
    assert knee.grad_accum is not None and knee.grad_accum > 1
    assert any(
        f"accumulate_grad_batches = {knee.grad_accum} on a batch with per-token labels" in s for s in said
    )
