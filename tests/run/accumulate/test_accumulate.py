"""Exact gradient accumulation: the accumulated gradient IS the full-batch gradient.

A tiny causal language model in float64 on variable-length, right-padded sequences (labels -100
on padding), so the micro-batches hold different numbers of valid tokens.
"""

from __future__ import annotations

from collections import namedtuple
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _helpers import WORKER_END, WORKER_START, two_rank_results
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import microbatch
from microbatch.errors import ConfigError
from microbatch.run.accumulate import (
    accumulate,
    accumulate_micro_batches,
    count_items,
    loss_scale,
    split,
    split_by_tokens,
    sync_unless_last,
)
from microbatch.run.noise import g_sq_estimate, trace_sigma_estimate

V, H, S, ROWS = 13, 8, 9, 10


class TinyLM(nn.Module):
    """Embedding → causal running mean → tanh MLP → vocabulary logits."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, H)
        self.mix = nn.Linear(H, H)
        self.head = nn.Linear(H, V)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        steps = torch.arange(1, tokens.shape[1] + 1, dtype=x.dtype).view(1, -1, 1)
        return self.head(torch.tanh(self.mix(x.cumsum(1) / steps)))


def make_model(seed: int = 0) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM().double()


def make_batch(seed: int = 1, rows: int = ROWS) -> dict[str, torch.Tensor]:
    """Right-padded sequences of lengths 1..S, very unequal so micro-batch token counts differ."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([S, 1, 2, S, 3, S - 1, 1, 5, 2, S] * (rows // 10 + 1))[:rows]
    ids = torch.randint(1, V, (rows, S), generator=g)
    mask = (torch.arange(S).view(1, -1) < lengths.view(-1, 1)).long()
    ids = ids * mask
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def loss_fn(model, mb):
    """Next-token cross-entropy summed over valid tokens, and their number (the HF shift)."""
    logits = model(mb["input_ids"])[:, :-1]
    target = mb["labels"][:, 1:]
    loss_sum = F.cross_entropy(logits.reshape(-1, V), target.reshape(-1), ignore_index=-100, reduction="sum")
    return loss_sum, (target != -100).sum()


def count_fn(mb):
    return (mb["labels"][:, 1:] != -100).sum()


def flat_grad(model) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def full_batch_grad(batch, seed: int = 0) -> tuple[torch.Tensor, float]:
    model = make_model(seed)
    loss_sum, n = loss_fn(model, batch)
    (loss_sum / n).backward()
    return flat_grad(model), float(loss_sum.detach() / n)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def set_pre_grads(model, seed: int = 7) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    pre = []
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)
        pre.append(p.grad.clone())
    return pre


# -- exactness ---------------------------------------------------------------------------------


def test_micro_batches_hold_different_token_counts():
    counts = [int(count_fn(mb)) for mb in split(make_batch(), 3)]
    assert len(set(counts)) > 1  # otherwise the naive mean would be right and the tests below weak


@pytest.mark.parametrize("with_count", [False, True])
@pytest.mark.parametrize("pre_existing", [False, True])
@pytest.mark.parametrize("b_m", [1, 3, 4, 25])
def test_equals_full_batch_gradient(with_count, pre_existing, b_m):
    batch = make_batch()
    ref, ref_loss = full_batch_grad(batch)
    model = make_model()
    pre = set_pre_grads(model) if pre_existing else None
    loss = accumulate(model, batch, loss_fn, micro_batch_size=b_m, count_fn=count_fn if with_count else None)
    got = flat_grad(model)
    if pre is not None:
        got = got - torch.cat([g.reshape(-1) for g in pre])
    assert rel(got, ref) < 1e-10
    assert abs(float(loss) - ref_loss) < 1e-12 * abs(ref_loss)
    assert not loss.requires_grad and loss.dim() == 0 and loss.dtype == torch.float64


