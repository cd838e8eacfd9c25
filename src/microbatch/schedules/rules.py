"""The rules of the built-in schedules: which (p, m, v) each can serve, and what each holds in flight.

Two kinds of pure function, one per schedule, that :mod:`microbatch.schedules.registry` attaches to
the schedule's :class:`~microbatch.schedules.registry.ScheduleSpec`:

- a **servability check** ``(p, m, v) -> None`` that raises :class:`ScheduleError` naming the value,
  the rule and the fix (torch's own rule where torch has the schedule);
- an **in-flight rule** ``(i, p, m, v) -> chunks``: the most activation chunks rank ``i`` holds at
  once, where a chunk is one micro-batch's activations of one virtual stage (1/v of the rank's
  layers). A chunk is held from the end of its forward to the end of the last part of its backward
  (B, or W when the backward is split). The rules assume a (p, m, v) the schedule serves and agree
  with the event simulation (:mod:`microbatch.schedules.simulate`; tested).
"""

from __future__ import annotations

from collections.abc import Callable

from microbatch.errors import ScheduleError, check_positive_int
from microbatch.schedules.generators import interleaved_rounds

__all__ = [
    "Check",
    "EndsRule",
    "InFlightRule",
    "check_1f1b",
    "check_dualpipev",
    "check_gpipe",
    "check_zb_h1",
    "check_zbv",
    "dualpipev_ends",
    "dualpipev_in_flight",
    "gpipe_ends",
    "gpipe_in_flight",
    "interleaved_ends",
    "interleaved_in_flight",
    "interleaved_in_flight_factor",
    "need_single_stage",
    "need_whole_rounds",
    "one_f_one_b_ends",
    "one_f_one_b_in_flight",
    "zb_h1_ends",
    "zb_h1_in_flight",
    "ZB_H1_TORCH_CLASS",
]

Check = Callable[[int, int, int], None]
"""``(stages, microbatches, virtual) -> None``; raises :class:`ScheduleError` for a size it cannot serve."""
InFlightRule = Callable[[int, int, int, int], int]
"""``(rank, stages, microbatches, virtual) -> activation chunks held at the peak``."""
EndsRule = Callable[[int, int, int], tuple[int, int]]
"""``(stages, microbatches, virtual) -> (micro-batches the first virtual stage holds, micro-batches the last holds)``
at their peaks: the embedding's and the output layer's activations live on one virtual stage each, not on every
chunk of their ranks (``in_flight / v`` over-counts the last stage of interleaved 1F1B and DualPipeV up to 2p + 1×)."""


# -- servability -----------------------------------------------------------------------------


def need_single_stage(
    name: str, torch_name: str | None, *, owner: str = "", instead: str = "interleaved-1f1b"
) -> Check:
    """A check refusing v != 1: the schedule runs one stage per rank. ``owner``: why, in words (default:
    torch's class ``torch_name`` does so); ``instead``: the schedule named for several stages per rank."""

    def check(p: int, m: int, v: int) -> None:
        if v != 1:
            why = owner or (
                f"as torch's {torch_name} does" if torch_name else "it has a single stage per rank"
            )
            raise ScheduleError(
                f"virtual = {v}: {name} runs one stage per rank ({why}); "
                f"use virtual 1, or schedule {instead} for several stages per rank",
                params=("virtual", "schedule"),
            )

    return check


def check_gpipe(p: int, m: int, v: int) -> None:
    """GPipe serves any p and m, one stage per rank (torch's ScheduleGPipe)."""
    need_single_stage("gpipe", "ScheduleGPipe")(p, m, v)


def check_1f1b(p: int, m: int, v: int) -> None:
    """1F1B: one stage per rank and m >= p (torch's Schedule1F1B)."""
    need_single_stage("1f1b", "Schedule1F1B")(p, m, v)
    if m < p:
        raise ScheduleError(
            f"microbatches = {m} < stages = {p}: torch's Schedule1F1B needs m >= p; "
            f"use microbatches {p} or more, or schedule gpipe",
            params=("microbatches", "stages", "schedule"),
        )


def fills_rounds(p: int, m: int) -> bool:
    """Whether m fills torch's max(1, m // p) rounds of an interleaved schedule over p ranks."""
    return m % interleaved_rounds(p, m)[0] == 0


