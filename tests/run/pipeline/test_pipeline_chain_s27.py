"""A factory's model as the pipeline runs it: its own forward must be the chain of its layers (a skip connection or a
scaled embedding was trained away, exit 0), a seq past a learned position table is refused naming seq, and a factory
that blocks ends at the launcher's deadline (it was called again for real after the deadline's error and hung)."""

from __future__ import annotations

import dataclasses
import functools
import math
import time

import pytest

from microbatch.errors import ConfigError, PipelineError
from microbatch.run.pipeline import config as pipeline_config
from microbatch.run.pipeline import fit
from microbatch.run.pipeline.config import PipelineConfig
from microbatch.run.pipeline.launch import check_splittable
from microbatch.run.pipeline.resolved import resolve

torch = pytest.importorskip("torch")
nn = torch.nn
HERE = "test_pipeline_chain_s27"
GIB = 1024**3


class Chain(nn.Module):
    """embed, layers, head; ``mode`` says what forward does besides chaining them."""

    def __init__(self, mode: str = "chain", positions: int = 0):
        super().__init__()
        self.mode = mode
        self.embed = nn.Embedding(64, 8) if not positions else _Positions(positions)
        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])
        self.head = nn.Linear(8, 64)

    def forward(self, x):
        h = self.embed(x)
        if self.mode == "scaled":
            h = h * math.sqrt(8)
        skip = h
        for i, layer in enumerate(self.layers):
            h = layer(h)
            if self.mode == "skip" and i == 1:
                h = h + skip
        if self.mode == "reordered":
            h = self.layers[0](h)
        out = self.head(h)
        return {"logits": out} if self.mode == "dict" else out


class _Positions(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.tok, self.pos = nn.Embedding(64, 8), nn.Embedding(n, 8)

    def forward(self, x):
        return self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))


chained = Chain


