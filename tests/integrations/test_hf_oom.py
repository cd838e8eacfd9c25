"""tune_trainer's opt-in on_oom="split" / split_on_oom on a real Trainer: an out-of-memory injected at the
allocation point mid-training halves the micro-batch, the step is redone, and the weights equal a run without it."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from _helpers import AllocationLimit  # noqa: E402

from microbatch.integrations.hf import split_on_oom  # noqa: E402


def _trainer(tmp_path, max_steps=2, padded=False, loss_kwargs=True, cls=None):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        n_layer=1,
        n_head=2,
        n_embd=32,
        vocab_size=64,
        n_positions=16,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )  # no RNG
    model = transformers.GPT2LMHeadModel(cfg).double()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (32, 16), generator=g)
    labels = ids.clone()
    if padded:  # rows 0-3 without any label (a piece of its own after the split), then 1..16 labels a row
        lengths = torch.tensor([0, 0, 0, 0] + [int(x) for x in torch.randint(1, 17, (28,), generator=g)])
        labels[torch.arange(16).view(1, -1) >= lengths.view(-1, 1)] = -100
    data = [{"input_ids": x, "labels": y} for x, y in zip(ids, labels, strict=True)]
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8,
        gradient_accumulation_steps=2, max_steps=max_steps, use_cpu=True, report_to="none", logging_strategy="no",
        save_strategy="no", dataloader_num_workers=0, learning_rate=1e-2)  # fmt: skip
    trainer = (cls or transformers.Trainer)(model=model, args=args, train_dataset=data)
    trainer._get_train_sampler = lambda *a, **k: torch.utils.data.SequentialSampler(data)  # rows 0-3 first
    if not loss_kwargs:  # the model's loss is its own per-token mean; the Trainer divides it by GA
        trainer.model_accepts_loss_kwargs = False
    return trainer


LOSS_TOL = (
    1e-6  # training_loss: the Trainer sums the steps' losses in a float32 tensor (1 ulp at 3.7 is 2.4e-7)
)


def shifted(inputs):
    """What GPT-2's per-token mean averages over: the labels after its shift that are not -100."""
    return (inputs["labels"][..., 1:] != -100).sum()


def same_weights(ref, run, tol=1e-10):
    return all(
        torch.allclose(a, b, rtol=0, atol=tol)
        for a, b in zip(ref.model.parameters(), run.model.parameters(), strict=True)
    )


def test_out_of_memory_mid_training_splits_and_the_weights_equal_a_run_without_it(tmp_path):
    ref = _trainer(tmp_path)
    ref_loss = ref.train().training_loss
    trainer = _trainer(tmp_path)
    ctrl = split_on_oom(trainer)
    assert trainer.microbatch_controller is ctrl and ctrl.micro_batch_size == 8
    limit = AllocationLimit(6 * 16 * 96 * 8)  # the (rows, 16, 96) fp64 qkv of 4 rows fit, of 8 do not
    with limit:
        loss = trainer.train().training_loss
    assert trainer.state.global_step == 2 and limit.failures >= 1
    assert abs(loss - ref_loss) <= LOSS_TOL * abs(ref_loss)  # the loss the Trainer logs, as without the split
    # a step is an optimizer step (the Trainer's global_step); the 2 accumulation calls per step are calls
    assert ctrl.splits == 1 and ctrl.micro_batch_size == 4 and ctrl.steps == 2 and ctrl.calls == 4
    assert ctrl.summary()["step_unit"] == "optimizer step"
    assert ctrl.summary()["history"][0]["old"] == 8 and ctrl.summary()["history"][0]["new"] == 4
    for (name, a), b in zip(ref.model.named_parameters(), trainer.model.parameters(), strict=True):
        assert torch.allclose(a, b, rtol=0, atol=1e-10), name
    assert not torch.equal(ref.model.transformer.wte.weight, _trainer(tmp_path).model.transformer.wte.weight)


def test_grow_after_counts_optimizer_steps_not_accumulation_calls(tmp_path):
    ref = _trainer(tmp_path, max_steps=4)
    ref.train()
    trainer = _trainer(tmp_path, max_steps=4)
    ctrl = split_on_oom(trainer, grow_after=2)
    with AllocationLimit(6 * 16 * 96 * 8):  # 8 rows never fit: every growth back to 8 is split again
        trainer.train()
    # optimizer step 0 splits (not clean), steps 1 and 2 run clean at 4 (two calls each); the window closes before
    # step 3, which grows back to 8 and is redone at 4. Counting calls would have grown after step 1 and split 3 times.
    events = [(e.kind, e.step, e.old, e.new) for e in ctrl.history]
    assert events == [("split", 0, 8, 4), ("grow", 3, 4, 8), ("split", 3, 8, 4)]
    assert (ctrl.steps, ctrl.calls, ctrl.splits, ctrl.grows) == (4, 8, 2, 1)
    assert "2 clean optimizer steps at 4" in ctrl.history[1].reason
    for (name, a), b in zip(ref.model.named_parameters(), trainer.model.parameters(), strict=True):
        assert torch.allclose(a, b, rtol=0, atol=1e-10), name


def test_padded_labels_and_a_piece_without_labels_with_num_items_in_batch(tmp_path):
    ref = _trainer(tmp_path, padded=True)
    ref_loss = ref.train().training_loss
    trainer = _trainer(tmp_path, padded=True)
    ctrl = split_on_oom(trainer)
    with AllocationLimit(6 * 16 * 96 * 8):
        loss = trainer.train().training_loss
    assert (
        ctrl.splits == 1 and ctrl.micro_batch_size == 4 and ctrl.steps == 2 and trainer.state.global_step == 2
    )
    assert loss == loss and abs(loss - ref_loss) <= LOSS_TOL * abs(ref_loss)  # not nan: the piece of rows 0-3
    assert same_weights(ref, trainer)


