"""tune_trainer on a real Hugging Face Trainer on the CPU: b_m × g × world == B, the knee, no trace."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from microbatch.errors import ConfigError  # noqa: E402
from microbatch.integrations.hf import checkpointing_setting, tune_trainer  # noqa: E402
from microbatch.measure.timing import TimingConfig  # noqa: E402

FAST = TimingConfig(warmup=1, min_repeats=2, max_repeats=3, max_time_s=0.3, rel_tol=0.9)


def _trainer(tmp_path, dataset=None, **args):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=64, n_positions=16)
    model = transformers.GPT2LMHeadModel(cfg)
    if dataset is None:
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, 64, (256, 16), generator=g)
        dataset = [{"input_ids": x, "labels": x, "unused": 0} for x in ids]
    kw = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=4, max_steps=2,
              use_cpu=True, report_to="none", logging_strategy="no", save_strategy="no", dataloader_num_workers=0)  # fmt: skip
    kw.update(args)
    return transformers.Trainer(model=model, args=transformers.TrainingArguments(**kw), train_dataset=dataset)


def test_train_runs_at_the_knee_with_the_effective_batch_kept_and_no_trace(tmp_path):
    trainer = _trainer(tmp_path)
    model = trainer.model
    weights0 = {k: v.clone() for k, v in model.state_dict().items()}
    training0 = [m.training for m in model.modules()]
    rng0 = torch.get_rng_state().clone()
    result = tune_trainer(trainer, timing=FAST, max_micro_batch=8, use_cache=False)  # B = 4 × 4 × 1 = 16
    b, g = trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps
    assert b * g * trainer.args.world_size == 16 and result.recommendation.knee.micro_batch == b
    best = max(p.throughput for p in result.points if not p.oom)
    assert result.recommendation.knee.throughput >= (1 - result.recommendation.tolerance) * best
    assert [p.micro_batch for p in result.points][:2] == [1, 2]
    # nothing left behind: weights, grads, training flags, RNG, no optimizer made for train() to reuse
    assert all(torch.equal(weights0[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters()) and trainer.optimizer is None
    assert [m.training for m in model.modules()] == training0 and torch.equal(torch.get_rng_state(), rng0)
    seen: list[int] = []
    model.register_forward_pre_hook(lambda m, a, k: seen.append(k["input_ids"].shape[0]), with_kwargs=True)
    trainer.train()
    assert seen == [b] * (2 * g) and trainer.state.global_step == 2


def test_a_given_global_batch_and_bad_input(tmp_path):
    trainer = _trainer(tmp_path)
    result = tune_trainer(trainer, 8, timing=FAST, max_micro_batch=2, use_cache=False)
    assert max(p.micro_batch for p in result.points) <= 2
    assert trainer.args.per_device_train_batch_size * trainer.args.gradient_accumulation_steps == 8
    with pytest.raises(ConfigError, match=r"global_batch 0 must be a whole number >= 1"):
        tune_trainer(trainer, 0)

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter([])

    weights0 = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    with pytest.raises(ConfigError, match=r"iterable dataset \(Stream\).*map-style"):
        tune_trainer(_trainer(tmp_path, dataset=Stream()))
    t = _trainer(tmp_path)
    t.train_dataset = None
    with pytest.raises(ConfigError, match="no train_dataset"):
        tune_trainer(t)
    assert all(torch.equal(weights0[k], v) for k, v in trainer.model.state_dict().items())


def test_checkpointing_setting_reads_either_name():
    class V4:
        gradient_checkpointing = True

    class V5:
        activation_checkpointing = True
        gradient_checkpointing = None

    assert checkpointing_setting(V4()) and checkpointing_setting(V5())
    assert not checkpointing_setting(object())


def _switches(model):
    names = ("gradient_checkpointing", "_gradient_checkpointing_func")
    return [{n: m.__dict__[n] for n in names if n in m.__dict__} for m in model.modules()]


def test_checkpointing_in_the_arguments_is_probed_then_the_model_is_left_as_it_was(tmp_path):
    import warnings

    name = "activation_checkpointing" if hasattr(transformers.TrainingArguments, "activation_checkpointing") else (
        "gradient_checkpointing")  # fmt: skip  # 5.x / 4.x
    trainer = _trainer(tmp_path, **{name: True})
    model = trainer.model
    before = _switches(model)
    assert not any(s.get("gradient_checkpointing") for s in before)
    seen: list[bool] = []
    hook = model.register_forward_pre_hook(
        lambda m, a: seen.append(any(getattr(x, "gradient_checkpointing", False) for x in m.modules()))
    )
    with warnings.catch_warnings():
        warnings.simplefilter(
            "error", FutureWarning
        )  # the installed version's own method, not a deprecated alias
        tune_trainer(trainer, timing=FAST, max_micro_batch=4, use_cache=False)
    hook.remove()
    assert seen and all(seen)  # every probe ran the step train() will run: with checkpointing
    assert _switches(model) == before  # flags back, and no _gradient_checkpointing_func left behind
    trainer.train()  # the Trainer turns it on itself
    assert trainer.state.global_step == 2 and any(s.get("gradient_checkpointing") for s in _switches(model))


def test_the_hf_export_builds_training_arguments_on_the_installed_version(tmp_path):
    import warnings

    from microbatch.show.export import export_plan

    cand = {"micro_batch": 4, "grad_accum": 8, "data_parallel": 1, "global_batch": 32, "precision": "fp32",
            "recompute": "full", "pipeline_parallel": 1, "tensor_parallel": 1, "zero": 0}  # fmt: skip
    ex = export_plan(cand, "hf")
    # the key every release reads (4.x through 5.25; activation_checkpointing exists only from 5.23), whatever
    # transformers the exporting machine has: the file is for the cluster's
    assert ex.config["gradient_checkpointing"] is True and "activation_checkpointing" not in ex.config
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # 5.23+ warns that the name is deprecated
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path), use_cpu=True, report_to="none", **ex.config
        )
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (4, 8)
    assert checkpointing_setting(args) is True


_DDP_CHILD = """
import json, os, tempfile
import torch, transformers
from microbatch.integrations.hf import tune_trainer
from microbatch.measure.timing import TimingConfig

