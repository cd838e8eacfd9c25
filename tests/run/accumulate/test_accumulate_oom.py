"""Out-of-memory during accumulation: the step is redone with smaller micro-batches and its gradient
does not change (``on_oom="split"``, :class:`microbatch.MicroBatchController`).

The out-of-memory is injected where memory is allocated, not by mocking ``accumulate``: an
``AllocationLimit`` (a ``TorchDispatchMode``, below autograd, so it sees the forward's and the
backward's kernels) raises ``torch.OutOfMemoryError`` — the type CUDA's caching allocator raises —
for any tensor a kernel produces over a byte budget, as a device with that much free memory would.
The loss trims padding to the micro-batch's longest row, so a micro-batch of long sequences needs
more memory than one of short ones: the failure comes part-way through a step, after earlier
micro-batches have added to ``.grad``. One test provokes a real CPU allocation failure in a
child process under ``RLIMIT_AS``; one runs two gloo processes where only rank 1 runs out.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _helpers import WORKER_END, WORKER_START, AllocationLimit, two_rank_results
from test_accumulate import V, full_batch_grad, make_model, rel, set_pre_grads

import microbatch
from microbatch.errors import ConfigError, OutOfMemoryError
from microbatch.run.accumulate import accumulate, accumulate_micro_batches, split_by_tokens
from microbatch.run.accumulate.controller import MicroBatchController
from microbatch.run.accumulate.oom import CPU_ALLOC_FAILURE, is_out_of_memory

S = 9
BYTES = 8  # float64


def logits_budget(rows: int, width: int) -> int:
    """Bytes of the largest tensor of a micro-batch of ``rows`` × ``width`` tokens: the (r, w, V) logits."""
    return rows * width * V * BYTES


def sorted_batch(rows: int = 12, seed: int = 1) -> dict[str, torch.Tensor]:
    """Right-padded rows with lengths growing down the batch (valid-token counts differ per micro-batch)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([1, 2, 2, 3, 4, 5, 5, 6, 7, 8, 9, 9, 3, 9, 1, 9][:rows])
    lengths = lengths.sort().values if rows <= 12 else lengths
    ids = torch.randint(1, V, (rows, S), generator=g)
    mask = (torch.arange(S).view(1, -1) < lengths.view(-1, 1)).long()
    ids = ids * mask
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def trim(mb: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Cut the padding down to the micro-batch's longest row (the model is causal: nothing else changes)."""
    width = max(2, int(mb["attention_mask"].sum(1).max()))
    return {k: v[:, :width] for k, v in mb.items()}


def loss_fn(model, mb):
    mb = trim(mb)
    logits = model(mb["input_ids"])[:, :-1]
    target = mb["labels"][:, 1:]
    loss_sum = F.cross_entropy(logits.reshape(-1, V), target.reshape(-1), ignore_index=-100, reduction="sum")
    return loss_sum, (target != -100).sum()


def count_fn(mb):
    return (mb["labels"][:, 1:] != -100).sum()


def flat(model) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


# -- exactness after splits -------------------------------------------------------------------------


@pytest.mark.parametrize("with_count", [False, True])
@pytest.mark.parametrize("pre_existing", [False, True])
@pytest.mark.parametrize(
    ("budget_rows", "splits", "sizes"),
    [
        (4, 1, [8, 4]),  # 8 rows of the longest fail; 4 fit
        (2, 2, [8, 4, 2]),  # 8 and then 4 fail; 2 fit
    ],
)
def test_split_gradient_equals_full_batch(with_count, pre_existing, budget_rows, splits, sizes):
    batch = sorted_batch()
    ref, ref_loss = full_batch_grad(batch)
    model = make_model()
    pre = set_pre_grads(model) if pre_existing else None
    ctl = MicroBatchController(8)
    limit = AllocationLimit(logits_budget(budget_rows, S))
    with limit:
        loss = accumulate(model, batch, loss_fn, controller=ctl, count_fn=count_fn if with_count else None)
    got = flat(model)
    if pre is not None:
        got = got - torch.cat([g.reshape(-1) for g in pre])
    assert rel(got, ref) < 1e-10
    assert abs(float(loss) - ref_loss) < 1e-10 * abs(ref_loss)
    assert limit.failures == splits
    assert ctl.splits == splits and ctl.micro_batch_size == sizes[-1] and ctl.steps == 1
    assert [(e.old, e.new, e.kind) for e in ctl.history] == [
        (a, b, "split") for a, b in zip(sizes, sizes[1:], strict=False)
    ]
    assert all("Tried to allocate" in e.reason for e in ctl.history)


def test_failure_part_way_through_the_step():
    """With b_m = 4 the first two micro-batches (short rows) fit and the third (long rows) does not."""
    batch = sorted_batch()
    widths = [int(mb["attention_mask"].sum(1).max()) for mb in microbatch.run.accumulate.split(batch, 4)]
    budget = logits_budget(4, 6)
    assert [logits_budget(4, w) <= budget for w in widths] == [True, True, False]
    ref, ref_loss = full_batch_grad(batch)
    model = make_model()
    pieces = []

    def counting(m, mb):
        pieces.append(int(mb["input_ids"].shape[0]))
        return loss_fn(m, mb)

    with AllocationLimit(budget) as limit:
        loss = accumulate(model, batch, counting, micro_batch_size=4, on_oom="split")
    # the third piece of 4 failed after two had added to .grad; the step was redone in pieces of 2
    assert limit.failures == 1 and pieces == [4, 4, 4] + [2] * 6
    assert rel(flat(model), ref) < 1e-10
    assert abs(float(loss) - ref_loss) < 1e-10 * abs(ref_loss)


def test_the_uneven_token_case_is_not_trivial():
    """The micro-batches after a split hold different token counts: the mean of means would be wrong."""
    batch = sorted_batch()
    counts = [int(count_fn(mb)) for mb in microbatch.run.accumulate.split(batch, 4)]
    assert len(set(counts)) == len(counts)
    ref, _ = full_batch_grad(batch)
    model = make_model()
    for mb in microbatch.run.accumulate.split(batch, 4):
        loss_sum, n = loss_fn(model, mb)
        (loss_sum / n / 3).backward()
    assert rel(flat(model), ref) > 1e-3


class BackwardGate(torch.nn.Module):
    """Wraps the tiny LM; the backward allocates a buffer the size of the activation's gradient."""

    def __init__(self, inner: torch.nn.Module, max_bytes: int) -> None:
        super().__init__()
        self.inner, self.max_bytes, self.failures = inner, max_bytes, 0

    def _alloc_like(self, g: torch.Tensor) -> torch.Tensor:
        nbytes = g.numel() * g.element_size()
        if nbytes > self.max_bytes:
            self.failures += 1
            raise torch.OutOfMemoryError(f"Tried to allocate {nbytes} bytes in the backward")
        buf = torch.empty_like(g)
        return buf.copy_(g)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.inner(tokens)
        if x.requires_grad:
            x.register_hook(self._alloc_like)
        return x


def test_out_of_memory_in_the_backward_splits_too():
    batch = sorted_batch()
    ref, _ = full_batch_grad(batch)
    model = BackwardGate(make_model(), logits_budget(3, S))
    loss = accumulate(model, batch, loss_fn, micro_batch_size=12, on_oom="split", count_fn=count_fn)
    assert model.failures == 2  # 12 and 6 rows fail in their backward; 3 fit
    assert rel(flat(model), ref) < 1e-10
    assert float(loss) == pytest.approx(full_batch_grad(batch)[1], rel=1e-12)


@pytest.mark.parametrize("with_count", [False, True])
def test_micro_batches_given_are_halved_on_out_of_memory(with_count, caplog):
    """split_by_tokens to 30 padded tokens gives (rows, width) (6, 5), (3, 7), (3, 9); 15 tokens' logits fit:
    6 rows fail, then at 3 rows the third piece ((5, 6, 7) long, 21 tokens) fails part-way, then 1 row fits."""
    batch = sorted_batch()
    given = split_by_tokens(batch, 30, lengths=batch["attention_mask"].sum(1))
    assert [tuple(mb["input_ids"].shape) for mb in given] == [(6, 5), (3, 7), (3, 9)]
    ref, ref_loss = full_batch_grad(batch)
    model = make_model()
    pre = set_pre_grads(model)
    limit = AllocationLimit(logits_budget(1, 15))
    with caplog.at_level(logging.WARNING, logger="microbatch.run.controller"), limit:
        loss = accumulate_micro_batches(
            model, given, loss_fn, count_fn=count_fn if with_count else None, on_oom="split"
        )
    got = flat(model) - torch.cat([g.reshape(-1) for g in pre])
    assert rel(got, ref) < 1e-10 and abs(float(loss) - ref_loss) < 1e-10 * abs(ref_loss)
    messages = [r.getMessage() for r in caplog.records if r.name == "microbatch.run.controller"]
    assert limit.failures == 2 and len(messages) == 2
    assert (
        "micro-batch 6, redoing the step at 3" in messages[0]
        and "micro-batch 3, redoing the step at 1" in messages[1]
    )
    with AllocationLimit(logits_budget(1, 15)), pytest.raises(torch.OutOfMemoryError):
        accumulate_micro_batches(model, given, loss_fn)  # on_oom="raise" is the default here too
    assert rel(flat(model) - torch.cat([g.reshape(-1) for g in pre]), ref) < 1e-10  # as they were


# -- when splitting cannot help, and what is not out of memory ------------------------------------


def test_one_row_out_of_memory_raises_and_leaves_the_gradients():
    model = make_model()
    pre = set_pre_grads(model)
    ctl = MicroBatchController(4)
    with (
        AllocationLimit(logits_budget(1, S) - 1),
        pytest.raises(OutOfMemoryError, match=r"micro-batch of 1 row"),
    ):
        accumulate(model, sorted_batch(), loss_fn, controller=ctl)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), pre, strict=True))
    assert ctl.splits == 2 and ctl.steps == 0  # 4 → 2 → 1, then nothing left to split


