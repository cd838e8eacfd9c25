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
