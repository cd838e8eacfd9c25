"""KneeBatchSize in a real Lightning fit on the CPU: b_m × g × world == B, the knee, no trace, bad input."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
L = pytest.importorskip("lightning.pytorch")

from torch.utils.data import DataLoader, IterableDataset, TensorDataset  # noqa: E402

from microbatch.errors import ConfigError  # noqa: E402
from microbatch.integrations.lightning import KneeBatchSize  # noqa: E402
from microbatch.measure.timing import TimingConfig  # noqa: E402

FAST = TimingConfig(warmup=1, min_repeats=2, max_repeats=3, max_time_s=0.3, rel_tol=0.9)
B = 16


class Tiny(L.LightningModule):
    def __init__(self, batch_size=2, loader="map"):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
        self.batch_size = batch_size
        self.loader = loader
        g = torch.Generator().manual_seed(1)
        self.data = TensorDataset(torch.randn(512, 32, generator=g), torch.randn(512, generator=g))
        self.seen: list[int] = []

    def training_step(self, batch, i):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x).squeeze(-1), y)
        self.log("loss", loss)
        return loss

    def on_train_batch_start(self, batch, i):
        self.seen.append(len(batch[0]))

    def train_dataloader(self):
        if self.loader == "sampler":
            from torch.utils.data import BatchSampler, SequentialSampler

            return DataLoader(self.data, batch_sampler=BatchSampler(SequentialSampler(self.data), 4, False))
        if self.loader == "iterable":

            class Stream(IterableDataset):
                def __iter__(s):
                    return iter(zip(self.data.tensors[0], self.data.tensors[1], strict=True))

            return DataLoader(Stream(), batch_size=self.batch_size)
        return DataLoader(self.data, batch_size=self.batch_size)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class Before(L.Callback):
    """The state right after tuning (the next on_fit_start hook), before the fit loop starts."""

    def on_fit_start(self, trainer, module):
        self.weights = {k: v.clone() for k, v in module.state_dict().items()}
        self.opt_state = dict(trainer.optimizers[0].state)
        self.grads = [p.grad for p in module.parameters()]
        self.rng = torch.get_rng_state().clone()
        self.training = [m.training for m in module.modules()]


def _trainer(*callbacks, devices=1, max_steps=2, **kw):
    return L.Trainer(accelerator="cpu", devices=devices, max_steps=max_steps, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                     callbacks=list(callbacks), **kw)  # fmt: skip


def test_fit_runs_at_the_knee_with_global_batch_exact_and_no_trace(caplog):
    caplog.set_level("INFO", logger="microbatch.integrations")
    module = Tiny()
    weights0 = {k: v.clone() for k, v in module.state_dict().items()}
    knee, first, before = (
        KneeBatchSize(B, timing=FAST, max_micro_batch=8, use_cache=False),
        Before(),
        Before(),
    )
    trainer = _trainer(first, knee, before)  # the state just before and just after tuning
    trainer.fit(module)
    b, g = knee.micro_batch, knee.grad_accum
    assert b * g * trainer.world_size == B
    assert module.batch_size == b and trainer.accumulate_grad_batches == g
    # the curve and the choice are logged, one line per probe and one for the choice
    lines = [r.getMessage() for r in caplog.records if r.name == "microbatch.integrations"]
    assert len(lines) == len(knee.result.points) + 1
    assert f"knee b_m = {b}, g = {g}, world 1: B_global = {b} × {g} × 1 = {B}" in lines[-1]
    # training ran at b_m: 2 optimizer steps of g micro-batches of b samples each
    assert module.seen == [b] * (2 * g) and trainer.global_step == 2
    # the knee is within τ of the best probed point
    rec = knee.result.recommendation
    best = max(p.throughput for p in knee.result.points if not p.oom)
    assert rec.knee.throughput >= (1 - rec.tolerance) * best
    assert knee.result.probes >= 2
    # the state training started from is the state before tuning (bitwise)
    assert all(torch.equal(weights0[k], before.weights[k]) for k in weights0)
    assert before.opt_state == {} and all(gr is None for gr in before.grads)
    assert torch.equal(before.rng, first.rng)  # tuning consumed no random numbers
    assert all(torch.equal(first.weights[k], before.weights[k]) for k in weights0)
    assert before.training == [True] * len(before.training)


def test_refuses_before_any_probe_with_the_model_untouched():
    def refused(module, match, **kw):
        weights0 = {k: v.clone() for k, v in module.state_dict().items()}
        bs0 = module.batch_size if hasattr(module, "batch_size") else None
        with pytest.raises(ConfigError, match=match):
            _trainer(KneeBatchSize(kw.pop("global_batch", B), timing=FAST, max_micro_batch=4, use_cache=False,
                                   **kw)).fit(module)  # fmt: skip
        assert all(torch.equal(weights0[k], v) for k, v in module.state_dict().items())
        if bs0 is not None:
            assert module.batch_size == bs0

    refused(Tiny(), r"batch size attribute 'bs' was not found .* BatchSizeFinder", batch_arg_name="bs")
    refused(
        Tiny(loader="sampler"), r"batch size is None after setting batch_size = 2: .* fixed batch_sampler"
    )
    refused(Tiny(loader="iterable"), r"iterable dataset \(Stream\).* map-style Dataset")
    with pytest.raises(ConfigError, match=r"global_batch 0 must be a whole number >= 1"):
        KneeBatchSize(0)


def test_unsupported_strategy_is_named():
    from microbatch.integrations.lightning import _check_strategy

    class FakeTrainer:
        class strategy:  # noqa: N801 - stands in for a Trainer's strategy
            pass

    with pytest.raises(
        ConfigError, match=r"cannot tune under strategy type: it supports SingleDeviceStrategy, DDP"
    ):
        _check_strategy(FakeTrainer)
    from lightning.pytorch.strategies import DeepSpeedStrategy

    FakeTrainer.strategy = DeepSpeedStrategy.__new__(DeepSpeedStrategy)
    with pytest.raises(ConfigError, match=r"strategy DeepSpeedStrategy"):
        _check_strategy(FakeTrainer)


_DDP_CHILD = r"""
import json, os, sys, torch
sys.path.insert(0, os.environ["TESTS_DIR"])
from test_lightning import Tiny, _trainer, FAST
from microbatch.integrations.lightning import KneeBatchSize
torch.set_num_threads(1)
module = Tiny()
knee = KneeBatchSize(int(os.environ["GLOBAL_BATCH"]), timing=FAST, max_micro_batch=4)
trainer = _trainer(knee, strategy="ddp", devices=2, num_nodes=1)
trainer.fit(module)
out = {"rank": trainer.global_rank, "world": trainer.world_size, "b": knee.micro_batch, "g": knee.grad_accum,
       "acc": trainer.accumulate_grad_batches, "bs": module.batch_size, "seen": module.seen,
       "points": [p.micro_batch for p in knee.result.points]}
