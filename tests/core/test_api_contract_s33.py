"""What a review of the public Python API found (2026-12-07, evening): each fixed with a test that fails without it."""

from __future__ import annotations

import pytest

from microbatch.errors import ConfigError
from microbatch.hardware import Accelerator, from_device_name, get_accelerator
from microbatch.hardware_names import device_key, name_key
from microbatch.model import get_model
from microbatch.predict.memory import estimate_memory
from microbatch.predict.memory_config import MemoryConfig
from microbatch.shape import ModelShape


def test_a_switch_given_as_a_string_is_refused_not_read_as_true():
    """flash_attention="no" priced flash attention (any non-empty string is truthy)."""
    with pytest.raises(
        ConfigError, match=r"MemoryConfig flash_attention must be True or False .*got 'no'"
    ) as err:
        MemoryConfig(micro_batch=8, flash_attention="no")
    assert err.value.params == ("flash_attention",)
    with pytest.raises(ConfigError, match="ModelShape tied_embeddings must be True or False, got 'false'"):
        ModelShape(name="m", layers=2, hidden=64, heads=4, vocab=100, seq=32, tied_embeddings="false")
    shape = get_model("gpt2")
    off, on = (estimate_memory(shape, MemoryConfig(micro_batch=8, flash_attention=f)) for f in (False, True))
    assert off.peak_bytes > on.peak_bytes  # the switch itself still means what it says


def test_the_registry_row_is_not_shared_with_its_callers():
    """get_accelerator returned the registry's own peaks dict: writing into it changed every later plan."""
    mine = get_accelerator("h100-sxm")
    mine.peak_flops["bf16"] = 1.0
    assert get_accelerator("h100").peak_flops["bf16"] > 1e14
    found = from_device_name("NVIDIA H100 80GB HBM3")
    assert found is not None
    found.peak_flops["bf16"] = 2.0
    assert get_accelerator("h100-sxm").peak_flops["bf16"] > 1e14
    with pytest.raises(ConfigError, match="peak_flops must be a dict of FLOP/s by dtype"):
        Accelerator(
            name="x",
            peak_flops=None,
            memory_bytes=1e9,
            memory_bandwidth_bytes_per_s=1e12,  # type: ignore[arg-type]
            intra_node_bytes_per_s=1e11,
            inter_node_bytes_per_s=1e10,
        )


@pytest.mark.parametrize("name", ["NVIDIA RTX A1000", "NVIDIA RTX A1000 Laptop GPU", "H1000", "b2000"])
def test_a_longer_part_number_is_not_the_row_it_starts_with(name):
    """'A1000' (an 8 GB workstation card) was read as an A100 80GB; 'H1000' as an H100."""
    assert device_key(name, 8e9) is None and name_key(name, ()) is None
    with pytest.raises(ConfigError, match="unknown accelerator"):
        get_accelerator(name)


def test_the_real_parts_are_still_found():
    assert device_key("NVIDIA A100-SXM4-80GB", 80e9) == "a100-80gb"
    assert name_key("NVIDIA H100 PCIe", ()) == "h100-pcie" and name_key("NVIDIA B200", ()) == "b200"


def test_scalars_of_numpy_and_torch_come_back_as_python_numbers():
    """np.int64 in a Measurement broke json.dumps(to_dict()); tensors given to GradientNoiseScale.update came back as
    tensors in its estimate; a string size gave Python's '>' TypeError."""
    import json

    import numpy as np
    import torch

    from microbatch.measure.probes import Measurement
    from microbatch.run.noise import GradientNoiseScale

    m = Measurement(micro_batch=np.int64(4), throughput=np.float32(2.5))
    assert json.loads(json.dumps(m.to_dict(), allow_nan=False))["micro_batch"] == 4
    with pytest.raises(ConfigError, match="a measurement is a dict of its fields"):
        Measurement.from_dict([1])  # type: ignore[arg-type]
    est = GradientNoiseScale().update(
        b_small=2, g_small_sq=torch.tensor(2.0), b_big=8, g_big_sq=torch.tensor(1.0)
    )
    assert type(est.b_simple) is float and type(est.g_sq) is float
    with pytest.raises(ConfigError, match="b_small must be a number, got '2'"):
        GradientNoiseScale().update(b_small="2", g_small_sq=1.0, b_big=8, g_big_sq=0.5)  # type: ignore[arg-type]


def test_plan_config_s_unknown_choice_names_none_for_every_one():
    from microbatch.predict.plan_config import PlanConfig

    with pytest.raises(ConfigError, match=r"recompute=None for every one"):
        PlanConfig(
            shape=get_model("gpt2"), gpu=get_accelerator("a100-80gb"), global_batch=8, recompute=("auto",)
        )


def test_objects_of_the_wrong_kind_are_refused_by_name():
    """A string for moe, a shape for a pipeline's model, a dict for run_pipeline's config, a negative deadline: each
    failed deep inside (AttributeError, TypeError, an itimer's errno)."""
    from microbatch.run.pipeline.config import PipelineConfig
    from microbatch.run.pipeline.launch import run_pipeline

    with pytest.raises(ConfigError, match="moe must be an Experts"):
        ModelShape(name="m", layers=2, hidden=64, heads=4, vocab=100, seq=32, moe="mixtral")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="model must be a built-in model's name"):
        PipelineConfig(model=get_model("gpt2"), stages=2)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="cfg must be a PipelineConfig"):
        run_pipeline({"stages": 2})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="deadline_s -1 must be seconds > 0"):
        run_pipeline(PipelineConfig(model="small", stages=2), deadline_s=-1)
