"""The closed forms of the pipeline bubble, each with its source and the conditions under which it holds.

- :func:`bubble_fraction` — idle share of total stage time, (p−1)/(v·m + p−1) (interleaved: m ≥ p);
- :func:`bubble_ratio` — bubble time over ideal time (Megatron's number), (p−1)/(v·m) (the same);
- :func:`fill_drain_bubble` — both at every m: interleaving's one round at m < p, (p·v+m−1−v·m)/(p·v+m−1);
- :func:`zb_idle_time` — idle time per stage of 1F1B / ZB-H1 / ZB-H2 (Qi et al. 2024, Table 2);
- :func:`dualpipev_idle_time` — idle time per rank of DualPipeV as torch runs it (DeepSeek-V3 report,
  sec 3.2.1, Table 2, and its V variant; exact under :func:`dualpipev_closed_form_holds`).

Each is tested against the event simulation (:func:`microbatch.schedules.simulate.simulate`), which
re-exports the first two.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from microbatch.errors import ConfigError, check_positive_int

__all__ = [
    "DUALPIPEV_CLOSED_FORM_RULE",
    "DUALPIPEV_IDLE",
    "IdleClosedForm",
    "PipelineTime",
    "StageTimesLike",
    "ZB_H1_IDLE",
    "ZB_IDLE_SCHEDULES",
    "bubble_fraction",
    "bubble_ratio",
    "dualpipev_closed_form_holds",
    "dualpipev_idle_time",
    "dualpipev_step_time",
    "fill_drain_bubble",
    "fill_drain_step_time",
    "non_negative_time",
    "zb_h1_step_time",
    "zb_idle_time",
]


def non_negative_time(name: str, value: object) -> float:
    """``value`` as a float; :class:`ConfigError` naming ``name`` unless it is a finite number >= 0."""
    try:
        if isinstance(value, bool | str | bytes):  # True is no duration, "1.0" a string of one: say so
            raise TypeError
        v = float(value)  # type: ignore[arg-type]  # a number, or a TypeError below
    except (TypeError, ValueError):
        raise ConfigError(
            f"{name} must be a number, got {value!r}; give a duration in seconds, e.g. 1.5",
            params=(name,) if name.isidentifier() else (),
        ) from None
    if not math.isfinite(v) or v < 0:
        raise ConfigError(
            f"{name} = {value!r}: a time must be a finite number >= 0; give a measured or estimated duration"
        )
    return v


def bubble_fraction(stages: int, microbatches: int, virtual: int = 1) -> float:
    """Idle share of the total stage time: (p−1) / (v·m + p−1).

    GPipe and 1F1B (v = 1): (p−1)/(m+p−1) (Huang et al. 2019, GPipe, sec 2.3; seed 002).
    Interleaved 1F1B with v stages per rank: the bubble shrinks by v (Narayanan et al. 2021,
    sec 2.2.2), so the idle share is (p−1)/(v·m+p−1), for m >= p (below it torch's order runs one
    round: :func:`fill_drain_bubble`). Assumes equal stage times, the backward a fixed multiple of the
    forward, and no communication time.
    """
    check_positive_int("stages", stages)
    check_positive_int("microbatches", microbatches)
    check_positive_int("virtual", virtual)
    return _fraction(stages, microbatches, virtual)


def _fraction(stages: int, microbatches: int, virtual: int = 1) -> float:
    """:func:`bubble_fraction` of a checked (p, m, v): the planner's screen calls it per candidate."""
    return (stages - 1) / (virtual * microbatches + stages - 1)


def bubble_ratio(stages: int, microbatches: int, virtual: int = 1) -> float:
    """Bubble time over ideal (busy) time: (p−1) / (v·m) — the number Megatron quotes.

    Narayanan et al. 2021 (Megatron-LM PTD-P), sec 2.2.1 ((p−1)/m) and 2.2.2 ((p−1)/(v·m)).
    Same assumptions as :func:`bubble_fraction`; fraction = ratio / (1 + ratio).
    """
    check_positive_int("stages", stages)
    check_positive_int("microbatches", microbatches)
    check_positive_int("virtual", virtual)
    return (stages - 1) / (virtual * microbatches)


