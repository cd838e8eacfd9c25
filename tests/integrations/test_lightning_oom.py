"""SplitOnOOM in a real Lightning fit on the CPU: an out-of-memory injected at the allocation point (the CPU
allocator's RuntimeError, or torch.OutOfMemoryError) splits the batch, and the weights, the gradients the hooks
and the clipping see, and the loss Lightning receives equal a fit without the injection (fp64, 1e-10)."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
L = pytest.importorskip("lightning.pytorch")

from _helpers import AllocationLimit  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from microbatch.errors import ConfigError, OutOfMemoryError  # noqa: E402
from microbatch.integrations.lightning import SplitOnOOM  # noqa: E402
from microbatch.run.accumulate.controller import MicroBatchController  # noqa: E402
from microbatch.run.accumulate.oom import CPU_ALLOC_FAILURE  # noqa: E402

WIDTH = 64  # the hidden layer: a (rows, 64) fp64 activation is rows × 512 bytes
FITS = 4 * WIDTH * 8  # 4 rows fit, 8 do not; the largest weight (64, 4) and its gradient are 2048 bytes too
ROWS = 16


class CPUAllocationLimit(AllocationLimit):
    """The same injector, raising what torch's CPU allocator raises: a RuntimeError in its own words."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.numel() * t.element_size() > self.max_bytes:
                self.failures += 1
                raise RuntimeError(
                    f"[enforce fail at alloc_cpu.cpp:127] err == 0. {CPU_ALLOC_FAILURE}: you tried to allocate "
                    f"{t.numel() * t.element_size()} bytes. Error code 12 (Cannot allocate memory)"
                )
        return out


