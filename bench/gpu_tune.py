"""GPU part of `tune` for bench/gpu.sh: our tune against Lightning's and Accelerate's batch-size finders.

Subcommands (each run as its own process under `timeout` by gpu.sh):

  checks                       CUDA checks as a plain script (used when pytest is missing)
  ours MODEL --out DIR         microbatch.tune on the HF model built on the device first, as the
                               others are (registry shape, bf16-mixed, seq 1024)
  lightning MODEL --out DIR    lightning Tuner.scale_batch_size(mode="power") on the same model
  accelerate MODEL --out DIR   accelerate find_executable_batch_size on the same model
  measure MODEL --out DIR --at B[,B...]   our probe at other tools' answers (throughput, memory)
  summary --out DIR            one JSON + a text table: memory saved and throughput kept by the knee

`--dry-run` shrinks everything to the tiny model on the CPU (seq 64) so the script can be
checked without a GPU. Results are JSON files under --out; nothing is printed but a summary.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def _settings(args):
    if args.dry_run:
        return {"device": "cpu", "precision": "fp32", "seq": 64, "cap": 8, "model": "tiny"}
    return {"device": "cuda", "precision": "bf16-mixed", "seq": 1024, "cap": 256, "model": args.model}


def _hf_model(name: str, seq: int, device: str):
    import torch

    from microbatch.measure.hf import hf_config_from_shape
    from microbatch.model import get_model

    shape = get_model(name)
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    with torch.device(device):  # initialise on the device: gpt2-large on the CPU takes many seconds
        model = AutoModelForCausalLM.from_config(hf_config_from_shape(shape))
    return model, shape.vocab


def _write(out: Path, name: str, data: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / name).write_text(json.dumps(data, indent=2, default=str))


# -- CUDA checks (plain functions: pytest wraps them in tests/test_measure.py) -------------
def check_cuda_peak_matches_known_allocation() -> None:
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    n = 256 * 2**20
    t = torch.empty(n, dtype=torch.uint8, device="cuda")
    peak = torch.cuda.max_memory_allocated() - before
    del t
    assert abs(peak - n) <= 0.01 * n, (peak, n)


def check_cuda_oom_caught_by_type_and_freed() -> None:
    import torch

    from microbatch.measure.gpt import build_model
    from microbatch.measure.probes import TrainProbe
    from microbatch.measure.timing import TimingConfig
    from microbatch.model import get_model

    shape = get_model("tiny", seq=64)
    model = build_model(shape, device="cuda")
    total = torch.cuda.get_device_properties(0).total_memory

    def make_batch(b):
        return torch.randint(0, shape.vocab, (b, 64), device="cuda")

    probe = TrainProbe(
        model, make_batch, device="cuda", timing=TimingConfig(warmup=0, min_repeats=1, max_repeats=1)
    )
    probe.setup(1)
    base = torch.cuda.memory_allocated()
    # logits alone: b·64·512·4 bytes; pick b so that they exceed the whole device
    huge = int(total // (64 * 512 * 4)) * 2
    m = probe.measure(huge)
    assert m.oom and "OutOfMemoryError" in (m.error or ""), m
    assert torch.cuda.memory_allocated() <= base + 2**20, (torch.cuda.memory_allocated(), base)
    ok = probe.measure(2)  # the search goes on after an OOM
    assert not ok.oom and ok.peak_allocated_bytes > 0


def check_cuda_tune_tiny_memory_linear() -> None:
    from microbatch.choose.tune import tune_model
    from microbatch.choose.tune.config import ProbeConfig, SearchConfig
    from microbatch.measure.timing import TimingConfig

    r = tune_model(
        "tiny",
        probe=ProbeConfig(
            seq=64, device="cuda", timing=TimingConfig(warmup=1, min_repeats=2, max_repeats=3, max_time_s=0.5)
        ),
        search=SearchConfig(max_micro_batch=64, patience=100, use_cache=False),
    )
    from microbatch.fit import fit_line

    pts = [p for p in r.points if not p.oom]
    allocs = [p.peak_allocated_bytes for p in pts]
    assert allocs == sorted(allocs) and allocs[-1] > allocs[0], allocs
    # linear, not just growing: a line through all but the largest point predicts the largest within
    # 5% of its activation memory (DESIGN: on a GPU the fit was within 0.5% at 64x the probe)
    assert len(pts) >= 4, [p.micro_batch for p in pts]
    c0, c1 = fit_line([p.micro_batch for p in pts[:-1]], allocs[:-1])
    assert c1 > 0, (c0, c1)
    predicted = c0 + c1 * pts[-1].micro_batch
    assert abs(predicted - allocs[-1]) <= 0.05 * (allocs[-1] - c0), (predicted, allocs[-1], c0)
    assert all(p.peak_memory_bytes >= p.peak_allocated_bytes for p in pts)
    d = r.to_dict()
    assert d["device"] == "cuda" and d["device_name"], d["device_name"]
    assert d["memory_budget_source"] == "device total"


CHECKS = [
    check_cuda_peak_matches_known_allocation,
    check_cuda_oom_caught_by_type_and_freed,
    check_cuda_tune_tiny_memory_linear,
]


def cmd_checks(args) -> int:
    import torch

    if not torch.cuda.is_available():
        print("no CUDA: checks skipped")
        return 0
    failed = 0
    results = {}
    for fn in CHECKS:
        t0 = time.perf_counter()
        try:
            fn()
            results[fn.__name__] = {"ok": True, "s": time.perf_counter() - t0}
        except Exception as e:  # noqa: BLE001 - a report, not a library
            failed += 1
            results[fn.__name__] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    if args.out:
        _write(Path(args.out), "cuda_checks.json", results)
    print(json.dumps(results, indent=1))
    return 1 if failed else 0


# -- our tune ---------------------------------------------------------------------------
def cmd_ours(args) -> int:
    """``microbatch.tune`` on the model as a user holds it (built on the device before the clock
    starts, exactly as the Lightning and Accelerate runs build theirs), bf16-mixed, seq 1024."""
    import torch

    import microbatch
    from microbatch.choose.tune.config import ProbeConfig, SearchConfig
    from microbatch.measure.timing import TimingConfig

    s = _settings(args)
    model, vocab = _hf_model(s["model"], s["seq"], s["device"])
    seq = s["seq"]

    def make_batch(b):
        x = torch.randint(0, vocab, (b, seq), device=s["device"])
        return {"input_ids": x, "labels": x}

    probe = ProbeConfig(
        seq=seq,
        precision=s["precision"],
        timing=TimingConfig(warmup=2, min_repeats=3, max_repeats=8, max_time_s=1.5, rel_tol=0.03),
    )
    t0 = time.perf_counter()
    r = microbatch.tune(
        model, make_batch, probe=probe, search=SearchConfig(max_micro_batch=s["cap"], use_cache=False)
    )
    d = r.to_dict()
    d["time_to_answer_s"] = time.perf_counter() - t0
    # where the seconds go: the timed steps of the probes (warm-up + repeats, each of step_time_s)
    # against everything else (setup, optimizer state, snapshot and restore, the search)
    steps_s = sum(
        (2 + (p.get("repeats") or 0)) * (p.get("step_time_s") or 0.0) for p in d["points"] if not p.get("oom")
    )
    d["time_breakdown_s"] = {"probe_steps": steps_s, "other": d["time_to_answer_s"] - steps_s}
    d["model"] = s["model"]
    _write(Path(args.out), f"ours_{args.model}.json", d)
    print(
        f"ours {args.model}: knee {d['micro_batch']} fastest {d['fastest_fitting']['micro_batch']} "
        f"in {d['time_to_answer_s']:.1f} s ({steps_s:.1f} s in timed steps), {d['oom_events']} OOM"
    )
    return 0


def cmd_measure(args) -> int:
    """Our probe (same settings as `ours`) at the batch sizes other tools chose."""
    from microbatch.measure.spec import ProbeSpec, build_probe
    from microbatch.measure.timing import TimingConfig

    s = _settings(args)
    spec = ProbeSpec(
        model=s["model"],
        backend="hf",
        seq=s["seq"],
        device=s["device"],
        precision=s["precision"],
        timing=TimingConfig(warmup=2, min_repeats=3, max_repeats=8, max_time_s=1.5, rel_tol=0.03),
    )
    probe = build_probe(spec)
    out = {}
    for b in sorted({int(x) for x in args.at.split(",") if x.strip() and int(x) > 0}):
        out[str(b)] = probe.measure(b).to_dict()
    _write(Path(args.out), f"measured_{args.model}.json", out)
    return 0


# -- Lightning ----------------------------------------------------------------------------
def _lightning_module(model, vocab: int, seq: int, trials: list | None = None):
    """The LightningModule both Lightning runs tune: the HF model on random tokens, AdamW, a
    ``batch_size`` attribute (from 2) that the finders set; ``trials`` records each loader's size."""
    import lightning.pytorch as pl
    import torch

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return 10**6

        def __getitem__(self, i):
            return torch.randint(0, vocab, (seq,))

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = model
            self.batch_size = 2

        def train_dataloader(self):
            if trials is not None:
                trials.append(self.batch_size)
            return torch.utils.data.DataLoader(Data(), batch_size=self.batch_size, num_workers=0)

        def training_step(self, batch, i):
            return self.model(input_ids=batch, labels=batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    return Module()


def cmd_lightning(args) -> int:
    s = _settings(args)
    try:
        import lightning.pytorch as pl
        from lightning.pytorch.tuner import Tuner
    except ImportError as e:
        _write(Path(args.out), f"lightning_{args.model}.json", {"installed": False, "error": str(e)})
        return 0

    model, vocab = _hf_model(s["model"], s["seq"], s["device"])
    seq = s["seq"]
    calls = {"trials": []}

    trainer = pl.Trainer(
        accelerator="cpu" if args.dry_run else "gpu",
        devices=1,
        precision="32" if args.dry_run else "bf16-mixed",
        max_steps=10,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=args.out,  # its temporary checkpoint goes here, not into the checkout
    )
    module = _lightning_module(model, vocab, seq, calls["trials"])
    t0 = time.perf_counter()
    found = Tuner(trainer).scale_batch_size(
        module, mode="power", steps_per_trial=3, init_val=2, max_val=s["cap"] * 2 if args.dry_run else 8192
    )
    elapsed = time.perf_counter() - t0
    tried = calls["trials"]
    # power mode doubles until the first OOM, then keeps the last size that ran
    oom = 1 if found is not None and tried and max(tried) > found else 0
    _write(
        Path(args.out),
        f"lightning_{args.model}.json",
        {
            "installed": True,
            "batch_size": found,
            "time_to_answer_s": elapsed,
            "trials": tried,
            "oom_events": oom,
            "version": pl.__version__,
        },
    )
    print(f"lightning {args.model}: {found} in {elapsed:.1f} s")
    return 0


# -- our integrations on the same models --------------------------------------------------
def cmd_knee_lightning(args) -> int:
    """microbatch's Lightning callback (KneeBatchSize) on the same module as ``lightning``: the time
    of its on_fit_start (probe, restore, set b_m and g), then one optimizer step at the knee."""
    import lightning.pytorch as pl
    import torch

    from microbatch.integrations.lightning import KneeBatchSize

    s = _settings(args)
    model, vocab = _hf_model(s["model"], s["seq"], s["device"])
    seq, B = s["seq"], (16 if args.dry_run else 256)

    timing = {}

    class Timed(KneeBatchSize):
        def on_fit_start(self, trainer, pl_module):
            t0 = time.perf_counter()
            super().on_fit_start(trainer, pl_module)
            timing["s"] = time.perf_counter() - t0

    cb = Timed(global_batch=B, max_micro_batch=s["cap"], use_cache=False)
    trainer = pl.Trainer(
        accelerator="cpu" if args.dry_run else "gpu", devices=1, precision="32" if args.dry_run else "bf16-mixed",
        max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[cb], default_root_dir=args.out,
    )  # fmt: skip
    module = _lightning_module(model, vocab, seq)
    before = {k: v.detach().clone() for k, v in list(module.state_dict().items())[:4]}
    t0 = time.perf_counter()
    trainer.fit(module)
    total = time.perf_counter() - t0
    r = cb.result.to_dict()
    out = {"knee": cb.micro_batch, "grad_accum": cb.grad_accum, "global_batch": B,
           "time_to_answer_s": timing.get("s"), "fit_with_one_step_s": total,
           "exact": cb.micro_batch * cb.grad_accum == B, "module_batch_size": module.batch_size,
           "accumulate_grad_batches": trainer.accumulate_grad_batches,
           "weights_moved_by_the_one_step": any(not torch.equal(before[k], module.state_dict()[k]) for k in before),
           "points": [(p["micro_batch"], p["throughput"], p["peak_memory_bytes"]) for p in r["points"]]}  # fmt: skip
    _write(Path(args.out), f"knee_lightning_{args.model}.json", out)
    print(
        f"knee-lightning {args.model}: b_m {cb.micro_batch} x g {cb.grad_accum} = {B} in {timing.get('s', 0):.1f} s"
    )
    return 0


def cmd_knee_accelerate(args) -> int:
    """microbatch's Accelerate decorator (knee_batch_size) on the same step as ``accelerate``."""
    import torch
    from accelerate import Accelerator

    from microbatch.integrations.accelerate import knee_batch_size

    s = _settings(args)
    model, vocab = _hf_model(s["model"], s["seq"], s["device"])
    B = 16 if args.dry_run else 256
    seen = []

    @knee_batch_size(global_batch=B, max_micro_batch=s["cap"], use_cache=False)
    def train(micro_batch, grad_accum, probe=None):
        acc = Accelerator(cpu=args.dry_run, mixed_precision="no" if args.dry_run else "bf16",
                          gradient_accumulation_steps=grad_accum)  # fmt: skip
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        m, opt = acc.prepare(model, opt)
        for _ in range(10**6 if probe is not None else grad_accum):
            x = torch.randint(0, vocab, (micro_batch, s["seq"]), device=acc.device)
            with acc.accumulate(m):
                acc.backward(m(input_ids=x, labels=x).loss)
                opt.step()
                opt.zero_grad()
            if probe is not None:
                probe.step()
            else:
                seen.append(micro_batch)
        return micro_batch, grad_accum

    t0 = time.perf_counter()
    b, g = train()
    total = time.perf_counter() - t0
    out = {"knee": b, "grad_accum": g, "global_batch": B, "time_with_one_step_s": total, "exact": b * g == B,
           "points": [(p.micro_batch, p.throughput, p.peak_memory_bytes) for p in train.result.points]}  # fmt: skip
    _write(Path(args.out), f"knee_accelerate_{args.model}.json", out)
    print(
        f"knee-accelerate {args.model}: b_m {b} x g {g} = {B} in {total:.1f} s (one optimizer step included)"
    )
    return 0


# -- Accelerate -------------------------------------------------------------------------
def cmd_accelerate(args) -> int:
    s = _settings(args)
    try:
        import accelerate
        from accelerate.utils import find_executable_batch_size
    except ImportError as e:
        _write(Path(args.out), f"accelerate_{args.model}.json", {"installed": False, "error": str(e)})
        return 0
    import torch

    model, vocab = _hf_model(s["model"], s["seq"], s["device"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tried = []
    start = 8 if args.dry_run else 128  # Accelerate's documented default starting size

    @find_executable_batch_size(starting_batch_size=start)
    def train(batch_size):
        tried.append(batch_size)
        for _ in range(3):
            x = torch.randint(0, vocab, (batch_size, s["seq"]), device=s["device"])
            with torch.autocast(s["device"], dtype=torch.bfloat16, enabled=not args.dry_run):
                loss = model(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return batch_size

    t0 = time.perf_counter()
    found = train()
    elapsed = time.perf_counter() - t0
    _write(
        Path(args.out),
        f"accelerate_{args.model}.json",
        {
            "installed": True,
            "batch_size": found,
            "time_to_answer_s": elapsed,
            "trials": tried,
            "oom_events": len(tried) - 1,
            "version": accelerate.__version__,
        },
    )
    print(f"accelerate {args.model}: {found} in {elapsed:.1f} s")
    return 0


# -- summary ------------------------------------------------------------------------------
def cmd_summary(args) -> int:
    out = Path(args.out)
    rows = []
    for ours_file in sorted(out.glob("ours_*.json")):
        model = ours_file.stem[len("ours_") :]
        d = json.loads(ours_file.read_text())
        pts = {p["micro_batch"]: p for p in d["points"] if not p["oom"]}
        measured = {}
        mfile = out / f"measured_{model}.json"
        if mfile.exists():
            measured = {int(k): v for k, v in json.loads(mfile.read_text()).items()}
        row = {
            "model": model,
            "knee": d["micro_batch"],
            "knee_tokens_per_s": d["throughput"],
            "knee_peak_bytes": d["peak_memory_bytes"],
            "fastest": d["fastest_fitting"]["micro_batch"],
            "ours_time_s": d.get("time_to_answer_s", d["wall_time_s"]),
            "ours_oom": d["oom_events"],
            "predicted_max": d.get("max_fitting_micro_batch"),
            "points": len(d["points"]),
        }
        for tool in ("lightning", "accelerate"):
            f = out / f"{tool}_{model}.json"
            if not f.exists():
                row[tool] = "missing (timed out or failed)"
                continue
            t = json.loads(f.read_text())
            if not t.get("installed"):
                row[tool] = "not installed"
                continue
            b = t["batch_size"]
            ref = pts.get(b) or measured.get(b)
            entry = {"batch_size": b, "time_s": t["time_to_answer_s"], "oom_events": t["oom_events"]}
            if ref and not ref.get("oom"):
                entry["memory_saved_by_knee"] = 1 - d["peak_memory_bytes"] / ref["peak_memory_bytes"]
                entry["throughput_kept_by_knee"] = d["throughput"] / ref["throughput"]
            row[tool] = entry
        rows.append(row)
    _write(out, "summary.json", {"rows": rows})
    lines = [
        f"{'model':<13}{'knee':>5}{'tok/s':>10}{'ours s':>8}{'OOM':>5}  lightning (b, s, OOM, mem saved, tput kept)"
        "  |  accelerate (same)"
    ]
    for r in rows:

        def fmt(e):
            if not isinstance(e, dict):
                return str(e)
            ms, tk = e.get("memory_saved_by_knee"), e.get("throughput_kept_by_knee")
            return (
                f"{e['batch_size']}, {e['time_s']:.1f} s, {e['oom_events']}, "
                f"{'?' if ms is None else f'{100 * ms:.0f}%'}, {'?' if tk is None else f'{100 * tk:.0f}%'}"
            )

        lines.append(
            f"{r['model']:<13}{r['knee']:>5}{r['knee_tokens_per_s']:>10.0f}{r['ours_time_s']:>8.1f}"
            f"{r['ours_oom']:>5}  {fmt(r['lightning'])}  |  {fmt(r['accelerate'])}"
        )
    text = "\n".join(lines)
    (out / "summary.txt").write_text(text + "\n")
    print(text)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "what",
        choices=[
            "checks",
            "ours",
            "lightning",
            "accelerate",
            "measure",
            "summary",
            "knee-lightning",
            "knee-accelerate",
        ],
    )
    ap.add_argument("model", nargs="?", default="gpt2")
    ap.add_argument("--out", default=None)
    ap.add_argument("--at", default="")
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args()
    return {
        "checks": cmd_checks,
        "ours": cmd_ours,
        "lightning": cmd_lightning,
        "accelerate": cmd_accelerate,
        "measure": cmd_measure,
        "summary": cmd_summary,
        "knee-lightning": cmd_knee_lightning,
        "knee-accelerate": cmd_knee_accelerate,
    }[args.what](args)


if __name__ == "__main__":
    sys.exit(main())
