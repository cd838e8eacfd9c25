"""tune(), the user's-step API, stops a script on Ctrl-C as a KeyboardInterrupt would, with what it measured
(review of 2026-12-07: it returned a knee chosen from half a curve, and the README's recipe trained on at it)."""

from __future__ import annotations

import pytest
import torch

import microbatch
from microbatch.choose.tune import TuneInterrupted
from microbatch.measure.timing import TimingConfig

FAST = TimingConfig(warmup=1, min_repeats=2, max_repeats=3, max_time_s=0.3, rel_tol=0.9)


def _setup():
    torch.manual_seed(0)
    x, y = torch.randn(256, 16), torch.randint(0, 10, (256,))
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Linear(64, 10))
    return model, torch.optim.AdamW(model.parameters()), (lambda b: (x[:b], y[:b]))


def test_ctrl_c_after_some_points_raises_with_them_and_leaves_no_trace():
    model, opt, make = _setup()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    calls = [0]

    def loss_fn(m, batch):
        calls[0] += 1
        if calls[0] == 12:  # a few points in
            raise KeyboardInterrupt
        return torch.nn.functional.cross_entropy(m(batch[0]), batch[1])

    with pytest.raises(TuneInterrupted) as err:
        microbatch.tune(model, make, loss_fn=loss_fn, optimizer=opt, global_batch=64, max_micro_batch=16,
                        timing=FAST, use_cache=False)  # fmt: skip
    assert isinstance(err.value, KeyboardInterrupt)
    partial = err.value.result
    assert partial.interrupted and len(partial.points) >= 1
    assert f"{len(partial.points)} point(s) measured" in str(err.value)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert not opt.state  # the optimizer's state as it was: empty


def test_ctrl_c_before_any_point_is_a_plain_interrupt():
    model, opt, make = _setup()

    def loss_fn(m, batch):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt) as err:
        microbatch.tune(model, make, loss_fn=loss_fn, optimizer=opt, global_batch=64, max_micro_batch=16,
                        timing=FAST, use_cache=False)  # fmt: skip
    assert not isinstance(err.value, TuneInterrupted)


def test_misuse_is_refused_with_the_contract_not_torch_s_traceback():
    """A review's user: a criterion passed as loss_fn, a detached loss, an optimizer over another model: torch's
    TypeError and RuntimeError, or (the last) a silent tune of another model's update."""
    from microbatch.errors import ConfigError

    model, opt, make = _setup()
    kw = dict(global_batch=64, max_micro_batch=4, timing=FAST, use_cache=False)
    with pytest.raises(ConfigError, match=r"tune calls loss_fn\(model, batch\) .* needs wrapping"):
        microbatch.tune(model, make, loss_fn=torch.nn.CrossEntropyLoss(), optimizer=opt, **kw)
    detached = lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]).detach()  # noqa: E731
    with pytest.raises(ConfigError, match="does not require grad"):
        microbatch.tune(model, make, loss_fn=detached, optimizer=opt, **kw)
    other = torch.optim.AdamW(torch.nn.Linear(16, 10).parameters())
    with pytest.raises(ConfigError, match=r"none of them Sequential's"):
        microbatch.tune(model, make, loss_fn=lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]),
                        optimizer=other, **kw)  # fmt: skip


def test_a_type_error_of_the_model_itself_is_not_blamed_on_loss_fn():
    """Every TypeError of the first step became "loss_fn needs wrapping", also a model's own bug (a Lightning module's
    self.net(x, y)), where the user gave no loss_fn at all."""

    class Buggy(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(16, 10)

        def forward(self, x, y):
            return torch.nn.functional.cross_entropy(self.net(x, y), y)  # Linear takes one input

    model = Buggy()
    step = lambda m, b: m(*b)  # noqa: E731  (an integration's own loss_fn, not the user's)
    with pytest.raises(TypeError, match=r"Linear.forward\(\) takes 2 positional arguments"):
        microbatch.tune(model, _setup()[2], loss_fn=step, global_batch=64, max_micro_batch=4, timing=FAST,
                        use_cache=False)  # fmt: skip
