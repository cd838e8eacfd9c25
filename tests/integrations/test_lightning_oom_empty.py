"""SplitOnOOM where a piece of a split batch holds no labelled token: the piece still runs its forward (its dropout
draws keep the random stream where the unsplit step leaves it), adds nothing to a mean, and the fit equals one
without the out-of-memory (fp64, 1e-10) — it drifted by ~1e-1 when such pieces were skipped."""

from __future__ import annotations

import logging
import warnings

import pytest

torch = pytest.importorskip("torch")
L = pytest.importorskip("lightning.pytorch")

from torch.utils.data import DataLoader  # noqa: E402

from microbatch.integrations.lightning import SplitOnOOM  # noqa: E402

V, T, N = 7, 5, 24


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, V, (N, T), generator=g)
    y = torch.randint(0, V, (N, T), generator=g)
    y[4:8] = -100  # rows 4-7: no labelled token, a piece of its own once a 6-row batch splits to 2 rows
    return [{"x": x[i], "y": y[i]} for i in range(N)]


class Limit:
    """A forward hook: out of memory past ``rows`` rows (0: never)."""

    def __init__(self, rows: int) -> None:
        self.rows, self.failures = rows, 0

    def __call__(self, module, inputs, output):
        if self.rows and inputs[0].shape[0] > self.rows:
            self.failures += 1
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")


class TokenNet(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.net = torch.nn.Sequential(
            torch.nn.Embedding(V, 8),
            torch.nn.Dropout(0.3),
            torch.nn.Linear(8, 8),
            torch.nn.Tanh(),
            torch.nn.Linear(8, V),
        ).double()

    def training_step(self, batch, i):
        logits = self.net(batch["x"])
        return torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), batch["y"].flatten(), ignore_index=-100
        )

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-2)


def _fit(limit: int, callback):
    model, hook = TokenNet(), Limit(limit)
    model.net[2].register_forward_hook(hook)
    torch.manual_seed(123)
    trainer = L.Trainer(
        max_steps=3, accumulate_grad_batches=2, callbacks=[callback] if callback else [], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.getLogger("lightning").setLevel(logging.ERROR)
        trainer.fit(model, DataLoader(_data(), batch_size=6, shuffle=False))
    return torch.cat([p.detach().flatten() for p in model.parameters()]), hook.failures


def test_a_split_with_pieces_of_no_items_trains_as_the_unsplit_fit():
    plain, _ = _fit(0, None)
    split, failures = _fit(2, SplitOnOOM(count_fn=lambda b: (b["y"] != -100).sum()))
    assert failures > 0
    assert torch.allclose(split, plain, rtol=1e-10, atol=1e-12), (split - plain).abs().max().item()
