"""A plan's size, counted before it is searched: a search too large for a laptop is refused with its numbers
(microbatch.predict.plan.check_plan_size), and ``plan`` says it is searching when it takes seconds."""

from __future__ import annotations

import dataclasses
import time

import pytest

from microbatch.cli import main
from microbatch.errors import ConfigError
from microbatch.hardware import get_accelerator
from microbatch.model import get_model
from microbatch.predict import plan as plan_module
from microbatch.predict.plan import (
    MAX_PLAN_BYTES,
    PlanConfig,
    _enumerate,
    candidate_count,
    check_plan_size,
    plan_bytes,
)

A100, H100 = get_accelerator("a100-80gb"), get_accelerator("h100-sxm")


@pytest.mark.parametrize(
    "kw",
    [
        dict(shape=get_model("llama-2-7b"), gpu=A100, global_batch=64, pipeline_parallel=4),
        dict(shape=get_model("gpt2"), gpu=A100, global_batch=512, data_parallel=8),
        dict(shape=get_model("megatron-530b"), gpu=A100, global_batch=2240, pipeline_parallel=35, tensor_parallel=8,
             data_parallel=8),
        dict(shape=get_model("llama-3-70b"), gpu=H100, global_batch=1024, pipeline_parallel=8, tensor_parallel=8,
             layers_per_stage=(9, 10, 10, 10, 10, 10, 10, 11)),
        dict(shape=get_model("llama-2-7b"), gpu=A100, global_batch=96, pipeline_parallel=4, recompute=("full",),
             zero=(1,), schedules=("interleaved-1f1b", "zb-h1")),
    ],
)  # fmt: skip
def test_the_count_is_the_number_of_candidates_built(kw):
    cfg = PlanConfig(**kw)
    assert candidate_count(cfg) == len(_enumerate(cfg)) > 0


def _huge(p: int) -> PlanConfig:
    shape = dataclasses.replace(get_model("gpt2"), layers=100_000, hidden=64, heads=1, vocab=1000, seq=128)
    return PlanConfig(shape=shape, gpu=H100, global_batch=735_134_400, pipeline_parallel=p)


def test_a_search_past_the_memory_limit_is_refused_before_any_candidate_is_built(monkeypatch):
    """A helper's runs: 23,685 candidates at p = 5,000 took 65 s and 5 GB; at p = 10,000 the search ended in a
    MemoryError traceback; 344,433 candidates at p = 2 took 27 s and 1.2 GB. Nothing said before."""
    built = []
    monkeypatch.setattr(plan_module, "to_candidate", lambda *a: built.append(a))
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=r"23,685 candidates .* of 5,000 stages each: about 4\.7 GiB") as e:
        check_plan_size(_huge(5000))
    with pytest.raises(ConfigError, match=r"23,685 candidates"):
        plan_module.make_plan(_huge(5000))
    assert built == [] and time.monotonic() - t0 < 10
    assert {"micro_batches", "recompute", "zero"} <= set(e.value.params)
    assert (
        plan_bytes(23_685, 5000) > MAX_PLAN_BYTES > plan_bytes(200_000, 2)
    )  # a large plain search still runs


def test_plan_says_it_is_searching_when_it_takes_seconds(monkeypatch, capsys):
    from microbatch.commands import plan as plan_command

    monkeypatch.setattr(plan_command, "PLAN_HEARTBEAT_S", 0.05)
    real = plan_module.make_plan
    monkeypatch.setattr(plan_module, "make_plan", lambda *a, **k: (time.sleep(0.3), real(*a, **k))[1])
    monkeypatch.setattr(
        plan_module,
        "compare_gpus",
        lambda cfg, gpus: [plan_module.make_plan(dataclasses.replace(cfg, gpu=g)) for g in gpus],
    )
    assert main(["plan", "--model", "gpt2", "--gpu", "a100-80gb,h100-sxm", "-B", "16", "--json"]) == 0
    err = capsys.readouterr().err
    assert "plan: searching the candidates of 2 accelerators [" in err


def test_the_zero_rows_of_one_schedule_share_one_simulation(monkeypatch):
    """An uneven split simulates every candidate (up to 50): the ZeRO stages of one (b_m, schedule, v, recompute)
    have the same stage times, so one simulation serves them all, and the plan is the same."""
    from microbatch.predict import candidate as candidate_module

    cfg = PlanConfig(shape=get_model("llama-2-7b"), gpu=H100, global_batch=64, data_parallel=4, pipeline_parallel=4,
                     layers_per_stage=(7, 8, 8, 9), micro_batches=(1, 2), recompute=("none", "full"))  # fmt: skip
    plain = plan_module.make_plan(cfg)
    calls = []
    real = candidate_module._simulated
    monkeypatch.setattr(candidate_module, "_simulated", lambda ctx, c: calls.append(c) or real(ctx, c))
    shared = plan_module.make_plan(cfg)
    keys = {
        (c.schedule, c.microbatches, c.virtual, c.micro_batch, c.recompute)
        for c in shared.candidates
        if c.simulated
    }
    assert len(calls) == len(keys) < sum(c.simulated for c in shared.candidates)
    assert [(c.step_time_s, c.zero) for c in shared.candidates] == [
        (c.step_time_s, c.zero) for c in plain.candidates
    ]