class _TokenTypes(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok, self.types = nn.Embedding(64, 8), nn.Embedding(2, 8)

    def forward(self, x):
        return self.tok(x) + self.types(torch.zeros_like(x))


def token_types():
    model = Chain()
    model.embed = _TokenTypes()
    return model


@dataclasses.dataclass
class _Out:
    loss: object
    scores: object


class Written(Chain):
    """Legitimate ways of writing the chain: the ids viewed, the units called by keyword, a tuple or a dataclass
    returned, the logits cast to another dtype."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how

    def forward(self, x, targets=None):
        x = x.view(-1, x.shape[-1])
        h = self.embed(input=x) if self.how == "keyword" else self.embed(x)
        for layer in self.layers:
            h = layer(input=h) if self.how == "keyword" else layer(h)
        logits = self.head(h)
        if self.how == "tuple":
            return logits, None
        if self.how == "dataclass":
            return _Out(loss=None, scores=logits)
        if self.how == "cast":
            return logits.to(torch.float64)
        return logits


written_keyword = functools.partial(Written, "keyword")
written_tuple = functools.partial(Written, "tuple")
written_dataclass = functools.partial(Written, "dataclass")
written_cast = functools.partial(Written, "cast")
chained_dict = functools.partial(Chain, "dict")
skip = functools.partial(Chain, "skip")
scaled = functools.partial(Chain, "scaled")
reordered = functools.partial(Chain, "reordered")
positions_64 = functools.partial(Chain, positions=64)


def blocks():
    time.sleep(20)
    return Chain()


def _check(model: str, seq: int = 16) -> None:
    fit.check_fits(resolve(PipelineConfig(model=f"{HERE}:{model}", global_batch=16, seq=seq)),
                   available=24 * GIB, flops_per_s=1e9)  # fmt: skip


@pytest.mark.parametrize(
    "model, said",
    [
        ("skip", r"forward gives layer 3 \(Linear\) something other than layer 2's output"),
        ("scaled", r"forward gives layer 1 \(Linear\) something other than layer 0's output"),
        ("reordered", r"calls its layers in the order \[0, 1, 2, 3, 1, 4\]"),
    ],
)
def test_a_forward_that_is_not_the_chain_of_its_layers_is_refused(model, said):
    with pytest.raises(ConfigError, match=said + r".*not forward, so it would train another model"):
        _check(model)


def test_a_forward_that_chains_its_layers_passes_whatever_it_returns_them_in():
    from microbatch.run.pipeline.chain_check import check_forward_is_chain
    from microbatch.run.pipeline.split import model_units

    tokens = torch.zeros((2, 16), dtype=torch.long)
    judged = []

    def judge(model) -> bool:
        ran = []
        model.register_forward_hook(lambda *a: ran.append(1))
        try:
            check_forward_is_chain("test", model, model_units(model), tokens)
        except ConfigError:
            return False
        judged.append(len(ran))
        return True

    assert not judge(skip())  # the check is live: a forward that is not the chain is refused
    assert judge(chained()) and judge(chained_dict())
    for how in ("keyword", "tuple", "dataclass", "cast"):  # each refused by the first version of the check
        assert judge(Written(how)), how
    assert judged == [1] * 6  # each forward was run once and judged, not skipped


def test_a_seq_past_a_learned_position_table_is_refused_naming_seq():
    _check("positions_64", seq=64)
    with pytest.raises(
        ConfigError, match=r"seq 80 is longer than the first layer's position table \(64 positions"
    ):
        _check("positions_64", seq=80)
    _check("token_types", seq=16)  # a 2-row token-type table beside the token table is no position table


@pytest.mark.timeout(60)
def test_a_factory_that_blocks_ends_at_the_launchers_deadline(monkeypatch):
    monkeypatch.setattr(pipeline_config, "STARTUP_S", 0.0)
    t0 = time.monotonic()
    with pytest.raises(PipelineError, match=r"calling the model factory .*blocks passed its deadline of 2 s"):
        check_splittable(resolve(PipelineConfig(model=f"{HERE}:blocks", timeout_s=2)))
    assert time.monotonic() - t0 < 10  # the factory sleeps 20 s, and was called a second time for real


class _Masked(nn.Module):
    def forward(self, x, mask=None, index=0):
        return x if mask is None else x * mask


class MaskedChain(Chain):
    def __init__(self, mask: bool):
        super().__init__()
        self.layers.append(_Masked())
        self.with_mask = mask

    def forward(self, x):
        h = self.embed(x)
        for i, layer in enumerate(self.layers):
            masks = isinstance(layer, _Masked) and self.with_mask
            h = (
                layer(h, torch.ones_like(h), index=i)
                if masks
                else layer(h, index=i)
                if isinstance(layer, _Masked)
                else layer(h)
            )
        return self.head(h)


def masked():
    return MaskedChain(True)


def indexed():
    return MaskedChain(False)


def test_a_layer_given_a_second_tensor_is_refused_and_a_layer_index_is_not():
    with pytest.raises(ConfigError, match=r"gives layer 4 \(_Masked\) a second tensor \(a mask, positions\)"):
        _check("masked")
    _check("indexed")


def test_a_batch_statistic_norm_is_named_as_a_cause_a_gradient_check_cannot_match():
    from microbatch.run.pipeline.split import dropout_modules

    stage = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.1))
    assert dropout_modules(stage, "stage 0") == ["stage 0 2", "stage 0 1 (BatchNorm1d: batch statistics)"]
    assert dropout_modules(stage.eval(), "stage 0") == []  # running statistics, no dropout: nothing to say


def test_the_profile_times_a_stage_under_the_hooks_the_ranks_run_it_under():
    # the ranks count every saved tensor in a Python hook (13% of tiny's forward and backward); the profile that
    # predicts their step ran the stage bare (a model of many small ops: 36 ms predicted against 74-100 measured)
    from microbatch.run.pipeline.stage_profile import _one_stage_ops

    seen = []

    class Probe(nn.Linear):
        def forward(self, x):
            seen.append(torch._C._autograd._top_saved_tensors_default_hooks(False) is not None)
            return super().forward(x)

    fwd = _one_stage_ops(Probe(4, 4), torch.randn(2, 4, requires_grad=True), None, None, 0.0)[0]
    fwd()
    assert seen and all(seen)