open(os.path.join(os.environ["OUT_DIR"], f"rank{trainer.global_rank}.json"), "w").write(json.dumps(out))
"""


def test_ddp_two_gloo_ranks_agree_on_one_micro_batch(tmp_path):
    from _helpers import run_launched

    r0, r1 = run_launched(_DDP_CHILD, tmp_path, GLOBAL_BATCH=str(B), TESTS_DIR=os.path.dirname(__file__))
    assert r0["world"] == r1["world"] == 2
    assert r0["b"] == r1["b"] and r0["g"] == r1["g"] and r0["points"] == r1["points"]
    assert r0["b"] * r0["g"] * 2 == B and r0["acc"] == r0["g"] and r0["bs"] == r0["b"]
    assert r0["seen"] == [r0["b"]] * (2 * r0["g"]) == r1["seen"]
    assert max(r0["points"]) <= B // 2


class GPT(L.LightningModule):
    """The built-in GPT on token ids, with its ``checkpointing`` switch on the module (where
    ``set_checkpointing`` finds it)."""

    def __init__(self):
        super().__init__()
        from microbatch.measure.gpt import build_model, next_token_loss
        from microbatch.model import get_model

        shape = get_model("tiny", seq=16)
        self.gpt, self.loss_of = build_model(shape), next_token_loss
        self.batch_size = 1
        self.data = torch.randint(0, shape.vocab, (256, 16), generator=torch.Generator().manual_seed(0))
        self.checkpointing = False
        self.checkpointed: list[bool] = []

    def training_step(self, batch, i):
        self.gpt.checkpointing = self.checkpointing
        self.checkpointed.append(self.checkpointing)
        return self.loss_of(self.gpt(batch), batch)

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=self.batch_size)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def test_probing_with_checkpointing_on_leaves_the_switch_off_for_training():
    module = GPT()
    knee = KneeBatchSize(4, timing=FAST, max_micro_batch=2, use_cache=False, checkpointing="on")
    trainer = _trainer(knee)
    trainer.fit(module)
    probes = len(module.checkpointed) - 2 * knee.grad_accum  # then fit's 2 steps of g micro-batches
    # every probe ran with checkpointing on (the first step, which makes AdamW's state, is not a probe)
    assert probes > 1 and all(module.checkpointed[1:probes])
    assert all(p.checkpointing for p in knee.result.points)
    assert module.checkpointing is False  # put back as found
    assert not any(module.checkpointed[probes:])  # and training ran without it, as the user set


def test_the_search_never_asks_the_loader_for_more_than_the_data_holds():
    """12 samples, B_global 32: a loader asked for 16 or 32 rows gives 12 (the whole dataset), and
    its throughput would be counted for rows never run; the probes stop at 12's largest ladder step."""
    module = Tiny()
    module.data = TensorDataset(module.data.tensors[0][:12], module.data.tensors[1][:12])
    asked: list[int] = []
    real = module.training_step

    def step(batch, *args, **kwargs):
        asked.append(len(batch[0]))
        return real(batch, *args, **kwargs)

    module.training_step = step
    knee = KneeBatchSize(32, timing=FAST, use_cache=False)
    _trainer(knee).fit(module)
    probed = [p.micro_batch for p in knee.result.points]
    assert max(probed) <= 12 and 32 % knee.micro_batch == 0
    assert set(asked) <= set(probed) | {knee.micro_batch, 12 % knee.micro_batch}  # every batch as labelled


