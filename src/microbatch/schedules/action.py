"""A pipeline schedule is data: per-rank lists of actions, like ``torch.distributed.pipelining``.

An :class:`Action` is ``(stage, kind, microbatch)`` printed as torch prints its ``_Action``:
``2F0`` is the forward of micro-batch 0 on stage 2. ``stage`` is the *virtual* stage index
``0 … p·v−1`` (torch's ``stage_index``; there is no chunk field); the rank that runs a stage
follows from the schedule's placement: ``loop`` (stage ``s`` on rank ``s mod p``) or ``v``
(a zigzag: stages ``0…p−1`` go down the ranks, ``p…2p−1`` come back up, as torch's
``generate_stage_to_rank_mapping(style="v")``).

Kinds: ``F`` forward, ``B`` full backward, and for zero-bubble schedules ``I`` (input
gradient, torch's ``BACKWARD_INPUT``) and ``W`` (weight gradient, ``BACKWARD_WEIGHT``).

This module holds the value only; the named schedules live in :mod:`microbatch.schedules.registry`,
their action orders in :mod:`microbatch.schedules.generators`, the dependency check in
:mod:`microbatch.schedules.validate`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from microbatch.errors import ConfigError, ScheduleError, check_positive_int, plain_numbers, whole_number

__all__ = ["KINDS", "PLACEMENTS", "Action", "Schedule", "check_placement", "stage_to_rank"]

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


def check_placement(placement: str) -> None:
    """Raise :class:`ConfigError` unless ``placement`` is one of :data:`PLACEMENTS`."""
    if placement not in PLACEMENTS:
        raise ConfigError(f"placement {placement!r} is unknown; use one of {', '.join(PLACEMENTS)}")


def _as_action(a: object) -> Action:
    """``a`` as an :class:`Action`: one already, a ``(stage, kind, microbatch)`` tuple, or its text ``"2F0"``."""
    if isinstance(a, Action):
        return a
    if isinstance(a, str):
        return Action.parse(a)
    if isinstance(a, tuple | list) and len(a) == 3:
        stage, kind, mb = a
        if kind in KINDS and (s := whole_number(stage)) is not None and (m := whole_number(mb)) is not None:
            return Action(s, kind, m)
    raise ConfigError(
        f"action {a!r} is not an Action; give Action(stage, kind, microbatch), a (stage, kind, microbatch) tuple "
        f"with kind one of {', '.join(KINDS)}, or its text, e.g. '2F0'",
        params=("actions",),
    )


def _as_actions(actions: object) -> tuple[tuple[Action, ...], ...]:
    """Per rank, the actions as :class:`Action` values (:func:`_as_action`); ``actions`` itself when they are."""
    try:
        if type(actions) is tuple and all(type(a) is Action for rank in actions for a in rank):
            return actions
        for rank in actions:  # type: ignore[attr-defined]
            if isinstance(rank, str):
                raise ConfigError(
                    f"each rank's actions must be a sequence of actions, got the string {rank!r}; give e.g. "
                    "(('0F0', '0B0'),) for one rank",
                    params=("actions",),
                )
        return tuple(tuple(_as_action(a) for a in rank) for rank in actions)  # type: ignore[attr-defined]
    except TypeError:
        raise ConfigError(
            "actions must hold one sequence of actions per rank, e.g. ((Action(0, 'F', 0), Action(0, 'B', 0)),)",
            params=("actions",),
        ) from None


@dataclass(frozen=True, kw_only=True)
class Schedule:
    """A pipeline schedule as a value: what each rank runs, in order."""

    name: str
    """Schedule name (a registered name, see :mod:`microbatch.schedules.registry`, or any label for a hand-written schedule)."""
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
    overlapped: tuple[frozenset[int], ...] = field(default=(), repr=False)
    """Per rank (or empty: none), the positions of forwards that run with the next action as one step,
    torch's ``OVERLAP_F_B`` (DualPipeV): the two run one after the other, and the forward's output is
    sent only after both (torch's ``_add_send_recv`` places the sends after the whole step)."""

    def __post_init__(self) -> None:
        plain_numbers(self, skip=("actions", "overlapped"))  # the actions: _as_actions, below
        check_positive_int("stages", self.stages, fix="a pipeline needs at least one rank")
        check_positive_int("microbatches", self.microbatches, fix="use at least one micro-batch")
        check_positive_int("virtual", self.virtual, fix="use 1 for one stage per rank")
        check_placement(self.placement)
        object.__setattr__(self, "actions", _as_actions(self.actions))
        if len(self.actions) != self.stages:
            raise ScheduleError(
                f"schedule {self.name!r} has action lists for {len(self.actions)} ranks but stages = "
                f"{self.stages}; give one list per rank"
            )
        if self.overlapped:
            if len(self.overlapped) != self.stages:
                raise ScheduleError(
                    f"schedule {self.name!r} has overlapped positions for {len(self.overlapped)} ranks but "
                    f"stages = {self.stages}; give one set per rank, or none"
                )
            for r, (acts, pos) in enumerate(zip(self.actions, self.overlapped, strict=True)):
                bad = [i for i in pos if not (0 <= i < len(acts) - 1 and acts[i].kind == "F")]
                if bad:
                    raise ScheduleError(
                        f"schedule {self.name!r} rank {r}: overlapped positions {sorted(bad)} are not forwards "
                        "followed by another action; an overlapped step is a forward and the action after it"
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

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict; actions as torch-style strings."""
        return {
            "name": self.name,
            "stages": self.stages,
            "microbatches": self.microbatches,
            "virtual": self.virtual,
            "placement": self.placement,
            "actions": [[str(a) for a in rank] for rank in self.actions],
            **({"overlapped": [sorted(pos) for pos in self.overlapped]} if self.overlapped else {}),
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