def fill_drain_bubble(stages: int, microbatches: int, virtual: int = 1) -> tuple[float, float]:
    """(fraction, ratio) of a fill-drain schedule's bubble at every m, in chunk times T_k/v.

    One flush lasts max(m, p)·v + min(m, p) − 1 chunk times, of which m·v are work: at m >= p this is
    :func:`bubble_fraction` and :func:`bubble_ratio` ((p−1) idle chunk times, Huang et al. 2019;
    Narayanan et al. 2021 sec 2.2.2); with v > 1 and m < p (torch's interleaved order runs one round)
    the last micro-batch leaves one pass through the p·v chunks after its start, m − 1 chunk times behind
    the first, so p·v + m − 1 (:func:`fill_drain_step_time`; equal to the event simulator,
    tests/schedules/test_closed_forms.py). At v = 1 both cases are (p−1)/(m+p−1).
    """
    check_positive_int("stages", stages)
    check_positive_int("microbatches", microbatches)
    check_positive_int("virtual", virtual)
    total = max(microbatches, stages) * virtual + min(microbatches, stages) - 1
    busy = microbatches * virtual
    return (total - busy) / total, (total - busy) / busy


ZB_IDLE_SCHEDULES = ("1f1b", "zb-h1", "zb-h2")


def zb_idle_time(
    schedule: str, stages: int, forward_time: float, input_time: float, weight_time: float
) -> float:
    """Idle time per stage, Qi et al., Zero Bubble Pipeline Parallelism (ICLR 2024), Table 2.

    1F1B: (p−1)(T_F + T_B + T_W); ZB-H1: (p−1)(T_F + T_B − T_W); ZB-H2: (p−1)(T_F + T_B − 2T_W),
    where T_B is the input-gradient time and T_W the weight-gradient time (a full backward is
    T_B + T_W). With equal times ZB-H1 idles a third of 1F1B's. The paper assumes m >= p, equal
    stages, no communication time and T_W no larger than T_F or T_B (our ZB-H1 order matches the
    H1 line only then); the H2 value is floored at 0.
    """
    check_positive_int("stages", stages)
    tf = non_negative_time("forward_time", forward_time)
    tb = non_negative_time("input_time", input_time)
    tw = non_negative_time("weight_time", weight_time)
    key = str(schedule).lower()
    if key == "1f1b":
        return (stages - 1) * (tf + tb + tw)
    if key == "zb-h1":
        return _zb_h1(stages, tf, tb, tw)
    if key == "zb-h2":
        return max(0.0, (stages - 1) * (tf + tb - 2 * tw))
    raise ConfigError(
        f"schedule {schedule!r} has no zero-bubble closed form; use one of {', '.join(ZB_IDLE_SCHEDULES)}"
    )


def _zb_h1(stages: int, forward_time: float, input_time: float, weight_time: float) -> float:
    """ZB-H1's line of :func:`zb_idle_time`, (p−1)(T_F + T_B − T_W), for checked times."""
    return (stages - 1) * (forward_time + input_time - weight_time)


DUALPIPEV_CLOSED_FORM_RULE = "T_W <= T_I"
"""When :func:`dualpipev_idle_time` is exact (per-chunk times; equal chunks, no communication)."""


ZB_H1_CLOSED_FORM_RULE = "T_W <= T_F and T_W <= T_I"
"""When :func:`zb_idle_time`'s ZB-H1 line is exact (Qi et al. 2024, Table 2's condition)."""


def zb_h1_closed_form_holds(forward_time: float, input_time: float, weight_time: float) -> bool:
    """True where ZB-H1's (p−1)(T_F + T_I − T_W) is its idle time: T_W no longer than T_F or T_I (Qi et al. 2024,
    Table 2). Outside it the line falls (it goes negative at T_W > T_F + T_I) where the schedule still waits; the
    commands simulate instead."""
    return weight_time <= forward_time and weight_time <= input_time


def dualpipev_closed_form_holds(forward_time: float, input_time: float, weight_time: float) -> bool:
    """True when :func:`dualpipev_idle_time` equals the event simulation of torch's DualPipeV: T_W <= T_I
    (the weight gradient no longer than the input gradient; any T_F). Outside, the closed form is a
    lower bound. ``forward_time`` is taken for symmetry with the closed form and does not matter."""
    return weight_time <= input_time


