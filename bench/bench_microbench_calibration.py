"""The step time the planner predicts from a kernel microbenchmark, against a measured step, on this machine.

1. ``microbatch bench-gpu`` (library: :func:`microbatch.measure.microbench.run_microbench`) on the model's
   layer GEMMs at the b_m below (CPU: one thread, the thread clock; GPU: CUDA events);
2. ``microbatch tune`` on the same model at the same b_m (its measured ``step_time_s``: forward, backward
   and optimizer, timed by the probe process);
3. the planner's micro-step time (:func:`microbatch.predict.steptime.predict_step_time_s`) with the
   microbenchmark's kernel terms (:func:`microbatch.predict.apply_calibration.apply_microbench`), and
   uncalibrated (the accelerator table's GPU; on the CPU a quick matmul peak and copy bandwidth,
   :func:`microbatch.measure.cpu.measure_cpu`, at the default efficiencies).

Prints one table: b_m, measured, predicted, error; and the mean |error|. Nothing is fitted to the
measured step. Run::

    .venv/bin/python bench/bench_microbench_calibration.py                      # CPU, tiny
    PYTHONPATH=src python3 bench/bench_microbench_calibration.py --device cuda --model gpt2 --out $OUT/x.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--micro-batches", default="1,2,4,8")
    ap.add_argument("--microbench", help="use this bench-gpu result instead of measuring one")
    ap.add_argument("--out", help="write the table as JSON here")
    args = ap.parse_args()
    from microbatch.hardware import ACCELERATORS
    from microbatch.measure.cpu import measure_cpu
    from microbatch.measure.microbench import MicrobenchConfig, run_microbench
    from microbatch.microbench_record import MicrobenchResult
    from microbatch.model import ModelShape, get_model
    from microbatch.predict.apply_calibration import apply_microbench
    from microbatch.predict.steptime import predict_step_time_s

    shape = get_model(args.model)
    bms = tuple(int(b) for b in args.micro_batches.split(","))
    cuda = args.device.startswith("cuda")
    precision = "bf16-mixed" if cuda else "fp32"
    if args.microbench:
        mb = MicrobenchResult.from_json(Path(args.microbench).read_text())
    else:
        mb = run_microbench(
            MicrobenchConfig(shape=shape, micro_batches=bms, device=args.device, quick=not cuda)
        )
    cmd = [sys.executable, "-m", "microbatch", "tune", "--model", args.model, "--device", args.device,
           "--start", str(min(bms)), "--max-micro-batch", str(max(bms)), "--patience", "99",
           "--precision", precision, "--no-cache", "--json"] + ([] if cuda else ["--threads", "1", "--clock", "process"])  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    tune = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout)
    points = {
        p["micro_batch"]: p["step_time_s"] for p in tune.get("result", tune)["points"] if p.get("step_time_s")
    }
    # predicted for the model tune measured: the shape its result records (the built-in GPT: no dropout)
    measured = tune.get("result", tune)["model_shape"]
    shape = ModelShape(**{k: v for k, v in measured.items() if k in ModelShape.__dataclass_fields__})
    gpu = ACCELERATORS.get(mb.accelerator or "") if cuda else None
    plain_acc = gpu if cuda else measure_cpu(threads=1)  # uncalibrated: the table's GPU, or a quick CPU peak
    applied = apply_microbench(mb, shape=shape, precision=precision, gpu=gpu)
    acc = applied.accelerator
    assert acc is not None
    rows = []
    print(
        f"{args.model} on {mb.device_name} ({mb.dtype}, {mb.timer}); microbenchmark {mb.seconds_total:.1f} s"
    )
    print(" b_m   measured s  predicted s   error   uncalibrated")
    for b in bms:
        if b not in points:
            continue
        pred = predict_step_time_s(shape, b, acc, precision=precision, efficiency=applied.efficiency)
        plain = (
            predict_step_time_s(shape, b, plain_acc, precision=precision) if plain_acc is not None else None
        )
        err = pred / points[b] - 1
        rows.append({"micro_batch": b, "measured_s": points[b], "predicted_s": pred, "error": err,
                     "uncalibrated_s": plain})  # fmt: skip
        un = f"{plain / points[b] - 1:+7.1%}" if plain else "      -"
        print(f"{b:4d}  {points[b]:11.4g}  {pred:11.4g}  {err:+6.1%}   {un}")
    mean = sum(abs(r["error"]) for r in rows) / max(1, len(rows))
    print(
        f"mean |error| {mean:.1%} over {len(rows)} b_m (measured: tune's micro-step, forward + backward; predicted: the planner's)"
    )
    if args.out:
        Path(args.out).write_text(
            json.dumps({"rows": rows, "mean_abs_error": mean, "device": mb.device_name}, indent=1)
        )


if __name__ == "__main__":
    main()
