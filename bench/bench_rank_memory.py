"""What one pipeline rank holds on the host before its model: the constants of ``run/pipeline/host_terms.py``.

    .venv/bin/python bench/bench_rank_memory.py [--repeat 3] [--model tiny] [--stages 2]

Runs ``microbatch pipeline --model MODEL -p STAGES -m 4 --schedule 1f1b --no-predict --json`` with the ranks
forked from the warm fork server (the CPU default) and as new interpreters (``MICROBATCH_COLD_RANKS=1``), and
prints, per rank, its peak resident set read by the run from ``/proc`` (VmHWM) less the prediction's terms
that are not the process itself (the model, its gradients and Adam's moments, the batch, the activations, the
receive buffers: ``fit.predicted_host_bytes``, shared over the ranks): the bytes of the interpreter and the
libraries a rank touches. ``GLOO_PROCESS_BYTES`` (new interpreters) and ``FORKED_PROCESS_BYTES`` (forked ranks) of
``run/pipeline/host_terms.py`` are these figures for the built-in ``tiny`` model, whose own terms are a few MB, so the rest is the
process. A larger model reads more per rank (the allocator's arenas the model terms do not count).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MIB = 1024**2


def rank_baselines(model: str, stages: int, cold: bool) -> list[float]:
    """Per rank: VmHWM less the prediction's non-process terms shared over the ranks, in bytes."""
    env = dict(os.environ)
    env.pop("MICROBATCH_COLD_RANKS", None)
    if cold:
        env["MICROBATCH_COLD_RANKS"] = "1"
    cmd = [
        str(ROOT / ".venv" / "bin" / "microbatch"),
        "pipeline",
        "--model",
        model,
        "-p",
        str(stages),
        "-m",
        "4",
    ]
    cmd += ["--schedule", "1f1b", "--no-predict", "--json"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, timeout=600)
    result = json.loads(out.stdout)  # the --json envelope is the result itself
    terms = result["host_memory"]["predicted_terms"]
    other = sum(v for k, v in terms.items() if k != "processes") / stages
    return [rank["host_peak_bytes"] - other for rank in result["memory"]]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--stages", type=int, default=2)
    args = ap.parse_args(argv)
    print(f"model {args.model}, p {args.stages}: per rank, VmHWM less the model's terms (MiB)")
    for cold, label in ((False, "forked from the fork server"), (True, "new interpreters")):
        runs = [rank_baselines(args.model, args.stages, cold) for _ in range(args.repeat)]
        flat = [b / MIB for run in runs for b in run]
        shown = "; ".join(", ".join(f"{b / MIB:.1f}" for b in run) for run in runs)
        print(f"  {label:28s} {shown}   median {statistics.median(flat):.1f}, max {max(flat):.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