def dualpipev_idle_time(stages: int, forward_time: float, input_time: float, weight_time: float) -> float:
    """Idle time per rank of DualPipeV as torch runs it (ScheduleDualPipeV), per-chunk times.

    idle = max((p−1)(2·T_F + T_I − T_W), (p−1)(T_F + 2·T_I − T_W) − T_F), the same on every rank and for
    every m >= 2p; T_F, T_I, T_W are one chunk's (half a rank's layers) forward, input-gradient and
    weight-gradient times, a full backward T_B = T_I + T_W. With T_I <= T_F the first term is the max.
    Equal times give 2(p−1)·T_F, a third of 1F1B's idle on the same layers per rank
    ((p−1)(2·T_F + 2·T_B), its stage being two chunks).

    Source: the DeepSeek-V3 technical report (arXiv 2412.19437, sec 3.2.1, Table 2) gives DualPipe's
    bubble as (PP/2 − 1)(T_F&B + T_B − 3·T_W), and deepseek-ai/DualPipe's README the same for its
    "cut-in-half" V variant DualPipeV with PP = 2p stages on p ranks: (p−1)(T_F&B + T_B − 3·T_W), T_F&B
    being a forward and a backward chunk run as one overlapped step. torch runs that step's two parts one
    after the other and sends the forward's output after both (``_add_send_recv`` puts the sends after
    the whole ``OVERLAP_F_B``), so with T_F&B = T_F + T_B the report's form is (p−1)(T_F + 2·T_I − T_W):
    ours when T_F = T_I, and (p−1)(T_F − T_I) less than ours otherwise (while T_I <= T_F). The max's
    second term (input gradients slower than forwards: the backward chain sets the cool-down) was
    derived from the event simulation, not from the report. Were the forward's output sent at once, the
    idle would be (p−1)·T_F less on every rank (checked while deriving this).

    Exact — equal to :func:`microbatch.schedules.simulate.simulate` on equal chunks with no
    communication — when :func:`dualpipev_closed_form_holds` (T_W <= T_I; tested over a grid of times,
    p and m: exact on all 288 triples with T_W <= T_I of 8 values each, on none of the 224 others, never
    above the simulation); otherwise a lower bound. The step's compute is 2m(T_F + T_I + T_W) per rank
    on top.
    """
    check_positive_int("stages", stages)
    tf = non_negative_time("forward_time", forward_time)
    ti = non_negative_time("input_time", input_time)
    tw = non_negative_time("weight_time", weight_time)
    n = stages - 1
    return max(0.0, n * (2 * tf + ti - tw), n * (tf + 2 * ti - tw) - tf)


# -- the closed forms as the registry attaches them to a schedule -------------------------------------


@dataclass(frozen=True, kw_only=True)
class IdleClosedForm:
    """The closed form of the idle time per stage of a schedule that splits the backward into I and W,
    as :attr:`microbatch.schedules.registry.ScheduleSpec.idle_closed_form` attaches it."""

    idle_time: Callable[[int, float, float, float], float]
    """``(stages, T_F, T_I, T_W) -> idle seconds per stage``."""
    exact_when: Callable[[float, float, float], bool] | None = None
    """``(T_F, T_I, T_W) -> True`` where the closed form equals the event simulation (a lower bound
    elsewhere); None: taken as exact under the source's own assumptions."""
    rule: str = ""
    """The condition of :attr:`exact_when`, for messages (``T_W <= T_I``)."""
    label: str = ""
    """The schedule as the source names it, for messages (``DualPipeV``)."""
    method: str = ""
    """The formula and its source, as ``bubble --json`` reports its ``method``."""
    valid_when: str = ""
    """When it holds, with the source, as ``simulate --json`` reports its ``valid_when``."""
    source: str = ""
    """The source, short (``Qi et al. 2024, Table 2``)."""
    microbatches_per_rank: int = 1
    """The closed form holds from m >= this × p micro-batches (the source's assumption: ZB-H1 m >= p)."""

    def holds(self, forward_time: float, input_time: float, weight_time: float) -> bool:
        """True where the closed form is exact for these times (:attr:`exact_when`)."""
        return self.exact_when is None or self.exact_when(forward_time, input_time, weight_time)

    def holds_at(self, stages: int, microbatches: int) -> bool:
        """True where the closed form describes (p, m): m >= :attr:`microbatches_per_rank` × p."""
        return microbatches >= self.microbatches_per_rank * stages


def _zb_h1_idle(stages: int, forward_time: float, input_time: float, weight_time: float) -> float:
    return zb_idle_time("zb-h1", stages, forward_time, input_time, weight_time)


ZB_H1_IDLE = IdleClosedForm(
    idle_time=_zb_h1_idle,
    exact_when=zb_h1_closed_form_holds,
    rule=ZB_H1_CLOSED_FORM_RULE,
    method="closed form: Qi et al. 2024 (Zero Bubble PP), Table 2",
    valid_when="m >= p, T_W <= T_F and T_W <= T_I (Qi et al. 2024, Table 2)",
    source="Qi et al. 2024, Table 2",
    label="ZB-H1",
)
"""ZB-H1's idle (p−1)(T_F + T_I − T_W) (:func:`zb_idle_time`)."""

