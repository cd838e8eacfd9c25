"""More Hugging Face heads under split_on_oom and tune_trainer (a helper's review, 2026-12-07):

- transformers' generic classification heads (Llama's, Qwen's, Mistral's ``GenericForSequenceClassification`` and
  ``GenericForTokenClassification``) and GPT-NeoX's call ``self.loss_function(...)`` without ``**kwargs``: a
  per-batch mean, which the source reading took for a share (a split step's gradient was the pieces' count times);
- label smoothing and a ``compute_loss_func`` divide by ``num_items_in_batch`` whatever the model's own loss does;
- tune_trainer, moving a head that averages its own loss from 1 to g accumulation steps, left transformers' rule
  (forward has ``**kwargs``: no division by g) in place: a gradient g× the user's configuration."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from microbatch.integrations.hf import split_on_oom, tune_trainer  # noqa: E402
from microbatch.integrations.hf_loss import forward_normalises as _forward_normalises  # noqa: E402
from microbatch.measure.timing import TimingConfig  # noqa: E402
from tests.integrations.test_hf_heads_s26 import (  # noqa: E402
    _data,
    _model,
    _no_more_than_4_rows,
    _trainer,
    _update_ratio,
)

FAST = TimingConfig(warmup=1, min_repeats=2, max_repeats=3, max_time_s=0.3, rel_tol=0.9)


def _llama(kind: str):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2, num_labels=3, pad_token_id=0)  # fmt: skip
    head = {
        "cls": transformers.LlamaForSequenceClassification,
        "tok": transformers.LlamaForTokenClassification,
    }
    return head[kind](cfg).double()


def _llama_trainer(tmp_path, kind, ga=1, batch=8, **kw):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 64, (16, 10), generator=g)
    if kind == "cls":
        data = [{"input_ids": a, "labels": int(a[-1]) % 3} for a in ids]
    else:
        data = [{"input_ids": a, "labels": a % 3} for a in ids]
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=batch,
        gradient_accumulation_steps=ga, max_steps=1, optim="sgd", max_grad_norm=0.0, use_cpu=True, report_to="none",
        logging_strategy="no", save_strategy="no", dataloader_num_workers=0, learning_rate=1.0, **kw)  # fmt: skip
    trainer = transformers.Trainer(model=_llama(kind), args=args, train_dataset=data)
    trainer._get_train_sampler = lambda *a, **k: torch.utils.data.SequentialSampler(data)
    return trainer


def test_the_source_reading_follows_the_loss_function_s_arguments():
    assert _forward_normalises(_llama("cls")) is False and _forward_normalises(_llama("tok")) is False
    neox = transformers.GPTNeoXForSequenceClassification(transformers.GPTNeoXConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64))  # fmt: skip
    assert _forward_normalises(neox) is False
    causal = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2))  # fmt: skip
    assert _forward_normalises(causal) is True  # passes **kwargs: num_items_in_batch reaches its loss


@pytest.mark.parametrize("kind", ["cls", "tok"])
def test_a_generic_head_splits_to_the_same_update(tmp_path, kind):
    ref = _llama_trainer(tmp_path, kind)
    ref.train()
    run = _llama_trainer(tmp_path, kind)
    ctrl = split_on_oom(run)
    run.model.register_forward_pre_hook(_no_more_than_4_rows, with_kwargs=True)
    run.train()
    assert ctrl.splits == 1
    assert _update_ratio(ref, run, _llama(kind)) == pytest.approx(1.0, abs=1e-9)  # it was 2.0 (two pieces)


@pytest.mark.parametrize("how", ["smoothing", "loss_func"])
def test_the_trainer_s_own_normalised_loss_splits_to_the_same_update(tmp_path, how):
    def loss_func(outputs, labels, num_items_in_batch=None):
        logits = outputs["logits"]
        return torch.nn.functional.cross_entropy(logits, labels, reduction="sum") / num_items_in_batch

    def make():
        t = _trainer(tmp_path, "bert", ga=1)
        if how == "smoothing":
            t.args.label_smoothing_factor = 0.1
            t.label_smoother = transformers.trainer_pt_utils.LabelSmoother(epsilon=0.1)
        else:
            t.compute_loss_func = loss_func
        return t

    ref = make()
    ref.train()
    run = make()
    split_on_oom(run)
    run.model.register_forward_pre_hook(_no_more_than_4_rows, with_kwargs=True)
    run.train()
    assert run.microbatch_controller.splits == 1
    assert _update_ratio(ref, run, _model("bert")) == pytest.approx(1.0, abs=1e-9)  # it was 0.52


def test_tune_trainer_keeps_the_update_of_a_head_that_averages_its_own_loss(tmp_path, caplog):
    ref = _llama_trainer(tmp_path, "cls", batch=16)
    ref.train()
    run = _llama_trainer(tmp_path, "cls", batch=16)
    result = tune_trainer(run, max_micro_batch=8, timing=FAST, use_cache=False)
    assert result is not None and run.args.gradient_accumulation_steps > 1
    assert run.model_accepts_loss_kwargs is False  # so the Trainer divides each micro-batch's mean by g
    assert any("model_accepts_loss_kwargs = False" in r.getMessage() for r in caplog.records)
    run.train()
    # one label a row, equal micro-batches: the mean of g micro-batch means is the batch's mean
    assert _update_ratio(ref, run, _llama("cls")) == pytest.approx(1.0, abs=1e-9)  # it was g


def test_tune_trainer_leaves_a_causal_lm_as_transformers_runs_it(tmp_path):
    data = _data("bert")
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=16, max_steps=1,
        use_cpu=True, report_to="none", logging_strategy="no", save_strategy="no")  # fmt: skip
    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64)
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=[
        {"input_ids": d["input_ids"], "labels": d["input_ids"]} for d in data])  # fmt: skip
    tune_trainer(trainer, max_micro_batch=8, timing=FAST, use_cache=False)
    assert trainer.model_accepts_loss_kwargs is True  # its loss is a share of num_items_in_batch: untouched


def test_a_wrapped_head_is_read_through_its_wrappers():
    """PEFT's forward holds no loss and torch.compile's is its own: read through them, a generic head was unknown and
    its split pieces added as shares (4x the gradient under LoRA: a helper's review)."""
    from microbatch.integrations.hf_loss import unwrapped

    head = _llama("cls")

    class Peft(torch.nn.Module):  # what peft's PeftModel offers
        def __init__(self, base):
            super().__init__()
            self.base = base

        def get_base_model(self):
            return self.base

        def forward(self, *a, **k):
            return self.base(*a, **k)

    compiled = torch.compile(head)  # not run: the wrapper alone
    for wrapped in (Peft(head), compiled, Peft(compiled)):
        assert unwrapped(wrapped) is head and _forward_normalises(wrapped) is False
