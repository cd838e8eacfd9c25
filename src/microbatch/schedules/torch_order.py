"""torch's own compute order of a pipeline schedule, derived without a process group.

:func:`torch_order` is what :mod:`microbatch.run.pipeline.summary` simulates to predict a run and
what ``tests/run/pipeline/test_pipeline.py`` compares the generators of :mod:`microbatch.schedules.generators` with.
"""

from __future__ import annotations

from microbatch.errors import ScheduleError
from microbatch.schedules.registry import ScheduleSpec, check_servable, get_spec, schedule_names, torch_spec

__all__ = ["in_flight_spec", "single_stage_order", "splits_backward", "torch_order"]


def torch_order(schedule: str, stages: int, microbatches: int, virtual: int = 1) -> dict[int, list[str]]:
    """The compute actions every rank runs, in order, as strings like ``"2F0"``, ``"1I3"``.

    For the multi-stage schedules this is torch's own ``pipeline_order``, computed by the schedule
    class's ``_calculate_single_rank_operations`` on an instance that has no process group and no
    stages (idle slots dropped). torch's single-stage classes (GPipe, 1F1B) have none: their order is
    the loop of their ``_step_microbatches`` (:func:`single_stage_order`; torch 2.13's
    ``Schedule1F1B._get_pipeline_order`` does not match what it runs). DualPipeV's overlapped
    forward+backward pairs are written as their two parts, forward first.
    """
    spec = torch_spec(schedule)
    check_servable(spec.name, stages, microbatches, virtual)
    p, m, v = stages, microbatches, virtual
    from torch.distributed.pipelining import schedules as ts

    cls = getattr(ts, str(spec.torch_name), None)
    if cls is None:
        import torch

        raise ScheduleError(
            f"{spec.name} needs torch.distributed.pipelining.{spec.torch_name}, absent in torch "
            f"{torch.__version__}; upgrade torch or use schedule 'interleaved-1f1b'"
        )
    if not hasattr(cls, "_calculate_single_rank_operations"):
        return single_stage_order(spec, p, m)
    obj = object.__new__(cls)
    obj.pp_group_size = p
    obj._n_microbatches = m
    obj.n_local_stages = v
    obj.num_stages = obj._num_stages = p * v
    obj.number_of_rounds = max(1, m // p)
    obj.microbatches_per_round = m // obj.number_of_rounds
    try:
        order = {r: obj._calculate_single_rank_operations(r) for r in range(p)}
    except Exception as e:  # torch internals moved: say so plainly
        raise ScheduleError(
            f"cannot derive {spec.torch_name}'s order on this torch ({type(e).__name__}: {e}); "
            "compare with schedule '1f1b' or 'gpipe'"
        ) from None
    return {r: [str(x) for a in ops if a is not None for x in _parts(a)] for r, ops in order.items()}


def single_stage_order(spec: ScheduleSpec, stages: int, microbatches: int) -> dict[int, list[str]]:
    """The loop of torch's single-stage schedules (``ScheduleGPipe``, ``Schedule1F1B``): rank r runs
    as many forwards as its in-flight rule holds (GPipe m, 1F1B min(m, p − r)), then one backward and
    one forward alternately until every micro-batch is done."""
    if spec.in_flight is None:
        raise ScheduleError(f"{spec.name} runs one stage per rank but has no in-flight rule to order it by")
    out: dict[int, list[str]] = {}
    for r in range(stages):
        warm = min(microbatches, spec.in_flight(r, stages, microbatches, 1))
        ops = [f"{r}F{i}" for i in range(warm)]
        f = warm
        for b in range(microbatches):
            ops.append(f"{r}B{b}")
            if f < microbatches:
                ops.append(f"{r}F{f}")
                f += 1
        out[r] = ops
    return out


def in_flight_spec(schedule: str, virtual: int) -> ScheduleSpec | None:
    """The registry entry whose in-flight rule describes torch running ``schedule`` with ``virtual``
    stages per rank: its own, or, with one stage per rank, that of the entry that runs as it
    (:attr:`ScheduleSpec.run_as`: ZB-H1 runs as torch's interleaved zero bubble with v = 1); None
    when no entry has a rule (the simulator counts those)."""
    spec = torch_spec(schedule)
    if spec.in_flight is not None:
        return spec
    if virtual != 1:
        return None
    runs_as = (get_spec(n) for n in schedule_names())
    return next((s for s in runs_as if s.run_as == spec.name and s.in_flight is not None), None)


def _parts(action: object) -> tuple[object, ...]:
    """An action's compute parts in the order torch runs them: an overlapped forward+backward
    (DualPipeV's ``OVERLAP_F_B``) is its sub-actions, forward first; any other action is itself."""
    subs = getattr(action, "sub_actions", None)
    return tuple(subs) if subs else (action,)


def splits_backward(order: dict[int, list[str]]) -> bool:
    """Whether an order (rank -> actions like ``"1I0"``) runs the backward split into input (I)
    and weight (W) gradients, as the zero-bubble schedules do, rather than whole (B)."""
    return any(k in ("I", "W") for acts in order.values() for a in acts for k in a if k.isalpha())
