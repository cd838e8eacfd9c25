"""Speed of the schedule simulator and of the light commands. Prints one summary table.

Targets (issue 2): simulate 1F1B with p = 64, m = 1024 (131,072 actions) in under 0.5 s;
`microbatch --help` and `microbatch bubble` return in under 0.5 s.

    .venv/bin/python bench/bench_simulate.py [--repeat N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from microbatch.schedules.registry import generate  # noqa: E402
from microbatch.schedules.simulate import simulate  # noqa: E402


def timed(fn, repeat):
    out = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return min(out), statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    rows = []

    cases = [
        ("1f1b", 64, 1024, 1, {"forward_time": 1.0, "backward_time": 2.0}),
        ("gpipe", 64, 1024, 1, {"forward_time": 1.0, "backward_time": 2.0}),
        ("interleaved-1f1b", 16, 1024, 4, {"forward_time": 1.0, "backward_time": 2.0}),
        ("zb-h1", 64, 1024, 1, {"forward_time": 1.0, "input_time": 1.0, "weight_time": 1.0}),
    ]
    for name, p, m, v, kw in cases:
        sched = generate(name, p, m, v)
        n = sched.num_actions()
        g_best, g_med = timed(lambda name=name, p=p, m=m, v=v: generate(name, p, m, v), args.repeat)
        s_best, s_med = timed(lambda sched=sched, kw=kw: simulate(sched, **kw), args.repeat)
        target = "< 0.5 s" if name == "1f1b" else ""
        rows.append((f"simulate {name} p={p} m={m} v={v}", f"{n:,} actions", s_best, s_med, target))
        rows.append((f"generate {name} p={p} m={m} v={v}", f"{n:,} actions", g_best, g_med, ""))

    exe = str(ROOT / ".venv/bin/microbatch")
    env = dict(os.environ, NO_COLOR="1")
    for label, argv in [
        ("microbatch --help", [exe, "--help"]),
        ("microbatch bubble -p 4 -m 8 -s 1f1b", [exe, "bubble", "-p", "4", "-m", "8", "-s", "1f1b"]),
        ("microbatch bubble -p 64 -m 1024 -s 1f1b", [exe, "bubble", "-p", "64", "-m", "1024", "-s", "1f1b"]),
    ]:

        def run(argv=argv):
            subprocess.run(argv, check=True, capture_output=True, env=env)

        best, med = timed(run, args.repeat)
        rows.append((label, "process wall time", best, med, "< 0.5 s" if "1024" not in label else ""))

    w = max(len(r[0]) for r in rows)
    print(f"{'what':<{w}}  {'size':>18}  {'best s':>8}  {'median s':>8}  target")
    for what, size, best, med, target in rows:
        print(f"{what:<{w}}  {size:>18}  {best:8.3f}  {med:8.3f}  {target}")


if __name__ == "__main__":
    main()
