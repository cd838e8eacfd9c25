"""Pipeline checks that fit on one GPU (issue 16): what a p >= 2 NCCL run needs is several GPUs.

NCCL refuses two ranks on one GPU, so per-rank CUDA memory and the bubble of a real NCCL pipeline
are out of reach on a one-GPU machine. What fits, and what this script runs:

1. ``profile``: the per-stage forward / backward / input-gradient / weight-gradient times of one
   micro-batch on CUDA (CUDA events, median of repeats), for a GPT-2-shaped stack split into p
   stages by parameter count as the runner splits it (microbatch.run.pipeline.split), with each
   stage's peak allocated memory — the inputs the before-the-run prediction takes, here measured on
   the GPU. Also the W / B ratio that zero-bubble schedules rely on.
2. ``gloo-cuda``: whether gloo moves CUDA tensors between two processes (send/recv): the only way
   to put two pipeline ranks on one GPU. Run in child processes under a time limit; the answer is
   recorded either way.
3. If gloo does move CUDA tensors: a p = 2, m = 4 1F1B run of the real runner with both ranks on
   cuda:0 (microbatch.run.pipeline.rank.run_rank), its per-rank ``max_memory_allocated``, busy and
   step time, and the gradient check against the unsplit model.

    PYTHONPATH=src python3 bench/gpu_pipeline.py --out $OUT/pipeline.json     # on the GPU, < 1 min
    PYTHONPATH=src python3 bench/gpu_pipeline.py --dry-run                    # CPU: tiny shapes
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def profile(model: str, seq: int, micro_batch: int, stages: int, device: str, repeats: int) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    from microbatch.run.pipeline.config import PipelineConfig
    from microbatch.run.pipeline.rank import build_full_model, make_batch
    from microbatch.run.pipeline.resolved import resolve
    from microbatch.run.pipeline.split import balanced_split, model_units, split_units, unit_param_counts

    cfg = PipelineConfig(schedule="1f1b", stages=stages, microbatches=stages, model=model, seq=seq,
                         global_batch=stages * micro_batch)  # fmt: skip
    full, vocab, s = build_full_model(resolve(cfg))
    full = full.to(device)
    units = model_units(full)
    sizes = balanced_split(unit_param_counts(units), stages)
    modules = split_units(units, sizes)
    tok, tgt = make_batch(cfg, vocab, s, -1)
    x: Any = tok[:micro_batch].to(device)
    target = tgt[:micro_batch].to(device)
    cuda = device.startswith("cuda")

    from microbatch.measure.timing import cuda_timer, wall_timer

    one = (
        cuda_timer if cuda else wall_timer
    )  # CUDA events (or the wall clock on the CPU): the library's clocks

    def run(fn: Any, repeats: int, warmup: int = 0) -> float:
        for _ in range(warmup):
            fn()
        return statistics.median(one(fn) for _ in range(repeats))

    def timed(fn: Any) -> float:
        return float(run(fn, repeats=repeats, warmup=0))

    def timed_once(fn: Any) -> float:
        return float(run(fn, repeats=1, warmup=0))

    rows = []
    last = len(modules) - 1
    for i, mod in enumerate(modules):
        inp = x.detach().requires_grad_(x.is_floating_point())
        params = [p for p in mod.parameters() if p.requires_grad]

        def fwd(mod: Any = mod, inp: Any = inp, i: int = i) -> Any:
            with torch.autocast(device_type="cuda" if cuda else "cpu", dtype=torch.bfloat16, enabled=cuda):
                y = mod(inp)
                if i == last:
                    y = F.cross_entropy(y.flatten(0, -2).float(), target.flatten())
            return y

        y = fwd()
        grad = None if i == last else torch.ones_like(y)
        fwd()  # warm-up
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        f_s = timed(fwd)

        def b_s_fn(fwd: Any = fwd, grad: Any = grad) -> float:
            vals = []
            for _ in range(repeats):
                y = fwd()
                vals.append(timed_once(lambda y=y: torch.autograd.backward(y, grad)))
            return statistics.median(vals)

        b_s = b_s_fn()
        i_vals, w_vals = [], []
        for _ in range(repeats):
            yy = fwd()
            if inp.requires_grad:
                i_vals.append(
                    timed_once(
                        lambda yy=yy, g=grad, x=inp: torch.autograd.grad(yy, [x], g, retain_graph=True)
                    )
                )
            else:
                i_vals.append(0.0)
            w_vals.append(
                timed_once(lambda yy=yy, g=grad, ps=params: torch.autograd.grad(yy, ps, g, allow_unused=True))
            )
        peak = (torch.cuda.max_memory_allocated() - base) if cuda else None
        rows.append({
            "stage": i, "units": sizes[i], "params": sum(p.numel() for p in params),
            "F_ms": f_s * 1e3, "B_ms": b_s * 1e3,
            "I_ms": statistics.median(i_vals) * 1e3, "W_ms": statistics.median(w_vals) * 1e3,
            "W_over_B": statistics.median(w_vals) / b_s if b_s > 0 else None,
            "B_over_F": b_s / f_s if f_s > 0 else None,
            "peak_allocated_over_base_bytes": peak,
        })  # fmt: skip
        mod.zero_grad(set_to_none=True)
        with (
            torch.no_grad(),
            torch.autocast(device_type="cuda" if cuda else "cpu", dtype=torch.bfloat16, enabled=cuda),
        ):
            x = mod(x)
    return {
        "model": model,
        "seq": s,
        "micro_batch": micro_batch,
        "stages": stages,
        "device": device,
        "rows": rows,
    }


def _gloo_child(rank: int, port: int, device: str, q: Any) -> None:
    try:
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}")
        t = torch.full((1024,), float(rank + 1), device=device)
        if rank == 0:
            dist.send(t, 1)
            q.put({"rank": 0, "ok": True})
        else:
            r = torch.zeros(1024, device=device)
            dist.recv(r, 0)
            q.put({"rank": 1, "ok": bool((r == 1.0).all().item()), "received_device": str(r.device)})
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 - recorded, not raised
        q.put({"rank": rank, "ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}"})


def gloo_cuda(device: str, timeout_s: float) -> dict[str, Any]:
    import multiprocessing as mp

    from microbatch.run.pipeline.launch import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_gloo_child, args=(r, port, device, q)) for r in range(2)]
    for p in procs:
        p.start()
    got = []
    deadline = time.monotonic() + timeout_s
    while len(got) < 2 and time.monotonic() < deadline:
        try:
            got.append(q.get(timeout=1.0))
        except Exception:  # noqa: BLE001 - queue.Empty
            if not any(p.is_alive() for p in procs):
                break
    for p in procs:
        p.join(timeout=2)
        if p.is_alive():
            p.kill()
    codes = [p.exitcode for p in procs]
    ok = len(got) == 2 and all(g.get("ok") for g in got)
    return {"device": device, "works": ok, "ranks": got, "exit_codes": codes}


def _runner_child(rank: int, port: int, device: str, q: Any, model: str) -> None:
    try:
        import torch.distributed as dist

        from microbatch.run.pipeline.config import PipelineConfig
        from microbatch.run.pipeline.rank import run_rank
        from microbatch.run.pipeline.resolved import resolve

        dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}")
        cfg = PipelineConfig(
            schedule="1f1b", stages=2, microbatches=4, model=model, steps=3, check_gradients=True
        )
        out = run_rank(resolve(cfg), rank=rank, world_size=2, device=device)
        if rank == 0:
            q.put({"ok": True, "raw": out})
        dist.barrier()
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        q.put({"ok": False, "rank": rank, "error": traceback.format_exc()[-1500:]})
    os._exit(0)


def runner_on_one_gpu(device: str, model: str, timeout_s: float) -> dict[str, Any]:
    import multiprocessing as mp

    from microbatch.run.pipeline.launch import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_runner_child, args=(r, port, device, q, model)) for r in range(2)]
    for p in procs:
        p.start()
    res: dict[str, Any] = {"ok": False, "error": "timed out"}
    try:
        res = q.get(timeout=timeout_s)
    except Exception:  # noqa: BLE001
        pass
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny model: check the script")
    args = ap.parse_args()
    import torch

    dry = args.dry_run or not torch.cuda.is_available()
    device = "cpu" if dry else "cuda:0"
    res: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if not dry else "cpu",
        "torch": torch.__version__,
    }

    def save() -> None:
        if args.out:
            Path(args.out).write_text(json.dumps(res, indent=1, default=str))

    t0 = time.perf_counter()
    runs = (
        [("tiny", 64, 2, 2)]
        if dry
        else [("gpt2", 1024, 8, 2), ("gpt2", 1024, 8, 4), ("gpt2-medium", 1024, 8, 4)]
    )
    res["profile"] = []
    for model, seq, mb, p in runs:
        try:
            res["profile"].append(profile(model, seq, mb, p, device, repeats=3 if dry else 10))
        except Exception:  # noqa: BLE001
            res["profile"].append({"model": model, "stages": p, "error": traceback.format_exc()[-1000:]})
        save()
    res["profile_s"] = time.perf_counter() - t0
    if not dry:
        res["gloo_cuda"] = gloo_cuda(device, timeout_s=60)
        save()
        if res["gloo_cuda"]["works"]:
            res["runner_two_ranks_one_gpu"] = runner_on_one_gpu(device, "small", timeout_s=120)
            save()
    for row in res["profile"]:
        for r in row.get("rows", []):
            print(f"{row['model']} p={row['stages']} stage {r['stage']}: F {r['F_ms']:.2f} B {r['B_ms']:.2f} "
                  f"I {r['I_ms']:.2f} W {r['W_ms']:.2f} ms, W/B {r['W_over_B']:.2f}")  # fmt: skip
    if "gloo_cuda" in res:
        print("gloo with CUDA tensors:", json.dumps(res["gloo_cuda"])[:400])
    if "runner_two_ranks_one_gpu" in res:
        r = res["runner_two_ranks_one_gpu"]
        if r.get("ok"):
            raw = r["raw"]
            summ = {k: v for k, v in raw.items() if "grad" in k}
            summ["ranks"] = [
                [{"step_ms": (st["end_wall_s"] - st["start_wall_s"]) * 1e3, "cuda_peak_bytes": st["cuda_peak_bytes"],
                  "saved_activation_bytes": st["peak_activation_bytes"], "counted_bytes": st["counted_activation_bytes"]}
                 for st in rk["steps"]]
                for rk in raw["ranks"]
            ]  # fmt: skip
            r["summary"] = summ
            print("runner, 2 ranks on one GPU:", json.dumps(summ, default=str)[:2000])
        else:
            print("runner, 2 ranks on one GPU failed:", str(r.get("error"))[-800:])
    save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
