"""split_on_oom on Hugging Face heads that are not causal LMs: transformers takes every model whose ``forward`` has
``**kwargs`` as normalising its loss by ``num_items_in_batch``, yet BERT's and RoBERTa's heads and T5 average with
their own ``CrossEntropyLoss``; a split step added their per-piece means as shares (2x the gradient). A collator's flag
(CLIP's ``return_loss=True``) stopped every step."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from microbatch.integrations.hf import split_on_oom  # noqa: E402

N, W = 16, 10


def _data(kind):
    g = torch.Generator().manual_seed(1)
    lens = torch.randint(1, W + 1, (N,), generator=g)
    mask = (torch.arange(W)[None] < lens[:, None]).long()
    ids = torch.randint(2, 60, (N, W), generator=g) * mask
    if kind == "bert":  # one label a row
        return [
            {"input_ids": ids[i], "attention_mask": mask[i], "labels": torch.tensor(i % 3)} for i in range(N)
        ]
    if kind == "roberta":  # a label a token, unshifted, -100 on the padding
        labels = torch.randint(0, 5, (N, W), generator=g).masked_fill(mask == 0, -100)
        return [{"input_ids": ids[i], "attention_mask": mask[i], "labels": labels[i]} for i in range(N)]
    labels = torch.randint(1, 60, (N, 6), generator=g)  # t5: targets of their own lengths
    labels = labels.masked_fill(torch.arange(6)[None] >= torch.randint(1, 7, (N, 1), generator=g), -100)
    return [{"input_ids": ids[i], "attention_mask": mask[i], "labels": labels[i]} for i in range(N)]


def _model(kind):
    torch.manual_seed(0)
    small = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0, "num_attention_heads": 4,
             "hidden_size": 32, "num_hidden_layers": 1, "intermediate_size": 64, "vocab_size": 64}  # fmt: skip
    if kind == "bert":
        cfg = transformers.BertConfig(max_position_embeddings=32, num_labels=3, **small)
        return transformers.BertForSequenceClassification(cfg).double()
    if kind == "roberta":
        cfg = transformers.RobertaConfig(max_position_embeddings=40, num_labels=5, pad_token_id=0, **small)
        return transformers.RobertaForTokenClassification(cfg).double()
    cfg = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_decoder_layers=1,
                                num_heads=4, decoder_start_token_id=0, pad_token_id=0, dropout_rate=0.0)  # fmt: skip
    return transformers.T5ForConditionalGeneration(cfg).double()


def _trainer(tmp_path, kind, ga=2):
    data = _data(kind)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8,
        gradient_accumulation_steps=ga, max_steps=1, optim="sgd", max_grad_norm=0.0, use_cpu=True,
        report_to="none", logging_strategy="no", save_strategy="no", dataloader_num_workers=0,
        learning_rate=1e-2)  # fmt: skip
    trainer = transformers.Trainer(model=_model(kind), args=args, train_dataset=data)
    trainer._get_train_sampler = lambda *a, **k: torch.utils.data.SequentialSampler(data)
    return trainer


def _no_more_than_4_rows(module, args, kwargs):
    if kwargs["input_ids"].shape[0] > 4:
        raise torch.OutOfMemoryError("injected: CUDA out of memory.")


def _update_ratio(ref, run, start):
    """Least-squares ratio of the split run's update to the unsplit run's: 1 when they are the same step."""
    pairs = [(a.detach(), b.detach(), c.detach()) for a, b, c in
             zip(run.model.parameters(), ref.model.parameters(), start.parameters(), strict=True)]  # fmt: skip
    num = sum(float(((a - c) * (b - c)).sum()) for a, b, c in pairs)
    return num / sum(float(((b - c) ** 2).sum()) for _, b, c in pairs)


@pytest.mark.parametrize("kind", ["bert", "roberta", "t5"])
def test_a_head_that_averages_its_own_loss_splits_to_the_same_update(tmp_path, kind):
    ref = _trainer(tmp_path, kind)
    ref.train()
    run = _trainer(tmp_path, kind)
    assert run.model_accepts_loss_kwargs  # transformers' rule says shares: the measurement says otherwise
    ctrl = split_on_oom(run)
    run.model.register_forward_pre_hook(_no_more_than_4_rows, with_kwargs=True)
    run.train()
    assert ctrl.splits == 1 and ctrl.micro_batch_size == 4
    assert run._microbatch_normalised is False  # its loss did not move with num_items_in_batch
    assert _update_ratio(ref, run, _model(kind)) == pytest.approx(
        1.0, abs=1e-9
    )  # it was 2.0 (bert), 2.24, 1.98
    for a, b in zip(ref.model.parameters(), run.model.parameters(), strict=True):
        assert torch.allclose(a, b, rtol=0, atol=1e-12)


def test_token_labels_are_counted_unshifted_for_a_token_classifier(tmp_path):
    from microbatch.integrations.hf_loss import items_of as _items_of

    trainer = _trainer(tmp_path, "roberta")
    batch = {k: torch.stack([d[k] for d in _data("roberta")]) for k in ("input_ids", "labels")}
    count, known = _items_of(trainer, batch)
    assert known and int(count(batch)) == int((batch["labels"] != -100).sum())  # not labels[..., 1:]


def test_a_collators_flag_goes_whole_to_every_piece(tmp_path):
    """CLIP's example collator puts return_loss=True in every batch: split, every piece gets it."""
    from microbatch.run.accumulate.microbatches import batch_rows, split, split_by_tokens

    batch = {"input_ids": torch.arange(12).view(6, 2), "return_loss": True, "past_key_values": None}
    assert batch_rows(batch) == 6
    pieces = split(batch, 4)
    assert [p["input_ids"].shape[0] for p in pieces] == [4, 2]
    assert all(p["return_loss"] is True and p["past_key_values"] is None for p in pieces)
    assert all(p["return_loss"] is True for p in split_by_tokens(batch, 4, lengths=[2] * 6))
    with pytest.raises(Exception, match="flag"):  # a number may count the batch: still refused, the fix named
        batch_rows({"input_ids": torch.zeros(2, 2), "num_items": 7})


def test_the_loss_path_is_read_from_the_source_with_no_forward():
    """Read, not measured, for a stock Trainer: the same verdict on every rank, no forwards that ranks would run in
    different numbers under FSDP. A masked LM's labels are counted unshifted."""
    from microbatch.integrations.hf_loss import forward_normalises as _forward_normalises
    from microbatch.integrations.hf_loss import items_of as _items_of

    assert _forward_normalises(_model("bert")) is False and _forward_normalises(_model("t5")) is False
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=32)
    )
    assert _forward_normalises(gpt2) is True

    class Stub:
        model = transformers.BertForMaskedLM(transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1,
                                                                     num_attention_heads=4, intermediate_size=64))  # fmt: skip
        microbatch_count_fn = None

    labels = torch.tensor([[5, -100, 7, -100], [-100, 3, -100, -100]])
    count, known = _items_of(Stub(), {"input_ids": labels.clamp(min=0), "labels": labels})
    assert known and int(count({"labels": labels})) == 3  # column 0 counted: labels[..., 1:] would give 2