DUALPIPEV_IDLE = IdleClosedForm(
    idle_time=dualpipev_idle_time,
    exact_when=dualpipev_closed_form_holds,
    rule=DUALPIPEV_CLOSED_FORM_RULE,
    label="DualPipeV",
    method=(
        "closed form: max((p−1)(2T_F+T_I−T_W), (p−1)(T_F+2T_I−T_W)−T_F) per chunk, DualPipeV as torch runs it "
        "(DeepSeek-V3 report, arXiv 2412.19437, sec 3.2.1, Table 2: (PP/2−1)(T_F&B+T_B−3T_W))"
    ),
    valid_when=(
        f"{DUALPIPEV_CLOSED_FORM_RULE} (exact), a lower bound otherwise (DeepSeek-V3 report, sec 3.2.1, "
        "as torch runs it)"
    ),
    source="DeepSeek-V3 report, sec 3.2.1",
    microbatches_per_rank=2,
)
"""DualPipeV's idle per rank as torch runs it (:func:`dualpipev_idle_time`)."""


class StageTimesLike(Protocol):
    """Seconds per micro-batch by stage that a step-time closed form reads (the planner's
    ``StageTimes``): per (virtual) stage lists and the bottleneck stage's sums."""

    @property
    def f(self) -> Sequence[float]:
        """Forward per stage (per virtual stage for a V placement)."""

    @property
    def i(self) -> Sequence[float]:
        """Input gradient per stage (idem)."""

    @property
    def w(self) -> Sequence[float]:
        """Weight gradient per stage (idem)."""

    @property
    def k(self) -> int:
        """The bottleneck rank."""

    @property
    def Tk(self) -> float:  # noqa: N802 - the planner's name
        """The bottleneck rank's F + I + W."""

    @property
    def sumT(self) -> float:  # noqa: N802 - the planner's name
        """Σ F + I + W over the ranks."""

    @property
    def fk(self) -> float:
        """The bottleneck rank's F."""

    @property
    def ik(self) -> float:
        """Its I."""

    @property
    def wk(self) -> float:
        """Its W."""


PipelineTime = Callable[[int, int, int, StageTimesLike], tuple[float, float]]
"""``(stages p > 1, microbatches m, virtual v, stage times) -> (seconds of compute + bubble of one
flush, bubble fraction)``: a schedule's step-time closed form, as the planner screens with it."""


def fill_drain_step_time(
    stages: int, microbatches: int, virtual: int, times: StageTimesLike
) -> tuple[float, float]:
    """GPipe, 1F1B, interleaved 1F1B: (m−1)·T_k + Σ T (the bottleneck's m micro-batches plus one pass
    through the others); with v > 1 chunks per rank m·T_k + (p−1)·T_k/v (Narayanan et al. 2021, sec
    2.2.2) when m >= p. The fraction is :func:`bubble_fraction` (equal stages).

    With fewer micro-batches than ranks (m < p, which torch's interleaved schedules run as one round) the
    p·v chunks cannot all be busy: the last micro-batch leaves after one pass through all p·v chunks,
    m − 1 chunk times behind the first, so (p·v + m − 1)·T_k/v, of which m·T_k is work. Both cases are
    (max(m, p)·v + min(m, p) − 1)·T_k/v; the event simulator gives exactly this at equal stages
    (tests/schedules/test_closed_forms.py)."""
    Tk = times.Tk
    if virtual > 1:
        if microbatches < stages:
            total = (stages * virtual + microbatches - 1) * Tk / virtual
            return total, fill_drain_bubble(stages, microbatches, virtual)[0]
        return microbatches * Tk + (stages - 1) * Tk / virtual, _fraction(stages, microbatches, virtual)
    return (microbatches - 1) * Tk + times.sumT, _fraction(stages, microbatches)


def zb_h1_step_time(
    stages: int, microbatches: int, virtual: int, times: StageTimesLike
) -> tuple[float, float]:
    """ZB-H1: m·T_k plus the idle (p−1)·max(0, T_F + T_I − T_W) of the bottleneck rank
    (:func:`zb_idle_time`, floored at 0), for m >= p (Table 2's assumption; at m < p the registry
    simulates: :func:`microbatch.schedules.simulate.zb_h1_flush_time`)."""
    idle = max(0.0, _zb_h1(stages, times.fk, times.ik, times.wk))
    total = microbatches * times.Tk + idle
    return total, idle / total


def dualpipev_step_time(
    stages: int, microbatches: int, virtual: int, times: StageTimesLike
) -> tuple[float, float]:
    """DualPipeV: m·T_k plus :func:`dualpipev_idle_time` on the per-chunk times of the bottleneck rank k's first
    chunk, virtual stage k (layers only; the head is on stage 2p − 1): every chunk's where the chunks are equal, and
    the slowest rank's where a MoE model's dense blocks make some chunks lighter."""
    k = times.k
    idle = dualpipev_idle_time(stages, times.f[k], times.i[k], times.w[k])
    total = microbatches * times.Tk + idle
    return total, idle / total
