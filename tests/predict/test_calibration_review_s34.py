"""plan --calibration from a kernel microbenchmark (a helper's review, 2026-12-08): a ratio carried to other shapes
never passes the sustained peak, terms a flag overrides are said so, several accelerators each keep their own
calibration in the JSON, a plan's saved microbenchmark calibration is refused, absurd figures are refused, and GEMMs
past the measured rows are said to be extrapolated."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from microbatch.cli import main
from microbatch.hardware import get_accelerator

FORGED = json.loads((Path(__file__).parents[1] / "data" / "microbench_forged_h100_gpt2.json").read_text())
PLAN = [
    "plan",
    "--model",
    "gpt2",
    "--gpu",
    "h100-sxm",
    "-B",
    "32",
    "-b",
    "4",
    "--recompute",
    "none",
    "--zero",
    "0",
]


def _file(tmp_path, d, name="mb.json"):
    p = tmp_path / name
    p.write_text(json.dumps(d))
    return str(p)


def _run(capsys, *args):
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def _scaled_gemms(factor):
    d = copy.deepcopy(FORGED)
    for g in d["gemms"]:
        g["seconds"] *= factor
        if "flops_per_s" in g:
            g["flops_per_s"] /= factor
    return d


def test_a_calibrated_gemm_never_runs_past_the_sustained_peak(tmp_path, capsys):
    fast = _file(tmp_path, _scaled_gemms(0.1))
    code, out, _ = _run(capsys, "plan", "--model", "llama-2-7b", "--gpu", "h100-sxm", "-B", "64", "-b", "1", "-d", "8",
                        "--recompute", "full", "--calibration", fast, "--json")  # fmt: skip
    assert code == 0
    eff = json.loads(out)["recommended"]["gemm_efficiency"]
    assert (
        eff <= get_accelerator("h100-sxm").sustained_clock_fraction + 1e-9
    )  # was 5.55: ten times the file's speed


def test_terms_a_flag_overrides_are_said_not_measured(tmp_path, capsys):
    f = _file(tmp_path, FORGED)
    code, out, _ = _run(
        capsys, *PLAN, "--calibration", f, "--attention-kernel", "fa3", "--fused-kernels", "--json"
    )
    src = json.loads(out)["calibration"]["details"]["term_sources"]
    assert code == 0 and src["attention_fraction"].startswith("the --attention-kernel's figures")
    assert src["norm_memory"].startswith("not used: --fused-kernels") and src["gemm"].startswith("measured")
    code, out, _ = _run(capsys, *PLAN, "--calibration", f, "--compile")
    assert "norm_memory: not used: --compile runs it at compiled code's 0.445 of the bandwidth" in out


def test_each_accelerator_compared_keeps_its_own_calibration(tmp_path, capsys):
    f = _file(tmp_path, FORGED)
    args = [*PLAN, "--calibration", f]
    args[args.index("h100-sxm")] = "a100-80gb,h100-sxm"
    code, out, _ = _run(capsys, *args, "--json")
    plans = json.loads(out)["plans"]
    gemm = [p["calibration"]["details"]["term_sources"]["gemm"] for p in plans]
    assert (
        code == 0 and gemm[0].startswith("analytic") and gemm[1].startswith("measured")
    )  # not the A100's for both
    code, out, _ = _run(capsys, *args)
    assert "calibration for a100-80gb:" in out and "calibration for h100-sxm:" in out


def test_a_plans_saved_microbenchmark_calibration_is_refused(tmp_path, capsys):
    f = _file(tmp_path, FORGED)
    code, out, _ = _run(capsys, *PLAN, "--calibration", f, "--json")
    saved = _file(tmp_path, json.loads(out)["calibration"], "saved.json")
    code, _, err = _run(capsys, *PLAN, "--calibration", saved)
    assert code == 2 and "the calibration a plan saved from a kernel microbenchmark" in err


@pytest.mark.parametrize(
    "where, field, value, rule",
    [
        (None, "launch_s_per_kernel", 1.0, "at most 1 ms"),
        (None, "overlap_slowdown", 50.0, "at most 1"),
        ("stream", "bytes_per_s", 1e3, "at least 1 MB/s"),
        (None, "micro_batches", [-1, 0], "whole numbers >= 1"),
    ],
)
def test_absurd_figures_are_refused(tmp_path, capsys, where, field, value, rule):
    d = copy.deepcopy(FORGED)
    (d[where][0] if where else d)[field] = value
    code, _, err = _run(capsys, *PLAN, "--calibration", _file(tmp_path, d))
    assert code == 2 and field in err and rule in err


def test_gemms_past_the_measured_rows_are_said_extrapolated(tmp_path, capsys):
    f = _file(tmp_path, FORGED)
    code, out, _ = _run(capsys, *PLAN, "--calibration", f, "--json")
    assert code == 0 and not any("outside the" in n for n in json.loads(out).get("calibration_notes", []))
    code, out, _ = _run(capsys, "plan", "--model", "gpt2", "--gpu", "h100-sxm", "-B", "256", "-b", "32",
                        "--calibration", f, "--json")  # fmt: skip
    notes = json.loads(out)["calibration_notes"]
    assert any("GEMMs of b_m above 8 at s = 1,024 run more than twice the 4,096 rows" in n for n in notes)


def test_a_slowdown_an_oversubscribed_cpu_measures_is_taken(tmp_path, capsys):
    d = copy.deepcopy(FORGED)
    d["overlap_slowdown"] = 1.98  # what bench-gpu wrote on 2 cores under 3 ranks
    code, _, err = _run(capsys, *PLAN, "--calibration", _file(tmp_path, d))
    assert code == 0, err
