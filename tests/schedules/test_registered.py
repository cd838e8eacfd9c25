"""A schedule a user registers (the registry is open): checked where it enters, served where its rules allow, and
refused with what its spec lacks where they do not — found by a read-only sweep (2026-12-06)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest

from microbatch.errors import ConfigError, ScheduleError
from microbatch.hardware import get_accelerator
from microbatch.model import get_model
from microbatch.predict.memory import estimate_memory
from microbatch.predict.memory_config import MemoryConfig
from microbatch.predict.plan import make_plan
from microbatch.predict.plan_config import PlanConfig
from microbatch.run.pipeline.config import PipelineConfig
from microbatch.schedules.generators import one_f_one_b_order
from microbatch.schedules.registry import SCHEDULES, ScheduleSpec, generate, get_spec, register_schedule
from microbatch.schedules.rules import check_1f1b, one_f_one_b_in_flight

A100 = get_accelerator("a100-80gb")
GPT2 = get_model("gpt2")


@pytest.fixture
def registered() -> Iterator[list[str]]:
    """Names registered by the test, removed after it (the built-ins put back where one was replaced)."""
    names: list[str] = []
    kept = dict(SCHEDULES)
    yield names
    for n in names:
        SCHEDULES.pop(n, None)
    SCHEDULES.update({k: v for k, v in kept.items() if k in ("1f1b",)})


def _spec(name: str, **kw: object) -> ScheduleSpec:
    fields: dict[str, object] = {"generate": one_f_one_b_order, "check": check_1f1b, **kw}
    return ScheduleSpec(name=name, **fields)  # type: ignore[arg-type]


def test_a_rule_without_a_step_time_leaves_the_default_plan_alone(registered: list[str]) -> None:
    registered.append("my-nostep")
    register_schedule(_spec("my-nostep", in_flight=one_f_one_b_in_flight))
    plan = make_plan(PlanConfig(shape=GPT2, gpu=A100, global_batch=64, pipeline_parallel=4))
    assert plan.recommended is not None and all(c.schedule != "my-nostep" for c in plan.candidates)
    with pytest.raises(
        ConfigError, match=r"'my-nostep' has no step-time closed form.*give its ScheduleSpec step_time"
    ):
        PlanConfig(shape=GPT2, gpu=A100, global_batch=64, pipeline_parallel=4, schedules=("my-nostep",))
    # its memory is served (it has an in-flight rule): the same as the 1F1B it copies
    mine = estimate_memory(
        GPT2, MemoryConfig(micro_batch=2, pipeline_parallel=4, microbatches=8, schedule="my-nostep")
    )
    ref = estimate_memory(GPT2, MemoryConfig(micro_batch=2, pipeline_parallel=4, microbatches=8))
    assert mine.peak_bytes == ref.peak_bytes


def test_a_spec_without_an_in_flight_rule_is_refused_with_what_to_add(registered: list[str]) -> None:
    registered.append("my-norule")
    register_schedule(_spec("my-norule"))
    with pytest.raises(
        ConfigError, match=r"'my-norule' has no in-flight rule.*give its ScheduleSpec in_flight="
    ):
        MemoryConfig(micro_batch=1, pipeline_parallel=4, schedule="my-norule")
    assert generate("my-norule", 2, 2).num_actions() == 8  # the simulator still serves it


def test_aliases_and_case_name_the_schedule_in_configs() -> None:
    cfg = MemoryConfig(micro_batch=1, pipeline_parallel=2, virtual=2, microbatches=4, schedule="interleaved")
    assert cfg.schedule == "interleaved-1f1b"
    assert PlanConfig(
        shape=GPT2, gpu=A100, global_batch=64, pipeline_parallel=4, schedules=("1F1B",)
    ).schedules == ("1f1b",)


def test_a_registered_name_is_not_replaced_unless_asked(registered: list[str]) -> None:
    with pytest.raises(ConfigError, match=r"'1f1b' is registered already.*replace=True"):
        register_schedule(_spec("1f1b"))
    assert get_spec("1f1b").in_flight is not None  # the built-in kept
    registered.append("my-copy")
    register_schedule(replace(get_spec("1f1b"), name="my-copy", aliases=()))
    register_schedule(
        replace(get_spec("1f1b"), name="my-copy", aliases=(), description="again"), replace=True
    )
    assert get_spec("my-copy").description == "again"


def test_what_a_registered_rule_answers_is_checked(registered: list[str]) -> None:
    registered += ["my-negative", "my-bad-time"]
    ref = get_spec("1f1b")
    register_schedule(replace(ref, name="my-negative", aliases=(), in_flight=lambda i, p, m, v: -1))
    with pytest.raises(ConfigError, match=r"'my-negative': its in_flight rule answered -1; .* 1 to 8"):
        estimate_memory(
            GPT2, MemoryConfig(micro_batch=1, pipeline_parallel=4, microbatches=8, schedule="my-negative")
        )
    with pytest.raises(ConfigError, match=r"its in_flight rule answered -1"):
        make_plan(
            PlanConfig(shape=GPT2, gpu=A100, global_batch=64, pipeline_parallel=4, schedules=("my-negative",))
        )
    register_schedule(replace(ref, name="my-bad-time", aliases=(), step_time=lambda p, m, v, tm: (-1.0, 2.0)))
    with pytest.raises(ConfigError, match=r"'my-bad-time': its step_time rule answered \(-1.0, 2.0\)"):
        make_plan(
            PlanConfig(shape=GPT2, gpu=A100, global_batch=64, pipeline_parallel=4, schedules=("my-bad-time",))
        )


def test_a_registered_generator_is_validated_and_the_pipeline_refuses_it(registered: list[str]) -> None:
    registered += ["my-short", "my-run"]

    def short(p: int, m: int, v: int) -> list[list]:
        order = one_f_one_b_order(p, m, v)
        return [order[0][:-1], *order[1:]]  # rank 0's last backward dropped

    register_schedule(_spec("my-short", generate=short))  # type: ignore[arg-type]
    with pytest.raises(ScheduleError):
        generate("my-short", 2, 4)
    register_schedule(replace(get_spec("1f1b"), name="my-run", aliases=()))
    with pytest.raises(
        ConfigError, match=r"'my-run' is registered in this process only; .* run one of gpipe, 1f1b"
    ):
        PipelineConfig(schedule="my-run", stages=2, microbatches=2)


@pytest.mark.parametrize(("kw", "words"), [
    ({"aliases": "abc"}, "is not a tuple of names"),
    ({"generate": None}, "generate None is not a function"),
    ({"in_flight": 5}, "in_flight 5 is not a function"),
    ({"placement": "v"}, "placement v puts two stages on each rank"),
    ({"name": 3}, "name 3 is not a string"),
])  # fmt: skip
def test_a_spec_of_the_wrong_shape_is_refused_when_built(kw: dict[str, object], words: str) -> None:
    fields = {"name": "my-bad", "generate": one_f_one_b_order, "check": check_1f1b, **kw}
    with pytest.raises(ConfigError, match=words):
        ScheduleSpec(**fields)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"register_schedule takes a ScheduleSpec, not '1f1b'"):
        register_schedule("1f1b")  # type: ignore[arg-type]