def test_pre_existing_grads_are_added_to_in_place():
    batch = make_batch()
    model = make_model()
    set_pre_grads(model)
    ids = [id(p.grad) for p in model.parameters()]
    accumulate(model, batch, loss_fn, micro_batch_size=3)
    assert ids == [id(p.grad) for p in model.parameters()]  # same tensors, like backward()


def test_naive_mean_of_means_differs():
    """The 2024 bug: averaging per-micro-batch means. Shows the test above can fail."""
    batch = make_batch()
    ref, _ = full_batch_grad(batch)
    model = make_model()
    mbs = split(batch, 3)
    for mb in mbs:
        loss_sum, n = loss_fn(model, mb)
        (loss_sum / n / len(mbs)).backward()
    assert rel(flat_grad(model), ref) > 1e-3


def test_changing_b_m_at_fixed_global_batch_leaves_gradients_unchanged():
    batch = make_batch(rows=20)
    grads = []
    for b_m in (1, 2, 3, 5, 7, 20):
        model = make_model()
        accumulate(model, batch, loss_fn, micro_batch_size=b_m, count_fn=count_fn)
        grads.append(flat_grad(model))
    for g in grads[1:]:
        assert rel(g, grads[0]) < 1e-12  # summation order only


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.integers(min_value=1, max_value=S), min_size=1, max_size=12),
    b_m=st.integers(min_value=1, max_value=14),
    with_count=st.booleans(),
)
def test_any_lengths_any_b_m_equal_full_batch(lengths, b_m, with_count):
    rows = len(lengths)
    g = torch.Generator().manual_seed(rows * 100 + b_m)
    ids = torch.randint(1, V, (rows, S), generator=g)
    mask = (torch.arange(S).view(1, -1) < torch.tensor(lengths).view(-1, 1)).long()
    batch = {"input_ids": ids * mask, "labels": (ids * mask).masked_fill(mask == 0, -100)}
    if int(count_fn(batch)) == 0:  # every row of length 1: no next-token target anywhere
        with pytest.raises(ConfigError, match="0 valid items"):
            accumulate(
                make_model(), batch, loss_fn, micro_batch_size=b_m, count_fn=count_fn if with_count else None
            )
        return
    ref, ref_loss = full_batch_grad(batch)
    model = make_model()
    loss = accumulate(model, batch, loss_fn, micro_batch_size=b_m, count_fn=count_fn if with_count else None)
    assert rel(flat_grad(model), ref) < 1e-10
    assert float(loss) == pytest.approx(ref_loss, rel=1e-12)


def test_batch_structures_tensor_tuple_list():
    batch = make_batch()
    ref, _ = full_batch_grad(batch)
    ids, labels = batch["input_ids"], batch["labels"]

    def lf_tuple(model, mb):
        return loss_fn(model, {"input_ids": mb[0], "labels": mb[1]})

    for structure in ((ids, labels), [ids, labels]):
        model = make_model()
        accumulate(model, structure, lf_tuple, micro_batch_size=4)
        assert rel(flat_grad(model), ref) < 1e-10

    stacked = torch.stack([ids, labels], dim=1)  # one tensor (rows, 2, S)

    def lf_tensor(model, mb):
        return loss_fn(model, {"input_ids": mb[:, 0], "labels": mb[:, 1]})

    model = make_model()
    accumulate(model, stacked, lf_tensor, micro_batch_size=4)
    assert rel(flat_grad(model), ref) < 1e-10

    # a namedtuple (torch's default_collate keeps them): split into namedtuples, fields by name
    Pair = namedtuple("Pair", ["ids", "labels"])

    def lf_named(model, mb):
        assert isinstance(mb, Pair)
        return loss_fn(model, {"input_ids": mb.ids, "labels": mb.labels})

    for on_oom in ("raise", "split"):
        model = make_model()
        accumulate(model, Pair(ids, labels), lf_named, micro_batch_size=3, on_oom=on_oom)
        assert rel(flat_grad(model), ref) < 1e-10


