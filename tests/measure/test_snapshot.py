"""tune leaves no trace: weights, buffers, grads, AdamW state, RNG and train() bitwise restored."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

from microbatch.choose.tune import tune  # noqa: E402
from microbatch.measure.snapshot import StateSnapshot, leave_no_trace  # noqa: E402
from microbatch.measure.timing import TimingConfig  # noqa: E402

FAST = TimingConfig(warmup=1, min_repeats=2, max_repeats=2, max_time_s=0.5, rel_tol=0.9)


def _model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Dropout(0.1), torch.nn.Linear(16, 1)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # a real state: one step taken, grads left in place, the model in eval mode
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    model(torch.randn(4, 8)).sum().backward()
    model.eval()
    return model, opt


def _state(model, opt):
    return {
        "tensors": {k: v.clone() for k, v in model.state_dict().items()},
        "grads": [None if p.grad is None else p.grad.clone() for p in model.parameters()],
        "opt": {
            i: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in opt.state[p].items()}
            for i, p in enumerate(model.parameters())
        },
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
        "training": [m.training for m in model.modules()],
        "rng": torch.get_rng_state().clone(),
        "random": random.getstate(),
    }


def _assert_same(a, b):
    assert a["tensors"].keys() == b["tensors"].keys()
    for k in a["tensors"]:
        assert torch.equal(a["tensors"][k], b["tensors"][k]), k
    for ga, gb in zip(a["grads"], b["grads"], strict=True):
        assert (ga is None) == (gb is None) and (ga is None or torch.equal(ga, gb))
    assert a["opt"].keys() == b["opt"].keys()
    for i in a["opt"]:
        assert a["opt"][i].keys() == b["opt"][i].keys()
        for k in a["opt"][i]:
            va, vb = a["opt"][i][k], b["opt"][i][k]
            assert torch.equal(va, vb) if torch.is_tensor(va) else va == vb, (i, k)
    assert a["groups"] == b["groups"]
    assert a["training"] == b["training"]
    assert torch.equal(a["rng"], b["rng"]) and a["random"] == b["random"]


def _loss(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x).squeeze(-1), y)


def _batches(fail_at=None, exc=RuntimeError):
    def make_batch(b):
        if fail_at is not None and b >= fail_at:
            raise exc(f"failing at {b}")
        return torch.randn(b + 1, 8), torch.randn(b + 1)  # BatchNorm needs 2 rows

    return make_batch


def _tune(model, opt, make_batch):
    return tune(model, make_batch, loss_fn=_loss, optimizer=opt, timing=FAST, max_micro_batch=8,
                use_cache=False, memory_budget_bytes=2**40)  # fmt: skip


def test_tune_returns_with_the_state_bitwise_unchanged():
    model, opt = _model_and_optimizer()
    before = _state(model, opt)
    result = _tune(model, opt, _batches())
    assert [p.micro_batch for p in result.points][:2] == [1, 2]  # it did probe (and step) the model
    _assert_same(before, _state(model, opt))


def test_without_restoring_the_probes_would_leave_a_trace():
    # the control: the same probes outside leave_no_trace change the weights and the RNG
    model, opt = _model_and_optimizer()
    before = _state(model, opt)
    snap = StateSnapshot.take(model, opt)
    from microbatch.measure.probes import TrainProbe

    TrainProbe(model, _batches(), loss_fn=_loss, optimizer=opt, timing=FAST).measure(2)
    with pytest.raises(AssertionError):
        _assert_same(before, _state(model, opt))
    snap.restore()
    _assert_same(before, _state(model, opt))
    assert snap.host_bytes >= 4 * sum(p.numel() * 4 for p in model.parameters())  # weights, grads, 2 moments


@pytest.mark.parametrize(
    "exc", [ValueError, KeyboardInterrupt, torch.OutOfMemoryError], ids=["exception", "ctrl-c", "oom"]
)
def test_state_restored_on_exception_interrupt_and_oom(exc):
    model, opt = _model_and_optimizer()
    before = _state(model, opt)
    try:
        result = _tune(model, opt, _batches(fail_at=4, exc=exc))
    except (ValueError, KeyboardInterrupt):
        result = None
    if exc is torch.OutOfMemoryError:  # recorded as a point that did not fit; the search goes on
        assert result is not None and any(p.oom for p in result.points)
    _assert_same(before, _state(model, opt))


def test_leave_no_trace_restores_after_a_raise_inside():
    model, opt = _model_and_optimizer()
    before = _state(model, opt)
    with pytest.raises(RuntimeError), leave_no_trace(model, opt):
        model.train()
        opt.zero_grad(set_to_none=True)
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        random.random()
        raise RuntimeError("boom")
    _assert_same(before, _state(model, opt))


def _switches(model):
    """Every sub-module's checkpointing switches, as the instance holds them (absent ones left out)."""
    names = ("checkpointing", "gradient_checkpointing", "_gradient_checkpointing_func")
    return [{n: m.__dict__[n] for n in names if n in m.__dict__} for m in model.modules()]


@pytest.mark.parametrize("setting", ["on", "auto"])
def test_a_tune_with_checkpointing_leaves_the_models_switch_as_it_was(setting):
    from microbatch.measure.gpt import build_model
    from microbatch.model import get_model

    shape = get_model("tiny", seq=16)
    model = build_model(shape)
    before = _switches(model)
    tokens = torch.randint(0, shape.vocab, (8, 16), generator=torch.Generator().manual_seed(0))
    # "auto" turns checkpointing on where plain steps run out of memory: b_m = 4 here (an injected OOM)
    oom_at = None if setting == "on" else 4

    def make_batch(b):
        if oom_at is not None and b >= oom_at and not model.checkpointing:
            raise torch.OutOfMemoryError(f"injected at {b}")
        return tokens[:b]

    result = tune(model, make_batch, timing=FAST, max_micro_batch=8, use_cache=False, checkpointing=setting,
                  memory_budget_bytes=2**40)  # fmt: skip
    assert any(p.checkpointing and not p.oom for p in result.points)  # it did probe with checkpointing on
    assert model.checkpointing is False and _switches(model) == before


