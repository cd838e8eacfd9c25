"""The integrations against each framework's own finder, on the same small CPU model.

For Lightning (``KneeBatchSize`` vs ``BatchSizeFinder(mode="power", max_trials=...)``), Accelerate
(``knee_batch_size`` vs ``find_executable_batch_size``) and the Hugging Face Trainer
(``tune_trainer`` vs ``auto_find_batch_size``), each in a fresh child process:

1. **time to answer**: from ``fit()`` / the decorated call / ``tune_trainer`` until the first
   training step starts (``on_train_start``; the first real call; the return), by the wall clock;
2. **the answer** (b_m, and g where the tool sets one);
3. **memory and throughput at the answer**, measured the same way for every tool in another fresh
   child, as training at the answer runs: each optimizer step is g micro-batches of b_m (forward,
   backward) then one AdamW step, so B_global samples per step for every tool (an answer b_m × g is
   not timed as b_m samples per optimizer step: that would charge it g optimizer steps per global
   batch). Peak RSS (VmHWM) above the RSS before the first step, over 2 warm-up and 5 timed steps
   (and, beside it, the peak over the 5 timed steps above the RSS the warm-up left once the free
   heap is returned: without the first step's one-time costs, which every answer pays alike);
   then samples/s of every answer measured alternately in one more child (5 rounds × 3 timed steps
   each, median), so that the drift of a shared machine falls on all of them alike, by the wall
   clock and by the process's CPU time (one thread: not stretched by other jobs' load).

On a CPU nothing runs out of memory, so the peers' finders answer with the largest size they try
(Lightning: 2^(max_trials−1) capped by the data; Accelerate and Hugging Face: the starting size,
which they keep). Model: the registry's ``tiny`` GPT (2 layers, hidden 64, seq 64) or, with
``--model small``, its ``small`` (4 layers, hidden 256, vocabulary 4096: activations large enough
that the process's fixed resident memory no longer dominates the peak); one thread.

Usage: python bench/bench_integrations.py [--model tiny|small] [--global-batch 64] [--max 64] [--json OUT]
Prints one summary table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

SEQ = 64
N_DATA = 4096
MODEL = os.environ.get("MB_BENCH_MODEL", "tiny")  # the parent passes --model to its children here


def _setup() -> tuple:
    import torch

    from microbatch.measure.gpt import build_model, next_token_loss
    from microbatch.model import get_model

    torch.set_num_threads(1)
    # the process's first optimizer imports torch._dynamo (~2 s, once per process): a cost every
    # training run pays once, before or after any finder. Paid here, before every tool's clock, so
    # that no tool is charged for it (Lightning imports it with its own package; Accelerate's
    # decorator stops its clock before the user's function builds its optimizer; our Accelerate
    # probes build it inside the clock)
    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])
    shape = get_model(MODEL, seq=SEQ)
    data = torch.randint(0, shape.vocab, (N_DATA, SEQ), generator=torch.Generator().manual_seed(0))
    return torch, shape, data, build_model, next_token_loss


def _rss_hwm() -> tuple[int, int]:
    rss = hwm = 0
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) * 1024
        if line.startswith("VmHWM:"):
            hwm = int(line.split()[1]) * 1024
    return rss, hwm


def _train_steps(torch, model, opt, data, loss_of, b: int, g: int, start: int):
    """One optimizer step as training at the answer runs it: ``g`` micro-batches of ``b`` samples
    (forward, backward), then one AdamW step; ``start`` is the first sample's index."""
    for j in range(g):
        i = (start + j * b) % (N_DATA - b)
        x = data[i : i + b]
        loss_of(model(x), x).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def measure_at(b: int, g: int) -> dict:
    """Samples/s and peak RSS above the start of optimizer steps at the answer b_m × g (the same for
    every tool): 2 warm-up then 5 timed steps, each ``g`` micro-batches of ``b`` and one AdamW step."""
    torch, shape, data, build_model, loss_of = _setup()
    model = build_model(shape)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    import gc

    from microbatch.measure.hostmem import malloc_trim

    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    base, _ = _rss_hwm()
    times = []
    for i in range(7):
        if i == 2:  # the warm state: what the warm-up left once the allocator gave back the free heap
            _, hwm_warmup = _rss_hwm()
            gc.collect()
            malloc_trim()
            Path("/proc/self/clear_refs").write_text("5")
            warm, _ = _rss_hwm()
        t0 = time.perf_counter()
        _train_steps(torch, model, opt, data, loss_of, b, g, i * b * g)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    _, hwm = _rss_hwm()
    return {
        "samples_per_s": b * g / statistics.median(times),
        "peak_above_start_bytes": max(hwm, hwm_warmup) - base,
        "peak_above_warm_bytes": hwm - warm,
        "warm_left_bytes": warm - base,
    }


