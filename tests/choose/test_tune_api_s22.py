"""The Python API as a user's script meets it: tune under the caller's no_grad or inference_mode (its probes train,
the optimizer it puts back can step again), tune's arguments checked before any probe, a one-row BatchNorm named
with the setting that fixes it; config objects checked where they are built; NumPy integers taken as numbers."""

from __future__ import annotations

import json
import warnings

import pytest

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")

from microbatch.choose.tune import tune  # noqa: E402
from microbatch.errors import ConfigError  # noqa: E402
from microbatch.hardware import get_accelerator  # noqa: E402
from microbatch.measure.timing import TimingConfig  # noqa: E402
from microbatch.model import get_model  # noqa: E402

FAST = TimingConfig(warmup=0, min_repeats=1, max_repeats=1, max_time_s=0.2, rel_tol=1.0)
X, Y = torch.randn(64, 8, generator=torch.Generator().manual_seed(0)), torch.randn(64)


def _mse(m, b):
    return torch.nn.functional.mse_loss(m(b[0]).squeeze(-1), b[1])


def _model_and_stepped_optimizer(*layers):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(layers or (torch.nn.Linear(8, 16), torch.nn.Linear(16, 1))))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _mse(model, (X[:8], Y[:8])).backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _tune(model, opt, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tune(model, lambda b: (X[:b], Y[:b]), loss_fn=_mse, optimizer=opt, max_micro_batch=4, timing=FAST,
                    use_cache=False, **kw)  # fmt: skip


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_tune_under_the_callers_grad_mode_trains_and_puts_back_a_usable_optimizer(mode):
    model, opt = _model_and_stepped_optimizer()
    before = {k: v.clone() for k, v in opt.state[model[0].weight].items()}
    with getattr(torch, mode)():
        result = _tune(model, opt)
        assert not torch.is_grad_enabled()  # the caller's mode, as it was
    assert result.recommendation.knee.micro_batch >= 1
    state = opt.state[model[0].weight]
    assert not any(t.is_inference() for t in state.values() if torch.is_tensor(t))
    assert all(torch.equal(state[k], v) for k, v in before.items())
    _mse(model, (X[:8], Y[:8])).backward()
    opt.step()  # an inference tensor in its state raised 'Inplace update to inference tensor'


def test_tunes_arguments_are_checked_before_any_probe():
    model, opt = _model_and_stepped_optimizer()
    cases = (
        (
            dict(optimizer=torch.optim.AdamW),
            r"optimizer must be the optimizer instance .* got the class AdamW",
        ),
        (dict(on_point=5), r"on_point must be a function or None, got int"),
        (dict(seq=128), r"tune\(\) takes no seq \(128\)"),
        (dict(in_process=False), r"tune\(\) takes no in_process \(False\)"),
    )
    for kw, says in cases:
        with pytest.raises(ConfigError, match=says):
            _tune(model, kw.pop("optimizer", opt), **kw)
    with pytest.raises(ConfigError, match=r"make_batch must be a function of b"):
        tune(model, None, loss_fn=_mse, optimizer=opt)  # type: ignore[arg-type]

    def per_row(m, b):
        return torch.nn.functional.mse_loss(m(b[0]).squeeze(-1), b[1], reduction="none")

    with pytest.raises(
        ConfigError, match=r"must return one number \(a 0-dim tensor\), got a tensor of shape \(1,\)"
    ):
        tune(model, lambda b: (X[:b], Y[:b]), loss_fn=per_row, optimizer=opt, max_micro_batch=2, timing=FAST,
             use_cache=False)  # fmt: skip


def test_a_one_row_batch_norm_names_start():
    model, opt = _model_and_stepped_optimizer(
        torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 1)
    )
    with pytest.raises(ConfigError, match=r"BatchNorm in training mode.*start=2"):
        _tune(model, opt)
    assert _tune(model, opt, start=2).recommendation.knee.micro_batch >= 2


def test_config_objects_and_numbers_are_checked_where_they_are_built():
    from microbatch.integrations.common import check_global_batch
    from microbatch.integrations.hf import split_on_oom
    from microbatch.predict.memory import MemoryConfig
    from microbatch.predict.plan import make_plan
    from microbatch.predict.plan_config import PlanConfig
    from microbatch.run.accumulate import MicroBatchController
    from microbatch.schedules.simulate import simulate

    base = dict(shape=get_model("gpt2"), gpu=get_accelerator("a100-80gb"), global_batch=8)
    with pytest.raises(ConfigError, match=r"efficiency must be a RooflineEfficiency, got None"):
        PlanConfig(**base, efficiency=None)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"memory_calibration must be a MemoryCalibration"):
        PlanConfig(**base, memory_calibration={"activation_scale": 1.1})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"cfg must be a PlanConfig, got MemoryConfig"):
        make_plan(MemoryConfig(micro_batch=1))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"expert_imbalance 0.5 must be >= 1"):
        PlanConfig(**{**base, "shape": get_model("mixtral-8x7b")}, expert_imbalance=0.5)
    with pytest.raises(ConfigError, match=r"schedule must be a Schedule .* got 'gpipe'"):
        simulate("gpipe", forward_time=1, backward_time=2)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"split_on_oom takes a transformers Trainer"):
        split_on_oom(None)
    with pytest.raises(ConfigError, match=r"step_counter must be a function"):
        MicroBatchController(8, step_counter=5)  # type: ignore[arg-type]
    c = MicroBatchController(np.int64(8), knee=np.int64(16))
    json.dumps(c.summary())  # NumPy's integers stored as ints: a JSON-ready summary
    assert check_global_batch(np.int64(256), 4) == 256 and type(check_global_batch(np.int64(256), 4)) is int
