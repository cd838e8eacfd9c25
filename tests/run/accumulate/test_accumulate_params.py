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


def test_a_new_loss_function_at_a_dead_ones_address_is_checked_again():
    """A user-loop helper's finding: the check ran once per id(loss_fn), and a fresh lambda each step (as the README's
    recipe writes it) reuses the dead one's id: a later loss on a parameter outside the model went unchecked, its
    gradient the sum's (8× here). Loss functions are now held weakly; a bound method by its object and function."""
    torch.manual_seed(0)
    model, temp = nn.Linear(5, 3).double(), Temperature()
    x, y = _data()

    def plain():
        return lambda m, mb: (F.cross_entropy(m(mb[0]), mb[1], reduction="sum"), len(mb[1]))

    def tempered():
        return lambda m, mb: (
            F.cross_entropy(m(mb[0]) / temp.log_t.exp(), mb[1], reduction="sum"),
            len(mb[1]),
        )

    first = plain()
    accumulate(model, (x, y), first, micro_batch_size=4)
    address = id(first)
    del first
    for _ in range(100):  # CPython hands a freed function's memory to the next one of its size
        candidate = tempered()
        if id(candidate) == address:
            break
    else:
        pytest.skip("no new function landed at the freed one's address on this interpreter")
    with pytest.raises(ConfigError, match=r"not the model's"):
        accumulate(model, (x, y), candidate, micro_batch_size=4)
    assert temp.log_t.grad is None


def test_a_bound_method_is_checked_once_per_object():
    class Loss:
        def __init__(self, scale):
            self.scale = scale

        def __call__(self, m, mb):  # not used: the bound method below is what accumulate gets
            raise AssertionError

        def run(self, m, mb):
            return F.cross_entropy(m(mb[0]) / self.scale(), mb[1], reduction="sum"), len(mb[1])

    model, temp = nn.Linear(5, 3).double(), Temperature()
    x, y = _data()
    fixed = Loss(lambda: torch.tensor(2.0, dtype=torch.float64))
    for _ in range(2):
        accumulate(model, (x, y), fixed.run, micro_batch_size=4)  # a new method object at each access
    learned = Loss(lambda: temp.log_t.exp())  # the same function on another object: checked again
    with pytest.raises(ConfigError, match=r"not the model's"):
        accumulate(model, (x, y), learned.run, micro_batch_size=4)


def test_numpy_counts_are_taken_as_python_numbers():
    """A user-loop helper's finding: n_items as np.int64 (a NumPy mask's sum) was refused, np.float64 taken; any
    real number is now taken as its Python value, and a string still refused with the fix."""
    np = pytest.importorskip("numpy")
    x, y = _data()
    grads = []
    for count in (lambda n: n, np.int64, np.float32):
        torch.manual_seed(0)
        model = nn.Linear(5, 3).double()
        accumulate(model, (x, y), lambda m, mb, c=count: (F.cross_entropy(m(mb[0]), mb[1], reduction="sum"),
                                                          c(len(mb[1]))), micro_batch_size=5)  # fmt: skip
        grads.append(model.weight.grad)
    assert torch.equal(grads[0], grads[1]) and torch.equal(grads[0], grads[2])
    with pytest.raises(ConfigError, match=r"got str '5'; return an int"):
        accumulate(nn.Linear(5, 3).double(), (x, y), lambda m, mb: (m(mb[0]).sum(), "5"), micro_batch_size=5)


def test_loss_functions_that_cannot_be_hashed_or_weakly_held_are_checked_once():
    """A review's finding: keyed by the loss function itself, an unhashable one (a dataclass instance, a bound method
    of one) or one without __weakref__ (__slots__) was walked every step; each is now walked once, by id with a
    reference that keeps the id meaning it."""
    import dataclasses

    from microbatch.run.accumulate import scaling

    @dataclasses.dataclass
    class Callable_:
        scale: float = 1.0

        def __call__(self, m, mb):
            return F.cross_entropy(m(mb[0]) * self.scale, mb[1], reduction="sum"), len(mb[1])

        def method(self, m, mb):
            return self(m, mb)

    class Slotted:
        __slots__ = ("scale",)

        def __init__(self):
            self.scale = 1.0

        def method(self, m, mb):
            return F.cross_entropy(m(mb[0]) * self.scale, mb[1], reduction="sum"), len(mb[1])

    model = nn.Linear(5, 3).double()
    dc, slotted = Callable_(), Slotted()
    for fn in (dc, dc.method, slotted.method):
        params, mark = scaling.params_once(model, fn, list(model.parameters()))
        assert params is not None and mark is not None  # the first call walks
        mark()
        again = getattr(fn, "__func__", None) and getattr(
            fn.__self__, fn.__func__.__name__
        )  # a new method object
        assert scaling.params_once(model, again or fn, list(model.parameters())) == (None, None)
