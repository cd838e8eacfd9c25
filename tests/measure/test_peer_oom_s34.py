"""tune under DDP where one rank's forward runs out of memory (a helper's review, 2026-12-08): rank 0 went on into
DDP's gradient all-reduce while rank 1 agreed on its error, and gloo aborted on the mismatched sizes (NCCL would
hang). Now every rank leaves before the backward and the b_m is out of memory on both."""

from __future__ import annotations

import json
import os

import pytest


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from microbatch.choose.tune import tune
    from microbatch.measure.gpt import build_model
    from microbatch.measure.timing import TimingConfig
    from microbatch.model import get_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        shape = get_model("tiny", seq=16)
        model = DDP(build_model(shape))

        def loss_fn(m, batch):
            if rank == 1 and batch.shape[0] >= 4:  # in the forward, after the batch was made on both ranks
                raise torch.OutOfMemoryError("simulated: CUDA out of memory on rank 1 only")
            logits = m(batch)
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch.flatten())

        r = tune(
            model, lambda b: torch.randint(0, shape.vocab, (b, 16)), loss_fn=loss_fn, max_micro_batch=8,
            patience=100, tolerance=0.0, use_cache=False,
            timing=TimingConfig(warmup=1, min_repeats=2, max_repeats=3, max_time_s=0.5, rel_tol=0.0),
        )  # fmt: skip
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(r.to_dict(), f)
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    os._exit(0)  # gloo's C++ teardown has aborted after the barrier under load (see test_measure.py)


@pytest.mark.timeout(240)
def test_a_forward_out_of_memory_on_one_rank_is_out_of_memory_on_both(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in results:
        ooms = sorted(p["micro_batch"] for p in r["points"] if p["oom"])
        ran = sorted(p["micro_batch"] for p in r["points"] if not p["oom"])
        assert ooms and min(ooms) == 4 and ran == [1, 2], r["points"]
    assert results[0]["micro_batch"] == results[1]["micro_batch"] <= 2
