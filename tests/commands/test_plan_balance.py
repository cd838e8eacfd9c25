"""The plan's idle column and the uneven split it suggests: Llama-3-8B on 4 stages idles 21% of its simulated step
against the schedule's 4.5% (its first stage also holds the embedding, its last the 128K-vocabulary output layer);
moving layers off the end stages, each move kept only where the simulated step falls and the peak fits, finds a split
the planner itself then predicts faster."""

from __future__ import annotations

from dataclasses import replace

import pytest
from _cli import run, run_json

from microbatch.hardware import get_accelerator
from microbatch.model import get_model
from microbatch.predict.plan import make_plan
from microbatch.predict.plan_balance import IMBALANCE_WORTH, balanced_split
from microbatch.predict.plan_config import PlanConfig

ARGS = [
    "plan",
    "--model",
    "llama-3-8b",
    "--gpu",
    "h100-sxm",
    "-B",
    "1024",
    "-d",
    "16",
    "-p",
    "4",
    "--seq",
    "8192",
]


def _cfg(**kw):
    layout = {"data_parallel": 16, "pipeline_parallel": 4, **kw}
    return PlanConfig(shape=get_model("llama-3-8b").with_seq(8192), gpu=get_accelerator("h100-sxm"),
                      global_batch=1024, **layout)  # fmt: skip


def test_the_split_found_is_what_the_planner_predicts_for_it():
    cfg = _cfg()
    c = make_plan(cfg).recommended
    assert c.simulated and c.time["simulated_idle"] - c.bubble_fraction > IMBALANCE_WORTH
    found = balanced_split(cfg, c)
    assert found is not None and sum(found.layers_per_stage) == 32
    assert found.layers_per_stage[-1] < 8 < found.layers_per_stage[0] + 1  # layers off the output's stage
    assert found.candidate.step_time_s < c.step_time_s and found.candidate.fits
    again = make_plan(replace(cfg, layers_per_stage=found.layers_per_stage, micro_batches=(c.micro_batch,),
                              schedules=(c.schedule,), recompute=(c.recompute,), zero=(c.zero,)))  # fmt: skip
    assert min(x.step_time_s for x in again.candidates) == pytest.approx(found.candidate.step_time_s)
    assert found.candidate.time["simulated_idle"] < c.time["simulated_idle"]


def test_nothing_to_balance_without_a_pipeline_or_past_the_bubble():
    flat = _cfg(pipeline_parallel=1)
    assert balanced_split(flat, make_plan(flat).recommended) is None
    cfg = _cfg()
    c = make_plan(cfg).recommended
    calm = replace(c, time={**c.time, "simulated_idle": c.bubble_fraction + IMBALANCE_WORTH / 2})
    assert balanced_split(cfg, calm) is None


def test_the_plan_shows_the_idle_and_names_the_split(capsys):
    code, out, _ = run(ARGS, capsys)
    assert code == 0
    header = next(line for line in out.splitlines() if line.startswith("b_m"))
    assert header.split()[6:8] == ["bubble", "idle"]
    first = next(line for line in out.splitlines() if line.startswith(" 1*"))
    bubble, idle = (float(x.rstrip("%")) for x in first.split()[6:8])
    assert bubble == 4.5 and idle > 15  # the closed form, and the simulated step's idle with its imbalance
    d = run_json(ARGS, capsys)
    rb = d["rebalance"]
    assert rb["step_time_s"] < rb["was_step_time_s"] and rb["simulated_idle"] < rb["was_simulated_idle"]
    assert f"--layers-per-stage {','.join(map(str, rb['layers_per_stage']))}" in out
    given = run_json([*ARGS, "--layers-per-stage", ",".join(map(str, rb["layers_per_stage"]))], capsys)
    assert "rebalance" not in given  # a split given is the user's: no search
    assert given["recommended"]["step_time_s"] <= rb["step_time_s"] * (1 + 1e-9)
