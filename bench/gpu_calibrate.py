"""Calibration on a GPU: predicted (uncalibrated, calibrated) against measured memory and step time.

Run by ``bench/gpu.sh`` on a lent GPU machine (no network; ``PYTHONPATH=src``; any torch >= 2.4)::

    python3 bench/gpu_calibrate.py --out $OUT/calibrate.json          # <= ~4 minutes in all
    python3 bench/gpu_calibrate.py --smoke --out /tmp/calibrate.json  # dry run on the CPU (tiny model)
    python3 bench/gpu_calibrate.py --from $OUT/calibrate.json         # table again from saved points

For gpt2-xl (s = 1024) and llama-3.2-1b (s = 2048), random weights from microbatch.measure.gpt, it
measures b_m = 1, 2, 4, 8, 16 (ascending, until out of memory or the model's time share runs
out) in this process:

- **numerics**: bf16 autocast over fp32 weights (fp32 gradients, AdamW fp32 moments: 4 + 4 + 8 =
  16 B/param, the same total as the analytic bf16-mixed 2 + 2 + 12), the setting ``tune
  --precision bf16-mixed`` uses;
- **steady state**: one full step (forward, backward, AdamW step) first, so the optimizer's
  state exists; gradients set to None before each probe, so the first micro-step allocates them;
- **memory**: ``torch.cuda.reset_peak_memory_stats`` after ``empty_cache``, then one warm-up and
  the timed micro-steps (forward + backward, gradients accumulating); ``max_memory_allocated``
  and ``max_memory_reserved`` read *before* the optimizer step (the activations' peak, which the
  planner models); the peak including the AdamW step is recorded too;
- **time**: CUDA events around each micro-step, median of the timed repeats;
- **out of memory**: ``torch.OutOfMemoryError`` caught by type; larger b_m are then not tried.

Then, per memory figure (allocated, reserved): calibrated on the smallest three probes, every
point predicted uncalibrated, calibrated and leave-one-out (:func:`microbatch.predict.validation.validate`),
with the accelerator matched from the device name (H200 → ``h200``). Partial results are
written to ``--out`` after every point; each model runs under try/except.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

MODELS = (("gpt2-xl", 1024), ("llama-3.2-1b", 2048))
SMOKE_MODELS = (("tiny", 64), ("small", 128))
MICRO_BATCHES = (1, 2, 4, 8, 16)
SMOKE_MICRO_BATCHES = (1, 2, 4, 8)


def _oom_types(torch) -> tuple[type[BaseException], ...]:
    out: list[type[BaseException]] = [MemoryError]
    for t in (getattr(torch, "OutOfMemoryError", None), getattr(torch.cuda, "OutOfMemoryError", None)):
        if isinstance(t, type) and t not in out:
            out.append(t)
    return tuple(out)


class Runner:
    """One model on one device: setup step, then probes."""

    def __init__(self, name: str, seq: int, device: str):
        import torch

        from microbatch.measure.gpt import build_model, next_token_loss
        from microbatch.model import get_model

        self.torch, self.loss_of = torch, next_token_loss
        self.shape = get_model(name, seq=seq)
        self.seq, self.device = seq, torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.model = build_model(self.shape, device=self.device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.gen = torch.Generator(device="cpu").manual_seed(1)
        self.context_bytes = 0
        if self.cuda:
            free, total = torch.cuda.mem_get_info(self.device)
            self.context_bytes = max(0, total - free - torch.cuda.memory_reserved(self.device))
        self.micro(self.batch(1))
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.sync()

    def batch(self, b: int):
        t = self.torch.randint(0, self.shape.vocab, (b, self.seq), generator=self.gen)
        return t.to(self.device)

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize(self.device)

    def micro(self, tokens) -> None:
        dt = self.torch.bfloat16
        with self.torch.autocast(device_type=self.device.type, dtype=dt, enabled=self.cuda):
            loss = self.loss_of(self.model(tokens), tokens)
        loss.backward()

    def timed(self, tokens) -> float:
        torch = self.torch
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            self.micro(tokens)
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        self.micro(tokens)
        return time.perf_counter() - t0

    def probe(self, b: int, *, target_s: float = 2.0, max_repeats: int = 10) -> dict:
        torch = self.torch
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
        held = {}
        try:
            held["tokens"] = self.batch(b)
            warm = self.timed(held["tokens"])  # warm-up: allocates the gradients
            n = max(3, min(max_repeats, int(target_s / max(warm, 1e-4))))
            times = [self.timed(held["tokens"]) for _ in range(n)]
            alloc = reserved = None
            if self.cuda:
                alloc = int(torch.cuda.max_memory_allocated(self.device))
                reserved = int(torch.cuda.max_memory_reserved(self.device))
            t0 = time.perf_counter()
            self.opt.step()
            self.sync()
            t_opt = time.perf_counter() - t0
            alloc_opt = int(torch.cuda.max_memory_allocated(self.device)) if self.cuda else None
        except _oom_types(torch) as e:
            held.clear()
            self.opt.zero_grad(set_to_none=True)
            gc.collect()
            if self.cuda:
                torch.cuda.empty_cache()
            return {
                "micro_batch": b,
                "oom": True,
                "error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}",
            }
        held.clear()
        self.opt.zero_grad(set_to_none=True)
        med = statistics.median(times)
        q = statistics.quantiles(times, n=4, method="inclusive") if len(times) > 1 else [med, med, med]
        if not self.cuda:  # the smoke run has no allocator statistics: stand-ins so the pipeline runs
            from microbatch.measure.hostmem import peak_rss_bytes

            alloc = reserved = alloc_opt = peak_rss_bytes()
        return {
            "micro_batch": b,
            "oom": False,
            "throughput": b * self.seq / med,
            "micro_step_s": med,
            "step_time_s": med,
            "spread": (q[2] - q[0]) / med,
            "repeats": len(times),
            "optimizer_step_s": t_opt,
            "peak_allocated_bytes": alloc,
            "peak_reserved_bytes": reserved,
            "peak_memory_bytes": reserved + self.context_bytes,
            "peak_allocated_with_optimizer_bytes": alloc_opt,
        }

    def close(self) -> None:
        del self.model, self.opt
        gc.collect()
        if self.cuda:
            self.torch.cuda.empty_cache()


def _write(path: Path, doc: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str))
    tmp.replace(path)


def _validate(name: str, seq: int, points: list[dict], device: str, device_name: str, smoke: bool) -> dict:
    from microbatch.hardware import get_accelerator
    from microbatch.measure.cpu import measure_cpu
    from microbatch.predict.calibrate import cover_measurements
    from microbatch.predict.validation import validate
    from microbatch.records import read_measurements

    data = {"points": points, "model": name, "seq": seq, "precision": "bf16-mixed" if not smoke else "fp32",
            "checkpointing": "off", "device": device, "device_name": device_name, "mode": "train"}  # fmt: skip
    out = {}
    for kind, key in (("allocated", "peak_allocated_bytes"), ("reserved", "peak_reserved_bytes")):
        try:
            meas = read_measurements(data, memory_key=key)
            if smoke:
                acc, _ = cover_measurements(measure_cpu(), meas)
            else:
                from microbatch.hardware import match_accelerator

                acc = get_accelerator(match_accelerator(device_name) or "h200")
            out[kind] = validate(meas, acc, fit_on=3).to_dict()
        except Exception as e:  # noqa: BLE001 - recorded, the other figure and model go on
            out[kind] = {"error": f"{type(e).__name__}: {e}"}
    return out


def _table(results: dict) -> str:
    lines = []
    head = (f"{'model':<13} {'mem':<9} {'b_m':>3} {'fit':>5} {'meas GiB':>9} {'uncal%':>7} {'cal%':>7} {'loo%':>7} "
            f"{'step ms':>9} {'uncal%':>7} {'cal%':>7} {'loo%':>7}")  # fmt: skip
    lines += [head, "-" * len(head)]
    for name, r in results.items():
        if "error" in r:
            lines.append(f"{name:<13} error: {r['error']}")
            continue
        for kind, v in r.get("validation", {}).items():
            if "error" in v:
                lines.append(f"{name:<13} {kind:<9} error: {v['error']}")
                continue
            for p in v["points"]:

                def pct(x):
                    return "—" if x is None else f"{100 * x:+.1f}"

                lines.append(
                    f"{name:<13} {kind:<9} {p['micro_batch']:>3} {'probe' if p['micro_batch'] in v['fit_on'] else '':>5} "
                    f"{p['memory_measured'] / 2**30:>9.2f} {pct(p['memory_uncal_err']):>7} {pct(p['memory_cal_err']):>7} "
                    f"{pct(p['memory_loo_err']):>7} {p['step_measured'] * 1e3:>9.1f} {pct(p['step_uncal_err']):>7} "
                    f"{pct(p['step_cal_err']):>7} {pct(p['step_loo_err']):>7}"
                )
            lines.append(f"{'':<13} {kind:<9} {v['summary']}")
        ooms = [p["micro_batch"] for p in r.get("points", []) if p.get("oom")]
        if ooms:
            lines.append(f"{name:<13} out of memory at b_m {ooms}")
    return "\n".join(lines)


def redo(path: Path, out: Path | None) -> int:
    """Validation and table again from saved points (after a time-out, or with a newer calibrate.py or validation.py)."""
    doc = json.loads(path.read_text())
    device_name = doc.get("machine", {}).get("device", "")
    smoke = not str(doc.get("numerics", "")).startswith("bf16")
    device = "cpu" if smoke else "cuda"
    for name, res in doc.get("models", {}).items():
        ok = [p for p in res.get("points", []) if not p.get("oom")]
        if len(ok) >= 3:
            res["validation"] = _validate(name, res["seq"], res["points"], device, device_name, smoke)
    doc["table"] = _table(doc.get("models", {}))
    if out is not None:
        _write(out, doc)
    print(doc["table"])
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="JSON file written after every point.")
    ap.add_argument(
        "--from",
        dest="from_file",
        help="Recompute the validation and table from a (partial) JSON this script wrote; no torch needed.",
    )
    ap.add_argument("--smoke", action="store_true", help="Dry run on the CPU with the tiny and small models.")
    ap.add_argument(
        "--budget-s", type=float, default=190.0, help="Wall time for building and measuring all models."
    )
    ap.add_argument(
        "--models", help="Comma-separated name:seq pairs (default gpt2-xl:1024,llama-3.2-1b:2048)."
    )
    args = ap.parse_args()
    if args.from_file:
        return redo(Path(args.from_file), Path(args.out) if args.out else None)
    if not args.out:
        ap.error("--out is required (or --from FILE)")
    t_start = time.perf_counter()
    import torch

    device = "cpu" if args.smoke else "cuda"
    if args.smoke:
        torch.set_num_threads(1)  # steadier on a shared CPU
    if not args.smoke and not torch.cuda.is_available():
        print("no CUDA device: use --smoke for a CPU dry run", file=sys.stderr)
        return 2
    models = SMOKE_MODELS if args.smoke else MODELS
    if args.models:
        models = tuple((m.split(":")[0], int(m.split(":")[1])) for m in args.models.split(","))
    bms = SMOKE_MICRO_BATCHES if args.smoke else MICRO_BATCHES
    device_name = torch.cuda.get_device_name(0) if device == "cuda" else platform.processor() or "cpu"
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "status": "running",
        "machine": {"device": device_name, "torch": torch.__version__, "python": platform.python_version(),
                    "cuda": getattr(torch.version, "cuda", None), "host": platform.node(), "cpus": os.cpu_count()},
        "numerics": "bf16 autocast over fp32 weights, fp32 grads, AdamW (16 B/param)" if not args.smoke else "fp32",
        "memory_window": "peak over warm-up + timed micro-steps, before the optimizer step",
        "models": {},
    }  # fmt: skip
    deadline = t_start + args.budget_s
    for i, (name, seq) in enumerate(models):
        left = deadline - time.perf_counter()
        model_deadline = time.perf_counter() + left / (len(models) - i)
        res: dict = {"seq": seq, "points": []}
        doc["models"][name] = res
        runner = None
        try:
            t0 = time.perf_counter()
            runner = Runner(name, seq, device)
            res["setup_s"] = time.perf_counter() - t0
            res["params"] = runner.shape.param_count()
            last = 0.0
            for b in bms:
                if time.perf_counter() + 2.5 * last > model_deadline:
                    res["stopped"] = f"time share used before b_m {b}"
                    break
                t0 = time.perf_counter()
                p = runner.probe(b, target_s=0.5 if args.smoke else 2.0)
                last = time.perf_counter() - t0
                p["wall_s"] = last
                res["points"].append(p)
                _write(out, doc)
                print(f"{name} b_m={b}: {json.dumps({k: p.get(k) for k in ('micro_step_s', 'peak_allocated_bytes', 'peak_reserved_bytes', 'oom')})}", flush=True)  # fmt: skip
                if p["oom"]:
                    break
        except Exception as e:  # noqa: BLE001 - one model's failure must not cost the other
            res["error"] = f"{type(e).__name__}: {e}"
            res["traceback"] = traceback.format_exc()[-2000:]
        finally:
            if runner is not None:
                runner.close()
            runner = None
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()
        ok = [p for p in res["points"] if not p.get("oom")]
        if len(ok) >= 3:
            res["validation"] = _validate(name, seq, res["points"], device, device_name, args.smoke)
        elif "error" not in res:
            res["error"] = f"only {len(ok)} points measured; validation needs 3"
        _write(out, doc)
    doc["status"] = "done"
    doc["wall_s"] = time.perf_counter() - t_start
    doc["table"] = _table(doc["models"])
    _write(out, doc)
    print(doc["table"])
    print(f"wall {doc['wall_s']:.0f} s on {device_name}, torch {torch.__version__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