def paired_throughput(answers: list[tuple[int, int]], rounds: int = 5) -> dict[str, dict[str, float]]:
    """Samples/s at each answer (b_m, g), measured alternately in one process: ``rounds`` rounds, each
    1 warm-up and 3 timed optimizer steps (g micro-batches of b_m and one AdamW step) per answer; the
    median of all. A shared machine's speed drifts over a minute: answers measured in turn share it.
    Two clocks: the wall clock, and the process's CPU time (one thread: the time the work takes when
    it has the core, which other jobs' load does not stretch; cache sharing still does)."""
    torch, shape, data, build_model, loss_of = _setup()
    model = build_model(shape)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    wall: dict[tuple[int, int], list[float]] = {a: [] for a in answers}
    cpu: dict[tuple[int, int], list[float]] = {a: [] for a in answers}
    for _round in range(rounds):
        for b, g in answers:
            for i in range(4):
                t0, c0 = time.perf_counter(), time.process_time()
                _train_steps(torch, model, opt, data, loss_of, b, g, i * b * g)
                if i >= 1:
                    wall[(b, g)].append((time.perf_counter() - t0) / (b * g))
                    cpu[(b, g)].append((time.process_time() - c0) / (b * g))
    return {
        f"{b}x{g}": {
            "wall": 1.0 / statistics.median(wall[(b, g)]),
            "cpu": 1.0 / statistics.median(cpu[(b, g)]),
        }
        for b, g in answers
    }


def _curve(result) -> list[list]:
    """The tune's curve: [b_m, samples/s] per point (None when out of memory; a point measured again
    to confirm the knee holds its median measurement), then [None, the number of probes]."""
    return [[p.micro_batch, p.samples_per_s] for p in result.points] + [[None, result.probes]]


def lightning(which: str, global_batch: int, cap: int) -> dict:
    torch, shape, data, build_model, loss_of = _setup()
    import lightning.pytorch as L
    from torch.utils.data import DataLoader

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = build_model(shape)
            self.batch_size = 1

        def training_step(self, batch, i):
            return loss_of(self.model(batch), batch)

        def train_dataloader(self):
            return DataLoader(data, batch_size=self.batch_size)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    class Clock(L.Callback):
        def on_train_start(self, trainer, module):
            self.t = time.perf_counter()  # the answer is in; fit then runs its one step

    if which == "ours":
        from microbatch.integrations.lightning import KneeBatchSize

        finder = KneeBatchSize(global_batch, max_micro_batch=cap, use_cache=False)
    else:
        from lightning.pytorch.callbacks import BatchSizeFinder

        trials = cap.bit_length()  # 1, 2, ..., cap
        finder = BatchSizeFinder(mode="power", init_val=1, max_trials=trials, steps_per_trial=3)
    clock = Clock()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[finder, clock])  # fmt: skip
    module = Module()
    t0 = time.perf_counter()
    trainer.fit(module)
    out = {"time_to_answer_s": clock.t - t0, "micro_batch": module.batch_size,
           "grad_accum": trainer.accumulate_grad_batches}  # fmt: skip
    if which == "ours":
        out["probes"] = _curve(finder.result)
    return out