def test_raise_is_the_default():
    model = make_model()
    with AllocationLimit(logits_budget(2, S)), pytest.raises(torch.OutOfMemoryError):
        accumulate(model, sorted_batch(), loss_fn, micro_batch_size=4)
    assert all(p.grad is None for p in model.parameters())


def test_other_runtime_errors_are_not_split():
    def broken(model, mb):
        raise RuntimeError("shape mismatch: not a memory problem")

    ctl = MicroBatchController(4)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        accumulate(make_model(), sorted_batch(), broken, controller=ctl)
    assert ctl.splits == 0


def test_cpu_allocator_message_is_recognised_narrowly():
    real = (
        "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to "
        "allocate 800000000 bytes. Error code 12 (Cannot allocate memory)"
    )
    assert CPU_ALLOC_FAILURE in real
    assert is_out_of_memory(RuntimeError(real))
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory")) and is_out_of_memory(MemoryError())
    assert not is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_out_of_memory(
        ValueError(real)
    )  # the message alone is not enough: it is the allocator's type


# -- the controller across steps ------------------------------------------------------------------


def test_controller_remembers_the_size_that_worked(caplog):
    batch = sorted_batch()
    model = make_model()
    ctl = MicroBatchController(8)
    limit = AllocationLimit(logits_budget(4, S))
    with caplog.at_level(logging.WARNING, logger="microbatch"), limit:
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            accumulate(model, batch, loss_fn, controller=ctl)
    assert limit.failures == 1 and ctl.splits == 1 and ctl.steps == 3 and ctl.micro_batch_size == 4
    records = [r for r in caplog.records if r.name == "microbatch.run.controller"]
    assert len(records) == 1  # logged once per split
    assert "step 0" in records[0].getMessage() and "micro-batch 8" in records[0].getMessage()
    assert "at 4" in records[0].getMessage() and "Tried to allocate" in records[0].getMessage()
    s = ctl.summary()
    assert (s["splits"], s["steps"], s["micro_batch_size"], s["grows"]) == (1, 3, 4, 0)
    assert s["history"][0]["old"] == 8 and s["history"][0]["new"] == 4


