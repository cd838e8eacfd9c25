"""Rebuild the H200 comparison (bench/results/h200-2026-11-30/comparison.txt) from the committed raw data.

The GPU run itself (``bench/gpu.sh``, ``bench/gpu_tune.py``) happened in an earlier session; its raw
results are committed in ``bench/results/h200-2026-11-30/``. The script that replayed those points
through the current search, and the ``comparison.txt`` it wrote, were not committed; this script
rebuilds both from the raw files, with no GPU:

1. **As measured on the GPU** (flat rule only, the search of that day): the knee each ``ours_*.json``
   recorded, against Lightning's and Accelerate's answers (``lightning_*.json``, ``accelerate_*.json``),
   their throughput and peak memory taken from our recorded points at their batch size or from
   ``measured_*.json``.
2. **Replayed**: the recorded points fed through today's :func:`microbatch.choose.tune.search.search` and
   :func:`microbatch.choose.knee.recommend` (a replay, not a new GPU run: a b_m the GPU run did not
   record ends the replay, and the line says so).

Where the finder's own point was not committed (``measured_gpt2.json``, ``measured_gpt2-large.json``),
it is rebuilt from the committed summaries' ratios (throughput = knee / kept, peak = knee peak /
(1 − saved)) and the line says so. Accelerate's gpt2 answer (82) is only in ``gpu.log``, measured
against a first ``ours_gpt2`` run that the committed rerun replaced: that comparison cannot be
rebuilt, and the line says so.

Usage: ``python bench/replay_h200.py [--dir bench/results/h200-2026-11-30] [--write]``
(``--write``: also write ``comparison.txt`` there).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from microbatch.choose.config import ChoiceConfig  # noqa: E402
from microbatch.choose.knee import recommend  # noqa: E402
from microbatch.choose.tune.config import SearchConfig  # noqa: E402
from microbatch.choose.tune.search import SearchLog, curve_point, search  # noqa: E402
from microbatch.measure.probes import Measurement  # noqa: E402

DIR = Path(__file__).resolve().parent / "results" / "h200-2026-11-30"
MODELS = ("gpt2", "gpt2-medium", "gpt2-large")
FIELDS = set(Measurement.__dataclass_fields__)


def _load(path: Path) -> Any:
    return json.loads(path.read_text()) if path.exists() else None


def _points(d: dict[str, Any]) -> dict[int, Measurement]:
    return {p["micro_batch"]: Measurement(**{k: v for k, v in p.items() if k in FIELDS}) for p in d["points"]}


def _reference(model: str, b: int, recorded: dict[int, Measurement], folder: Path) -> Measurement | None:
    """Our measurement at a finder's batch size b: a recorded probe or ``measured_<model>.json``."""
    if b in recorded and not recorded[b].oom:
        return recorded[b]
    extra = _load(folder / f"measured_{model}.json") or {}
    p = extra.get(str(b))
    if p is not None:
        return Measurement(**{k: v for k, v in p.items() if k in FIELDS})
    return _from_summary(model, b, folder)


def _from_summary(model: str, b: int, folder: Path) -> Measurement | None:
    """The finder's point rebuilt from a committed summary's ratios, where its raw point was not
    committed: throughput = knee / kept, peak = knee peak / (1 − saved) (the summary's own knee)."""
    for f in sorted(folder.glob("summary-*.json")):
        for row in (_load(f) or {}).get("rows", []):
            if row["model"] != model:
                continue
            for tool in ("lightning", "accelerate"):
                e = row.get(tool)
                if isinstance(e, dict) and e.get("batch_size") == b and e.get("throughput_kept_by_knee"):
                    return Measurement(
                        micro_batch=b,
                        throughput=row["knee_tokens_per_s"] / e["throughput_kept_by_knee"],
                        peak_memory_bytes=int(row["knee_peak_bytes"] / (1 - e["memory_saved_by_knee"])),
                        memory_method=f"derived from {f.name}",
                    )
    return None


