"""tune_trainer's opt-in on_oom="split" / split_on_oom on a real Trainer: an out-of-memory injected at the
allocation point mid-training halves the micro-batch, the step is redone, and the weights equal a run without it."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from _helpers import AllocationLimit  # noqa: E402

from microbatch.integrations.hf import split_on_oom  # noqa: E402


def _trainer(tmp_path):
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
    data = [{"input_ids": x, "labels": x} for x in ids]
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8,
        gradient_accumulation_steps=2, max_steps=2, use_cpu=True, report_to="none", logging_strategy="no",
        save_strategy="no", dataloader_num_workers=0, learning_rate=1e-2)  # fmt: skip
    return transformers.Trainer(model=model, args=args, train_dataset=data)


def test_out_of_memory_mid_training_splits_and_the_weights_equal_a_run_without_it(tmp_path):
    ref = _trainer(tmp_path)
    ref.train()
    trainer = _trainer(tmp_path)
    ctrl = split_on_oom(trainer)
    assert trainer.microbatch_controller is ctrl and ctrl.micro_batch_size == 8
    limit = AllocationLimit(6 * 16 * 96 * 8)  # the (rows, 16, 96) fp64 qkv of 4 rows fit, of 8 do not
    with limit:
        trainer.train()
    assert trainer.state.global_step == 2 and limit.failures >= 1
    assert ctrl.splits == 1 and ctrl.micro_batch_size == 4 and ctrl.steps == 4
    assert ctrl.summary()["history"][0]["old"] == 8 and ctrl.summary()["history"][0]["new"] == 4
    for (name, a), b in zip(ref.model.named_parameters(), trainer.model.parameters(), strict=True):
        assert torch.allclose(a, b, rtol=0, atol=1e-10), name
    assert not torch.equal(ref.model.transformer.wte.weight, _trainer(tmp_path).model.transformer.wte.weight)