def test_growth_is_off_by_default_and_never_passes_the_knee():
    plain = MicroBatchController(2)
    for _ in range(50):
        plain.record_step()
    assert plain.micro_batch_size == 2 and plain.grows == 0

    ctl = MicroBatchController(8, knee=12, grow_after=3)
    ctl.record_split(2, "test")
    sizes = []
    for _ in range(12):
        ctl.record_step()
        sizes.append(ctl.micro_batch_size)
    # the step that split (its first record) ran out of memory: not clean; three clean ones after it, then growth
    assert sizes == [2, 2, 2, 4, 4, 4, 8, 8, 8, 12, 12, 12]
    assert ctl.grows == 3 and [e.kind for e in ctl.history] == ["split", "grow", "grow", "grow"]


def test_growth_in_training_returns_to_the_knee_after_a_long_batch():
    batch = sorted_batch()
    short_rows = {k: v[:6] for k, v in batch.items()}  # widths up to 5: 6 × 5 fits the budget of 4 × 9
    model = make_model()
    ctl = MicroBatchController(8, grow_after=2)
    with AllocationLimit(logits_budget(4, S)) as limit:
        accumulate(model, batch, loss_fn, controller=ctl)  # 8 rows of width 6 fail: the step runs at 4
        sizes = [ctl.micro_batch_size]
        for _ in range(3):
            accumulate(model, short_rows, loss_fn, controller=ctl)
            sizes.append(ctl.micro_batch_size)
    # the step that split ran out of memory (not clean); the two after it are: back to 8 (the knee), where short
    # rows fit
    assert sizes == [4, 4, 8, 8] and ctl.splits == 1 and ctl.grows == 1 and limit.failures == 1


