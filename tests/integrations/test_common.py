"""B_global held exactly: the checks every integration shares."""

from __future__ import annotations

import pytest

from microbatch.errors import ConfigError
from microbatch.integrations.common import check_global_batch, nearest_global_batches, options_with_cap


def test_global_batch_not_divisible_by_world_names_the_nearest_valid():
    with pytest.raises(ConfigError, match=r"global_batch 10 is not divisible by the world size 4: .* 8, 12$"):
        check_global_batch(10, 4)
    assert nearest_global_batches(10, 4) == (8, 12) and nearest_global_batches(3, 4) == (4, 4)
    assert check_global_batch(12, 4) == 12
    for bad in (0, -4, 2.0, True, "8"):
        with pytest.raises(ConfigError, match="must be a whole number >= 1"):
            check_global_batch(bad, 1)


def test_search_is_capped_at_the_per_process_batch():
    assert options_with_cap({}, 64, 4)["max_micro_batch"] == 16
    assert options_with_cap({"max_micro_batch": 8}, 64, 4)["max_micro_batch"] == 8
    assert options_with_cap({"max_micro_batch": None}, 64, 2)["max_micro_batch"] == 32


@pytest.mark.parametrize(
    "kw,error,pattern",
    [
        ({"tolerance": -1}, "ConfigError", r"tolerance -1 must be a number in \[0, 1\)"),
        ({"max_micro_batch": 0}, "ConfigError", r"max_micro_batch must be a whole number >= 1, got 0"),
        ({"colour": 1}, "TypeError", r"unexpected option\(s\) 'colour'"),
    ],
)
def test_the_callback_and_the_decorator_check_their_options_when_made(kw, error, pattern):
    """Bad settings are refused when the callback is made or the function decorated, not when fit
    starts or the function is first called."""
    from microbatch.integrations.accelerate import knee_batch_size
    from microbatch.integrations.lightning import KneeBatchSize

    exc = ConfigError if error == "ConfigError" else TypeError
    with pytest.raises(exc, match=pattern):
        KneeBatchSize(global_batch=64, **kw)
    with pytest.raises(exc, match=pattern):
        knee_batch_size(global_batch=64, **kw)(lambda micro_batch, grad_accum, probe=None: None)


def test_the_callback_takes_tunes_own_keywords_and_a_torch_device():
    import torch

    from microbatch.choose.tune.config import SearchConfig
    from microbatch.integrations.lightning import KneeBatchSize

    cb = KneeBatchSize(
        8, device=torch.device("cpu"), on_point=lambda p: None, search=SearchConfig(max_micro_batch=4)
    )
    assert cb.options["search"].max_micro_batch == 4  # handed to tune as given


def test_the_knee_tolerance_is_one_constant():
    """Every entry point's default τ is choose.config.DEFAULT_TOLERANCE itself (the same object: a
    literal 0.15 written again would be another float), and the CLI's --tolerance shows it."""
    import inspect

    from microbatch.choose.config import DEFAULT_TOLERANCE, ChoiceConfig
    from microbatch.integrations.accelerate import knee_batch_size
    from microbatch.integrations.hf import tune_trainer
    from microbatch.integrations.lightning import KneeBatchSize

    for fn in (knee_batch_size, tune_trainer, KneeBatchSize.__init__):
        assert inspect.signature(fn).parameters["tolerance"].default is DEFAULT_TOLERANCE, fn
    assert ChoiceConfig().tolerance is DEFAULT_TOLERANCE
    from microbatch.commands.recommend import cmd

    (opt,) = [o for o in cmd.params if o.name == "tolerance"]
    assert opt.default is DEFAULT_TOLERANCE