def _versus(knee: Measurement, ref: Measurement | None) -> str:
    if ref is None or knee.throughput is None or ref.throughput is None:
        return "not recorded"
    saved = 1 - (knee.peak_memory_bytes or 0) / (ref.peak_memory_bytes or 1)
    kept = knee.throughput / ref.throughput
    src = f" (their point {ref.memory_method})" if ref.memory_method.startswith("derived") else ""
    return f"{100 * saved:.0f}% memory saved, {100 * kept:.0f}% throughput kept{src}"


def _replay(d: dict[str, Any], recorded: dict[int, Measurement]) -> tuple[int, list[int], str]:
    """(knee, b_m probed, why it stopped) of today's search over the recorded points."""
    missing: list[int] = []

    def measure(b: int, ckpt: bool) -> Measurement:
        if b not in recorded:
            missing.append(b)
            raise KeyboardInterrupt  # ends the walk; search() keeps what it has
        return recorded[b]

    choice = ChoiceConfig(
        tolerance=d["tolerance"], memory_budget_bytes=d["memory_budget_bytes"], reference="bound"
    )
    log = SearchLog()
    pts = search(measure, SearchConfig(max_micro_batch=None), choice, log=log)
    rec = recommend([curve_point(p) for p in pts], choice)
    why = f"asked for b_m {missing[0]}, not recorded on the GPU" if missing else log.stop_reason
    return rec.knee.micro_batch, [p.micro_batch for p in pts], why


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=str(DIR))
    ap.add_argument("--write", action="store_true", help="write comparison.txt in --dir")
    args = ap.parse_args()
    folder = Path(args.dir)
    lines = [
        f"H200 comparison rebuilt from {folder.name}/ by bench/replay_h200.py (no GPU; raw data of bench/gpu.sh)",
        "",
        "1. As measured on the GPU (the search of that day: flat rule only)",
    ]
    replay = ["", "2. Replayed through today's search (recorded points only; a replay, not a GPU run)"]
    for model in MODELS:
        d = _load(folder / f"ours_{model}.json")
        if d is None:
            lines.append(f"  {model}: ours_{model}.json not committed")
            continue
        recorded = _points(d)
        knee = recorded[d["micro_batch"]]
        lines.append(
            f"  {model}: knee {d['micro_batch']} ({knee.throughput:,.0f} tokens/s, "
            f"{(knee.peak_memory_bytes or 0) / 2**30:.1f} GiB), {len(d['points'])} probes, {d['oom_events']} OOM, "
            f"{d.get('time_to_answer_s', d['wall_time_s']):.1f} s"
        )
        b2, probed, why = _replay(d, recorded)
        k2 = recorded[b2]
        replay.append(
            f"  {model}: knee {b2} ({k2.throughput:,.0f} tokens/s, {(k2.peak_memory_bytes or 0) / 2**30:.1f} GiB); "
            f"probed {', '.join(map(str, probed))}; stopped: {why}"
        )
        for tool in ("lightning", "accelerate"):
            t = _load(folder / f"{tool}_{model}.json")
            if t is None:
                gpt2_acc = (tool, model) == ("accelerate", "gpt2")
                note = (
                    " (gpu.log: 82 in 4.0 s, 4 OOM; 88% memory saved, 84% kept against a first run's knee "
                    "that was not committed)"
                    if gpt2_acc
                    else ""
                )
                lines.append(f"    {tool}: no result committed{note}")
                replay.append(f"    vs {tool}: cannot be rebuilt (no committed point at its answer)")
                continue
            b = t["batch_size"]
            ref = _reference(model, b, recorded, folder)
            head = f"    {tool}: b_m {b}, {t['time_to_answer_s']:.1f} s, {t['oom_events']} OOM; "
            lines.append(head + "knee: " + _versus(knee, ref))
            replay.append(f"    vs {tool} ({b}): " + _versus(k2, ref))
    text = "\n".join(lines + replay) + "\n"
    print(text, end="")
    if args.write:
        (folder / "comparison.txt").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
