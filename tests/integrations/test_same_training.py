"""Training with the tuner is training without it (issue 30): with shuffling and dropout on, the first
losses of a run tuned by the integration equal, bitwise, those of a run set by hand to the same b_m and
g. The Accelerate decorator's equivalent is ``test_accelerate.py::test_the_real_call_draws_what_it_would
_have_drawn_without_the_probes``."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from microbatch.measure.timing import TimingConfig  # noqa: E402

FAST = TimingConfig(warmup=1, min_repeats=2, max_repeats=3, max_time_s=0.3, rel_tol=0.9)
B = 16


def test_lightning_knee_batch_size_trains_as_a_run_without_it(tmp_path, caplog):
    L = pytest.importorskip("lightning.pytorch")
    from torch.utils.data import DataLoader, TensorDataset

    from microbatch.integrations.lightning import KneeBatchSize

    class Drop(L.LightningModule):
        def __init__(self, batch_size=2):
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(64, 1)
            )
            self.batch_size = batch_size
            g = torch.Generator().manual_seed(1)
            self.data = TensorDataset(torch.randn(256, 32, generator=g), torch.randn(256, generator=g))
            self.losses: list[float] = []

        def training_step(self, batch, i):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x).squeeze(-1), y)
            self.losses.append(loss.item())
            return loss

        def train_dataloader(self):
            return DataLoader(self.data, batch_size=self.batch_size, shuffle=True)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

        def on_train_start(self):
            self.losses.clear()  # the probes' steps

    def fit(module, callbacks=(), accumulate=1):
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                            callbacks=list(callbacks), accumulate_grad_batches=accumulate,
                            default_root_dir=str(tmp_path))  # fmt: skip
        trainer.fit(module)
        return module.losses

    torch.manual_seed(0)
    knee = KneeBatchSize(B, timing=FAST, max_micro_batch=8, use_cache=False)
    with caplog.at_level("INFO", logger="lightning.pytorch"):
        tuned = fit(Drop(), [knee])
    b, g = knee.micro_batch, knee.grad_accum
    assert b is not None and g is not None and b * g == B
    # the choice is said once, through Lightning's rank_zero_info (shown by Lightning's default logging)
    said = [r.getMessage() for r in caplog.records if r.name.startswith("lightning.pytorch")]
    assert [m for m in said if m.startswith("microbatch: use b_m")] == [
        next(
            m
            for m in said
            if m.startswith(f"microbatch: use b_m = {b}, g = {g} (b_m x g x world = {b} x {g} x 1")
        )
    ]
    torch.manual_seed(0)
    plain = fit(Drop(batch_size=b), accumulate=g)
    assert len(tuned) == len(plain) == 3 * g
    assert tuned == plain  # bitwise: the same shuffled order, the same dropout masks


def test_hf_tune_trainer_trains_as_a_run_without_it(tmp_path):
    transformers = pytest.importorskip("transformers")
    from microbatch.integrations.hf import tune_trainer

    def trainer(b, g):
        torch.manual_seed(0)
        cfg = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=64, n_positions=16,
                                      resid_pdrop=0.3, embd_pdrop=0.3, attn_pdrop=0.3)  # fmt: skip
        model = transformers.GPT2LMHeadModel(cfg)
        ids = torch.randint(0, 64, (128, 16), generator=torch.Generator().manual_seed(1))
        data = [{"input_ids": x, "labels": x} for x in ids]
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path), per_device_train_batch_size=b, gradient_accumulation_steps=g, max_steps=2,
            use_cpu=True, report_to="none", logging_strategy="no", save_strategy="no", dataloader_num_workers=0,
            seed=0,
        )  # fmt: skip
        t = transformers.Trainer(model=model, args=args, train_dataset=data)
        losses: list[float] = []
        model.register_forward_hook(lambda m, a, out: losses.append(out.loss.item()) if m.training else None)
        return t, losses

    tuned_trainer, tuned = trainer(4, 4)  # B = 16
    import logging

    class Keep(logging.Handler):
        def __init__(self):
            super().__init__(level=logging.NOTSET)
            self.records: list[logging.LogRecord] = []

        def emit(self, record):
            self.records.append(record)

    keep, hf_logger = Keep(), transformers.utils.logging.get_logger("transformers.trainer")
    hf_logger.addHandler(keep)
    try:
        tune_trainer(tuned_trainer, timing=FAST, max_micro_batch=8, use_cache=False)
    finally:
        hf_logger.removeHandler(keep)
    b, g = tuned_trainer.args.per_device_train_batch_size, tuned_trainer.args.gradient_accumulation_steps
    tuned.clear()  # the probes' forwards
    # said once through the Trainer's logger, at WARNING: the level its default verbosity shows
    said = [r for r in keep.records if "microbatch: use b_m" in r.getMessage()]
    shown = transformers.utils.logging.get_verbosity()  # the default: WARNING
    assert all(r.levelno >= shown for r in said)
    assert len(said) == 1 and said[0].levelname == "WARNING", [r.getMessage() for r in said]
    assert said[0].getMessage().startswith(f"microbatch: use b_m = {b}, g = {g}")
    tuned_trainer.train()
    plain_trainer, plain = trainer(b, g)
    plain_trainer.train()
    assert len(tuned) == len(plain) == 2 * g
    assert tuned == plain