class Scheduled(Tiny):
    """A one-cycle schedule over the steps Lightning estimates (its docs' pattern), sized at configure_optimizers."""

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        self.total = self.trainer.estimated_stepping_batches
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, 0.1, total_steps=self.total)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def test_a_schedule_over_the_estimated_steps_is_built_for_the_knee():
    """An integration helper's finding: the strategy builds the optimizers before on_fit_start, so a schedule
    sized from estimated_stepping_batches covered the pre-tune batch's steps (64 against the 8 that ran): the
    training was not a by-hand run's. configure_optimizers now runs again at the chosen b_m and g."""
    module = Scheduled()
    original = module.batch_size
    knee = KneeBatchSize(B, timing=FAST, max_micro_batch=8, use_cache=False)
    _trainer(knee, max_steps=-1, max_epochs=1, limit_train_batches=64).fit(module)
    b, g = knee.micro_batch, knee.grad_accum
    batches = module.trainer.limit_train_batches  # 64 batches of the user's size, counted in batches of b_m
    assert batches * b == 64 * original
    assert module.total == batches // g  # the optimizer steps of one epoch of those batches, g at a time
    assert module.trainer.global_step == module.total and b * g == B


class NoIndex(Tiny):
    def training_step(self, batch):  # Lightning 2 passes batch_idx only where the hook takes it
        return torch.nn.functional.mse_loss(self.net(batch[0]).squeeze(-1), batch[1])


class TwoLoaders(Tiny):
    def training_step(self, batch, i):
        return sum(torch.nn.functional.mse_loss(self.net(x).squeeze(-1), y) for x, y in batch.values())

    def train_dataloader(self):
        return {name: DataLoader(self.data, batch_size=self.batch_size) for name in ("a", "b")}


def test_a_step_without_batch_idx_is_probed_and_other_layouts_refused_before_any_probe():
    """An integration helper's findings: training_step(self, batch) raised TypeError in the probe (it was always
    called with an index); a GradientAccumulationScheduler (it changes g, so B, by epoch) was not seen; two train
    loaders had the first loader's batch passed to a step that takes both."""
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    knee = KneeBatchSize(B, timing=FAST, max_micro_batch=8, use_cache=False)
    _trainer(knee).fit(NoIndex())
    assert knee.micro_batch * knee.grad_accum == B
    with pytest.raises(ConfigError, match=r"GradientAccumulationScheduler changes g by epoch"):
        _trainer(KneeBatchSize(B, timing=FAST, use_cache=False), GradientAccumulationScheduler({1: 4})).fit(
            Tiny()
        )
    module = TwoLoaders()
    with pytest.raises(ConfigError, match=r"train_dataloader\(\) returns 2 dataloader\(s\) in a dict"):
        _trainer(KneeBatchSize(B, timing=FAST, use_cache=False)).fit(module)
    assert module.batch_size == 2
    module.train_dataloader = lambda: {
        "a": DataLoader(module.data, batch_size=module.batch_size)
    }  # one, in a dict
    with pytest.raises(
        ConfigError, match=r"returns 1 dataloader\(s\) in a dict"
    ):  # the step takes {"a": batch}
        _trainer(KneeBatchSize(B, timing=FAST, use_cache=False)).fit(module)