def test_a_tune_leaves_a_hugging_face_models_checkpointing_as_it_was():
    transformers = pytest.importorskip("transformers")
    import warnings

    cfg = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=64, n_positions=16)
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(0))
    for on_before in (False, True):
        if on_before:  # 5.x: activation_checkpointing_enable; 4.x: gradient_checkpointing_enable
            kind = "activation" if hasattr(model, "activation_checkpointing_enable") else "gradient"
            getattr(model, f"{kind}_checkpointing_enable")(
                **{f"{kind}_checkpointing_kwargs": {"use_reentrant": False}}
            )
        before = _switches(model)
        with warnings.catch_warnings():
            warnings.simplefilter(
                "ignore", FutureWarning
            )  # 5.x: gradient_checkpointing_* are deprecated aliases
            result = tune(model, lambda b: {"input_ids": ids[:b], "labels": ids[:b]}, timing=FAST,
                          max_micro_batch=2, use_cache=False, checkpointing="on", memory_budget_bytes=2**40)  # fmt: skip
        assert all(p.checkpointing for p in result.points)
        # the flags and the function attribute enable() sets (and disable() would leave behind)
        assert _switches(model) == before
        assert any(s.get("gradient_checkpointing") for s in before) == on_before


def test_a_probe_that_changes_the_param_groups_gets_them_put_back():
    """A probe may set the learning rate, change betas, attach a scheduler (which adds
    ``initial_lr`` and rescales ``lr``) or change a tensor learning rate in place: afterwards every
    group holds exactly its keys and values from before, on the same parameters, and a second
    probe in the same snapshot starts from them too."""
    model, opt = _model_and_optimizer()
    opt.param_groups[0]["weight_decay"] = torch.tensor(0.05)  # a tensor setting (torch accepts tensor lr too)
    before = _state(model, opt)
    params = [list(g["params"]) for g in opt.param_groups]
    with leave_no_trace(model, opt) as snap:
        g = opt.param_groups[0]
        g["lr"] = 0.5
        g["betas"] = (0.5, 0.5)
        g["weight_decay"].fill_(9.0)  # in place
        torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.1)  # adds initial_lr, lr *= 0.1
        assert "initial_lr" in g and g["lr"] != 1e-2
        snap.restore()
        assert opt.param_groups[0]["lr"] == 1e-2
        opt.param_groups[0]["weight_decay"].fill_(7.0)  # the second probe changes it again
    after = _state(model, opt)
    assert [sorted(g) for g in after["groups"]] == [sorted(g) for g in before["groups"]]  # no initial_lr
    assert after["groups"][0]["lr"] == 1e-2 and after["groups"][0]["betas"] == before["groups"][0]["betas"]
    assert float(after["groups"][0]["weight_decay"]) == pytest.approx(0.05)
    assert [list(g["params"]) for g in opt.param_groups] == params


def test_a_parameter_the_optimizer_steps_beside_the_model_is_put_back():
    """A user-loop helper's finding: tune restored the model's parameters only, so a loss temperature the same
    optimizer steps moved for good (1.0 -> 0.708) while its Adam state went back: the two out of step."""
    model, _ = _model_and_optimizer()
    temp = torch.nn.Parameter(torch.ones(()))
    temp.grad = torch.full((), 0.25)
    opt = torch.optim.AdamW([*model.parameters(), temp], lr=0.1)

    def loss(m, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(m(x).squeeze(-1) * temp, y)

    tune(model, _batches(), loss_fn=loss, optimizer=opt, timing=FAST, max_micro_batch=4, use_cache=False,
         memory_budget_bytes=2**40)  # fmt: skip
    assert temp.item() == 1.0 and temp.grad.item() == 0.25 and temp not in opt.state


def test_a_cpu_allocation_failure_is_an_out_of_memory_point_not_an_error():
    """A user-loop helper's finding: in-process tune on the CPU caught torch's OutOfMemoryError and MemoryError
    only, so the CPU allocator's RuntimeError ended the search and lost its points."""
    from microbatch.measure.device import CPU_ALLOC_FAILURE

    model, opt = _model_and_optimizer()
    before = _state(model, opt)

    def make_batch(b):
        if b >= 4:
            raise RuntimeError(
                f"[enforce fail at alloc_cpu.cpp:127] {CPU_ALLOC_FAILURE}: you tried to allocate 1 GB"
            )
        return torch.randn(b + 1, 8), torch.randn(b + 1)

    result = _tune(model, opt, make_batch)
    assert [(p.micro_batch, p.oom) for p in result.points] == [(1, False), (2, False), (4, True)]
    _assert_same(before, _state(model, opt))
    with pytest.raises(RuntimeError, match="not memory"):  # any other RuntimeError still propagates
        _tune(model, opt, _batches(fail_at=4, exc=lambda m: RuntimeError("not memory")))


def test_a_schedulers_mark_on_the_optimizer_is_put_back():
    """torch's LRScheduler marks the optimizer once it steps (``_opt_called``) and warns of a scheduler step before
    any optimizer step only while the mark is absent: tune's probe steps set it, and it stayed (a helper's finding)."""
    model, opt = _model_and_optimizer()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # a fresh optimizer: no step taken yet
    torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    assert "_opt_called" not in opt.__dict__
    _tune(model, opt, _batches())
    assert "_opt_called" not in opt.__dict__
