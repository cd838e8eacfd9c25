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
"""At most this many one-layer moves: bounds the search on deep models."""

REBALANCE_ACTIONS = 200_000
"""The schedule actions the whole search may simulate (each narrowed plan simulates its candidate once): a plan of
many micro-batches (gpt2-xl at p 12, B 12,288: 24,576 actions, ~40 ms a narrowed plan) stops after 8 of them."""


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


def _moves(split: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Splits one layer away from ``split``: off the last stage (the output layer's) or the first (the embedding's),
    onto a middle stage holding the fewest layers (the ends carry the extra work; with two stages, the other end)."""
    p = len(split)
    middle = list(range(1, p - 1)) or [0, p - 1]
    out = []
    for end in (p - 1, 0):
        if split[end] <= 1:
            continue
        rest = [i for i in middle if i != end]
        fewest = min(split[i] for i in rest)
        for to in (i for i in rest if split[i] == fewest):
            moved = list(split)
            moved[end] -= 1
            moved[to] += 1
            out.append(tuple(moved))
            break  # one target per end: the middle stages with the fewest layers are alike
    return out


def balanced_split(cfg: PlanConfig, c: Candidate) -> Rebalance | None:
    """A split of the layers over the stages that runs ``c``'s settings (b_m, schedule, v, recompute, ZeRO) in less
    simulated time and still fits, or None: no pipeline, ``c`` not simulated, its idle within
    :data:`IMBALANCE_WORTH` of its closed-form bubble, no move helps, or the search's actions
    (:data:`REBALANCE_ACTIONS`) run out before one does."""
    from microbatch.schedules.limits import count_actions

    p = cfg.pipeline_parallel
    idle = c.time.get("simulated_idle")
    if p < 2 or not c.simulated or idle is None or idle - c.bubble_fraction < IMBALANCE_WORTH:
        return None
    try:
        narrow = replace(
            cfg, micro_batches=(c.micro_batch,), schedules=(c.schedule,), recompute=(c.recompute,), zero=(c.zero,),
            virtuals=(c.virtual,) if c.virtual > 1 else None, choose="fastest",
        )  # fmt: skip
    except ConfigError:  # a setting the narrowed plan would read otherwise: no search
        return None
    cost = count_actions(c.schedule, p, c.microbatches, c.virtual)
    budget = REBALANCE_ACTIONS
    best, best_split = c, split_layers(cfg.shape.layers, p, cfg.layers_per_stage)
    for _ in range(MAX_MOVES):
        tried = []
        for moved in _moves(best_split):
            if budget < cost:
                break
            budget -= cost
            got = _planned(narrow, moved)
            if got is not None and got.fits and got.step_time_s < best.step_time_s:
                tried.append((got.step_time_s, moved, got))
        if not tried:
            break
        _, best_split, best = min(tried, key=lambda t: t[0])
    return None if best is c else Rebalance(layers_per_stage=best_split, candidate=best, was=c)
