"""A loss on trainable parameters the model does not hold (a loss module's learnable temperature passed beside the
backbone): accumulate normalises and restores the model's gradients only, so theirs came out B times the mean's
(16.7 for 1.39 in a helper's loop), and kept a failed attempt's part after an out-of-memory split. Refused before
any backward, the gradients as they were; the same parameters inside the model give the exact gradient."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from microbatch.errors import ConfigError
from microbatch.run.accumulate import accumulate


class Temperature(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.log_t = nn.Parameter(torch.tensor(0.3, dtype=torch.float64))


def _data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(12, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (12,), generator=g)


def test_a_loss_on_a_parameter_outside_the_model_is_refused_before_any_backward():
    torch.manual_seed(0)
    backbone, temp = nn.Linear(5, 3).double(), Temperature()
    x, y = _data()

    def loss_fn(model, mb):
        xb, yb = mb
        return F.cross_entropy(model(xb) / temp.log_t.exp(), yb, reduction="sum"), len(yb)

    with pytest.raises(
        ConfigError, match=r"depends on 1 trainable parameter\(s\) that are not the model's \(shapes \(\)\)"
    ):
        accumulate(backbone, (x, y), loss_fn, micro_batch_size=4)
    assert all(p.grad is None for p in backbone.parameters()) and temp.log_t.grad is None


def test_the_same_parameter_inside_the_model_gets_the_exact_gradient():
    torch.manual_seed(0)
    backbone, temp = nn.Linear(5, 3).double(), Temperature()
    whole = nn.ModuleDict({"backbone": backbone, "temp": temp})
    x, y = _data()

    def loss_fn(model, mb):
        xb, yb = mb
        return F.cross_entropy(model["backbone"](xb) / model["temp"].log_t.exp(), yb, reduction="sum"), len(
            yb
        )

    accumulate(whole, (x, y), loss_fn, micro_batch_size=4)
    got = temp.log_t.grad.clone()
    temp.log_t.grad = None
    loss = F.cross_entropy(backbone(x) / temp.log_t.exp(), y)  # the mean over the whole batch, by hand
    (ref,) = torch.autograd.grad(loss, [temp.log_t])
    assert torch.allclose(got, ref, rtol=1e-12)
