"""Models that are not language models, as users bring them (a review of 2026-12-07): BatchNorm said to change the
training (tune and accumulate_micro_batches), a float batch holding no tokens, a plain dict's loss, a lazy module, an
all-frozen model (accumulate, the pipeline's factory), and data that runs out in a batch-first layout."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn
F = torch.nn.functional

from microbatch.choose.tune import tune  # noqa: E402
from microbatch.errors import ConfigError  # noqa: E402
from microbatch.measure.batch_check import BatchDidNotGrow, GrowingBatches  # noqa: E402
from microbatch.measure.probes import _tokens_in, default_loss  # noqa: E402
from microbatch.measure.timing import TimingConfig  # noqa: E402
from microbatch.records_fields import throughput_unit  # noqa: E402
from microbatch.run.accumulate import accumulate, accumulate_micro_batches, split  # noqa: E402
from microbatch.show.recommendation import render_tune  # noqa: E402

FAST = TimingConfig(warmup=0, min_repeats=1, max_repeats=1, max_time_s=0.2, rel_tol=1.0)


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MICROBATCH_CACHE_DIR", str(tmp_path / "cache"))


def cnn(norm):
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), norm(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 10))


IMAGES = torch.randn(32, 3, 8, 8)


def image_tune(model):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = tune(model, lambda b: IMAGES[:b], start=2, max_micro_batch=4, timing=FAST, use_cache=False)
    return r, [str(w.message) for w in caught]


def test_tune_says_batch_norm_makes_b_m_change_the_training_and_counts_samples_of_images():
    r, said = image_tune(cnn(nn.BatchNorm2d))
    note = [n for n in r.notes if "BatchNorm2d" in n]
    assert len(note) == 1 and note[0].startswith("b_m changes this model's training, not only its speed")
    assert any(
        "BatchNorm2d layer(s) normalise each micro-batch" in s for s in said
    )  # the integrations print no notes
    r, said = image_tune(cnn(lambda c: nn.GroupNorm(2, c)))  # per-sample statistics: b_m changes nothing
    assert not any("normalise" in n for n in r.notes) and not any("normalise" in s for s in said)
    # an image's channels are no tokens: the throughput is samples per second, and says so
    assert all(p.tokens_per_s is None and p.throughput == p.samples_per_s for p in r.points if not p.oom)
    d = r.to_dict()
    assert (
        throughput_unit(d) == "samples/s"
        and "samples/s" in render_tune(d)
        and "tokens/s" not in render_tune(d)
    )


def test_throughput_unit_follows_what_the_points_counted():
    assert (
        throughput_unit({"mode": "train", "points": [{"micro_batch": 1, "tokens_per_s": 5.0}]}) == "tokens/s"
    )
    assert (
        throughput_unit({"mode": "train", "points": [{"micro_batch": 1, "tokens_per_s": None}]})
        == "samples/s"
    )
    assert throughput_unit({"mode": "decode", "points": []}) == "tokens/s"
    assert throughput_unit({"command": "recommend", "points": [{"micro_batch": 1}]}) == "per s"


def test_accumulate_micro_batches_warns_of_batch_norm_once_as_accumulate_does():
    m = cnn(nn.BatchNorm2d)
    x, y = torch.randn(8, 3, 8, 8), torch.randint(0, 10, (8,))

    def loss(model, b):
        return F.cross_entropy(model(b[0]), b[1], reduction="sum"), len(b[1])

    for run in (
        lambda: accumulate_micro_batches(m, split((x, y), 2), loss),
        lambda: accumulate(m, (x, y), loss, micro_batch_size=2),
    ):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run()
        said = [str(w.message) for w in caught if "BatchNorm2d" in str(w.message)]
        assert (
            len(said) == 1 and "micro-batch of 2 rows by its own statistics, not the 8-row batch's" in said[0]
        )
        m.zero_grad(set_to_none=True)


def test_the_default_loss_reads_token_ids_only_and_a_plain_dicts_loss():
    class Gru(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.GRU(4, 6, batch_first=True)

        def forward(self, x):
            return self.rnn(x)[0]  # (b, 10, 6): 3-D, but the batch holds features, not token ids

    feats = torch.randn(3, 10, 4)
    loss = default_loss(Gru(), feats)  # was next-token cross-entropy against the features: a shape error
    assert loss.dim() == 0 and loss.requires_grad
    assert _tokens_in(feats) is None and _tokens_in(IMAGES[:2]) is None
    assert (
        _tokens_in(torch.zeros(3, 7, dtype=torch.long)) == 21
        and _tokens_in({"input_ids": torch.zeros(2, 5).long()}) == 10
    )

    class DictOut(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Linear(4, 1)

        def forward(self, x):
            return {"loss": self.w(x).pow(2).mean()}

    assert default_loss(DictOut(), torch.randn(2, 4)).requires_grad


def test_a_lazy_module_and_an_all_frozen_model_are_refused_naming_the_fix():
    lazy = nn.Sequential(nn.LazyLinear(4), nn.ReLU(), nn.LazyLinear(1))
    with pytest.raises(
        ConfigError, match=r"parameter '0.weight' and 3 more of Sequential is not initialised yet"
    ):
        tune(lazy, lambda b: torch.randn(b, 3), max_micro_batch=2, timing=FAST, use_cache=False)
    frozen = nn.Linear(3, 1).requires_grad_(False)
    with pytest.raises(ConfigError, match=r"no parameter that requires grad \(every one frozen\)"):
        accumulate(frozen, torch.randn(4, 3), lambda m, b: (m(b).sum(), len(b)), micro_batch_size=2)


def test_the_pipelines_factory_refuses_an_all_frozen_model_before_any_rank(tmp_path, monkeypatch):
    from microbatch.run.pipeline.split import inspect_factory

    (tmp_path / "frozen_fac.py").write_text(
        "import torch.nn as nn\n"
        "def build():\n"
        "    return nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 8), nn.Linear(8, 16)).requires_grad_(False)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(
        ConfigError, match=r"frozen_fac:build returned a Sequential with no parameter that requires"
    ):
        inspect_factory("frozen_fac:build")


def test_data_that_runs_out_in_a_batch_first_layout_ends_the_search():
    x = torch.randn(5, 3)
    grow = GrowingBatches(lambda b: (x[:b], x[:b, 0]))
    for b in (1, 2, 4):
        grow(b)
    with pytest.raises(BatchDidNotGrow, match=r"make_batch\(8\) returned tensors of shapes \[\(5, 3\), \(5,\)\], not 8 "
                       r"rows, where each smaller b's led with b rows \(1, 2, 4\)") as e:  # fmt: skip
        grow(8)
    assert e.value.grown  # the points measured before stand
    seq_first = GrowingBatches(
        lambda b: torch.randn(10, min(b, 5), 3)
    )  # (s, b, f): rows are not first, not judged
    for b in (1, 2, 4, 8):
        seq_first(b)


def test_a_callers_own_split_in_any_layout_is_accumulated_as_before():
    lin = nn.Linear(3, 1)

    def loss(model, mb):
        return model(mb["x"].mean(0)).sum(), mb["y"].numel()  # (s, b, f) features, (b,) targets

    pieces = [{"x": torch.randn(5, 2, 3), "y": torch.randn(2), "t": torch.tensor(0.5)} for _ in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn of, and no refusal of the layout
        assert torch.isfinite(accumulate_micro_batches(lin, pieces, loss))


def test_data_that_runs_out_at_the_second_size_from_start_2_is_caught():
    x = torch.randn(6, 3)
    grow = GrowingBatches(lambda b: x[:b])
    grow(4)
    with pytest.raises(
        BatchDidNotGrow, match=r"make_batch\(8\) returned tensors of shapes \[\(6, 3\)\], not 8 rows"
    ):
        grow(8)
