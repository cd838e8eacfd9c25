"""XLA's published GEMM table (issue 28 item 1's kernel evidence) beside the planner's GEMM model: the transcription
is whole, and the unfitted comparison bench/bench_gemm_xla.py prints is recorded (the planner slower than XLA's
rates on large H100 shapes, at the burst clock). A change to the GEMM model that moves these shows here."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DATA = json.loads((ROOT / "tests" / "data" / "xla_gemm_bf16.json").read_text())


def _bench():
    spec = importlib.util.spec_from_file_location("bench_gemm_xla", ROOT / "bench" / "bench_gemm_xla.py")
    assert spec and spec.loader
    import sys

    sys.path.insert(0, str(ROOT / "bench"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_table_is_whole_and_named():
    assert "matmul_interpolator_data.h" in DATA["_source"] and "ea2c45f2" in DATA["_source"]
    sizes = [256, 512, 1024, 2048, 4096]
    for key in ("sm_90", "sm_100_B200"):
        table = DATA["tables"][key]
        assert sorted((m, n, k) for m, n, k, _ in table) == [
            (m, n, k) for m in sizes for n in sizes for k in sizes
        ]
        assert all(f > 0 for *_, f in table)
    h100 = {(m, n, k): f for m, n, k, f in DATA["tables"]["sm_90"]}
    assert h100[(4096, 4096, 4096)] / 989.4e12 == pytest.approx(
        0.7886, abs=1e-3
    )  # the table's largest H100 rate


def test_the_planner_against_xla_as_recorded():
    rows = _bench().rows()
    band = {(r["table"], r["band"]): r for r in rows if "band" in r}
    big = band[("sm_90", "m·n·k >= 2^34")]
    # recorded, not fitted: the planner's H100 GEMM at the burst clock is 15-25% under XLA's rates on the largest
    # shapes (XLA's inputs and clock unstated); the short-k 4,096 × 4,096 × 1,024 is 33% under
    assert big["shapes"] == 10 and -25.0 < big["median_error_pct"] < -15.0
    short_k = next(r for r in rows if r.get("shape") == [4096, 4096, 1024] and r["table"] == "sm_90")
    assert -36.0 < short_k["error_pct"] < -28.0