def whole_rounds_near(p: int, m: int) -> tuple[int, int]:
    """(the largest m' < m, the smallest m' > m) that fill their own rounds (:func:`fills_rounds`).

    The rounds move with m' (m = 23 over p = 4 is 5 rounds, 25 is 6), so the next multiple of m's own round
    count can be refused in turn (25 is not a multiple of 6): each side is searched, not computed. A multiple
    k·p is k rounds of p and fills them, so each search ends within p steps.
    """
    lo = next(k for k in range(m - 1, 0, -1) if fills_rounds(p, k))
    hi = next(k for k in range(m + 1, m + p + 1) if fills_rounds(p, k))
    return lo, hi


def need_whole_rounds(torch_name: str) -> Check:
    """torch's interleaved schedules split m into max(1, m // p) rounds and need m to fill them."""

    def check(p: int, m: int, v: int) -> None:
        rounds, _ = interleaved_rounds(p, m)
        if m % rounds:
            lo, hi = whole_rounds_near(p, m)
            raise ScheduleError(
                f"microbatches = {m} with stages = {p}: torch's {torch_name} needs m to be a "
                f"multiple of its number of rounds max(1, m // p) = {rounds}; use microbatches {lo} or {hi}",
                params=("microbatches", "stages"),
            )

    return check


ZB_H1_TORCH_CLASS = "ScheduleInterleavedZeroBubble"
"""torch has no ZB-H1 class of its own: its interleaved zero-bubble class (ZB1P) with one stage per rank
runs ZB-H1's order (the registry's ``run_as``; tested)."""


def check_zb_h1(p: int, m: int, v: int) -> None:
    """ZB-H1 as torch runs it: its :data:`ZB_H1_TORCH_CLASS` with one stage per rank, under that class's
    rule on m (a multiple of its max(1, m // p) rounds; any m < p is one round). One rule for every
    command: ``bubble`` computes what ``pipeline`` can run. torch 2.13 checked by running: p = 2, m = 1
    runs (gradients equal to the unsplit model's); m = 5 raises ValueError in the class's constructor.
    At m < p the order is torch's one round (:func:`microbatch.schedules.generators.zb_h1_order`) and
    the (p−1)(T_F+T_I−T_W) closed form does not hold (it is simulated)."""
    need_single_stage(
        "zb-h1",
        None,
        owner=f"torch runs it as its interleaved zero-bubble class {ZB_H1_TORCH_CLASS} with one stage per rank",
        instead="interleaved-1f1b or zb-interleaved (its interleaved form)",
    )(p, m, v)
    need_whole_rounds(ZB_H1_TORCH_CLASS)(p, m, v)


def check_zbv(p: int, m: int, v: int) -> None:
    """ZB-V: exactly two stages per rank (torch's ScheduleZBVZeroBubble)."""
    if v != 2:
        raise ScheduleError(
            f"virtual = {v}: zbv places exactly two stages per rank in a V (torch's ScheduleZBVZeroBubble "
            "requires 2); use virtual 2",
            params=("virtual",),
        )


def check_dualpipev(p: int, m: int, v: int) -> None:
    """DualPipeV: exactly two stages per rank in a V and m >= 2p, the number of stages (torch's
    ScheduleDualPipeV raises for either)."""
    if v != 2:
        raise ScheduleError(
            f"virtual = {v}: dualpipev places exactly two stages per rank in a V (torch's ScheduleDualPipeV "
            "requires 2); use virtual 2",
            params=("virtual",),
        )
    if m < 2 * p:
        raise ScheduleError(
            f"microbatches = {m} < 2·stages = {2 * p}: torch's ScheduleDualPipeV needs at least as many "
            f"micro-batches as stages (2 per rank); use microbatches {2 * p} or more, or schedule zbv where it is offered "
            "(bubble and simulate run it; memory and plan price no zbv)",
            params=("microbatches", "schedule"),  # not stages: "2·stages" and "as stages" are p, not the flag
        )


# -- in flight -------------------------------------------------------------------------------


def gpipe_in_flight(i: int, p: int, m: int, v: int) -> int:
    """GPipe holds every micro-batch: m (Huang et al. 2019; seed 002)."""
    return m


def one_f_one_b_in_flight(i: int, p: int, m: int, v: int) -> int:
    """1F1B: min(m, p − i) on rank i (Narayanan et al. 2021; Korthikanti et al. 2022 sec 4.2.3;
    Megatron-core's warm-up of p − i − 1 forwards plus the one in steady state)."""
    return min(m, p - i)


def zb_h1_in_flight(i: int, p: int, m: int, v: int) -> int:
    """ZB-H1: min(m, p) on every rank. Rank i defers i + 1 weight-gradient passes, each holding its
    micro-batch's activations, on top of 1F1B's p − i (Qi et al. 2024, Table 2: peak p·M_B)."""
    return min(m, p)