@pytest.mark.parametrize("size", [np.int64(4), torch.tensor(4), 4])
def test_any_integer_type_is_a_micro_batch_size(size):
    """NumPy's integers and a 0-d integer tensor are whole numbers (they have __index__); the split is the same."""
    ref, _ = full_batch_grad(make_batch())
    model = make_model()
    accumulate(model, make_batch(), loss_fn, micro_batch_size=size)
    assert rel(flat_grad(model), ref) < 1e-10
    assert [len(mb["input_ids"]) for mb in split(make_batch(), size)] == [4, 4, 2]


def test_split_sizes():
    batch = make_batch()
    assert [len(mb["input_ids"]) for mb in split(batch, 4)] == [4, 4, 2]
    assert [len(mb["input_ids"]) for mb in split(batch, 10)] == [10]
    assert [len(mb["input_ids"]) for mb in split(batch, 99)] == [10]
    mbs = split(batch, 3)
    assert torch.equal(torch.cat([mb["labels"] for mb in mbs]), batch["labels"])
    assert isinstance(split((batch["input_ids"], batch["labels"]), 3)[0], tuple)


def test_split_by_tokens_respects_budget_and_stays_exact():
    batch = make_batch(rows=20)
    lengths = batch["attention_mask"].sum(1)
    ref, _ = full_batch_grad(batch)
    for budget in (9, 12, 20, 40):
        mbs = split_by_tokens(batch, budget, lengths=lengths)
        for mb in mbs:
            rows, width = mb["input_ids"].shape
            assert rows * width <= budget
            assert width == int(mb["attention_mask"].sum(1).max())  # trimmed to the longest row
        assert sum(len(mb["input_ids"]) for mb in mbs) == 20
        model = make_model()
        accumulate_micro_batches(model, mbs, loss_fn, count_fn=count_fn)
        assert rel(flat_grad(model), ref) < 1e-10
    # a bigger budget never needs more micro-batches
    sizes = [len(split_by_tokens(batch, b, lengths=lengths)) for b in (9, 12, 20, 40, 200)]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[-1]
    # without trimming every row costs the padded width
    assert all(
        mb["input_ids"].shape == (2, S) or mb["input_ids"].shape[0] < 2
        for mb in split_by_tokens(batch, 2 * S, lengths=lengths, trim_padding=False)
    )


def test_split_by_tokens_errors():
    batch = make_batch()
    lengths = batch["attention_mask"].sum(1)
    with pytest.raises(ConfigError, match=r"row 0 alone costs 9 tokens, over max_tokens=5"):
        split_by_tokens(batch, 5, lengths=lengths)
    with pytest.raises(ConfigError, match=r"lengths has 3 entries but the batch has 10 rows"):
        split_by_tokens(batch, 50, lengths=[1, 2, 3])
    with pytest.raises(ConfigError, match=r"max_tokens must be a whole number >= 1"):
        split_by_tokens(batch, 0, lengths=lengths)


def test_hand_written_loop_with_helpers():
    batch = make_batch()
    ref, _ = full_batch_grad(batch)
    model = make_model()
    mbs = split(batch, 3)
    total = count_items(mbs, count_fn, model=model)
    assert total == float(count_fn(batch))
    scale = loss_scale(total, model=model)
    assert scale == 1.0 / total
    for i, mb in enumerate(mbs):
        with sync_unless_last(model, i == len(mbs) - 1):
            loss_sum, _ = loss_fn(model, mb)
            (loss_sum * scale).backward()
    assert rel(flat_grad(model), ref) < 1e-10


def test_public_name_is_callable_after_the_module_is_imported():
    # importing microbatch.run.accumulate (done above) binds the package attribute to the module
    batch = make_batch()
    model = make_model()
    loss = microbatch.accumulate(model, batch, loss_fn, micro_batch_size=3)
    assert rel(flat_grad(model), full_batch_grad(batch)[0]) < 1e-10
    assert abs(float(loss) - full_batch_grad(batch)[1]) < 1e-12


