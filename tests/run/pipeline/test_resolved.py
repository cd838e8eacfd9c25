"""The resolved run's stage split: known before the model is built, and the split the ranks make."""

from __future__ import annotations

import pytest

from microbatch.errors import ConfigError
from microbatch.model import PRESETS, get_model
from microbatch.run.pipeline.config import PipelineConfig
from microbatch.run.pipeline.rank import build_full_model, params_split
from microbatch.run.pipeline.resolved import resolve
from microbatch.run.pipeline.split import balanced_split, model_units, shape_unit_params, unit_param_counts


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_the_unit_parameters_of_a_shape_are_those_of_the_model_built_from_it(name):
    """Every preset (tied and separate heads, LayerNorm and RMSNorm, biases, grouped-query
    attention, learned and rotary positions, experts and latent attention, which the built-in GPT
    builds dense): the formula counts each unit's parameters exactly as the built model has them."""
    from microbatch.measure.gpt import build_model

    shape = get_model(name)
    built = unit_param_counts(model_units(build_model(shape, device="meta")))
    assert shape_unit_params(shape) == built


@pytest.mark.parametrize(
    ("model", "stages", "virtual", "schedule"),
    [("tiny", 2, 1, "1f1b"), ("small", 2, 1, "gpipe"), ("small", 4, 1, "1f1b"), ("small", 2, 2, "interleaved-1f1b"),
     ("small", 3, 2, "zbv"), ("small", 2, 1, "zb-h1")],
)  # fmt: skip
def test_the_resolved_split_is_the_split_of_the_built_model(model, stages, virtual, schedule):
    """The split held in the resolved run, made from the shape alone, equals the split by parameter
    count of the model each rank builds, and is what the ranks use."""
    cfg = PipelineConfig(model=model, stages=stages, virtual=virtual, schedule=schedule, microbatches=6)
    run = resolve(cfg)
    full, _, _ = build_full_model(run)
    units = model_units(full)
    assert run.split is not None and len(run.split) == stages * virtual and sum(run.split) == len(units)
    assert list(run.split) == balanced_split(unit_param_counts(units), stages * virtual)
    assert params_split(run, units) == list(run.split)


def test_no_split_is_resolved_where_it_needs_the_built_model_or_a_timing():
    """A factory's layers are known only once it is built; a split by time only once rank 0 has timed
    them; a built-in model shallower than p·v stages is refused by the config itself, before the rule on m."""
    assert (
        resolve(PipelineConfig(model="microbatch.run.pipeline.calibrate:calibration_model_8")).split is None
    )
    assert resolve(PipelineConfig(model="small", balance="time")).split is None
    with pytest.raises(ConfigError, match=r"5 stages \(p·v = 5·1\) but model tiny has only 4 layers"):
        PipelineConfig(model="tiny", stages=5, microbatches=8)