def dualpipev_in_flight(i: int, p: int, m: int, v: int) -> int:
    """DualPipeV: 2p + 1 chunks (half a rank's layers each) on every rank, for every m >= 2p it serves.

    Counted on the generated order (tested against the event simulation for p <= 6): the warm-up
    holds 2(p−i−1) + 2(i+1) = 2p chunks before the first backward, and one more forward runs before
    each backward in steady state. The DeepSeek-V3 report (2024, Table 2; deepseek-ai/DualPipe) gives
    DualPipe's activation memory as PP + 1 micro-batches of a stage.
    """
    return min(2 * m, 2 * p + 1)


def interleaved_in_flight(i: int, p: int, m: int, v: int) -> int:
    """Interleaved 1F1B: warm-up forwards plus the one in steady state, in chunks of L/v layers.

    torch's ScheduleInterleaved1F1B (and Megatron-core) warm up with (v − 1)·n + 2(p − 1 − i)
    forwards, n = m // max(1, m // p) micro-batches per round (n = p when p divides m), capped at
    m·v chunks; on rank 0 this is p·v·(1 + (p−1)/(p·v)) chunks (Korthikanti et al. 2022 sec 4.2.3,
    see :func:`interleaved_in_flight_factor`). With v = 1 torch's order still warms up 2(p − 1 − i) forwards
    (:func:`~microbatch.schedules.generators.interleaved_order`): 2(p − 1 − i) + 1, not 1F1B's p − i, though its
    bubble is 1F1B's.
    """
    _, per_round = interleaved_rounds(p, m)
    return min(m * v, (v - 1) * per_round + 2 * (p - 1 - i) + 1)


def interleaved_in_flight_factor(stages: int, virtual: int) -> float:
    """First-rank activation factor of interleaved 1F1B: 1 + (p−1)/(p·v) (v = 1 gives 2 − 1/p: torch's order warms
    up 2(p − 1) forwards at one stage per rank, :func:`interleaved_in_flight`).

    Korthikanti et al. 2022, sec 4.2.3: the first stage holds p micro-batches of its layers
    times this factor, i.e. p + (p−1)/v micro-batches of a rank's layers (when p divides m).
    """
    check_positive_int("stages", stages)
    check_positive_int("virtual", virtual)
    return 1 + (stages - 1) / (stages * virtual)


# -- the end stages: the embedding's and the output layer's micro-batches ---------------------


def gpipe_ends(p: int, m: int, v: int) -> tuple[int, int]:
    """GPipe: every micro-batch on the first and on the last stage, (m, m)."""
    return m, m


def one_f_one_b_ends(p: int, m: int, v: int) -> tuple[int, int]:
    """1F1B: rank 0's warm-up, min(m, p), on the first stage; one on the last, whose backward follows its forward."""
    return min(m, p), 1


def zb_h1_ends(p: int, m: int, v: int) -> tuple[int, int]:
    """ZB-H1: min(m, p) on both: the last rank runs each I right after its F but defers its W, which reads the
    output layer's input gradient (the logits' gradient), held until then (counted as the logits)."""
    return min(m, p), min(m, p)


def dualpipev_ends(p: int, m: int, v: int) -> tuple[int, int]:
    """DualPipeV: min(m, 2p) on stage 0 (rank 0 warms up 2p forwards on it), one on stage 2p − 1 (the same rank runs
    its I right after its F; counted on the generated order, tested)."""
    return min(m, 2 * p), 1


def interleaved_ends(p: int, m: int, v: int) -> tuple[int, int]:
    """Interleaved 1F1B (torch's order, n micro-batches a round): stage 0's forwards run before rank 0's first stage-0
    backward, which comes after its w = :func:`interleaved_in_flight` (0) warm-up chunks and the (v − 1)·n backwards
    of its later stages (each after one more forward): of those K = w + (v − 1)·n forwards, stage 0 runs n of each
    v·n, min(m, ⌊K/(v·n)⌋·n + min(n, K mod v·n)). One on the last stage, whose backward follows its forward.
    Counted on the generated order for p ≤ 8, m < 50, v ≤ 4 (tested)."""
    _, n = interleaved_rounds(p, m)
    k = min(m * v, interleaved_in_flight(0, p, m, v) + (v - 1) * n)
    full, rest = divmod(k, v * n)
    return min(m, full * n + min(n, rest)), 1