# -- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, None])
def test_bad_micro_batch_size(bad):
    with pytest.raises(ConfigError, match=r"micro_batch_size must be a whole number >= 1, got"):
        accumulate(make_model(), make_batch(), loss_fn, micro_batch_size=bad)


def test_callables_are_checked_before_any_forward():
    model, batch = make_model(), make_batch()
    with pytest.raises(
        ConfigError, match=r"^loss_fn must be callable \(model, micro_batch\) -> \(loss_sum, items\), got int"
    ):
        accumulate(model, batch, 3, micro_batch_size=2)
    with pytest.raises(ConfigError, match=r"^count_fn must be callable \(micro_batch\) -> items, got int"):
        accumulate(model, batch, loss_fn, micro_batch_size=2, count_fn=3)
    with pytest.raises(ConfigError, match=r"^model must be a torch.nn.Module .* got dict"):
        accumulate(batch, model, loss_fn, micro_batch_size=2)  # the arguments swapped
    with pytest.raises(ConfigError, match=r"^loss_fn must be callable"):
        accumulate_micro_batches(model, split(batch, 2), None)
    assert all(p.grad is None for p in model.parameters())  # nothing ran


def test_different_first_dimensions():
    batch = make_batch()
    batch["labels"] = batch["labels"][:7]
    with pytest.raises(ConfigError, match=r"different first dimensions .*'labels'\] has 7"):
        accumulate(make_model(), batch, loss_fn, micro_batch_size=2)


def test_non_tensor_entry():
    batch = make_batch()
    batch["note"] = "hello"
    with pytest.raises(ConfigError, match=r"batch\['note'\] is a str, not a tensor"):
        accumulate(make_model(), batch, loss_fn, micro_batch_size=2)


def test_non_scalar_loss_is_rejected_and_grads_untouched():
    model = make_model()

    def per_token(model, mb):
        logits = model(mb["input_ids"])[:, :-1]
        t = mb["labels"][:, 1:]
        return F.cross_entropy(logits.reshape(-1, V), t.reshape(-1), reduction="none"), (t != -100).sum()

    with pytest.raises(ConfigError, match=r"loss of shape \(\d+,\) .* must be a scalar: the SUM"):
        accumulate(model, make_batch(), per_token, micro_batch_size=3)
    assert all(p.grad is None for p in model.parameters())


def test_loss_fn_must_return_a_pair():
    with pytest.raises(ConfigError, match=r"must return \(loss_sum, n_items\)"):
        accumulate(make_model(), make_batch(), lambda m, mb: loss_fn(m, mb)[0], micro_batch_size=3)


def test_loss_without_grad():
    def no_grad_loss(model, mb):
        with torch.no_grad():
            return loss_fn(model, mb)

    with pytest.raises(ConfigError, match=r"does not require grad"):
        accumulate(make_model(), make_batch(), no_grad_loss, micro_batch_size=3)


@pytest.mark.parametrize("with_count", [False, True])
def test_zero_items_over_whole_batch(with_count):
    batch = make_batch()
    batch["labels"] = torch.full_like(batch["labels"], -100)
    model = make_model()
    pre = set_pre_grads(model)
    with pytest.raises(ConfigError, match=r"whole batch has 0 valid items.*all -100"):
        accumulate(model, batch, loss_fn, micro_batch_size=3, count_fn=count_fn if with_count else None)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), pre, strict=True))


def test_count_fn_disagreeing_with_loss_fn():
    model = make_model()
    with pytest.raises(ConfigError, match=r"count_fn counted \d+ items but loss_fn reported \d+"):
        accumulate(
            model, make_batch(), loss_fn, micro_batch_size=3, count_fn=lambda mb: (mb["labels"] != -100).sum()
        )
    assert all(p.grad is None for p in model.parameters())


# -- all or nothing ------------------------------------------------------------------------------