def accelerate_(which: str, global_batch: int, cap: int) -> dict:
    torch, shape, data, build_model, loss_of = _setup()
    from accelerate import Accelerator
    from accelerate.utils import find_executable_batch_size
    from torch.utils.data import DataLoader

    seen: dict = {}
    t0 = time.perf_counter()

    def body(micro_batch, grad_accum, probe=None):
        if probe is None:
            seen.update(t=time.perf_counter(), b=micro_batch, g=grad_accum)
            return
        acc = Accelerator(cpu=True, gradient_accumulation_steps=grad_accum)
        model = build_model(shape)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        model, opt, loader = acc.prepare(model, opt, DataLoader(data, batch_size=micro_batch))
        for x in loader:
            with acc.accumulate(model):
                acc.backward(loss_of(model(x), x))
                opt.step()
                opt.zero_grad()
            probe.step()

    if which == "ours":
        from microbatch.integrations.accelerate import knee_batch_size

        f = knee_batch_size(body, global_batch=global_batch, max_micro_batch=cap, use_cache=False)
        f()
        return {"time_to_answer_s": seen["t"] - t0, "micro_batch": seen["b"], "grad_accum": seen["g"],
                "probes": _curve(f.result)}  # fmt: skip

    @find_executable_batch_size(starting_batch_size=cap)
    def peer(batch_size):
        body(batch_size, 1, None)

    peer()
    return {"time_to_answer_s": seen["t"] - t0, "micro_batch": seen["b"], "grad_accum": None}


def hf(which: str, global_batch: int, cap: int) -> dict:
    torch, shape, data, build_model, loss_of = _setup()
    import tempfile

    import transformers

    cfg = transformers.GPT2Config(n_layer=shape.layers, n_head=shape.heads, n_embd=shape.hidden,
                                  vocab_size=shape.vocab, n_positions=SEQ)  # fmt: skip
    model = transformers.GPT2LMHeadModel(cfg)
    ds = [{"input_ids": x, "labels": x} for x in data]
    b0 = cap if which == "peer" else 1
    args = transformers.TrainingArguments(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=b0, gradient_accumulation_steps=global_batch // b0,
        use_cpu=True, report_to="none", auto_find_batch_size=which == "peer", max_steps=1)  # fmt: skip
    trainer = transformers.Trainer(model=model, args=args, train_dataset=ds)
    t0 = time.perf_counter()
    if which == "ours":
        from microbatch.integrations.hf import tune_trainer

        res = tune_trainer(trainer, global_batch, max_micro_batch=cap, use_cache=False)
        extra = {"probes": _curve(res)}
    else:
        extra = {}  # auto_find_batch_size acts only on out-of-memory inside train(): on a CPU it keeps b0
    return {"time_to_answer_s": time.perf_counter() - t0, "micro_batch": trainer.args.per_device_train_batch_size,
            "grad_accum": trainer.args.gradient_accumulation_steps, **extra}  # fmt: skip


RUNS = {"lightning": lightning, "accelerate": accelerate_, "hf": hf}


