"""The one registry of pipeline schedules: every name, alias and rule that any layer reads.

A :class:`ScheduleSpec` says everything the package knows about one schedule: its name and
aliases, how to generate its action order, the (p, m, v) it can serve (torch's own rule where
torch has the schedule), the placement of virtual stages on ranks, whether the backward is split
into I and W, the activation chunks each rank holds at its peak (the *in-flight rule*), the
``torch.distributed.pipelining`` class that runs it, and whether the fill-drain closed form of the
bubble applies. :data:`SCHEDULES` is open: add a schedule with :func:`register_schedule`.

The memory model (:mod:`microbatch.predict`), the simulator, the planner, the pipeline runner and
every ``--schedule`` option read this one table; nothing else lists schedules.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from microbatch.errors import ConfigError, ScheduleError, check_positive_int, plain_numbers
from microbatch.schedules.action import Action, Schedule, check_placement, stage_to_rank
from microbatch.schedules.closed_forms import (
    DUALPIPEV_IDLE,
    ZB_H1_IDLE,
    IdleClosedForm,
    PipelineTime,
    fill_drain_step_time,
)
from microbatch.schedules.generators import (
    dualpipev_order,
    dualpipev_overlapped,
    gpipe_order,
    interleaved_order,
    one_f_one_b_order,
    zb_h1_order,
    zb_interleaved_order,
    zbv_order,
    zbv_planned,
)
from microbatch.schedules.rules import (
    Check,
    EndsRule,
    InFlightRule,
    check_1f1b,
    check_dualpipev,
    check_gpipe,
    check_zb_h1,
    check_zbv,
    dualpipev_ends,
    dualpipev_in_flight,
    gpipe_ends,
    gpipe_in_flight,
    interleaved_ends,
    interleaved_in_flight,
    need_whole_rounds,
    one_f_one_b_ends,
    one_f_one_b_in_flight,
    zb_h1_ends,
    zb_h1_in_flight,
)
from microbatch.schedules.simulate import dualpipev_flush_time, zb_h1_flush_time
from microbatch.schedules.spec_checks import check_spec_fields
from microbatch.schedules.validate import validate

__all__ = [
    "DEFAULT_SCHEDULE",
    "INTERLEAVED_SCHEDULE",
    "MAX_STAGES",
    "SCHEDULES",
    "ScheduleSpec",
    "check_servable",
    "default_schedule",
    "generate",
    "is_builtin",
    "get_spec",
    "rank_stages",
    "register_schedule",
    "schedule_names",
    "stage_ranks",
    "torch_spec",
]


@dataclass(frozen=True, kw_only=True)
class ScheduleSpec:
    """Everything known about one named schedule."""

    name: str
    """Registry key, lower case, e.g. ``"1f1b"``."""
    generate: Callable[[int, int, int], list[list[Action]]]
    """``(stages, microbatches, virtual) -> per-rank action lists``; called after :attr:`check`."""
    check: Check
    """Raises :class:`ScheduleError` (value, rule, fix) for an (p, m, v) it cannot serve."""
    placement: str = "loop"
    """Stage-to-rank placement of the generated schedule: ``loop`` or ``v``."""
    split_backward: bool = False
    """True when the schedule uses I and W instead of B (needs input and weight times)."""
    description: str = ""
    """One line for help texts."""
    label: str = ""
    """The name as the literature writes it (``GPipe``, ``1F1B``), for sentences; empty: :attr:`name`."""
    torch_name: str | None = None
    """Name of the matching ``torch.distributed.pipelining`` class, if torch has one."""
    aliases: tuple[str, ...] = ()
    """Other names accepted wherever a schedule is named (lower case)."""
    in_flight: InFlightRule | None = None
    """``(rank, p, m, v) -> activation chunks`` the rank holds at its peak; None when only the
    simulator knows (see :mod:`microbatch.schedules.rules`). The memory model serves exactly the
    schedules that have one."""
    ends: EndsRule | None = None
    """``(p, m, v) -> (micro-batches on the first virtual stage, on the last)`` at their peaks (the embedding's and the
    output layer's activations); None: the ranks' own in-flight micro-batches (an upper bound)."""
    run_as: str | None = None
    """Name of the registered schedule whose torch class runs this one, when it has no class of its
    own (zb-h1 runs as zb-interleaved: torch's ScheduleInterleavedZeroBubble with one stage per
    rank runs ZB-H1's order, tested)."""
    fill_drain_bubble: bool = False
    """True when the bubble is the closed form (p−1)/(v·m+p−1) for equal stages and m >= p."""
    fill_drain_any_m: bool = False
    """True when the fill-drain form holds for every m, not only m >= p: GPipe's (p−1)/(m+p−1), and the
    interleaved order's one round at m < p (:func:`microbatch.schedules.closed_forms.fill_drain_bubble`)."""
    idle_closed_form: IdleClosedForm | None = None
    """The closed form of the idle time per stage when the backward is split (ZB-H1, DualPipeV);
    :mod:`microbatch.schedules.closed_forms`."""
    step_time: PipelineTime | None = None
    """The planner's closed form of one flush's time and bubble from per-stage times; None when the
    planner does not serve the schedule (it also needs :attr:`in_flight`)."""
    stages_per_rank: int | None = 1
    """Stages (model chunks) each rank holds: 1; 2 for a V placement; None when v is free (the
    interleaved schedules: any v that splits the layers evenly)."""
    v1_equivalent: str | None = None
    """The schedule whose bubble this one has with one stage per rank (interleaved-1f1b: 1f1b; torch's order still
    warms up more), said when v defaults to 1."""
    lighter_equivalent: str | None = None
    """A schedule with the same bubble that holds fewer activations (GPipe: 1F1B), named by the
    planner's lint."""
    bubble_flat_in_m: bool = False
    """True when the idle does not grow as m falls (DualPipeV, m >= 2p): the planner's lint of
    m < 4p then fires only when the bubble is over 1F1B's at m = 4p."""
    deepspeed_native: bool = False
    """True when DeepSpeed's pipeline engine runs this schedule (its 1F1B-like TrainSchedule)."""
    planned_microbatches: Callable[[int, int], int] | None = None
    """``(p, m) -> micro-batches the generator builds`` when more than m (it drops the rest); None: m."""
    overlapped: Callable[[Sequence[Sequence[Action]]], tuple[frozenset[int], ...]] | None = None
    """Per-rank positions of forwards that torch runs with the next action as one overlapped step
    (:attr:`microbatch.schedules.action.Schedule.overlapped`), from the generated actions; None: none."""

    def fill_drain_holds(self, stages: int, microbatches: int) -> bool:
        """True when the fill-drain closed form gives this schedule's bubble at (p, m): (p−1)/(v·m+p−1) at
        m >= p, :func:`microbatch.schedules.closed_forms.fill_drain_bubble` at every m where it holds."""
        return self.fill_drain_bubble and (microbatches >= stages or self.fill_drain_any_m)

    @property
    def needs_even_split(self) -> bool:
        """A fixed number of stages per rank > 1 (a V placement): the layers split evenly into p·v chunks, no
        uneven split. A free v (interleaved) serves uneven stages, each rank's layers spread over its chunks."""
        return self.stages_per_rank not in (1, None)

    def __post_init__(self) -> None:
        check_spec_fields(self)
        plain_numbers(self)
        check_placement(self.placement)
        for alias in (self.name, *self.aliases):
            if alias != alias.strip().lower() or not alias:
                raise ConfigError(
                    f"schedule name {alias!r} must be lower case without surrounding spaces; write "
                    f"{alias.strip().lower()!r}"
                )


SCHEDULES: dict[str, ScheduleSpec] = {}
"""The open registry of schedules: name -> :class:`ScheduleSpec`, in registration order."""


def register_schedule(spec: ScheduleSpec, *, replace: bool = False) -> ScheduleSpec:
    """Add a schedule to :data:`SCHEDULES` (or, with ``replace``, put it in place of the one of its name); returns
    ``spec``. It serves this process: the pipeline runner's ranks are new processes and run built-ins only.

    Raises :class:`ConfigError` when one of its names or aliases already names another schedule, or its name is
    registered and ``replace`` is not given.
    """
    if not isinstance(spec, ScheduleSpec):
        raise ConfigError(
            f"register_schedule takes a ScheduleSpec, not {spec!r}; build ScheduleSpec(name=..., ...)"
        )
    if spec.name in SCHEDULES and not replace:
        raise ConfigError(
            f"schedule {spec.name!r} is registered already; give it another name, or register_schedule(spec, "
            "replace=True) to put it in place of that one"
        )
    for alias in (spec.name, *spec.aliases):
        other = _lookup(alias)
        if other is not None and other.name != spec.name:
            raise ConfigError(
                f"schedule name {alias!r} of {spec.name!r} already names schedule {other.name!r}; "
                "choose another name or alias"
            )
    SCHEDULES[spec.name] = spec
    return spec


def _lookup(name: str) -> ScheduleSpec | None:
    exact = SCHEDULES.get(name) if isinstance(name, str) else None
    if exact is not None:  # a registered name as given (the planner's every call): no normalising scan
        return exact
    key = _norm(str(name))
    spec = next((s for n, s in SCHEDULES.items() if _norm(n) == key), None)
    if spec is not None:
        return spec
    return next((s for s in SCHEDULES.values() if key in map(_norm, s.aliases)), None)


def _norm(name: str) -> str:
    """A schedule name as looked up: case and ``_`` against ``-`` do not matter (``Interleaved_1F1B``)."""
    return name.strip().lower().replace("_", "-")


def get_spec(name: str) -> ScheduleSpec:
    """The spec named ``name`` or one of its aliases (case-insensitive), or a ConfigError listing them."""
    spec = _lookup(name)
    if spec is None:
        raise ConfigError(
            f"schedule {name!r} is unknown; known schedules: {', '.join(SCHEDULES)}; pick one of these",
            params=("schedule",),
        )
    return spec


def schedule_names(
    *, in_flight: bool = False, torch: bool = False, aliases: bool = False, planned: bool = False
) -> tuple[str, ...]:
    """Registered names in registration order, for ``--schedule`` choices and messages.

    ``in_flight``: only schedules with an in-flight rule (those the memory model serves); ``planned``: with a
    step-time closed form too (those the planner serves); ``torch``: only schedules ``torch.distributed.pipelining``
    can run (see :func:`torch_spec`); ``aliases``: each name followed by its aliases.
    """
    out: list[str] = []
    for spec in SCHEDULES.values():
        if (in_flight or planned) and spec.in_flight is None or planned and spec.step_time is None:
            continue
        if torch and spec.torch_name is None and spec.run_as is None:
            continue
        out.append(spec.name)
        if aliases:
            out += spec.aliases
    return tuple(out)


DEFAULT_SCHEDULE = "1f1b"
"""The schedule when none is asked, v = 1 (and a plan's label without a pipeline: plain accumulation)."""
INTERLEAVED_SCHEDULE = "interleaved-1f1b"
"""The schedule named when none is asked with several stages per rank."""


def default_schedule(virtual: int = 1) -> str:
    """:data:`DEFAULT_SCHEDULE` for v = 1, :data:`INTERLEAVED_SCHEDULE` for v > 1."""
    return INTERLEAVED_SCHEDULE if virtual > 1 else DEFAULT_SCHEDULE


MAX_STAGES = 100_000
"""Most pipeline ranks p any schedule is served for. Every per-rank answer is a list of p numbers:
``bubble --json`` at p = 1,000,000 took 1.1 s and 116 MB peak RSS (2 cores, 2026-12-03), linear in p
(p = 10^8 never answered); at this limit about 0.1 s. The deepest published pipeline has p = 64
(Narayanan et al. 2021, Table 1: 1T parameters, t = 8, p = 64), 1,500 times fewer."""


def check_servable(name: str, stages: int, microbatches: int, virtual: int = 1) -> None:
    """Raise :class:`ScheduleError` if schedule ``name`` cannot serve (p, m, v); names the rule."""
    check_positive_int("stages", stages, fix="a pipeline needs at least one rank (stages 1 or more)")
    check_positive_int(
        "microbatches", microbatches, fix="use at least one micro-batch (microbatches 1 or more)"
    )
    check_positive_int("virtual", virtual, fix="use virtual 1 for one stage per rank")
    if stages > MAX_STAGES:
        raise ScheduleError(
            f"stages = {stages:,} is over the limit of {MAX_STAGES:,} ranks: every per-rank answer (in-flight "
            f"counts, idle times) is a list of p numbers, so time and memory grow with p; use stages "
            f"{MAX_STAGES:,} or fewer (the deepest published pipelines have 64)",
            params=("stages",),
        )
    get_spec(name).check(stages, microbatches, virtual)


def generate(name: str, stages: int, microbatches: int, virtual: int = 1) -> Schedule:
    """Build the named schedule for p = ``stages`` ranks, m micro-batches, v stages per rank."""
    spec = get_spec(name)
    check_servable(spec.name, stages, microbatches, virtual)
    per_rank = spec.generate(stages, microbatches, virtual)
    built = Schedule(
        name=spec.name,
        stages=stages,
        microbatches=microbatches,
        virtual=virtual,
        placement=spec.placement,
        actions=tuple(tuple(r) for r in per_rank),
        overlapped=spec.overlapped(per_rank) if spec.overlapped is not None else (),
    )
    if not is_builtin(
        spec.name
    ):  # a registered generator's order is checked once: complete, every dependency met
        validate(built)
    return built


def is_builtin(name: str) -> bool:
    """Whether ``name`` is one of the schedules this module registers, as registered (not replaced)."""
    spec = _lookup(name)
    return spec is not None and _BUILTIN.get(spec.name) is spec


def torch_spec(name: str) -> ScheduleSpec:
    """The spec whose ``torch.distributed.pipelining`` class runs schedule ``name`` (itself, or its
    :attr:`ScheduleSpec.run_as`); :class:`ScheduleError` when torch has none."""
    spec = get_spec(name)
    if spec.run_as is not None:
        spec = get_spec(spec.run_as)
    if spec.torch_name is None:
        raise ScheduleError(
            f"schedule {name!r} has no torch.distributed.pipelining class to run it; use one of "
            f"{', '.join(schedule_names(torch=True))}"
        )
    return spec


def stage_ranks(name: str, stages: int, virtual: int) -> list[int]:
    """Rank of every virtual stage of schedule ``name``: loop (stage s on rank s mod p) or, for a
    ``v`` placement such as zbv's, a V (rank r holds stages r and 2p−1−r, torch's
    ``generate_stage_to_rank_mapping(style="v")``); see :func:`microbatch.schedules.action.stage_to_rank`."""
    placement = get_spec(name).placement
    return [stage_to_rank(s, stages, placement) for s in range(stages * virtual)]


def rank_stages(name: str, stages: int, virtual: int, rank: int) -> list[int]:
    """Virtual stages that ``rank`` holds under schedule ``name``, in increasing order."""
    return [s for s, r in enumerate(stage_ranks(name, stages, virtual)) if r == rank]


# -- the built-in schedules ------------------------------------------------------------------

register_schedule(
    ScheduleSpec(
        name="gpipe",
        generate=gpipe_order,
        check=check_gpipe,
        description="GPipe: all forwards, then all backwards (holds m micro-batches).",
        label="GPipe",
        torch_name="ScheduleGPipe",
        in_flight=gpipe_in_flight,
        ends=gpipe_ends,
        fill_drain_bubble=True,
        fill_drain_any_m=True,
        step_time=fill_drain_step_time,
        lighter_equivalent="1f1b",
    )
)
register_schedule(
    ScheduleSpec(
        name="1f1b",
        generate=one_f_one_b_order,
        check=check_1f1b,
        description="1F1B / PipeDream-Flush: same bubble as GPipe, holds at most p − rank.",
        label="1F1B",
        torch_name="Schedule1F1B",
        in_flight=one_f_one_b_in_flight,
        ends=one_f_one_b_ends,
        fill_drain_bubble=True,
        step_time=fill_drain_step_time,
        deepspeed_native=True,
    )
)
register_schedule(
    ScheduleSpec(
        name="interleaved-1f1b",
        generate=interleaved_order,
        check=need_whole_rounds("ScheduleInterleaved1F1B"),
        description="Interleaved 1F1B: v stages per rank, bubble ratio (p−1)/(v·m).",
        torch_name="ScheduleInterleaved1F1B",
        aliases=("interleaved",),
        in_flight=interleaved_in_flight,
        ends=interleaved_ends,
        fill_drain_bubble=True,
        fill_drain_any_m=True,
        step_time=fill_drain_step_time,
        stages_per_rank=None,
        v1_equivalent="1f1b",
    )
)
register_schedule(
    ScheduleSpec(
        name="zb-h1",
        generate=zb_h1_order,
        check=check_zb_h1,
        split_backward=True,
        description="Zero-bubble H1: backward split into I and W; idle (p−1)(T_F+T_I−T_W).",
        in_flight=zb_h1_in_flight,
        ends=zb_h1_ends,
        run_as="zb-interleaved",
        idle_closed_form=ZB_H1_IDLE,
        step_time=zb_h1_flush_time,
    )
)
register_schedule(
    ScheduleSpec(
        name="zbv",
        generate=zbv_order,
        check=check_zbv,
        placement="v",
        split_backward=True,
        description="Zero-bubble V: two stages per rank in a V, backward split into I and W (torch's order).",
        torch_name="ScheduleZBVZeroBubble",
        aliases=("zb-v",),
        planned_microbatches=zbv_planned,
        stages_per_rank=2,
    )
)
register_schedule(
    ScheduleSpec(
        name="zb-interleaved",
        generate=zb_interleaved_order,
        check=need_whole_rounds("ScheduleInterleavedZeroBubble"),
        split_backward=True,
        description="Interleaved zero bubble (ZB1P): v stages per rank, I/W split (torch's order).",
        torch_name="ScheduleInterleavedZeroBubble",
        aliases=("zb", "zero-bubble"),
        stages_per_rank=None,
    )
)
register_schedule(
    ScheduleSpec(
        name="dualpipev",
        generate=dualpipev_order,
        check=check_dualpipev,
        placement="v",
        split_backward=True,
        description="DualPipeV (DeepSeek-V3): two stages per rank in a V, F and B paired, I/W split at the end.",
        torch_name="ScheduleDualPipeV",
        aliases=("dualpipe-v", "dual-pipe-v"),
        in_flight=dualpipev_in_flight,
        ends=dualpipev_ends,
        overlapped=dualpipev_overlapped,
        idle_closed_form=DUALPIPEV_IDLE,
        step_time=dualpipev_flush_time,
        stages_per_rank=2,
        bubble_flat_in_m=True,
    )
)

_BUILTIN: dict[str, ScheduleSpec] = dict(SCHEDULES)
"""The schedules registered above, as they are: the ones the pipeline runner's ranks see."""