torch.manual_seed(0)
model = transformers.GPT2LMHeadModel(
    transformers.GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=64, n_positions=16))
ids = torch.randint(0, 64, (512, 16), generator=torch.Generator().manual_seed(1))
args = transformers.TrainingArguments(
    output_dir=tempfile.mkdtemp(), per_device_train_batch_size=4, gradient_accumulation_steps=3, max_steps=2,
    use_cpu=True, report_to="none", logging_strategy="no", save_strategy="no", dataloader_num_workers=0)
trainer = transformers.Trainer(model=model, args=args, train_dataset=[{"input_ids": x, "labels": x} for x in ids])
res = tune_trainer(trainer, timing=TimingConfig(warmup=1, min_repeats=3, max_repeats=6, max_time_s=0.5),
                   use_cache=False)
seen = []
model.register_forward_pre_hook(lambda m, a, k: seen.append(k["input_ids"].shape[0]), with_kwargs=True)
trainer.train()
out = {"world": args.world_size, "b": args.per_device_train_batch_size, "g": args.gradient_accumulation_steps,
       "points": [p.micro_batch for p in res.points], "seen": seen, "steps": trainer.state.global_step}
open(os.path.join(os.environ["OUT_DIR"], f"rank{args.process_index}.json"), "w").write(json.dumps(out))
"""


def test_two_gloo_processes_keep_the_effective_batch_and_agree(tmp_path):
    """torchrun-style, 2 processes: the arguments' effective batch 4 × 3 × 2 = 24 is kept exactly,
    both ranks probe the same b_m (divisors of 24 / 2 = 12 only) and train at the same knee."""
    from _helpers import run_launched

    r0, r1 = run_launched(_DDP_CHILD, tmp_path)
    assert r0["world"] == r1["world"] == 2
    assert r0["b"] == r1["b"] and r0["g"] == r1["g"] and r0["points"] == r1["points"]
    assert r0["b"] * r0["g"] * 2 == 24 and all(12 % b == 0 for b in r0["points"])
    assert r0["seen"] == [r0["b"]] * (2 * r0["g"]) == r1["seen"] and r0["steps"] == 2


def test_the_probes_never_ask_for_more_rows_than_the_dataset_holds(tmp_path):
    """10 rows, effective batch 16: b_m 16 would run on 10 rows and be counted as 16."""
    ids = torch.randint(0, 64, (10, 16), generator=torch.Generator().manual_seed(2))
    trainer = _trainer(tmp_path, dataset=[{"input_ids": x, "labels": x} for x in ids])
    result = tune_trainer(trainer, timing=FAST, use_cache=False)
    assert max(p.micro_batch for p in result.points) <= 10
    b, g = trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps
    assert b * g == 16 and b <= 8


def test_tune_trainer_names_what_it_needs():
    with pytest.raises(ConfigError, match=r"tune_trainer needs a transformers.Trainer, got NoneType"):
        tune_trainer(None)


def test_a_bf16_trainer_is_probed_under_the_autocast_train_runs(tmp_path):
    """transformers 5 takes autocast from Accelerate's prepared model inside train(): the probes, before it, ran the
    step in fp32 (a user's walk-through: the MLP's output float32 in the probes, bfloat16 in training)."""
    trainer = _trainer(tmp_path, bf16=True)
    seen: list[tuple[bool, str]] = []
    hook = trainer.model.transformer.h[0].mlp.register_forward_hook(
        lambda m, a, out: seen.append((torch.is_autocast_enabled("cpu"), str(out.dtype)))
    )
    result = tune_trainer(trainer, timing=FAST, max_micro_batch=2, use_cache=False)
    hook.remove()
    assert seen and all(s == (True, "torch.bfloat16") for s in seen)  # every probe's step as train() runs it
    assert result.to_dict()["precision"] == "bf16-mixed"


def test_a_probe_config_given_keeps_its_precision_under_a_bf16_trainer(tmp_path):
    """A review: the Trainer's bf16 replaced an explicit ProbeConfig(precision="fp32") silently."""
    from microbatch.choose.tune.config import ProbeConfig

    trainer = _trainer(tmp_path, bf16=True)
    result = tune_trainer(
        trainer, probe=ProbeConfig(precision="fp32"), timing=FAST, max_micro_batch=2, use_cache=False
    )
    assert result.to_dict()["precision"] == "fp32"