def _child(args: list[str]) -> dict:
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        MICROBATCH_CACHE_DIR=str(Path(os.environ.get("TMPDIR", "/tmp")) / "mb-bench-cache"),
    )
    out = subprocess.run(
        [sys.executable, __file__, *args], capture_output=True, text=True, env=env, timeout=900
    )
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("tiny", "small"), default=MODEL)
    ap.add_argument("--global-batch", type=int, default=64)
    ap.add_argument("--max", type=int, default=64, help="largest b_m any tool tries")
    ap.add_argument("--json")
    ap.add_argument("--only", choices=sorted(RUNS))
    ap.add_argument("--one", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--measure", help=argparse.SUPPRESS)
    ap.add_argument("--pair", help=argparse.SUPPRESS)
    a = ap.parse_args()
    os.environ["MB_BENCH_MODEL"] = a.model  # read by every child at import
    if a.measure:
        b, g = map(int, a.measure.split("x"))
        print(json.dumps(measure_at(b, g)))
        return
    if a.pair:
        print(json.dumps(paired_throughput([tuple(map(int, x.split("x"))) for x in a.pair.split(",")])))
        return
    if a.one:
        print(json.dumps(RUNS[a.one[0]](a.one[1], a.global_batch, a.max)))
        return
    rows, measured = [], {}
    for fw in [a.only] if a.only else list(RUNS):
        for which in ("ours", "peer"):
            r = _child(["--one", fw, which, "--global-batch", str(a.global_batch), "--max", str(a.max)])
            answer = f"{r['micro_batch']}x{r['grad_accum'] or 1}"  # what training at the answer runs
            if answer not in measured:
                measured[answer] = _child(["--measure", answer])
            rows.append({"framework": fw, "tool": which, "answer": answer, **r, **measured[answer]})
    paired = _child(["--pair", ",".join(sorted(measured))])
    for r in rows:
        r["samples_per_s_single"] = r["samples_per_s"]
        r["samples_per_s"] = paired[r["answer"]]["wall"]
        r["samples_per_cpu_s"] = paired[r["answer"]]["cpu"]
    load = os.getloadavg()[0]
    print(f"{'framework':<11}{'tool':<6}{'answer s':>9}{'b_m':>5}{'g':>5}{'samples/s':>11}{'peak MiB':>10}"
          f"{'mem vs peer':>12}{'warm MiB':>9}{'(vs peer)':>10}{'thr vs peer':>12}{'(cpu time)':>11}")  # fmt: skip

    def ratio(r: dict, peer: dict, key: str) -> float:
        return r[key] / peer[key] if peer[key] else float("nan")

    for r in rows:
        peer = next(p for p in rows if p["framework"] == r["framework"] and p["tool"] == "peer")
        mem = ratio(r, peer, "peak_above_start_bytes")
        warm = ratio(r, peer, "peak_above_warm_bytes")
        thr = r["samples_per_s"] / peer["samples_per_s"]
        thr_cpu = r["samples_per_cpu_s"] / peer["samples_per_cpu_s"]
        print(f"{r['framework']:<11}{r['tool']:<6}{r['time_to_answer_s']:>9.2f}{r['micro_batch']:>5}"
              f"{str(r['grad_accum']):>5}{r['samples_per_s']:>11.1f}{r['peak_above_start_bytes'] / 2**20:>10.1f}"
              f"{mem:>12.2f}{r['peak_above_warm_bytes'] / 2**20:>9.1f}{warm:>10.2f}{thr:>12.2f}{thr_cpu:>11.2f}")  # fmt: skip
    print(
        "peak MiB: peak RSS above the RSS before the first step (2 warm-up + 5 timed steps); warm MiB: peak RSS "
        "over the 5 timed steps above the RSS after the warm-up, the free heap returned (malloc_trim) - "
        "without the one-time costs of a first step (lazy library set-up, "
        + ", ".join(sorted({f"{r['warm_left_bytes'] / 2**20:.1f}" for r in rows}))
        + " MiB here) that every answer pays alike"
    )
    for r in rows:
        if r.get("probes"):
            curve = " ".join(f"{b}:{t:.0f}" if t else f"{b}:oom" for b, t in r["probes"] if b is not None)
            print(f"{r['framework']} ours, samples/s as probed: {curve} ({r['probes'][-1][1]} probes)")
    print(
        f"load average (1 min) at the end: {load:.2f}; cores: {os.cpu_count()}; model {a.model}, seq {SEQ}, 1 thread"
    )
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows, "load": load, "model": a.model}, indent=2))


if __name__ == "__main__":
    main()