def test_bad_arguments():
    model, batch = make_model(), sorted_batch()
    with pytest.raises(ConfigError, match="not both"):
        accumulate(model, batch, loss_fn, micro_batch_size=4, controller=MicroBatchController(4))
    with pytest.raises(ConfigError, match="on_oom must be one of"):
        accumulate(model, batch, loss_fn, micro_batch_size=4, on_oom="retry")
    with pytest.raises(ConfigError, match="a controller splits"):
        accumulate(model, batch, loss_fn, controller=MicroBatchController(4), on_oom="raise")
    with pytest.raises(ConfigError, match="knee 2 is below initial 4"):
        MicroBatchController(4, knee=2)
    with pytest.raises(ConfigError, match="grow_after must be a whole number"):
        MicroBatchController(4, grow_after=0)


def test_exported_at_the_top_level():
    assert microbatch.MicroBatchController is MicroBatchController


# -- a real CPU out-of-memory in a child process under a memory limit ------------------------------

CHILD = r"""
import os, resource, sys, torch
torch.set_num_threads(1)  # before the limit: libgomp cannot start threads under it
from microbatch.measure.hostmem import virtual_bytes
from microbatch.run.accumulate import accumulate
from microbatch.run.accumulate.controller import MicroBatchController

ROWS, D, W = 256, 64, 16384
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(D, W), torch.nn.Tanh(), torch.nn.Linear(W, 1)).double()
x = torch.randn(ROWS, D, dtype=torch.float64)
y = torch.randn(ROWS, 1, dtype=torch.float64)

def loss_fn(m, mb):
    xb, yb = mb
    return ((m(xb) - yb) ** 2).sum(), xb.shape[0]

room = int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_AS, (virtual_bytes() + room, resource.RLIM_INFINITY))
ctl = MicroBatchController(ROWS)
loss = accumulate(model, (x, y), loss_fn, controller=ctl)
resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
torch.save({"grad": torch.cat([p.grad.reshape(-1) for p in model.parameters()]), "loss": float(loss),
            "summary": ctl.summary()}, sys.argv[1])
"""


@pytest.mark.timeout(120)
def test_real_cpu_out_of_memory_in_a_child_recovers(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    src = str(Path(microbatch.__file__).resolve().parents[1])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": src, "MALLOC_ARENA_MAX": "2"}
    env.update({"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536"})
    # one (256, 16384) float64 activation is 32 MiB and the step holds a few: 48 MiB of room fails at
    # 256 rows and fits at 64 or fewer
    room = 48 * 2**20
    out = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "r.pt"), str(room)],
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    res = torch.load(tmp_path / "r.pt")
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 16384), torch.nn.Tanh(), torch.nn.Linear(16384, 1)
    ).double()
    x = torch.randn(256, 64, dtype=torch.float64)
    y = torch.randn(256, 1, dtype=torch.float64)
    loss = ((model(x) - y) ** 2).sum() / 256
    loss.backward()
    ref = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    assert rel(res["grad"], ref) < 1e-10
    assert res["loss"] == pytest.approx(float(loss.detach()), rel=1e-12)
    s = res["summary"]
    assert s["splits"] >= 1 and s["micro_batch_size"] < 256
    assert all(CPU_ALLOC_FAILURE in e["reason"] for e in s["history"]), s["history"]


# -- two ranks, only rank 1 runs out of memory ------------------------------------------------------

