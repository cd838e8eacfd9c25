"""Accelerator names as users type them (a new user's sweep, 2026-12-08): a misspelt name planned another card
without a word (a100-4 as the A100 80GB, h100-pci as the H100 SXM, mi300a as the MI300X); device names as torch and
nvidia-smi print them still resolve."""

from __future__ import annotations

import pytest

from microbatch.errors import ConfigError
from microbatch.hardware import get_accelerator


@pytest.mark.parametrize("typed", ["a100-4", "h100-pci", "mi300a", "h200x", "a100x", "h100s", "a100-80gbb"])
def test_a_misspelt_name_is_refused_with_a_suggestion(typed):
    with pytest.raises(ConfigError, match=rf"unknown accelerator '{typed}'.*known:"):
        get_accelerator(typed)


def test_the_suggestion_names_the_nearest():
    with pytest.raises(ConfigError, match=r"did you mean h100-pcie\?"):
        get_accelerator("h100-pcei")


@pytest.mark.parametrize(
    "name, key",
    [
        ("NVIDIA H100 80GB HBM3", "h100-sxm"), ("NVIDIA A100-SXM4-40GB", "a100-40gb"), ("NVIDIA H100 PCIe", "h100-pcie"),
        ("NVIDIA H100 NVL", "h100-nvl"), ("AMD Instinct MI300X", "mi300x"), ("NVIDIA H200", "h200"), ("a100", "a100-80gb"),
        ("H100", "h100-sxm"), ("a100 40gb", "a100-40gb"), ("h100-sxm5", "h100-sxm"), ("Tesla A100", "a100-80gb"),
        ("NVIDIA A100 80 GB", "a100-80gb"), ("A100 40 GB", "a100-40gb"), ("h100-80g", "h100-sxm"),
        ("NVIDIA HGX H100", "h100-sxm"), ("NVIDIA A100 (80GB)", "a100-80gb"), ("AMD Instinct MI300X VF", "mi300x"),
        ("NVIDIA H100 80GB HBM3 MIG 1g.10gb", "h100-sxm"),
    ],
)  # fmt: skip
def test_device_names_still_resolve(name, key):
    assert get_accelerator(name).name == key
