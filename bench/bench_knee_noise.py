"""Does the knee hold under noise? (issue 30) Repeated ``tune`` runs beside a busy process.

Runs ``microbatch tune --model tiny -B 64 --no-cache --json`` ``--runs`` times (default 10) while
``--busy`` processes (default 1) spin on the CPU, then re-measures every b_m those runs chose, and
the fastest, alternately for ``--rounds`` rounds (each a one-point tune of that b_m, the tool's
own probe: one thread, process clock on a small CPU). Prints, per run: the chosen b_m, its
``indistinguishable`` set, whether the choice is in every other run's set, and the re-measured
throughput of the choice as a share of the re-measured best. The two figures of the issue:

- each chosen b_m lies within the others' ``indistinguishable`` sets (count of runs for which it holds);
- the re-measured throughput of each choice is within the tolerance τ of the best (count).

    .venv/bin/python bench/bench_knee_noise.py [--runs 10] [--busy 1] [--rounds 5] [--model tiny] [-B 64]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time


def _spin() -> None:
    while True:
        pass


def _tune(model: str, global_batch: int, extra: list[str], cache: str) -> dict:
    cmd = [sys.executable, "-m", "microbatch", "tune", "--model", model, "-B", str(global_batch),
           "--no-cache", "--json", *extra]  # fmt: skip
    env = dict(os.environ, MICROBATCH_CACHE_DIR=cache)
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"tune failed ({out.returncode}): {out.stderr[-800:]}")
    return json.loads(out.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--busy", type=int, default=1, help="busy processes beside the runs")
    ap.add_argument("--rounds", type=int, default=5, help="re-measurement rounds of each chosen b_m")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("-B", "--global-batch", type=int, default=64)
    ap.add_argument("--raw", help="write every run's tune JSON and the re-measurements here")
    a = ap.parse_args()
    busy = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(a.busy)]
    for p in busy:
        p.start()
    cache = tempfile.mkdtemp(prefix="mb-bench-cache-")
    t0 = time.time()
    try:
        runs = []
        for i in range(a.runs):
            d = _tune(a.model, a.global_batch, [], cache)
            runs.append(d)
            print(f"run {i + 1}: b_m {d['micro_batch']}, indistinguishable {d['indistinguishable']}, "
                  f"{d['probes']} probes, load {os.getloadavg()[0]:.2f}", flush=True)  # fmt: skip
        tau = runs[0]["tolerance"]
        chosen = sorted({d["micro_batch"] for d in runs})
        fastest = sorted({d["fastest_fitting"]["micro_batch"] for d in runs})
        sizes = sorted(set(chosen) | set(fastest))
        again: dict[int, list[float]] = {b: [] for b in sizes}
        for _ in range(a.rounds):  # alternately, so the machine's drift falls on all alike
            for b in sizes:
                d = _tune(a.model, a.global_batch, ["--start", str(b), "--max-micro-batch", str(b)], cache)
                again[b].append(next(p["throughput"] for p in d["points"] if p["micro_batch"] == b))
        med = {b: statistics.median(v) for b, v in again.items()}
        best = max(med.values())
        if a.raw:
            with open(a.raw, "w") as f:
                json.dump({"runs": runs, "remeasured": {str(b): v for b, v in again.items()}}, f)
    finally:
        for p in busy:
            p.terminate()
    print()
    print(f"{a.runs} runs of tune --model {a.model} -B {a.global_batch} beside {a.busy} busy process(es), "
          f"{os.cpu_count()} cpus, {time.time() - t0:.0f} s; re-measured medians over {a.rounds} rounds:")  # fmt: skip
    print("  " + ", ".join(f"b_m {b}: {med[b]:,.0f}/s ({100 * med[b] / best:.1f}%)" for b in sizes))
    print()
    print(
        f"{'run':>4} {'b_m':>5}  {'indistinguishable':<22} {'in every other set':<19} {'re-measured / best':>18}"
    )
    in_all = within = 0
    for i, d in enumerate(runs):
        b = d["micro_batch"]
        ok_sets = all(b in o["indistinguishable"] for j, o in enumerate(runs) if j != i)
        share = med[b] / best
        in_all += ok_sets
        within += share >= 1 - tau
        print(f"{i + 1:>4} {b:>5}  {str(d['indistinguishable']):<22} {'yes' if ok_sets else 'no':<19} "
              f"{100 * share:>17.1f}%")  # fmt: skip
    print()
    print(f"chosen b_m in every other run's indistinguishable set: {in_all} of {len(runs)}")
    print(f"re-measured throughput of the choice within tau = {tau:g} of the best: {within} of {len(runs)}")


if __name__ == "__main__":
    main()
