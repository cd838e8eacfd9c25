"""Pipeline stages: how many layers each holds, and how many parameters one of its GPUs keeps.

Pure functions shared by the memory model (:mod:`microbatch.predict.memory`, which re-exports them) and the
planner (:mod:`microbatch.predict.plan_context`).
"""

from __future__ import annotations

from collections.abc import Sequence

from microbatch.errors import ConfigError, check_positive_int
from microbatch.model import ModelShape
from microbatch.schedules.action import stage_to_rank
from microbatch.schedules.registry import DEFAULT_SCHEDULE

__all__ = ["check_unpipelined", "rank_moe_blocks", "split_layers", "stage_params", "virtual_stage_layers"]


def check_unpipelined(
    stages: int, schedules: Sequence[str], virtuals: Sequence[int], params: tuple[str, str, str]
) -> None:
    """ConfigError for a schedule other than the one a run without stages is labelled with, or a v > 1, when there is
    no pipeline (``stages`` 1): nothing for them to shape, so a plan or a memory estimate would ignore them (or
    count micro-batches in flight that no pipeline holds). ``params``: the schedule's, v's and p's parameter names."""
    if stages != 1:
        return
    odd = [f"schedule {s}" for s in schedules if s != DEFAULT_SCHEDULE] + [
        f"virtual {v}" for v in virtuals if v > 1
    ]
    if odd:
        raise ConfigError(
            f"{' and '.join(odd)} {'needs' if len(odd) == 1 else 'need'} pipeline stages, and pipeline_parallel is 1 "
            "(no pipeline: nothing for it to shape); give pipeline_parallel > 1, or drop it",
            params=params,
        )


def split_layers(
    layers: int, stages: int, layers_per_stage: tuple[int, ...] | None = None
) -> tuple[int, ...]:
    """Layers on each stage: as given, or an even split with the remainder on the last stages.

    The first stage holds the most in-flight micro-batches (and the embedding), so extra layers go
    to the end.
    """
    check_positive_int("pipeline-parallel", stages)
    if stages > layers:
        raise ConfigError(
            f"pipeline-parallel {stages} > layers {layers}; every stage needs at least one layer; "
            f"use at most {layers} stages"
        )
    if layers_per_stage is not None:
        split = tuple(layers_per_stage)
        if (
            len(split) != stages
            or any(not isinstance(n, int) or n < 1 for n in split)
            or sum(split) != layers
        ):
            other = (  # the split names another number of stages, which fits the layers: that p was meant
                f" (it names {len(split)} stages: give pipeline_parallel {len(split)} with it)"
                if len(split) != stages
                and sum(split) == layers
                and all(isinstance(n, int) and n >= 1 for n in split)
                else ""
            )
            raise ConfigError(
                f"layers per stage {list(split)} must be {stages} whole numbers >= 1 summing to {layers}{other}; "
                f"for example {list(split_layers(layers, stages))}",
                params=("layers_per_stage", "pipeline_parallel") if other else ("layers_per_stage",),
            )
        return split
    base, extra = divmod(layers, stages)
    return tuple(base + (1 if i >= stages - extra else 0) for i in range(stages))


def stage_params(
    shape: ModelShape,
    stage: int,
    stages: int,
    stage_layers: int,
    tensor_parallel: int = 1,
    first: int = -1,
    moe_blocks: int | None = None,
) -> float:
    """Parameters one GPU of stage ``stage`` holds: its layers, plus embedding (first) and output (last).

    Megatron layout: the vocabulary-parallel embedding on the first stage, the final norm and
    output layer on the last; with tied embeddings and p > 1 the last stage keeps its own copy of
    the embedding matrix (synchronised by an all-reduce). Everything is divided by t; the few
    parameters tensor parallelism replicates (norms, row-parallel biases) are ignored. ``first`` is the
    stage's first layer (−1: an even split, stage × stage_layers): a MoE model's dense first blocks count
    as dense; ``moe_blocks``: how many of its blocks have the experts, where the placement decides
    (:func:`rank_moe_blocks`). Every expert is counted; :func:`expert_params` gives the part expert parallelism shards.
    """
    if moe_blocks is not None:
        n = shape.blocks_params(stage_layers, moe_blocks)
    else:
        n = shape.layers_params(stage * stage_layers if first < 0 else first, stage_layers)
    if stage == 0:
        n += shape.embedding_params()
    if stage == stages - 1:
        n += shape.output_params()
        if shape.tied_embeddings and stages > 1:
            n += shape.vocab * shape.hidden
    return n / tensor_parallel


def virtual_stage_layers(
    split: tuple[int, ...], virtual: int = 1, placement: str = "loop"
) -> tuple[int, ...]:
    """Layers of each virtual stage s = 0 … p·v − 1, in the model's order, for the ranks' ``split``: under the ``loop``
    placement (virtual stage s on rank s mod p) rank r's ``split[r]`` layers spread over its v chunks, chunk c (stage
    c·p + r) holding ⌊n/v⌋ and one more for the first n mod v; under DualPipeV's ``v`` placement (rank r holds stages
    r and 2p − 1 − r, v = 2) rank r's first chunk ⌊n/2⌋, its second the rest."""
    p = len(split)
    if placement == "v":
        return tuple(
            split[s] // 2 if s < p else split[2 * p - 1 - s] - split[2 * p - 1 - s] // 2 for s in range(2 * p)
        )
    return tuple(split[s % p] // virtual + (s // p < split[s % p] % virtual) for s in range(p * virtual))


def rank_moe_blocks(
    shape: ModelShape, split: tuple[int, ...], virtual: int = 1, placement: str = "loop"
) -> tuple[int, ...]:
    """Mixture-of-experts blocks each rank holds, for a model whose blocks are not all MoE blocks (its dense blocks
    cost less time and memory). The layers run in order through the p·v virtual stages; virtual stage s is on rank
    :func:`~microbatch.schedules.action.stage_to_rank` (``loop``: s mod p, Megatron's and torch's interleaving;
    ``v``: DualPipeV's zigzag, rank r holding stages r and 2p − 1 − r, v = 2). Under the loop placement rank r's
    ``split[r]`` layers are spread over its v chunks (chunk c holds ⌊n/v⌋, one more for the first n mod v), virtual
    stage c·p + r being its chunk c; one chunk a rank is consecutive blocks. Under the V placement rank r's first
    chunk holds ⌊n/2⌋ layers, its second the rest."""
    p = len(split)
    chunks = virtual_stage_layers(split, virtual, placement)
    virtual = len(chunks) // p
    counts = [0] * p
    first = 0
    for s, n in enumerate(chunks):
        counts[stage_to_rank(s, p, placement)] += shape.moe_layer_count(first, n)
        first += n
    assert first == sum(split), (split, virtual, placement)  # every layer placed once
    return tuple(counts)