class Net(L.LightningModule):
    def __init__(self, batch: str = "tuple"):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, WIDTH), torch.nn.Tanh(), torch.nn.Linear(WIDTH, 1)
        ).double()
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(64, 4, generator=g, dtype=torch.float64)
        self.y = torch.randn(64, generator=g, dtype=torch.float64)
        self.batch = batch
        self.norms: list[float] = []  # the gradient the optimizer step and the clipping receive
        self.losses: list[float] = []  # the loss Lightning hands to on_train_batch_end
        self.forwards = 0

    def training_step(self, batch, i):
        x, y = batch
        self.forwards += 1
        loss = torch.nn.functional.mse_loss(self.net(x).squeeze(-1), y)
        self.log("loss", loss)
        return loss

    def on_before_optimizer_step(self, optimizer):
        self.norms.append(sum(float(p.grad.pow(2).sum()) for p in self.parameters()) ** 0.5)

    def on_train_batch_end(self, outputs, batch, i):
        self.losses.append(float(outputs["loss"]))

    def train_dataloader(self):
        return DataLoader(TensorDataset(self.x, self.y), batch_size=ROWS)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class MaskedNet(Net):
    """A dict batch and a per-item mean over the rows the mask keeps (uneven per piece): the mean of the
    pieces' means would be wrong; a training_step without batch_idx, returning a dict."""

    def training_step(self, batch):
        self.forwards += 1
        err = (self.net(batch["x"]).squeeze(-1) - batch["y"]) ** 2
        return {"loss": (err * batch["mask"]).sum() / batch["mask"].sum(), "rows": len(err)}

    def train_dataloader(self):
        mask = (torch.arange(64) % 7 < 2 + torch.arange(64) // 16).double()  # 2..5 of every 7 rows
        data = [{"x": x, "y": y, "mask": m} for x, y, m in zip(self.x, self.y, mask, strict=True)]
        return DataLoader(data, batch_size=ROWS)


def fit(module, *, callback=None, limit=None, agb=1, clip=None, steps=3, **kwargs):
    trainer = L.Trainer(max_steps=steps, accumulate_grad_batches=agb, gradient_clip_val=clip, accelerator="cpu",
        devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[callback] if callback else [], **kwargs)  # fmt: skip
    if limit is None:
        trainer.fit(module)
    else:
        with limit:
            trainer.fit(module)
    return module


def close(a, b, tol=1e-10):
    return all(abs(x - y) <= tol for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize(
    ("agb", "clip", "limit"),
    [(1, None, CPUAllocationLimit), (2, None, AllocationLimit), (2, 0.05, CPUAllocationLimit)],
    ids=["accumulate-1", "accumulate-2", "accumulate-2-clipped"],
)
def test_a_split_fit_equals_the_fit_without_out_of_memory(agb, clip, limit):
    ref = fit(Net(), agb=agb, clip=clip)
    cb, lim = SplitOnOOM(), limit(FITS)
    run = fit(Net(), callback=cb, limit=lim, agb=agb, clip=clip)
    # 16 rows fail, 8 fail, 4 fit: two splits in the first step, then every batch runs in 4 pieces
    assert lim.failures == 2 and cb.controller.splits == 2 and cb.controller.micro_batch_size == 4
    assert [(e.step, e.old, e.new, e.kind) for e in cb.controller.history] == [
        (0, 16, 8, "split"),
        (0, 8, 4, "split"),
    ]
    assert cb.controller.steps == 3 and cb.controller.calls == 3 * agb  # optimizer steps; one call per batch
    assert run.forwards == 3 * agb * 4 + 2  # and the two that failed: 16 rows, then the first 8
    for (name, a), b in zip(ref.named_parameters(), run.parameters(), strict=True):
        assert torch.allclose(a, b, rtol=0, atol=1e-10), name
    assert len(ref.norms) == 3 and close(
        ref.norms, run.norms
    )  # what on_before_optimizer_step and clipping see
    assert len(ref.losses) == 3 * agb and close(
        ref.losses, run.losses
    )  # Lightning's loss / accumulate_grad_batches
    assert "training_step" not in run.__dict__  # the module's own step is back
    if clip is not None:  # the clipping did act: the unclipped fit ends elsewhere
        unclipped = fit(Net(), agb=agb)
        assert min(ref.norms) > clip and not torch.allclose(
            unclipped.net[0].weight, ref.net[0].weight, atol=1e-6
        )


def test_a_dict_batch_with_a_per_item_mean_is_exact_with_count_fn():
    def kept(batch):
        return batch["mask"].sum()

    ref = fit(MaskedNet(), agb=2)
    run = fit(MaskedNet(), callback=SplitOnOOM(count_fn=kept), limit=AllocationLimit(FITS), agb=2)
    rows = fit(
        MaskedNet(), callback=SplitOnOOM(), limit=AllocationLimit(FITS), agb=2
    )  # pieces weighted by rows
    for (name, a), b in zip(ref.named_parameters(), run.parameters(), strict=True):
        assert torch.allclose(a, b, rtol=0, atol=1e-10), name
    assert close(ref.losses, run.losses) and close(ref.norms, run.norms)
    assert not close(ref.norms, rows.norms, tol=1e-6)  # the mean of the pieces' means is another gradient


class SumNet(Net):
    def training_step(self, batch, i):
        x, y = batch
        self.forwards += 1
        return torch.nn.functional.mse_loss(self.net(x).squeeze(-1), y, reduction="sum")


def test_a_summed_loss_with_reduction_sum():
    ref = fit(SumNet(), agb=2)
    run = fit(SumNet(), callback=SplitOnOOM(reduction="sum"), limit=AllocationLimit(FITS), agb=2)
    as_mean = fit(SumNet(), callback=SplitOnOOM(), limit=AllocationLimit(FITS), agb=2)
    for (name, a), b in zip(ref.named_parameters(), run.parameters(), strict=True):
        assert torch.allclose(a, b, rtol=0, atol=1e-10), name
    assert close(ref.losses, run.losses) and not close(ref.losses, as_mean.losses, tol=1e-3)


def test_grow_after_counts_lightnings_optimizer_steps():
    ctrl = MicroBatchController(16, grow_after=1)
    cb = SplitOnOOM(ctrl)
    fit(Net(), callback=cb, limit=AllocationLimit(FITS), agb=2)
    assert ctrl.step_counter is not None and ctrl.step_unit == "optimizer step"
    # step 0 splits 16 → 8 → 4 (not clean: it ran out of memory); step 1 runs clean at 4 (two calls), so step 2
    # grows to 8 and splits again
    assert [(e.kind, e.step, e.old, e.new) for e in ctrl.history] == [
        ("split", 0, 16, 8), ("split", 0, 8, 4), ("grow", 2, 4, 8), ("split", 2, 8, 4),
    ]  # fmt: skip
    assert (ctrl.steps, ctrl.calls) == (3, 6)


class NoRowFits(Net):
    def training_step(self, batch, i):
        with AllocationLimit(8):  # the forward of one row already fails (its activation is 512 bytes)
            return super().training_step(batch, i)


def test_one_row_out_of_memory_raises_and_the_module_is_unwrapped():
    module = NoRowFits()
    before = [p.detach().clone() for p in module.parameters()]
    with pytest.raises(OutOfMemoryError, match="a micro-batch of 1 row is out of memory"):
        fit(module, callback=SplitOnOOM())
    assert "training_step" not in module.__dict__ and module.forwards == 5  # 16, 8, 4, 2, 1 rows
    assert all(torch.equal(a, b) and b.grad is None for a, b in zip(before, module.parameters(), strict=True))


class Manual(Net):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False


class Strings(Net):
    def train_dataloader(self):
        data = [(x, y, "a row") for x, y in zip(self.x, self.y, strict=True)]
        return DataLoader(data, batch_size=ROWS)

    def training_step(self, batch, i):
        return super().training_step(batch[:2], i)


def test_refused_up_front():
    module = Manual()
    with pytest.raises(ConfigError, match=r"automatic_optimization = False.*microbatch\.accumulate"):
        fit(module, callback=SplitOnOOM())
    assert module.forwards == 0
    module = Strings()  # a per-row list of strings splits with the rows (it was refused before 2026-12-05)
    fit(module, callback=SplitOnOOM())
    assert module.forwards > 0 and "training_step" not in module.__dict__
    from lightning.pytorch.plugins.precision import MixedPrecision
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy

    scaler = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    module = Net()
    with pytest.raises(ConfigError, match=r"fp16 with a gradient scaler.*bf16-mixed"):
        fit(module, callback=SplitOnOOM(), plugins=[scaler])
    assert module.forwards == 0
    for strategy in (DDPStrategy(), FSDPStrategy()):
        trainer = SimpleNamespace(strategy=strategy, precision_plugin=None, precision="32-true")
        with pytest.raises(ConfigError, match=rf"single-device strategy only, got {type(strategy).__name__}"):
            SplitOnOOM().setup(trainer, Net(), "fit")
    with pytest.raises(ConfigError, match="the controller holds it"):
        SplitOnOOM(MicroBatchController(4), grow_after=2)
    with pytest.raises(ConfigError, match="reduction must be one of"):
        SplitOnOOM(reduction="max")
    with pytest.raises(ConfigError, match="grow_after must be a whole number"):
        SplitOnOOM(grow_after=0)


class EmptyFirstPiece(MaskedNet):
    """The first 4 rows of every batch are masked out: after the split to 4 rows the first piece has no items
    (it runs, for its random draws; its loss, a mean over none, is replaced by a zero); the step also returns a tensor that carries its graph."""

    def training_step(self, batch):
        self.forwards += 1
        err = (self.net(batch["x"]).squeeze(-1) - batch["y"]) ** 2
        return {"loss": (err * batch["mask"]).sum() / batch["mask"].sum(), "err": {"rows": [err]}}

    def on_train_batch_end(self, outputs, batch, i):
        super().on_train_batch_end(outputs, batch, i)
        self.seen = (
            outputs["loss"].dtype,
            outputs["err"]["rows"][0].grad_fn,
            outputs["err"]["rows"][0].shape,
        )

    def train_dataloader(self):
        mask = (torch.arange(64) % 16 >= 4).double() * (1 + (torch.arange(64) % 3 == 0).double())
        data = [{"x": x, "y": y, "mask": m} for x, y, m in zip(self.x, self.y, mask, strict=True)]
        return DataLoader(data, batch_size=ROWS)


def test_a_piece_without_items_gives_the_models_dtype_and_extra_outputs_are_detached():
    ref = fit(EmptyFirstPiece(), agb=2)
    cb = SplitOnOOM(count_fn=lambda b: b["mask"].sum())
    run = fit(EmptyFirstPiece(), callback=cb, limit=AllocationLimit(FITS), agb=2)
    # 3 steps of 2 batches of 4 pieces, the empty one run too (its random draws), and the 2 failed attempts
    assert cb.controller.micro_batch_size == 4 and run.forwards == 3 * 2 * 4 + 2
    for (name, a), b in zip(ref.named_parameters(), run.parameters(), strict=True):
        assert torch.allclose(a, b, rtol=0, atol=1e-10), name
    assert close(ref.losses, run.losses) and close(ref.norms, run.norms)
    # fp64 as the model's own loss (the stand-in zero of the first piece is not float32), and the last
    # piece's extra output without its graph (Lightning's own step keeps it attached: the graph is ours)
    assert run.seen == (torch.float64, None, (4,)) and ref.seen[0] == torch.float64


class TokenNet(MaskedNet):
    """Per-token labels (a ``labels`` with a sequence dimension, -100 for padding) and a mean over the tokens."""

    def training_step(self, batch):
        self.forwards += 1
        pred = self.net(batch["x"]).squeeze(-1)  # (rows,)
        labels = batch["labels"]  # (rows, 3): the row's target where kept, else -100
        keep = labels != -100
        err = (pred.unsqueeze(-1) - torch.where(keep, labels, 0.0)) ** 2
        return (err * keep).sum() / keep.sum()

    def train_dataloader(self):
        n = torch.arange(64)
        labels = torch.stack([self.y, self.y, self.y], dim=-1)
        labels[(n % 5) < 3, 1:] = -100  # 1 token on 3 rows of 5, 3 on the others: uneven per piece
        data = [{"x": x, "labels": lab} for x, lab in zip(self.x, labels, strict=True)]
        return DataLoader(data, batch_size=ROWS)


def test_per_token_labels_without_count_fn_warn_once_and_count_fn_is_exact():
    """A split step weighted by rows is another gradient for a mean over tokens; SplitOnOOM says so once, as
    the Hugging Face split_on_oom does; with count_fn (the kept tokens) it is exact and says nothing."""
    ref = fit(TokenNet())
    with pytest.warns(RuntimeWarning, match="per-token labels") as rec:
        rows = fit(TokenNet(), callback=SplitOnOOM(), limit=AllocationLimit(FITS))
    assert sum("per-token labels" in str(w.message) for w in rec) == 1
    assert not close(ref.norms, rows.norms, tol=1e-6)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        exact = fit(TokenNet(), callback=SplitOnOOM(count_fn=lambda b: (b["labels"] != -100).sum()),
                    limit=AllocationLimit(FITS))  # fmt: skip
    assert close(ref.norms, exact.norms)