def test_a_per_token_mean_without_num_items_is_weighted_by_its_items(tmp_path):
    """The model takes no loss kwargs: its loss is the mean over the piece's shifted labels. Weighting the pieces
    by that count is exact; by another count (unshifted labels; the rows were worse) it is another gradient; a
    piece without labels (rows 0-3) would be nan."""
    ref = _trainer(tmp_path, padded=True, loss_kwargs=False)
    ref_loss = ref.train().training_loss
    runs = {}
    unshifted = lambda inputs: (inputs["labels"] != -100).sum()  # noqa: E731
    for name, count in (("count_fn", shifted), ("default", None), ("unshifted", unshifted)):
        trainer = _trainer(tmp_path, padded=True, loss_kwargs=False)
        ctrl = split_on_oom(trainer, count_fn=count)
        with AllocationLimit(6 * 16 * 96 * 8), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss = trainer.train().training_loss
        assert ctrl.splits == 1 and ctrl.steps == 2 and trainer.state.global_step == 2
        runs[name] = (loss, trainer, [str(w.message) for w in caught if w.category is RuntimeWarning])
    for name in ("count_fn", "default"):
        loss, trainer, _ = runs[name]
        assert abs(loss - ref_loss) <= LOSS_TOL * abs(ref_loss) and same_weights(ref, trainer), name
    assert runs["count_fn"][2] == []  # told what the loss averages over: nothing to warn about
    # GPT-2 sets no loss_type, so the Trainer does not confirm the shift: the default guessed right, and says so once
    assert len(runs["default"][2]) == 1 and "count_fn=lambda inputs" in runs["default"][2][0]
    loss, trainer, _ = runs["unshifted"]
    assert loss == loss and not same_weights(ref, trainer, tol=1e-8)  # one label per row too many


class MeanLossTrainer(transformers.Trainer):
    """A loss of the user's own: the piece's per-token mean, num_items_in_batch ignored (loss_is_scaled_for_ga left
    None, so transformers takes it as normalised and does not divide it by the accumulation steps)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = model(input_ids=inputs["input_ids"])
        logits, labels = out.logits[:, :-1], inputs["labels"][:, 1:]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        return (loss, out) if return_outputs else loss


def _split_run(tmp_path, count_fn=None, declared=None):
    trainer = _trainer(tmp_path, padded=True, cls=MeanLossTrainer)
    if declared is not None:
        trainer.loss_is_scaled_for_ga = declared
    ctrl = split_on_oom(trainer, count_fn=count_fn)
    with AllocationLimit(6 * 16 * 96 * 8), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = trainer.train().training_loss
    assert ctrl.splits == 1 and trainer.state.global_step == 2
    return loss, trainer, [str(w.message) for w in caught if w.category is RuntimeWarning]


def test_a_custom_per_batch_mean_with_count_fn_splits_to_the_unsplit_trainers_step(tmp_path):
    """A user's compute_loss returning its batch's mean, with count_fn saying over what: the pieces' means weighted
    by their items and the step scaled as the Trainer scales the unsplit one (it took the per-piece means as shares,
    so a split step's gradient was the number of pieces times too large)."""
    ref = _trainer(tmp_path, padded=True, cls=MeanLossTrainer)
    ref_loss = ref.train().training_loss
    loss, trainer, warned = _split_run(tmp_path, count_fn=shifted)
    assert abs(loss - ref_loss) <= LOSS_TOL * abs(ref_loss) and same_weights(ref, trainer) and warned == []
    # declared a per-batch mean (transformers' own advice for such a loss): divided by the accumulation steps, as
    # the unsplit Trainer divides it then
    ref = _trainer(tmp_path, padded=True, cls=MeanLossTrainer)
    ref.loss_is_scaled_for_ga = False
    ref_loss = ref.train().training_loss
    loss, trainer, warned = _split_run(tmp_path, count_fn=shifted, declared=False)
    assert abs(loss - ref_loss) <= LOSS_TOL * abs(ref_loss) and same_weights(ref, trainer) and warned == []


class WrappingTrainer(transformers.Trainer):
    """A compute_loss that wraps super() (TRL's SFTTrainer does, to log): normalised by num_items_in_batch."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return super().compute_loss(
            model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
        )


@pytest.mark.parametrize("count_fn", [None, shifted], ids=["no-count_fn", "count_fn"])
def test_a_custom_loss_is_measured_as_a_share_or_a_mean_and_splits_exactly(tmp_path, count_fn):
    """Whether a compute_loss of the user's own is normalised by num_items_in_batch is measured (its loss halves
    when that doubles, or does not move), not taken from count_fn's presence: a wrapper of super() given count_fn was
    weighted as a per-piece mean (3e-2 off, a review's finding), a mean without count_fn added as shares."""
    for cls in (WrappingTrainer, MeanLossTrainer):
        ref = _trainer(tmp_path, padded=True, cls=cls)
        ref_loss = ref.train().training_loss
        trainer = _trainer(tmp_path, padded=True, cls=cls)
        ctrl = split_on_oom(trainer, count_fn=count_fn)
        with AllocationLimit(6 * 16 * 96 * 8), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss = trainer.train().training_loss
        assert ctrl.splits == 1 and trainer._microbatch_normalised is (cls is WrappingTrainer), cls.__name__
        assert abs(loss - ref_loss) <= LOSS_TOL * abs(ref_loss) and same_weights(ref, trainer), cls.__name__
        said = [str(w.message) for w in caught if w.category is RuntimeWarning]
        assert not any("taken as normalised" in m for m in said), said
