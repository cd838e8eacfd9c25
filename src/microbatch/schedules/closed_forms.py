"""The closed forms of the pipeline bubble, each with its source and the conditions under which it holds.

- :func:`bubble_fraction` — idle share of total stage time, (p−1)/(v·m + p−1);
- :func:`bubble_ratio` — bubble time over ideal time (Megatron's number), (p−1)/(v·m);
- :func:`zb_idle_time` — idle time per stage of 1F1B / ZB-H1 / ZB-H2 (Qi et al. 2024, Table 2);
- :func:`dualpipev_idle_time` — idle time per rank of DualPipeV as torch runs it (DeepSeek-V3 report,
  sec 3.2.1, Table 2, and its V variant; exact under :func:`dualpipev_closed_form_holds`).

Each is tested against the event simulation (:func:`microbatch.schedules.simulate.simulate`), which
re-exports them.
"""

from __future__ import annotations

import math

from microbatch.errors import ConfigError, check_positive_int

__all__ = [
    "DUALPIPEV_CLOSED_FORM_RULE",
    "ZB_IDLE_SCHEDULES",
    "bubble_fraction",
    "bubble_ratio",
    "dualpipev_closed_form_holds",
    "dualpipev_idle_time",
    "non_negative_time",
    "zb_idle_time",
]


def non_negative_time(name: str, value: float) -> float:
    """``value`` as a float; :class:`ConfigError` naming ``name`` unless it is a finite number >= 0."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(v) or v < 0:
        raise ConfigError(
            f"{name} = {value!r}: a time must be a finite number >= 0; give a measured or estimated duration"
        )
    return v


def bubble_fraction(stages: int, microbatches: int, virtual: int = 1) -> float:
    """Idle share of the total stage time: (p−1) / (v·m + p−1).

    GPipe and 1F1B (v = 1): (p−1)/(m+p−1) (Huang et al. 2019, GPipe, sec 2.3; seed 002).
    Interleaved 1F1B with v stages per rank: the bubble shrinks by v (Narayanan et al. 2021,
    sec 2.2.2), so the idle share is (p−1)/(v·m+p−1). Assumes equal stage times, the backward
    a fixed multiple of the forward, and no communication time.
    """
    check_positive_int("stages", stages)
    check_positive_int("microbatches", microbatches)
    check_positive_int("virtual", virtual)
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
        return (stages - 1) * (tf + tb - tw)
    if key == "zb-h2":
        return max(0.0, (stages - 1) * (tf + tb - 2 * tw))
    raise ConfigError(
        f"schedule {schedule!r} has no zero-bubble closed form; use one of {', '.join(ZB_IDLE_SCHEDULES)}"
    )


DUALPIPEV_CLOSED_FORM_RULE = "T_W <= T_I"
"""When :func:`dualpipev_idle_time` is exact (per-chunk times; equal chunks, no communication)."""


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
