"""The several-machine recipe, on one machine: two torchrun agents (--nnodes 2, one rank each) meet
through a c10d rendezvous on localhost and run ``microbatch pipeline`` as two ranks, as a user does
across two machines. Loopback only; bounded by a timeout so a rendezvous that never completes fails."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from microbatch.run.pipeline.launch import free_port

pytest.importorskip("torch")


def _agents(port: int, command: list[str], timeout_s: float = 150) -> list[subprocess.CompletedProcess[str]]:
    """Two torchrun agents of one rank each, meeting at localhost:port. The rendezvous store is hosted
    here, by the test, for as long as both agents run (``is_host=false`` for both): when one agent hosts
    it, as on two machines, that agent can exit the moment its worker is done while the other agent
    still polls the store (torch's elastic agent, ``num_nodes_waiting``), and the other agent then fails
    with a RendezvousConnectionError although both workers finished (seen in 2 of 4 runs on the 2-core
    VM, 2026-12-03)."""
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore("localhost", port, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_s))  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("MICROBATCH_PIPELINE_FAULT", None)

    def agent(rank: int) -> list[str]:
        return [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
            "--node-rank", str(rank), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}",
            "--rdzv-id", f"microbatch-test-{port}", "--rdzv-conf", "is_host=false", *command,
        ]  # fmt: skip

    procs = [
        subprocess.Popen(agent(rank), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for rank in (0, 1)
    ]
    out = []
    try:
        for p in procs:
            try:
                o, e = p.communicate(timeout=timeout_s)
            except subprocess.TimeoutExpired:  # killed; what it printed is kept (communicate loses no output)
                p.kill()
                o, e = p.communicate()
                e += f"\n[agent killed after {timeout_s:.0f} s]"
            out.append(subprocess.CompletedProcess(p.args, p.returncode, o, e))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        del store
    return out


@pytest.mark.timeout(200)
def test_pipeline_under_two_torchrun_agents_with_c10d_rendezvous():
    res = _agents(
        free_port(),
        ["-m", "microbatch", "pipeline", "--stages", "2", "--microbatches", "4", "--schedule", "1f1b",
         "--steps", "1", "--check-gradients", "--json"],
    )  # fmt: skip
    for r in res:
        assert r.returncode == 0, r.stderr[-2000:]
    printed = [r.stdout for r in res if r.stdout.strip()]
    assert len(printed) == 1  # only rank 0 prints
    out = json.loads(printed[0])
    assert out["gradients_match"] is True
    assert [s["counted_in_flight"] for s in out["measured"]["stage_stats"]] == [2, 1]
    assert out["order_matches_torch"]


DDP_TUNE = """
import json, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
import microbatch
from microbatch.measure.gpt import build_model
from microbatch.model import get_model

dist.init_process_group("gloo")
torch.set_num_threads(1)
shape = get_model("tiny", seq=32)
model = DDP(build_model(shape))
res = microbatch.tune(model, lambda b: torch.randint(0, shape.vocab, (b, 32)), max_micro_batch=4)
if dist.get_rank() == 0:
    print(json.dumps({"points": [p.micro_batch for p in res.points],
                      "knee": res.recommendation.knee.micro_batch, "world": dist.get_world_size()}))
dist.barrier()  # both ranks at the end before either tears gloo down (an early teardown aborted a rank)
import os, sys
sys.stdout.flush()
os._exit(0)  # past gloo's teardown, as the other workers end (one rank once hung there after printing, CI)
"""


@pytest.mark.serial  # two ranks tuning on two cores: beside the other workers' busy loops it outran 200 s once (CI)
@pytest.mark.timeout(240)
def test_ddp_tune_under_two_torchrun_agents(tmp_path):
    script = tmp_path / "ddp_tune.py"
    script.write_text(DDP_TUNE)
    res = _agents(free_port(), [str(script)], timeout_s=200)
    printed = [r for r in res if r.stdout.strip()]
    assert len(printed) == 1, [
        r.stderr[-2000:] for r in res
    ]  # rank 0's worker finished the tune and printed it
    for r in res:
        # an agent whose worker had finished and printed was once left in torch's elastic agent past 200 s at
        # a load of 0.2 (CI, 2026-12-07: its exit, not the tune; 6 of 6 runs alone took 7 s): killed, it may be
        # excused where the other agent exited 0
        excused = r is printed[0] and r.returncode == -9 and all(o.returncode == 0 for o in res if o is not r)
        assert r.returncode == 0 or excused, r.stderr[-2000:]
    out = json.loads(printed[0].stdout.strip().splitlines()[-1])
    assert out["world"] == 2
    assert out["points"] and max(out["points"]) <= 4
    assert out["knee"] in out["points"]
