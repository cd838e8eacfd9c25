"""A pipeline schedule is data: per-rank lists of actions, like ``torch.distributed.pipelining``.

An :class:`Action` is ``(stage, kind, microbatch)`` printed as torch prints its ``_Action``:
``2F0`` is the forward of micro-batch 0 on stage 2. ``stage`` is the *virtual* stage index
``0 … p·v−1`` (torch's ``stage_index``; there is no chunk field); the rank that runs a stage
follows from the schedule's placement: ``loop`` (stage ``s`` on rank ``s mod p``) or ``v``
(a zigzag: stages ``0…p−1`` go down the ranks, ``p…2p−1`` come back up, as torch's
``generate_stage_to_rank_mapping(style="v")``).

Kinds: ``F`` forward, ``B`` full backward, and for zero-bubble schedules ``I`` (input
gradient, torch's ``BACKWARD_INPUT``) and ``W`` (weight gradient, ``BACKWARD_WEIGHT``).

Generators live in an open registry, :data:`SCHEDULES` (name -> :class:`ScheduleSpec`); add one
with :func:`register_schedule`. :func:`generate` builds a :class:`Schedule`, :func:`validate`
checks every dependency and names the first violation with its position, and
:func:`check_servable` refuses an ``(m, p, v)`` the schedule cannot serve, naming the rule
(torch's own rule where torch has the schedule).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from microbatch.errors import ConfigError, ScheduleError, check_positive_int

KINDS = ("F", "B", "I", "W")
"""Computation kinds: forward, full backward, input-gradient backward, weight-gradient backward."""

PLACEMENTS = ("loop", "v")
"""How virtual stages map to ranks: round-robin (``loop``) or zigzag (``v``)."""

_ACTION_RE = re.compile(r"^\s*(\d+)([FBIW])(\d+)\s*$")


class Action(NamedTuple):
    """One computation: ``kind`` on virtual stage ``stage`` for micro-batch ``microbatch``.

    A named tuple (hashable, cheap), like torch's ``_Action``; ``str(Action(2, "F", 0)) == "2F0"``.
    """

    stage: int
    kind: str
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    def __repr__(self) -> str:
        return str(self)

    @staticmethod
    def parse(text: str) -> Action:
        """Parse ``"2F0"`` (stage, kind in F/B/I/W, micro-batch) back into an :class:`Action`."""
        match = _ACTION_RE.match(text)
        if match is None:
            raise ConfigError(
                f"action {text!r} is not of the form <stage><kind><microbatch> with kind one of "
                f"{', '.join(KINDS)}; write it as torch prints it, e.g. '2F0'"
            )
        return Action(int(match.group(1)), match.group(2), int(match.group(3)))


def stage_to_rank(stage: int, stages: int, placement: str = "loop") -> int:
    """Rank that runs virtual stage ``stage`` with ``stages`` ranks under ``placement``.

    ``loop``: ``stage mod p`` (Megatron and torch interleaved). ``v``: zigzag, so virtual
    stages ``p−1`` and ``p`` sit on the same (last) rank and ``2p−1`` is back on rank 0
    (torch's ``generate_stage_to_rank_mapping(style="v")``, used by ``ScheduleZBVZeroBubble``).
    """
    chunk, pos = divmod(stage, stages)
    if placement == "loop":
        return pos
    if placement == "v":
        return pos if chunk % 2 == 0 else stages - 1 - pos
    raise ConfigError(f"placement {placement!r} is unknown; use one of {', '.join(PLACEMENTS)}")


@dataclass(frozen=True, kw_only=True)
class Schedule:
    """A pipeline schedule as a value: what each rank runs, in order."""

    name: str
    """Schedule name (a key of :data:`SCHEDULES`, or any label for a hand-written schedule)."""
    stages: int
    """p: pipeline ranks."""
    microbatches: int
    """m: micro-batches per pipeline flush."""
    virtual: int = 1
    """v: virtual stages (model chunks) per rank; the schedule has p·v virtual stages."""
    placement: str = "loop"
    """How virtual stages map to ranks: ``loop`` or ``v`` (see :func:`stage_to_rank`)."""
    actions: tuple[tuple[Action, ...], ...] = field(repr=False)
    """Per rank, the actions in the order that rank runs them."""

    def __post_init__(self) -> None:
        check_positive_int("stages", self.stages, fix="a pipeline needs at least one rank")
        check_positive_int("microbatches", self.microbatches, fix="use at least one micro-batch")
        check_positive_int("virtual", self.virtual, fix="use 1 for one stage per rank")
        if self.placement not in PLACEMENTS:
            raise ConfigError(f"placement {self.placement!r} is unknown; use one of {', '.join(PLACEMENTS)}")
        if len(self.actions) != self.stages:
            raise ScheduleError(
                f"schedule {self.name!r} has action lists for {len(self.actions)} ranks but stages = "
                f"{self.stages}; give one list per rank"
            )

    @property
    def num_virtual_stages(self) -> int:
        """p·v: the number of virtual stages (model chunks) in the pipeline."""
        return self.stages * self.virtual

    @property
    def split_backward(self) -> bool:
        """True when the backward is split into I and W (zero-bubble schedules)."""
        return any(a.kind in ("I", "W") for rank in self.actions for a in rank)

    def stage_to_rank(self, stage: int) -> int:
        """Rank that runs virtual stage ``stage`` under this schedule's placement."""
        return stage_to_rank(stage, self.stages, self.placement)

    def num_actions(self) -> int:
        """Total number of actions over all ranks."""
        return sum(len(r) for r in self.actions)

    def format(self) -> str:
        """Per-rank action lists as text, one line per rank: ``rank 0: 0F0 0F1 0B0 …``."""
        return "\n".join(f"rank {r}: " + " ".join(map(str, acts)) for r, acts in enumerate(self.actions))

    def to_dict(self) -> dict:
        """JSON-ready dict; actions as torch-style strings."""
        return {
            "name": self.name,
            "stages": self.stages,
            "microbatches": self.microbatches,
            "virtual": self.virtual,
            "placement": self.placement,
            "actions": [[str(a) for a in rank] for rank in self.actions],
        }

    @staticmethod
    def from_strings(
        name: str,
        rank_actions: Sequence[Iterable[str]],
        *,
        microbatches: int,
        virtual: int = 1,
        placement: str = "loop",
    ) -> Schedule:
        """Build a schedule from per-rank lists of torch-style action strings (``"2F0"``)."""
        acts = tuple(tuple(Action.parse(s) for s in rank) for rank in rank_actions)
        return Schedule(
            name=name,
            stages=len(acts),
            microbatches=microbatches,
            virtual=virtual,
            placement=placement,
            actions=acts,
        )


# --------------------------------------------------------------------------------------------
# Registry


@dataclass(frozen=True, kw_only=True)
class ScheduleSpec:
    """How to build one named schedule and which (p, m, v) it can serve."""

    name: str
    """Registry key, e.g. ``"1f1b"``."""
    generate: Callable[[int, int, int], list[list[Action]]]
    """``(stages, microbatches, virtual) -> per-rank action lists``; called after :attr:`check`."""
    check: Callable[[int, int, int], None]
    """Raises :class:`ScheduleError` (value, rule, fix) for an (p, m, v) it cannot serve."""
    placement: str = "loop"
    """Stage-to-rank placement of the generated schedule."""
    split_backward: bool = False
    """True when the schedule uses I and W instead of B (needs input and weight times)."""
    description: str = ""
    """One line for help texts."""
    torch_name: str | None = None
    """Name of the matching ``torch.distributed.pipelining`` class, if torch has one."""


SCHEDULES: dict[str, ScheduleSpec] = {}
"""The open registry of schedule generators: name -> :class:`ScheduleSpec`."""


def register_schedule(spec: ScheduleSpec) -> ScheduleSpec:
    """Add (or replace) a schedule generator in :data:`SCHEDULES`; returns ``spec``."""
    if spec.placement not in PLACEMENTS:
        raise ConfigError(f"placement {spec.placement!r} is unknown; use one of {', '.join(PLACEMENTS)}")
    SCHEDULES[spec.name] = spec
    return spec


def get_spec(name: str) -> ScheduleSpec:
    """The registered spec for ``name`` (case-insensitive), or a ConfigError listing the known ones."""
    key = str(name).strip().lower()
    if key not in SCHEDULES:
        raise ConfigError(
            f"schedule {name!r} is unknown; known schedules: {', '.join(SCHEDULES)}; "
            "pick one of these with --schedule"
        )
    return SCHEDULES[key]


def check_servable(name: str, stages: int, microbatches: int, virtual: int = 1) -> None:
    """Raise :class:`ScheduleError` if schedule ``name`` cannot serve (p, m, v); names the rule."""
    check_positive_int("stages", stages, fix="a pipeline needs at least one rank (--stages 1 or more)")
    check_positive_int(
        "microbatches", microbatches, fix="use at least one micro-batch (--microbatches 1 or more)"
    )
    check_positive_int("virtual", virtual, fix="use --virtual 1 for one stage per rank")
    get_spec(name).check(stages, microbatches, virtual)


def generate(name: str, stages: int, microbatches: int, virtual: int = 1) -> Schedule:
    """Build the named schedule for p = ``stages`` ranks, m micro-batches, v stages per rank."""
    spec = get_spec(name)
    check_servable(spec.name, stages, microbatches, virtual)
    per_rank = spec.generate(stages, microbatches, virtual)
    return Schedule(
        name=spec.name,
        stages=stages,
        microbatches=microbatches,
        virtual=virtual,
        placement=spec.placement,
        actions=tuple(tuple(r) for r in per_rank),
    )


# --------------------------------------------------------------------------------------------
# Validation


def validate(schedule: Schedule) -> None:
    """Check that ``schedule`` is complete and that every dependency can be met.

    Rules: every (virtual stage, micro-batch) has exactly one F and either one B or one I and
    one W, each on the rank that owns the stage; F on stage s after F on stage s−1; B or I on
    stage s after its own F and after B or I on stage s+1; W after I. The check replays the
    per-rank orders (a rank runs its list in order and waits when a dependency is not met), so
    a cycle across ranks — a deadlock — is found too. Raises :class:`ScheduleError` naming the
    first violation, its rank and its position in that rank's list.
    """
    p, m, nst = schedule.stages, schedule.microbatches, schedule.num_virtual_stages
    seen: dict[Action, tuple[int, int]] = {}
    for rank, acts in enumerate(schedule.actions):
        for pos, a in enumerate(acts):
            where = f"rank {rank} position {pos} ({a})"
            if a.kind not in KINDS:
                raise ScheduleError(f"{where}: kind {a.kind!r} is not one of {', '.join(KINDS)}")
            if not 0 <= a.stage < nst:
                raise ScheduleError(
                    f"{where}: stage {a.stage} is outside 0..{nst - 1} (p·v = {p}·{schedule.virtual})"
                )
            if not 0 <= a.microbatch < m:
                raise ScheduleError(f"{where}: micro-batch {a.microbatch} is outside 0..{m - 1}")
            owner = schedule.stage_to_rank(a.stage)
            if owner != rank:
                raise ScheduleError(
                    f"{where}: stage {a.stage} belongs to rank {owner} under {schedule.placement!r} placement"
                )
            if a in seen:
                r0, p0 = seen[a]
                raise ScheduleError(f"{where}: duplicate of rank {r0} position {p0}")
            seen[a] = (rank, pos)
    for s in range(nst):
        for mb in range(m):
            if Action(s, "F", mb) not in seen:
                raise ScheduleError(f"missing action {Action(s, 'F', mb)} (rank {schedule.stage_to_rank(s)})")
            has_b = Action(s, "B", mb) in seen
            has_i = Action(s, "I", mb) in seen
            has_w = Action(s, "W", mb) in seen
            if has_b and (has_i or has_w):
                raise ScheduleError(f"stage {s} micro-batch {mb} has both B and I/W; use B or I+W, not both")
            if not has_b and not (has_i and has_w):
                missing = f"{s}B{mb}" if not (has_i or has_w) else (f"{s}W{mb}" if has_i else f"{s}I{mb}")
                raise ScheduleError(f"missing action {missing} (rank {schedule.stage_to_rank(s)})")

    # Replay: a rank advances while its next action's dependencies are done.
    done: set[Action] = set()
    ptr = [0] * p
    remaining = schedule.num_actions()
    while remaining:
        progressed = False
        for rank, acts in enumerate(schedule.actions):
            i = ptr[rank]
            while i < len(acts):
                a = acts[i]
                missing = next((d for d in _deps(a, nst) if d not in done and d in seen), None)
                if missing is not None:
                    break
                done.add(a)
                i += 1
                remaining -= 1
                progressed = True
            ptr[rank] = i
        if not progressed:
            blocked = []
            for rank, acts in enumerate(schedule.actions):
                if ptr[rank] < len(acts):
                    a = acts[ptr[rank]]
                    d = next(d for d in _deps(a, nst) if d not in done and d in seen)
                    blocked.append((seen[d][0] != rank, rank, a, d))
            # An action waiting for a later one of its own rank is the root cause; else the lowest rank.
            cross, rank, a, d = min(blocked, key=lambda b: (b[0], b[1]))
            r_d, pos_d = seen[d]
            why = (
                "which is later in its own list"
                if not cross
                else "which waits, directly or not, for this rank (deadlock)"
            )
            raise ScheduleError(
                f"rank {rank} position {ptr[rank]} ({a}) needs {d} (rank {r_d} position {pos_d}), {why}: "
                "reorder so that every dependency comes first"
            )


def _deps(a: Action, num_stages: int) -> list[Action]:
    """Actions that must finish before ``a`` starts (B or I on s+1 may be either kind)."""
    s, k, mb = a
    if k == "F":
        return [Action(s - 1, "F", mb)] if s > 0 else []
    if k in ("B", "I"):
        deps = [Action(s, "F", mb)]
        if s < num_stages - 1:
            deps += [Action(s + 1, "B", mb), Action(s + 1, "I", mb)]
        return deps
    return [Action(s, "I", mb)]  # W


# --------------------------------------------------------------------------------------------
# Generators. Each returns per-rank lists; (p, m, v) has passed the spec's check.


def _need_single_stage(name: str, torch_name: str | None):
    def check(p: int, m: int, v: int) -> None:
        if v != 1:
            owner = (
                f"torch's {torch_name} is a single-stage schedule"
                if torch_name
                else "it is a single-stage schedule"
            )
            raise ScheduleError(
                f"virtual = {v}: schedule {name!r} runs one stage per rank ({owner}); "
                "use --virtual 1, or --schedule interleaved-1f1b for several stages per rank"
            )

    return check


def _gpipe(p: int, m: int, v: int) -> list[list[Action]]:
    """GPipe (Huang et al. 2019): all forwards, then all backwards, in micro-batch order (torch's ScheduleGPipe)."""
    return [[Action(r, "F", i) for i in range(m)] + [Action(r, "B", i) for i in range(m)] for r in range(p)]


def _check_gpipe(p: int, m: int, v: int) -> None:
    _need_single_stage("gpipe", "ScheduleGPipe")(p, m, v)


def _one_f_one_b(p: int, m: int, v: int) -> list[list[Action]]:
    """1F1B (PipeDream-Flush, Narayanan et al. 2021), in the order of torch's Schedule1F1B.

    Rank r runs p−1−r warm-up forwards, then alternates one forward and one backward, then
    drains the remaining backwards; so it holds at most p−r micro-batches (min(m, p−r)).
    """
    out = []
    for r in range(p):
        warm = min(p - 1 - r, m)
        acts = [Action(r, "F", i) for i in range(warm)]
        f, b = warm, 0
        while f < m:
            acts.append(Action(r, "F", f))
            acts.append(Action(r, "B", b))
            f += 1
            b += 1
        acts += [Action(r, "B", i) for i in range(b, m)]
        out.append(acts)
    return out


def _check_1f1b(p: int, m: int, v: int) -> None:
    _need_single_stage("1f1b", "Schedule1F1B")(p, m, v)
    if m < p:
        raise ScheduleError(
            f"microbatches = {m} < stages = {p}: torch's Schedule1F1B needs m >= p; "
            f"use --microbatches {p} or more, or --schedule gpipe"
        )


def _interleaved_rounds(p: int, m: int) -> tuple[int, int]:
    """torch's ScheduleInterleaved1F1B: rounds = max(1, m // p), micro-batches per round = m // rounds."""
    rounds = max(1, m // p)
    return rounds, m // rounds


def _interleaved(p: int, m: int, v: int) -> list[list[Action]]:
    """Interleaved 1F1B (Narayanan et al. 2021, sec 2.2), the order of torch's ScheduleInterleaved1F1B.

    Rank r owns virtual stages r, r+p, …, r+(v−1)p (loop placement). Its forwards walk the
    local stages in blocks of one round's micro-batches (depth first), backwards the reverse.
    Warm-up forwards: (v−1)·n_round + 2(p−1−r), capped at m·v (torch's ``_get_warmup_ops``).
    """
    _, per_round = _interleaved_rounds(p, m)
    total = m * v
    out = []
    for r in range(p):
        warm = min((v - 1) * per_round + 2 * (p - 1 - r), total)
        fwd_next = [0] * v
        bwd_next = [0] * v
        acts: list[Action] = []
        for op in range(total + warm):
            if op < total:  # a forward at every step but the cool-down
                local = (op // per_round) % v
                acts.append(Action(local * p + r, "F", fwd_next[local]))
                fwd_next[local] += 1
            if op >= warm:  # a backward at every step after the warm-up
                local = v - 1 - ((op - warm) // per_round) % v
                acts.append(Action(local * p + r, "B", bwd_next[local]))
                bwd_next[local] += 1
        out.append(acts)
    return out


def _need_whole_rounds(torch_name: str):
    """torch's interleaved schedules split m into max(1, m // p) rounds and need m to fill them."""

    def check(p: int, m: int, v: int) -> None:
        rounds, _ = _interleaved_rounds(p, m)
        if m % rounds:
            lo, hi = (m // rounds) * rounds, (m // rounds + 1) * rounds
            raise ScheduleError(
                f"microbatches = {m} with stages = {p}: torch's {torch_name} needs m to be a "
                f"multiple of its number of rounds max(1, m // p) = {rounds}; use --microbatches {lo} or {hi}"
            )

    return check


def _zb_h1(p: int, m: int, v: int) -> list[list[Action]]:
    """ZB-H1 (Qi et al., Zero Bubble Pipeline Parallelism, ICLR 2024, sec 3.1, Fig. 3).

    The backward splits into I (input gradient, on the critical path) and W (weight
    gradient, deferrable). Rank r keeps 1F1B's warm-up (p−r forwards before its first I), then
    runs cycles "I, W, F"; rank r holds back r+1 of its W passes so that they fill the
    cool-down bubble at the end. With T_W <= T_F and T_W <= T_I the idle time per rank is
    (p−1)(T_F + T_I − T_W): a third of 1F1B's when the three times are equal. For m >= p its
    order equals torch's ScheduleInterleavedZeroBubble run with one stage per rank (tested);
    unlike that class it also serves an m that is not a multiple of max(1, m // p).
    """
    out = []
    for r in range(p):
        nf = p - r  # m >= p is checked
        acts = [Action(r, "F", i) for i in range(nf)]
        held = r + 1  # W passes deferred to the tail
        for k in range(m):
            acts.append(Action(r, "I", k))
            w = k - held + 1
            if 0 <= w < m - held:
                acts.append(Action(r, "W", w))
            if nf < m:
                acts.append(Action(r, "F", nf))
                nf += 1
        acts += [Action(r, "W", i) for i in range(m - held, m)]
        out.append(acts)
    return out


def _check_zb_h1(p: int, m: int, v: int) -> None:
    _need_single_stage("zb-h1", None)(p, m, v)
    if m < p:
        raise ScheduleError(
            f"microbatches = {m} < stages = {p}: zb-h1 needs m >= p (it keeps 1F1B's warm-up, and torch's "
            f"Schedule1F1B has the same rule); use --microbatches {p} or more"
        )


register_schedule(
    ScheduleSpec(
        name="gpipe",
        generate=_gpipe,
        check=_check_gpipe,
        description="GPipe: all forwards, then all backwards (holds m micro-batches).",
        torch_name="ScheduleGPipe",
    )
)
register_schedule(
    ScheduleSpec(
        name="1f1b",
        generate=_one_f_one_b,
        check=_check_1f1b,
        description="1F1B / PipeDream-Flush: same bubble as GPipe, holds at most p − rank.",
        torch_name="Schedule1F1B",
    )
)
register_schedule(
    ScheduleSpec(
        name="interleaved-1f1b",
        generate=_interleaved,
        check=_need_whole_rounds("ScheduleInterleaved1F1B"),
        description="Interleaved 1F1B: v stages per rank, bubble ratio (p−1)/(v·m).",
        torch_name="ScheduleInterleaved1F1B",
    )
)
register_schedule(
    ScheduleSpec(
        name="zb-h1",
        generate=_zb_h1,
        check=_check_zb_h1,
        split_backward=True,
        description="Zero-bubble H1: backward split into I and W; idle (p−1)(T_F+T_I−T_W).",
    )
)


def _zbv(p: int, m: int, v: int) -> list[list[Action]]:
    """ZB-V (Qi et al. 2024, sec 6), the order of torch's ScheduleZBVZeroBubble.

    Two chunks per rank in a V: rank r runs stage r on the way down and stage 2p−1−r on the
    way back. Torch plans n = max(m, 2p−1) micro-batches and drops the ones >= m. Warm-up:
    2(p−r)−1 forwards of chunk 0, then r pairs (F chunk 1, F chunk 0), then p−r triples
    (F, I, W) of chunk 1. Steady state: [F chunk 0 while any remain], I and W of chunk 0, then
    F, I, W of chunk 1, until both chunks have run n forwards. Cool-down: r pairs (I chunk 0,
    I chunk 1), p−r pairs (I, W) of chunk 0, then the W passes still owed, chunk 1 first.
    """
    n = max(m, 2 * p - 1)
    out = []
    for r in range(p):
        down, up = r, 2 * p - 1 - r
        acts: list[Action] = []
        f = [0, 0]  # forwards done per chunk
        i_ = [0, 0]  # input backwards done per chunk
        stage = (down, up)

        def add(chunk: int, kind: str, mb: int, acts=acts, stage=stage) -> None:
            acts.append(Action(stage[chunk], kind, mb))

        for _ in range(2 * (p - r) - 1):
            add(0, "F", f[0])
            f[0] += 1
        for _ in range(r):
            add(1, "F", f[1])
            f[1] += 1
            add(0, "F", f[0])
            f[0] += 1
        for _ in range(p - r):
            add(1, "F", f[1])
            f[1] += 1
            add(1, "I", i_[1])
            add(1, "W", i_[1])
            i_[1] += 1
        while f[1] < f[0] or f[0] < n:
            if f[0] < n:
                add(0, "F", f[0])
                f[0] += 1
            add(0, "I", i_[0])
            add(0, "W", i_[0])
            i_[0] += 1
            add(1, "F", f[1])
            f[1] += 1
            add(1, "I", i_[1])
            add(1, "W", i_[1])
            i_[1] += 1
        w = list(i_)  # weight passes done per chunk
        for _ in range(r):
            add(0, "I", i_[0])
            i_[0] += 1
            add(1, "I", i_[1])
            i_[1] += 1
        for _ in range(p - r):
            add(0, "I", i_[0])
            i_[0] += 1
            add(0, "W", w[0])
            w[0] += 1
        acts += [Action(up, "W", k) for k in range(w[1], i_[1])]
        acts += [Action(down, "W", k) for k in range(w[0], i_[0])]
        out.append([a for a in acts if a.microbatch < m])
    return out


def _check_zbv(p: int, m: int, v: int) -> None:
    if v != 2:
        raise ScheduleError(
            f"virtual = {v}: zbv places exactly two stages per rank in a V (torch's ScheduleZBVZeroBubble "
            "requires 2); use --virtual 2"
        )


register_schedule(
    ScheduleSpec(
        name="zbv",
        generate=_zbv,
        check=_check_zbv,
        placement="v",
        split_backward=True,
        description="Zero-bubble V: two stages per rank in a V, backward split into I and W (torch's order).",
        torch_name="ScheduleZBVZeroBubble",
    )
)


def _zb_interleaved(p: int, m: int, v: int) -> list[list[Action]]:
    """Interleaved zero bubble (ZB1P, Qi et al. 2024), the order of torch's ScheduleInterleavedZeroBubble.

    Loop placement as interleaved 1F1B, with the backward split into I and W. Rank r warms up with
    (v−1)·n_round + (p−1−r) forwards (half of interleaved 1F1B's extra depth), then runs F, I
    pairs; after its first r input backwards every I is followed by the W of the oldest input
    backward still owed; the cool-down runs the remaining I (same rule) and then the owed W. With
    v = 1 this is ZB-H1 (``zb-h1``).
    """
    _, per_round = _interleaved_rounds(p, m)
    total = m * v
    out = []
    for r in range(p):
        warm = min((v - 1) * per_round + (p - 1 - r), total)

        def fwd_stage(op: int, r: int = r) -> int:
            return ((op // per_round) % v) * p + r

        def bwd_stage(op: int, r: int = r, warm: int = warm) -> int:
            return (v - 1 - ((op - warm) // per_round) % v) * p + r

        nxt: dict[tuple[str, int], int] = {}
        acts: list[Action] = []

        def add(kind: str, stage: int, acts=acts, nxt=nxt) -> None:
            i = nxt.get((kind, stage), 0)
            nxt[(kind, stage)] = i + 1
            acts.append(Action(stage, kind, i))

        owed: list[int] = []  # stages of input backwards whose W has not run, oldest first
        for op in range(total + warm):
            if op < total:
                add("F", fwd_stage(op))
            if op >= warm:
                add("I", bwd_stage(op))
                owed.append(bwd_stage(op))
                if op - warm >= r:
                    add("W", owed.pop(0))
        for stage in owed:
            add("W", stage)
        out.append(acts)
    return out


register_schedule(
    ScheduleSpec(
        name="zb-interleaved",
        generate=_zb_interleaved,
        check=_need_whole_rounds("ScheduleInterleavedZeroBubble"),
        split_backward=True,
        description="Interleaved zero bubble (ZB1P): v stages per rank, I/W split (torch's order).",
        torch_name="ScheduleInterleavedZeroBubble",
    )
)
