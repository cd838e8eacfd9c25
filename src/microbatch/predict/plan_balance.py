"""An uneven layer split that evens out a pipeline's stages: the first stage also holds the embedding and the last
the output layer and the loss (a 128K vocabulary's output GEMM is two or three Llama-3-8B layers), so an even split
leaves the other stages waiting on them — idle the schedule's closed form does not count and the simulator does
(``Candidate.time["simulated_idle"]``). Megatron-core (``decoder_first_pipeline_num_layers`` /
``decoder_last_pipeline_num_layers``) and torchtitan (``pipeline_parallel_layers_per_stage`` with the embedding and
output as layers) give such splits; :func:`balanced_split` finds one by the simulator itself: one layer at a time off
the slower end stage onto the stage with the fewest, each move kept only if the simulated step falls and the peak
still fits — the planner's own figures, nothing fitted."""

from __future__ import annotations

from dataclasses import dataclass, replace

from microbatch.errors import ConfigError
from microbatch.predict.candidate import Candidate
from microbatch.predict.plan_config import PlanConfig
from microbatch.predict.stages import split_layers

__all__ = ["IMBALANCE_WORTH", "Rebalance", "balanced_split"]

IMBALANCE_WORTH = 0.03
"""The least simulated idle beyond the closed form's bubble (a share of the step) worth a search: 3%, above the
simulator's own one-action granularity on a plan's stages."""

MAX_MOVES = 16
"""At most this many one-layer moves (each one narrowed plan, ~10 ms): bounds the search on deep models."""


@dataclass(frozen=True)
class Rebalance:
    """A split that runs the candidate's settings faster: its layers per stage and the candidate it gives."""

    layers_per_stage: tuple[int, ...]
    candidate: Candidate
    was: Candidate


def _planned(cfg: PlanConfig, split: tuple[int, ...]) -> Candidate | None:
    """The narrowed plan's candidate at ``split`` (simulated: an uneven split simulates every candidate), or None where
    no schedule serves it (an interleaved v over a stage with fewer layers)."""
    from microbatch.predict.plan import make_plan

    try:
        plan = make_plan(replace(cfg, layers_per_stage=split), advise=False)
    except ConfigError:
        return None
    return min(plan.candidates, key=lambda c: c.step_time_s) if plan.candidates else None


def balanced_split(cfg: PlanConfig, c: Candidate) -> Rebalance | None:
    """A split of the layers over the stages that runs ``c``'s settings (b_m, schedule, v, recompute, ZeRO) in less
    simulated time and still fits, or None: no pipeline, ``c`` not simulated, its idle within
    :data:`IMBALANCE_WORTH` of its closed-form bubble, or no move helps."""
    p = cfg.pipeline_parallel
    idle = c.time.get("simulated_idle")
    if p < 2 or not c.simulated or idle is None or idle - c.bubble_fraction < IMBALANCE_WORTH:
        return None
    narrow = replace(
        cfg, micro_batches=(c.micro_batch,), schedules=(c.schedule,), virtuals=(c.virtual,),
        recompute=(c.recompute,), zero=(c.zero,), choose="fastest",
    )  # fmt: skip
    split = split_layers(cfg.shape.layers, p, cfg.layers_per_stage)
    best, best_split = c, split
    for _ in range(MAX_MOVES):
        tried = []
        for end in (p - 1, 0):  # the output's stage first: the larger extra
            rest = [i for i in range(p) if i != end]
            to = min(rest, key=lambda i: (best_split[i], abs(i - end) < 1))
            if best_split[end] <= 1:
                continue
            moved = list(best_split)
            moved[end] -= 1
            moved[to] += 1
            got = _planned(narrow, tuple(moved))
            if got is not None and got.fits and got.step_time_s < best.step_time_s:
                tried.append((got.step_time_s, tuple(moved), got))
        if not tried:
            break
        _, best_split, best = min(tried, key=lambda t: t[0])
    return None if best is c else Rebalance(layers_per_stage=best_split, candidate=best, was=c)
