"""Planner search speed: candidates evaluated per second over a large layout space.

Space: Megatron-Turing 530B (105 layers, h = 20480, 128 heads, s = 2048) on 2,240 A100 80GB GPUs
(Narayanan et al. 2021 Table 1's 530B run), B_global = 2240; every t in {1, 2, 4, 8}, every
pipeline depth p dividing 2240/t (p <= 105; uneven splits allowed), d = 2240/(t·p) when d | B,
every b_m dividing B/d, every schedule that can serve (p, m, v) (gpipe, 1f1b, zb-h1,
interleaved-1f1b with every v > 1 such that p·v divides 105; dualpipev needs 2p to divide the layers,
which 105 never allows), recompute none/selective/full,
ZeRO 0-3. A candidate counts once it has its per-stage peak memory, fits/does not fit and step
time (closed forms; no simulation, as in calculon's search); its tokens/s and MFU, a division each of the
step time, are written with the full ``Candidate`` only for each new best (``search_layouts``; ``plan``
builds every candidate: ``_enumerate``, timed on the same space and printed as "every candidate built").

**Against calculon, on the same space** (``--calculon DIR``, a checkout of calculon-ai/calculon; none of
its code is in this project). calculon's own 530B example searches its own space (8,112
configurations in 67 s on a 2-core machine, published.json ``search_speed_anchor``; about half are
rejected almost free, before any timing), so a ratio to that rate compares two different spaces and
this script prints none. ``--calculon`` builds one list — 530B, 2,240 A100s, B = 2,240; t in
{1, 2, 4, 8} with sequence parallelism when t > 1, p dividing both 2240/t and 105, every b_m, 1F1B (v = 1)
or interleaved (every v > 1 with p·v | 105, m a multiple of p), recompute none/selective/full
(calculon: none/attn_only/full), ZeRO 0/1 (calculon: optimizer_sharding) — and times both tools on it:

- a **candidate** for microbatch is one (t, p, d, b_m, schedule, v, recompute, ZeRO) predicted by the
  closed forms (memory of the probed stages, step time, fits); for calculon it is one ``Llm`` compiled
  and run on one execution (per-layer compute, memory and network tiers, overlap, offload options),
  or rejected with ``Llm.Error`` (for example out of memory) part-way through;
- it prints both rates over the whole list, calculon's over the candidates it does not reject,
  and both tools' step times for calculon's best layout here (t8 p7 d40 b_m 1 v3 selective ZeRO-1)
  and for Narayanan et al. 2021 Table 1's 529.6B row, whose step time was measured.

Run: .venv/bin/python bench/bench_plan.py [--repeat N] [--calculon DIR]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from microbatch.hardware import get_accelerator  # noqa: E402
from microbatch.model import get_model  # noqa: E402
from microbatch.predict.plan import search_layouts  # noqa: E402

NARAYANAN_530B_MEASURED_S = 54.08
"""Narayanan et al. 2021 Table 1, 529.6B on 2,520 A100s, B 2,520: 163 TFLOP/s per GPU of the paper's Eq. 3
FLOPs (full recompute) → 96·B·s·L·h²·(1 + s/(6h) + V/(16·L·h)) / (163e12 · 2520) s (bench/bench_published.py)."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3, help="timed repetitions (best is reported)")
    ap.add_argument("--gpus", type=int, default=2240)
    ap.add_argument("--global-batch", type=int, default=2240)
    ap.add_argument("--calculon", metavar="DIR", help="a calculon-ai/calculon checkout: compare on one list")
    args = ap.parse_args()
    shape = get_model("megatron-530b")
    gpu = get_accelerator("a100-80gb")
    runs = []
    cpu = []
    for _ in range(args.repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        best, evaluated, feasible = search_layouts(
            shape, gpu, global_batch=args.global_batch, num_gpus=args.gpus
        )
        runs.append((time.perf_counter() - t0, evaluated, feasible, best))
        cpu.append(time.process_time() - c0)
    secs, evaluated, feasible, best = min(runs, key=lambda r: r[0])
    rate = evaluated / secs
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    rows = [
        ("model / GPUs / B_global", f"{shape.name} / {args.gpus} x {gpu.name} / {args.global_batch}"),
        ("candidates evaluated", f"{evaluated:,}"),
        ("candidates that fit", f"{feasible:,}"),
        (f"seconds (best of {args.repeat})", f"{secs:.2f}"),
        ("candidates per second", f"{rate:,.0f}"),
        # on a shared machine the wall clock counts the time other jobs hold the cores; the process's own
        # CPU time does not (both best of the repeats), and the load average says how shared it was
        ("per CPU second (process time)", f"{evaluated / min(cpu):,.0f}"),
        ("every candidate built (per CPU s)", f"{every_candidate_rate(shape, gpu, args):,.0f}"),
        ("load average (1 min)", f"{load:.2f} on {os.cpu_count()} cores"),
        ("calculon", "its own 530B example searches another space: no ratio (see --calculon)"),
    ]
    if best is not None:
        rows.append((
            "best layout",
            f"t={best.tensor_parallel} p={best.pipeline_parallel} d={best.data_parallel} b_m={best.micro_batch} "
            f"m={best.microbatches} {best.schedule} v={best.virtual} recompute={best.recompute} ZeRO={best.zero}: "
            f"{best.step_time_s:.1f} s/step, MFU {100 * best.mfu:.1f}%, peak {best.peak_memory_bytes / 2**30:.1f} GiB",
        ))  # fmt: skip
    width = max(len(k) for k, _ in rows)
    print("planner search speed")
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
    same_space(args.calculon, args.repeat)


def every_candidate_rate(shape: object, gpu: object, args: argparse.Namespace) -> float:
    """Candidates per CPU second on the same space when each is built whole (``plan``'s ``_enumerate``: memory
    breakdown, times, tokens/s, MFU), best of the repeats."""
    from microbatch.batch import divisors
    from microbatch.errors import ConfigError
    from microbatch.predict.plan import PlanConfig, _enumerate, make_context

    best = 0.0
    for _ in range(args.repeat):
        c0, n = time.process_time(), 0
        for t in (1, 2, 4, 8):
            like = None
            for p in (x for x in divisors(args.gpus // t) if x <= shape.layers):  # type: ignore[attr-defined]
                d = args.gpus // (t * p)
                try:
                    cfg = PlanConfig(shape=shape, gpu=gpu, global_batch=args.global_batch, data_parallel=d,
                                     pipeline_parallel=p, tensor_parallel=t, simulate_top=0)  # fmt: skip
                except ConfigError:
                    continue
                like = make_context(cfg, like)
                n += len(_enumerate(cfg, like))
        best = max(best, n / (time.process_time() - c0))
    return best


# -- the same list for both tools -----------------------------------------------------------------------
N, B, L = 2240, 2240, 105
RECOMPUTE_CALCULON = {"none": "none", "selective": "attn_only", "full": "full"}
LAYOUT = (8, 7, 40, 1, 3, "selective", 1)
"""calculon's best layout on this space (issue 18): t8 p7 d40 b_m 1 v3 selective ZeRO-1."""


def same_space_candidates() -> list[tuple[int, int, int, int, int, str, int]]:
    """(t, p, d, b_m, v, recompute, ZeRO) of the shared list (module docstring)."""
    from microbatch.batch import divisors

    out = []
    for t in (1, 2, 4, 8):
        for p in divisors(N // t):
            d = N // (t * p)
            if p > L or L % p or B % d:
                continue
            for b in divisors(B // d):
                m = B // d // b
                if p > 1 and m < p:
                    continue
                vs = [1] + (
                    [v for v in range(2, L // p + 1) if L % (p * v) == 0 and m % p == 0] if p > 1 else []
                )
                for v in vs:
                    for rc in ("none", "selective", "full"):
                        for z in (0, 1):
                            out.append((t, p, d, b, v, rc, z))
    return out


def ours_on(cands: list[tuple[int, int, int, int, int, str, int]]) -> list[object]:
    from microbatch.predict.candidate import evaluate, make_context
    from microbatch.predict.plan import PlanConfig
    from microbatch.predict.roofline import model_flops_per_step

    shape, gpu = get_model("megatron-530b"), get_accelerator("a100-80gb")
    mf = model_flops_per_step(shape, B, 2048)
    ctxs: dict[tuple[int, int], object] = {}
    out = []
    for t, p, d, b, v, rc, z in cands:
        ctx = ctxs.get((t, p))
        if ctx is None:
            ctx = ctxs[(t, p)] = make_context(PlanConfig(
                shape=shape, gpu=gpu, global_batch=B, data_parallel=d, pipeline_parallel=p, tensor_parallel=t,
                sequence_parallel=t > 1, simulate_top=0,
            ))  # fmt: skip
        out.append(evaluate(ctx, b, B // d // b, "1f1b" if v == 1 else "interleaved-1f1b", v, rc, z, mf))  # type: ignore[arg-type]
    return out


def _calculon(root: str):  # type: ignore[no-untyped-def]
    import json
    import logging
    import types

    sys.path.insert(0, root)
    try:
        import pandas  # noqa: F401  (calculon imports it for a command this script does not use)
    except ImportError:
        sys.modules["pandas"] = types.ModuleType("pandas")
    from calculon.llm import Llm
    from calculon.system import System

    app = Llm.Application(json.loads((Path(root) / "models" / "turing-530B.json").read_text()))
    syst = System(json.loads((Path(root) / "systems" / "a100_80g.json").read_text()))
    log = logging.getLogger("calculon")
    log.setLevel(logging.CRITICAL)

    def run(n, t, p, d, b, v, rc, z, batch, sp):  # type: ignore[no-untyped-def]
        exe = Llm.Execution.from_json({
            "num_procs": n, "tensor_par": t, "pipeline_par": p, "data_par": d, "tensor_par_net": 0,
            "pipeline_par_net": 1, "data_par_net": 1, "batch_size": batch, "microbatch_size": b,
            "datatype": "float16", "fused_activation": True, "attention_type": "multihead",
            "activation_recompute": RECOMPUTE_CALCULON[rc], "pipeline_interleaving": v, "optimizer_sharding": bool(z),
            "tensor_par_comm_type": "rs_ag" if sp else "ar", "tensor_par_overlap": "none", "seq_par_ag_redo": False,
            "data_par_overlap": False, "weight_offload": False, "activations_offload": False,
            "optimizer_offload": False, "training": True,
        })  # fmt: skip
        model = Llm(app, log)
        try:
            model.compile(syst, exe)
            model.run(syst)
        except Llm.Error:
            return None
        return model.get_total_time()

    return run


def same_space(calculon_dir: str | None, repeat: int) -> None:
    cands = same_space_candidates()
    secs = min(_timed(lambda: ours_on(cands))[0] for _ in range(repeat))
    ours = ours_on(cands)
    rows = [
        ("candidates (same list)", f"{len(cands):,}"),
        ("microbatch", f"{len(cands) / secs:,.0f} per second ({sum(c.fits for c in ours)} fit)"),  # type: ignore[attr-defined]
    ]
    lay = ours[cands.index(LAYOUT)]
    rows.append(("microbatch t8 p7 d40 b1 v3 sel Z1", f"{lay.step_time_s:.1f} s/step, fits {lay.fits}"))  # type: ignore[attr-defined]
    if calculon_dir:
        run = _calculon(calculon_dir)
        t0 = time.perf_counter()
        times = [run(N, *c, B, c[0] > 1) for c in cands]
        tc = time.perf_counter() - t0
        ok = [c for c, x in zip(cands, times, strict=True) if x is not None]
        t0 = time.perf_counter()
        for c in ok:
            run(N, *c, B, c[0] > 1)
        tf = time.perf_counter() - t0
        rows += [
            ("calculon", f"{len(cands) / tc:,.1f} per second ({len(ok)} not rejected)"),
            ("calculon, not rejected only", f"{len(ok) / tf:,.1f} per second"),
            ("same-space ratio", f"{(len(cands) / secs) / (len(cands) / tc):,.0f}x"),
            ("calculon t8 p7 d40 b1 v3 sel Z1", f"{times[cands.index(LAYOUT)]:.1f} s/step"),
        ]
        rows.append(("calculon Narayanan 530B row", f"{run(2520, 8, 35, 9, 1, 1, 'full', 0, 2520, False):.1f} s/step "
                     f"(measured {NARAYANAN_530B_MEASURED_S} s)"))  # fmt: skip
    width = max(len(k) for k, _ in rows)
    print("same list for both tools (530B, 2,240 A100s, B 2,240; module docstring)")
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")


def _timed(fn):  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


if __name__ == "__main__":
    main()
