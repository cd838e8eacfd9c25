"""The end stages' micro-batches (the embedding's on the first virtual stage, the output layer's on the last),
counted on each schedule's generated order against the closed rules the memory model reads."""

from __future__ import annotations

import pytest

from microbatch.model import get_model
from microbatch.predict.activations import output_activation_bytes
from microbatch.predict.memory import estimate_memory
from microbatch.predict.memory_config import MemoryConfig
from microbatch.schedules.in_flight import end_stages_in_flight, in_flight_microbatches
from microbatch.schedules.registry import check_servable, generate, get_spec, stage_ranks


def _held(name: str, p: int, m: int, v: int, stage: int) -> int:
    """Most micro-batches alive on virtual ``stage``: from its forward to its last backward part (B, or W)."""
    rank = stage_ranks(name, p, v)[stage]
    alive: set[int] = set()
    most = 0
    for a in generate(name, p, m, v).actions[rank]:
        if a.stage != stage:
            continue
        if a.kind == "F":
            alive.add(a.microbatch)
        elif a.kind in ("B", "W"):
            alive.discard(a.microbatch)
        most = max(most, len(alive))
    return most


CASES = [
    (name, p, m, v)
    for name, vs in (
        ("gpipe", (1,)),
        ("1f1b", (1,)),
        ("zb-h1", (1,)),
        ("dualpipev", (2,)),
        ("interleaved-1f1b", (1, 2, 3, 4)),
    )  # fmt: skip
    for p in (2, 3, 4, 5, 8)
    for m in range(1, 34)
    for v in vs
]


def _servable(name: str, p: int, m: int, v: int) -> bool:
    try:
        check_servable(name, p, m, v)
    except Exception:
        return False
    return True


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1", "dualpipev", "interleaved-1f1b"])
def test_end_stage_rules_match_the_generated_orders(name):
    cases = [c for c in CASES if c[0] == name and _servable(*c)]
    assert len(cases) > 20
    for _, p, m, v in cases:
        counted = (_held(name, p, m, v, 0), _held(name, p, m, v, p * v - 1))
        assert end_stages_in_flight(name, p, m, v) == counted, (p, m, v)


def test_the_last_stage_of_interleaved_and_dualpipev_holds_one_micro_batch_not_its_ranks_count():
    # the ranks' own micro-batches (the rule the output layer used to be charged by) are far more
    assert end_stages_in_flight("dualpipev", 8, 16, 2) == (16, 1)
    assert in_flight_microbatches("dualpipev", 0, 8, 16, 2) == 9
    assert end_stages_in_flight("interleaved-1f1b", 8, 16, 2) == (16, 1)
    assert in_flight_microbatches("interleaved-1f1b", 7, 8, 16, 2) == 5
    assert end_stages_in_flight("zb-h1", 4, 8, 1) == (4, 4)  # the head's W deferred: held until it runs
    assert all(
        get_spec(n).ends is not None for n in ("gpipe", "1f1b", "zb-h1", "dualpipev", "interleaved-1f1b")
    )


@pytest.mark.parametrize("schedule,v", [("dualpipev", 2), ("interleaved-1f1b", 2)])
def test_memory_charges_the_output_layer_once_on_its_rank(schedule, v):
    """llama-3-8b, p = 8, m = 16: the output term of the rank holding the head is one micro-batch of logits, as
    1F1B's last rank's (and one micro-batch's output bytes, fp32 logits), though that rank holds several."""
    shape = get_model("llama-3-8b")
    est = estimate_memory(
        shape, MemoryConfig(micro_batch=1, pipeline_parallel=8, microbatches=16, virtual=v, schedule=schedule)
    )
    flat = estimate_memory(
        shape, MemoryConfig(micro_batch=1, pipeline_parallel=8, microbatches=16, schedule="1f1b")
    )
    head = stage_ranks(schedule, 8, v)[-1]
    out = est.stages[head].activation_terms["output"]
    assert out == flat.stages[7].activation_terms["output"]
    assert (
        output_activation_bytes(shape, 1, dtype_bytes=2)
        <= out
        <= output_activation_bytes(shape, 1, dtype_bytes=4)
    )
    assert est.stages[head].in_flight >= 5 and flat.stages[7].in_flight == 1
