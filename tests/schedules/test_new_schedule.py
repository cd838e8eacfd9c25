"""A schedule added to the registry alone is served everywhere: plan, bubble, simulate, memory, export.

The fixture registers a copy of 1F1B under a new name (monkeypatched into
:data:`microbatch.schedules.registry.SCHEDULES`, removed after the test) and no code outside
``schedules/`` changes; every command then answers for it exactly what it answers for 1F1B, but the
name. This is the claim of issue 31 (2): adding a schedule touches ``schedules/`` and its tests only.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

from microbatch.cli import main
from microbatch.hardware import get_accelerator
from microbatch.model import get_model
from microbatch.predict.memory import MemoryConfig, estimate_memory
from microbatch.predict.plan import PlanConfig, make_plan
from microbatch.schedules import registry
from microbatch.show.export import export_plan

NEW = "copy-1f1b"


@pytest.fixture
def new_schedule(monkeypatch: pytest.MonkeyPatch) -> registry.ScheduleSpec:
    """1F1B's entry under the name ``copy-1f1b``, registered for one test."""
    spec = replace(registry.get_spec("1f1b"), name=NEW, aliases=("copy",), description="1F1B, copied.")
    monkeypatch.setitem(registry.SCHEDULES, NEW, spec)
    return spec


def _json(args: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    code = main([*args, "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    d: dict[str, Any] = json.loads(out.out)
    return d


def _but_name(d: Any) -> Any:
    """``d`` with the schedule's name written as 1f1b's, wherever it is a value or in a string."""
    return json.loads(json.dumps(d).replace(NEW, "1f1b"))


def test_the_new_schedule_is_registered_and_named(new_schedule):
    assert NEW in registry.schedule_names(in_flight=True)
    assert registry.get_spec("COPY") is new_schedule
    assert registry.generate(NEW, 4, 8).actions == registry.generate("1f1b", 4, 8).actions


def test_plan_serves_it_as_1f1b(new_schedule):
    base = dict(
        shape=get_model("gpt2"), gpu=get_accelerator("a100-80gb"), global_batch=64, pipeline_parallel=4
    )
    new = make_plan(PlanConfig(**base, schedules=(NEW,)))
    old = make_plan(PlanConfig(**base, schedules=("1f1b",)))
    assert {c.schedule for c in new.candidates} == {NEW}
    assert len(new.candidates) == len(old.candidates) > 10
    assert _but_name(new.to_dict()) == _but_name(old.to_dict())
    # both in one plan: every 1F1B candidate has its twin at the same step time and memory (to rounding:
    # the leaders are replayed by the simulator, the others screened by the closed form)
    both = make_plan(PlanConfig(**base, schedules=("1f1b", NEW)))
    twins = {(c.micro_batch, c.recompute, c.zero): c for c in both.candidates if c.schedule == NEW}
    for c in both.candidates:
        if c.schedule == "1f1b":
            t = twins[(c.micro_batch, c.recompute, c.zero)]
            assert t.peak_memory_bytes == c.peak_memory_bytes
            assert (t.step_time_s, t.bubble_fraction) == pytest.approx(
                (c.step_time_s, c.bubble_fraction), rel=1e-9
            )


@pytest.mark.parametrize(
    "args",
    [
        ["bubble", "-p", "4", "-m", "8", "--no-diagram"],
        ["simulate", "-p", "4", "-m", "8", "--forward-time", "1", "--backward-time", "2"],
        ["memory", "--model", "gpt2", "--stages", "4", "--micro-batch", "2"],
        ["plan", "--model", "gpt2", "--gpu", "a100-80gb", "--global-batch", "64", "--stages", "4"],
    ],
)
def test_commands_answer_for_it_as_for_1f1b(new_schedule, capsys, args):
    """The command line takes the new name (its choices are read from the registry) and answers what it
    answers for 1F1B."""
    new = _json([*args, "--schedule", NEW], capsys)
    old = _json([*args, "--schedule", "1f1b"], capsys)
    assert NEW in json.dumps(new)
    assert _but_name(new) == old


def test_its_rules_are_1f1bs(new_schedule, capsys):
    """m < p: refused by its own check (1F1B's), with 1F1B's message."""
    args = ["bubble", "-p", "4", "-m", "2", "--json"]
    assert main([*args, "-s", NEW]) == 2
    new = capsys.readouterr()
    assert main([*args, "-s", "1f1b"]) == 2
    old = capsys.readouterr()
    assert new.out.replace(NEW, "1f1b") == old.out and "m >= p" in old.out


def test_memory_model_serves_it(new_schedule):
    shape = get_model("gpt2")
    new = estimate_memory(shape, MemoryConfig(micro_batch=2, pipeline_parallel=4, schedule=NEW))
    old = estimate_memory(shape, MemoryConfig(micro_batch=2, pipeline_parallel=4, schedule="1f1b"))
    assert [s.peak_bytes for s in new.stages] == [s.peak_bytes for s in old.stages]
    assert [s.in_flight for s in new.stages] == [4, 3, 2, 1]


def test_export_names_the_torch_class_that_runs_it(new_schedule):
    cfg = PlanConfig(shape=get_model("gpt2"), gpu=get_accelerator("a100-80gb"), global_batch=128, data_parallel=2,
                     pipeline_parallel=4, schedules=(NEW,), micro_batches=(2,), zero=(1,))  # fmt: skip
    plan = make_plan(cfg)
    tt = export_plan(plan.to_dict(), "torchtitan")
    assert tt.config["parallelism"]["pipeline_parallel_schedule"] == "1F1B"
    ds = export_plan(plan.to_dict(), "deepspeed")
    assert not any(f"not {NEW}" in n for n in ds.notes)  # DeepSpeed runs 1F1B itself (deepspeed_native)
    # a schedule DeepSpeed does not run natively is said
    other = replace(new_schedule, deepspeed_native=False)
    registry.SCHEDULES[NEW] = other
    ds2 = export_plan(plan.to_dict(), "deepspeed")
    assert any(f"not {NEW}" in n for n in ds2.notes)


def test_the_default_virtual_is_the_registry_entrys():
    """v when none is given comes from the entry (stages_per_rank, v1_equivalent), in parameter words."""
    from microbatch.schedules.registry import get_spec
    from microbatch.schedules.virtual import virtual_in_effect

    assert virtual_in_effect(get_spec("dualpipev"), None) == (2, None)  # a V: two stages per rank
    assert virtual_in_effect(get_spec("1f1b"), None) == (1, None)
    assert virtual_in_effect(get_spec("interleaved-1f1b"), 3) == (3, None)  # given, it stands
    v, note = virtual_in_effect(get_spec("interleaved-1f1b"), None)
    assert v == 1 and note is not None
    assert "has 1F1B's bubble" in note and "give virtual 2 or" in note and "--" not in note
