"""Does the suite hold under load? (issue 32) Runs pytest beside busy processes, several times.

    .venv/bin/python bench/bench_suite_load.py [--busy 8] [--repeat 3] [--timing-only] [PYTEST ARGS...]

``--busy N`` processes spin on the CPU for the whole run (load ≈ N + the suite's own); each of
``--repeat`` runs prints its outcome line and wall time, and the summary says how many passed.
``--timing-only`` selects the tests that rest on timing (``TIMING_TESTS``: the tests whose assertions
read a clock, a measured throughput or a measured bubble), the part of the suite a loaded machine can
move; without it, the whole suite (long: on 2 cores beside 8 busy processes each run takes several
times the idle suite's 8-10 minutes).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import subprocess
import sys
import time

TIMING_TESTS = [
    "tests/choose/test_tune.py",
    "tests/choose/test_confirm.py",
    "tests/choose/test_knee_noise.py",
    "tests/commands/test_tune_interrupt.py",
    "tests/commands/test_interrupts.py",
    "tests/measure/test_childprobe_close.py",
    "tests/measure/test_measure.py",
    "tests/predict/test_calibrate.py",
    "tests/run/pipeline/test_pipeline.py",
    "tests/run/pipeline/test_pipeline_profile.py",
    "tests/run/pipeline/test_pipeline_memory.py",
    "tests/run/test_noise.py",
    "tests/integrations/test_accelerate.py",
    "tests/integrations/test_same_training.py",
    "tests/schedules/test_dualpipev.py",
    "tests/commands/test_cli_bubble.py",
]
"""Test files whose assertions read a clock or a measured rate (grep for perf_counter, process_time,
throughput, bubble in asserts), reviewed in issue 32."""


def _spin() -> None:
    while True:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--busy", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--timing-only", action="store_true")
    a, rest = ap.parse_known_args()
    targets = rest or (TIMING_TESTS if a.timing_only else [])
    busy = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(a.busy)]
    for p in busy:
        p.start()
    results = []
    try:
        for i in range(a.repeat):
            t0 = time.time()
            out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *targets],
                                 capture_output=True, text=True)  # fmt: skip
            tail = [line for line in out.stdout.splitlines() if line.strip()][-12:]
            last = tail[-1] if tail else "(no output)"
            results.append((out.returncode, time.time() - t0, last))
            print(
                f"run {i + 1}: exit {out.returncode}, {time.time() - t0:.0f} s, load {os.getloadavg()[0]:.1f}: {last}"
            )
            if out.returncode:
                print("\n".join("    " + line for line in tail if "FAILED" in line or "Error" in line))
            sys.stdout.flush()
    finally:
        for p in busy:
            p.terminate()
    ok = sum(1 for rc, _, _ in results if rc == 0)
    print(f"\n{ok} of {len(results)} runs passed beside {a.busy} busy processes "
          f"({'timing tests' if a.timing_only and not rest else ' '.join(targets) or 'whole suite'})")  # fmt: skip


if __name__ == "__main__":
    main()
