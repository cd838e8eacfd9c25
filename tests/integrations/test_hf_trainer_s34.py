"""tune_trainer as Hugging Face users write their Trainers (a helper's review, 2026-12-08): a ``compute_loss`` of
their own returning a per-batch mean, a ``compute_loss`` that logs, ``auto_find_batch_size``, ``dataloader_drop_last``,
and the tune cache told one Trainer's loss from another's."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from microbatch.choose.tune.cache import callable_identity  # noqa: E402
from microbatch.errors import ConfigError  # noqa: E402
from microbatch.integrations.hf import _probe_step, tune_trainer  # noqa: E402
from microbatch.measure.timing import TimingConfig  # noqa: E402

FAST = TimingConfig(warmup=1, min_repeats=2, max_repeats=3, max_time_s=0.3, rel_tol=0.9)
N = 20


class MeanTrainer(transformers.Trainer):
    """The common pattern: the model's loss returned whatever num_items_in_batch says (a per-batch mean)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return model(**inputs).loss


class LoggingTrainer(transformers.Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        self.log({"my_metric": 1.0})
        return loss


class Seen(transformers.TrainerCallback):
    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs or {}))


def _trainer(tmp_path, cls=transformers.Trainer, batch=8, ga=1, rows=N, **kw):
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64,
                                                                 resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)).double()  # fmt: skip
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 64, (rows, 12), generator=g)
    data = [{"input_ids": a, "labels": a} for a in ids]
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=batch,
        gradient_accumulation_steps=ga, max_steps=1, optim="sgd", max_grad_norm=0.0, use_cpu=True, report_to="none",
        logging_steps=1, save_strategy="no", dataloader_num_workers=0, learning_rate=1e-2, **kw)  # fmt: skip
    return cls(model=model, args=args, train_dataset=data)


def test_a_compute_loss_returning_a_mean_is_divided_by_g(tmp_path, caplog):
    run = _trainer(tmp_path, MeanTrainer, batch=16)
    assert (
        run.model_accepts_loss_kwargs is True
    )  # transformers' rule: the loss taken as normalised, not divided
    rng = torch.get_rng_state()
    tune_trainer(run, max_micro_batch=4, timing=FAST, use_cache=False)
    assert torch.equal(
        rng, torch.get_rng_state()
    )  # the measurement's batch drew nothing the training would see
    assert run.args.gradient_accumulation_steps > 1  # 16 rows, at most 4 a micro-batch
    assert run.model_accepts_loss_kwargs is False  # each micro-batch's mean is now divided by g
    assert any("MeanTrainer.compute_loss returns a per-batch mean" in r.getMessage() for r in caplog.records)
    share = _trainer(tmp_path, batch=16)  # the Trainer's own causal-LM loss divides by num_items_in_batch
    tune_trainer(share, max_micro_batch=4, timing=FAST, use_cache=False)
    assert share.model_accepts_loss_kwargs is True


def test_the_probes_do_not_reach_the_user_s_logs(tmp_path):
    seen = Seen()
    run = _trainer(tmp_path, LoggingTrainer, batch=8)
    run.add_callback(seen)
    tune_trainer(run, max_micro_batch=4, timing=FAST, use_cache=False)
    assert seen.logs == [] and run.state.log_history == []  # the probes logged 30-odd times before
    assert "log" not in vars(run)  # the Trainer's own method again
    run.train()
    assert any("my_metric" in x for x in seen.logs)  # training's logs still arrive


def test_auto_find_batch_size_is_refused_before_any_probe(tmp_path):
    run = _trainer(tmp_path, auto_find_batch_size=True)
    run.compute_loss = lambda *a, **k: pytest.fail("probed")
    with pytest.raises(ConfigError, match="auto_find_batch_size=False"):
        tune_trainer(run, timing=FAST, use_cache=False)


def test_drop_last_that_keeps_other_rows_is_said(tmp_path, caplog):
    run = _trainer(tmp_path, batch=8, ga=1, rows=20, dataloader_drop_last=True)
    tune_trainer(run, max_micro_batch=4, timing=FAST, use_cache=False)  # 8 x 1 -> 4 x 2
    msgs = [r.getMessage() for r in caplog.records if "dataloader_drop_last" in r.getMessage()]
    # 20 rows: at 8 x 1, 2 steps on 16 rows; at 4 x 2, 5 micro-batches, 3 steps on 20 rows
    assert msgs and "trains on 20 rows in 3 optimizer steps, where 8 × 1 trained on 16 in 2" in msgs[0]
    caplog.clear()
    same = _trainer(tmp_path, batch=8, ga=1, rows=16, dataloader_drop_last=True)
    tune_trainer(same, max_micro_batch=4, timing=FAST, use_cache=False)  # 16 rows: 2 steps of 16 either way
    assert not any("dataloader_drop_last" in r.getMessage() for r in caplog.records)


def test_the_cache_key_tells_trainers_losses_apart(tmp_path):
    keys = set()
    for cls in (transformers.Trainer, MeanTrainer, LoggingTrainer):
        t = _trainer(tmp_path, cls)
        keys.add(callable_identity(_probe_step(t, t.train_dataset, None)[1]))
    smooth = _trainer(tmp_path, label_smoothing_factor=0.1)
    keys.add(callable_identity(_probe_step(smooth, smooth.train_dataset, None)[1]))
    assert len(keys) == 4


class TargetTrainer(transformers.Trainer):
    """A mean loss from a key of the user's own: no labels, so transformers divides by g itself."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        target = inputs.pop("target")
        return model(**inputs, labels=target).loss


def test_a_batch_without_labels_is_left_as_transformers_divides_it(tmp_path, caplog):
    run = _trainer(tmp_path, TargetTrainer, batch=16)
    run.train_dataset = [{"input_ids": r["input_ids"], "target": r["labels"]} for r in run.train_dataset]
    run.args.remove_unused_columns = False
    tune_trainer(run, max_micro_batch=4, timing=FAST, use_cache=False)
    assert run.args.gradient_accumulation_steps > 1 and run.model_accepts_loss_kwargs is True
    assert not any("returns a per-batch mean" in r.getMessage() for r in caplog.records)


class PopTrainer(transformers.Trainer):
    """transformers' documented custom loss: the labels popped from the batch."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        logits = model(**inputs).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1)
        )
        return (loss, None) if return_outputs else loss


def test_a_compute_loss_that_pops_the_labels_is_probed(tmp_path):
    run = _trainer(tmp_path, PopTrainer, batch=16)
    tune_trainer(run, max_micro_batch=4, timing=FAST, use_cache=False)  # KeyError 'labels' on the second call
    assert run.args.gradient_accumulation_steps > 1
    run.train()