class Boom(RuntimeError):
    pass


@pytest.mark.parametrize("with_count", [False, True])
@pytest.mark.parametrize("pre_existing", [False, True])
@pytest.mark.parametrize("exc", [Boom, KeyboardInterrupt])
def test_exception_mid_way_restores_grads(with_count, pre_existing, exc):
    model = make_model()
    pre = set_pre_grads(model) if pre_existing else None
    calls = []

    def failing(model, mb):
        calls.append(1)
        if len(calls) == 3:
            raise exc("third micro-batch")
        return loss_fn(model, mb)

    with pytest.raises(exc, match="third micro-batch"):
        accumulate(
            model, make_batch(), failing, micro_batch_size=2, count_fn=count_fn if with_count else None
        )
    assert len(calls) == 3  # two micro-batches had run their backward
    if pre is None:
        assert all(p.grad is None for p in model.parameters())
    else:
        assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), pre, strict=True))
    # and the model still accumulates correctly afterwards
    for p in model.parameters():
        p.grad = None
    accumulate(model, make_batch(), loss_fn, micro_batch_size=2)
    assert rel(flat_grad(model), full_batch_grad(make_batch())[0]) < 1e-10


def test_exception_inside_a_backward_restores_grads():
    model = make_model()
    pre = set_pre_grads(model)
    calls = []

    def hook(grad):
        calls.append(1)
        if len(calls) == 2:
            raise Boom("in the second backward")
        return grad

    model.head.weight.register_hook(hook)
    with pytest.raises(Boom, match="second backward"):
        accumulate(model, make_batch(), loss_fn, micro_batch_size=3, count_fn=count_fn)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), pre, strict=True))


# -- DDP -----------------------------------------------------------------------------------------

WORKER = (
    WORKER_START
    + r"""
from test_accumulate import make_model, make_batch, loss_fn, count_fn, set_pre_grads, split
from microbatch.run.accumulate import accumulate, count_items, loss_scale, sync_unless_last
from microbatch.run.noise import GradientNoiseScale

batch = make_batch(rows=10)
shard = {{k: (v[:6] if rank == 0 else v[6:]) for k, v in batch.items()}}  # 6 and 4 rows, unequal tokens
results = {{}}
for with_count in (False, True):
    for pre_existing in (False, True):
        model = torch.nn.parallel.DistributedDataParallel(make_model())
        pre = set_pre_grads(model.module, seed=10 + rank) if pre_existing else None
        loss = accumulate(model, shard, loss_fn, micro_batch_size=2, count_fn=count_fn if with_count else None)
        g = torch.cat([p.grad.reshape(-1) for p in model.module.parameters()])
        if pre is not None:
            g = g - torch.cat([x.reshape(-1) for x in pre])
        results[(with_count, pre_existing)] = (g, float(loss))
# gradient_as_bucket_view: .grad are views into DDP's buckets; two calls in a row (the second finds
# the first's gradients, bucket views, already there) must give twice the gradient.
for with_count in (False, True):
    model = torch.nn.parallel.DistributedDataParallel(make_model(), gradient_as_bucket_view=True)
    for _ in range(2):
        accumulate(model, shard, loss_fn, micro_batch_size=2, count_fn=count_fn if with_count else None)
    g = torch.cat([p.grad.reshape(-1) for p in model.module.parameters()])
    results[("bucket_view_twice", with_count)] = (g / 2, None)
# the helpers in a loop written by hand
model = torch.nn.parallel.DistributedDataParallel(make_model())
mbs = split(shard, 2)
scale = loss_scale(count_items(mbs, count_fn, model=model), model=model)
for i, mb in enumerate(mbs):
    with sync_unless_last(model, i == len(mbs) - 1):
        (loss_fn(model, mb)[0] * scale).backward()
results["helpers"] = (torch.cat([p.grad.reshape(-1) for p in model.module.parameters()]), None)
for size in (2, 6):  # three and two micro-batches, and one per rank (a step DDP reduces in its only backward)
    model = torch.nn.parallel.DistributedDataParallel(make_model())
    hook = GradientNoiseScale(decay=1.0)
    accumulate(model, shard, loss_fn, micro_batch_size=size, count_fn=count_fn, noise=hook)
    results[("noise", size)] = (hook.estimate.g_sq, hook.estimate.trace_sigma)
"""
    + WORKER_END
)


