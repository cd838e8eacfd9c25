"""A candidate inside the device but not its headroom is "tight", not "no" (issue 28, item 4: configurations
that really ran must not be reported as not fitting without saying they fit the device)."""

from __future__ import annotations

import json

import pytest

from microbatch.hardware import get_accelerator
from microbatch.model import get_model
from microbatch.predict.plan import make_plan
from microbatch.predict.plan_config import PlanConfig
from microbatch.show.plan_report import render_plan as plan_text

GPT2 = get_model("gpt2")
A100 = get_accelerator("a100-80gb")


def _cfg(gpu) -> PlanConfig:
    return PlanConfig(
        shape=GPT2, gpu=gpu, global_batch=16, micro_batches=(16,), recompute=("none",), zero=(0,)
    )


def _peak() -> float:
    return make_plan(_cfg(A100)).candidates[0].peak_memory_bytes


def test_tight_between_budget_and_capacity():
    peak = _peak()
    tight_gpu = A100.with_overrides(
        memory_bytes=peak / 0.95
    )  # 95% full: over the 90% budget, inside the device
    plan = make_plan(_cfg(tight_gpu))
    c = plan.candidates[0]
    assert not c.fits and c.fits_device and plan.recommended is None
    d = c.to_dict()
    assert d["fits"] is False and d["fits_device"] is True
    text = plan_text(plan)
    assert "tight = inside the device's" in text
    row = [line for line in text.splitlines() if line.strip().startswith("16 ")][0]
    assert row.split()[-1] == "tight"
    assert "inside the device's" in text and "a memory headroom of 0 plans with it" in text
    # the HTML report's candidate table says the same
    from microbatch.show.html import _candidates_table

    html = "".join(_candidates_table([d], {}))
    assert ">tight<" in html
    # with no headroom it is the plan
    import dataclasses

    assert make_plan(dataclasses.replace(_cfg(tight_gpu), memory_headroom=0.0)).recommended is not None


def test_over_the_device_is_no_and_says_nothing_of_the_device():
    peak = _peak()
    small = A100.with_overrides(memory_bytes=peak / 1.05)  # 5% over the device
    plan = make_plan(_cfg(small))
    c = plan.candidates[0]
    assert not c.fits and not c.fits_device
    text = plan_text(plan)
    assert "tight" not in text and "inside the device" not in text
    row = [line for line in text.splitlines() if line.strip().startswith("16 ")][0]
    assert row.split()[-1] == "no"


def test_each_candidate_is_judged_against_the_device_and_the_budget(capsys):
    from microbatch.cli import main

    args = ["plan", "--model", "llama-3-8b", "--gpu", "h100-sxm", "-B", "1024", "-d", "16", "-p", "4",
            "--seq", "8192", "--json"]  # fmt: skip
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    plan = out["result"] if "result" in out else out
    cap = 81559 * 2**20  # the 81,559 MiB an 80 GB H100's driver reports
    budget = 0.9 * cap
    kinds = set()
    for c in plan["candidates"]:
        assert c["fits"] == (c["peak_memory_bytes"] <= budget)
        assert c["fits_device"] == (c["peak_memory_bytes"] <= cap)
        kinds.add((c["fits"], c["fits_device"]))
    assert kinds == {(True, True), (False, True), (False, False)}  # fits, tight and over the device


def test_a_plan_read_back_without_the_field_says_no_not_tight():
    from microbatch.predict.candidate import Candidate
    from microbatch.show.plan_report import _row

    c = make_plan(_cfg(A100.with_overrides(memory_bytes=_peak() / 0.95))).candidates[0].to_dict()
    del c["fits_device"]  # a plan written before the field existed
    assert _row(Candidate.from_dict(c))[-1] == "no"


def test_a_comparison_row_says_tight_when_the_smallest_fits_the_device():
    from microbatch.predict.plan import compare_gpus
    from microbatch.show.plan_report import comparison_records, comparison_rows

    peak = _peak()
    tight_gpu = A100.with_overrides(memory_bytes=peak / 0.95)
    plans = compare_gpus(_cfg(A100), [A100, tight_gpu])
    records = comparison_records(plans)
    rows = comparison_rows(records)
    assert rows[1][7] != "nothing fits" and not rows[1][7].startswith("tight")  # the 80 GB A100 fits
    assert rows[2][7].startswith("tight: ")
    # the JSON's records are numbers: the fitting one the recommendation's, the tight one its smallest peak
    fit, tight = records
    assert fit["fits"] and fit["peak_memory_bytes"] == plans[0].recommended.peak_memory_bytes
    assert fit["tokens_per_s_per_gpu"] * plans[0].config.num_gpus == pytest.approx(fit["tokens_per_s"])
    assert (
        not tight["fits"]
        and tight["step_time_s"] is None
        and tight["tight_peak_bytes"] == pytest.approx(peak)
    )
    small = A100.with_overrides(memory_bytes=peak / 1.05)
    none = comparison_records(compare_gpus(_cfg(A100), [small]))
    assert comparison_rows(none)[1][7] == "nothing fits" and none[0]["tight_peak_bytes"] is None
    # a record written as the table's strings (plan --json before it gave numbers) reads back as it is
    old = dict(zip(rows[0], rows[1], strict=True))
    assert comparison_rows([old])[1] == rows[1]