WORKER = (
    WORKER_START
    + r"""
from test_accumulate_oom import AllocationLimit, sorted_batch, loss_fn, count_fn, logits_budget, S
from test_accumulate import make_model, set_pre_grads
from microbatch.run.accumulate import accumulate, accumulate_micro_batches, split_by_tokens
from microbatch.run.accumulate.controller import MicroBatchController

batch = sorted_batch()
shard = {{k: (v[:6] if rank == 0 else v[6:]) for k, v in batch.items()}}  # rank 1 holds the long rows
results = {{}}
for with_count in (False, True):
    for pre_existing in (False, True):
        model = torch.nn.parallel.DistributedDataParallel(make_model())
        pre = set_pre_grads(model.module, seed=10 + rank) if pre_existing else None
        ctl = MicroBatchController(6)
        limit = AllocationLimit(logits_budget(2, S) if rank == 1 else 10**12)  # rank 1: 2 rows of 9 fit
        with limit:
            loss = accumulate(model, shard, loss_fn, controller=ctl, count_fn=count_fn if with_count else None)
        g = torch.cat([p.grad.reshape(-1) for p in model.module.parameters()])
        if pre is not None:
            g = g - torch.cat([x.reshape(-1) for x in pre])
        results[(with_count, pre_existing)] = (g, float(loss), ctl.summary(), limit.failures)
# micro-batches given: rank 0 (6, 5) runs, rank 1 (3, 7) fails; they agree on mean rows 5: rank 0 halves to
# 3, rank 1 to 1; then both complete
model = torch.nn.parallel.DistributedDataParallel(make_model())
limit = AllocationLimit(logits_budget(2, S) if rank == 1 else 10**12)
given = split_by_tokens(shard, 30, lengths=shard["attention_mask"].sum(1))
with limit:
    loss = accumulate_micro_batches(model, given, loss_fn, count_fn=count_fn, on_oom="split")
g = torch.cat([p.grad.reshape(-1) for p in model.module.parameters()])
results["given"] = (g, float(loss), [tuple(mb["input_ids"].shape) for mb in given], limit.failures)
# a model with buffers that DDP broadcasts in every forward cannot agree: refused before any work
buffered = make_model()
buffered.register_buffer("scale", torch.ones(1, dtype=torch.float64))
try:
    accumulate(torch.nn.parallel.DistributedDataParallel(buffered), shard, loss_fn, micro_batch_size=2,
               on_oom="split")
    results["buffers"] = "accepted"
except Exception as e:
    results["buffers"] = f"{{type(e).__name__}}: {{e}}"
"""
    + WORKER_END
)


@pytest.mark.timeout(180)
def test_ddp_only_rank_1_fails_both_split(tmp_path):
    res = two_rank_results(WORKER.format(tests=str(Path(__file__).parent)), tmp_path)
    ref, ref_loss = full_batch_grad(sorted_batch())
    for key in [(False, False), (False, True), (True, False), (True, True)]:
        for r in range(2):
            g, loss, summary, _ = res[r][key]
            assert rel(g, ref) < 1e-10, (key, r)
            assert abs(loss - ref_loss) < 1e-10 * abs(ref_loss)
            assert [(e["old"], e["new"]) for e in summary["history"]] == [(6, 3), (3, 1)], (key, r)
        assert res[0][key][3] == 0 and res[1][key][3] == 2  # only rank 1 ran out of memory
        assert "out of memory on 1 of 2 ranks" in res[0][key][2]["history"][0]["reason"]
        assert "Tried to allocate" in res[1][key][2]["history"][0]["reason"]
    assert [res[r]["given"][2] for r in range(2)] == [[(6, 5)], [(3, 7), (3, 9)]]
    assert [res[r]["given"][3] for r in range(2)] == [0, 1]  # rank 1's first piece; at 1 row all fit
    for r in range(2):
        assert rel(res[r]["given"][0], ref) < 1e-10 and abs(res[r]["given"][1] - ref_loss) < 1e-10 * abs(
            ref_loss
        )
    for r in range(2):
        assert (
            res[r]["buffers"].startswith("ConfigError") and "forward_sync_buffers=False" in res[r]["buffers"]
        )


def test_fsdp_is_refused():
    class FSDPModule(torch.nn.Module):  # the class name fully_shard's modules derive from
        pass

    model = make_model()
    model.extra = FSDPModule()
    with pytest.raises(ConfigError, match="does not support FSDP"):
        accumulate(model, sorted_batch(), loss_fn, micro_batch_size=4, on_oom="split")
    assert all(p.grad is None for p in model.parameters())