@pytest.mark.timeout(180)
def test_ddp_two_processes_equal_one_process(tmp_path):
    res = two_rank_results(WORKER.format(tests=str(Path(__file__).parent)), tmp_path)
    ref, ref_loss = full_batch_grad(make_batch(rows=10))
    keys = [(False, False), (False, True), (True, False), (True, True)]
    keys += [("bucket_view_twice", False), ("bucket_view_twice", True), "helpers"]
    for key in keys:
        for r in range(2):
            g, loss = res[r][key]
            assert rel(g, ref) < 1e-10, (key, r)
            if loss is not None:
                assert abs(loss - ref_loss) < 1e-12 * abs(ref_loss)
    for size in (2, 6):
        assert res[0][("noise", size)] == res[1][("noise", size)]  # averaged over ranks
        assert res[0][("noise", size)] == pytest.approx(
            ddp_noise_by_hand(make_batch(rows=10), size), rel=1e-9
        )


def ddp_noise_by_hand(batch, size: int) -> tuple[float, float]:
    """(|G|², tr(Σ)) as the two-rank worker's step should estimate them: on each rank (rows 0-5 and 6-9) every
    micro-batch's own mean gradient against the whole batch's (both ranks' tokens), the pairs' estimates averaged on
    the rank, then over the ranks (McCandlish et al. 2018, App. A; each device's gradient against the reduced one)."""
    big, n_big = flat_grad_sq(batch), float(count_fn(batch))
    per_rank = []
    for rows in (slice(0, 6), slice(6, 10)):
        pairs = [
            dict(b_small=float(count_fn(mb)), g_small_sq=flat_grad_sq(mb), b_big=n_big, g_big_sq=big)
            for mb in split({k: v[rows] for k, v in batch.items()}, size)
        ]
        per_rank.append(
            [sum(f(**p) for p in pairs) / len(pairs) for f in (g_sq_estimate, trace_sigma_estimate)]
        )
    return tuple(sum(r[i] for r in per_rank) / 2 for i in range(2))


def flat_grad_sq(batch) -> float:
    """|∇ mean loss|² of a fresh model on ``batch``."""
    g, _ = full_batch_grad(batch)
    return float(g.pow(2).sum())


# -- the README example: a Hugging Face causal LM ------------------------------------------------


def hf_loss_fn(model, mb):
    """The docs' loss_fn, verbatim: summed next-token loss over the valid tokens, and their number."""
    logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits[:, :-1].float()
    labels = mb["labels"][:, 1:]
    loss_sum = F.cross_entropy(
        logits.reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=-100, reduction="sum"
    )
    return loss_sum, (labels != -100).sum()


@pytest.mark.timeout(120)
def test_hugging_face_causal_lm_equals_its_own_full_batch_loss():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=50, n_positions=16)
    model = transformers.AutoModelForCausalLM.from_config(config).double()
    model.train(False)  # no dropout, so the two runs see the same function
    batch = make_batch()  # right-padded, labels -100 on padding: what a collator gives
    out = model(**batch)  # Hugging Face's own loss: mean over all valid shifted tokens
    out.loss.backward()
    ref = flat_grad(model)
    model.zero_grad(set_to_none=True)
    loss = accumulate(model, batch, hf_loss_fn, micro_batch_size=3, count_fn=count_fn)
    assert rel(flat_grad(model), ref) < 1e-10
    assert float(loss) == pytest.approx(float(out.loss.detach()), rel=1e-6)
