"""A Multi-Instance GPU slice: torch names the whole GPU's row (``... MIG 3g.40gb``) and reports the slice's SMs and
memory; the planner took the whole H100's peak and bandwidth for 60 of its 132 SMs and half its memory."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from microbatch.hardware import ACCELERATORS, from_device_name
from microbatch.hardware_overrides import mig_slice

GIB = 1024**3


def test_a_slice_has_its_share_of_the_sms_and_of_the_memory_bandwidth():
    row = ACCELERATORS["h100-sxm"]
    acc = from_device_name("NVIDIA H100 80GB HBM3 MIG 3g.40gb", 40 * GIB)
    assert acc is not None and acc.name == "h100-sxm"
    sliced = mig_slice(acc, 60, 40 * GIB)
    for dtype, peak in row.peak_flops.items():
        assert sliced.peak_flops[dtype] == pytest.approx(peak * 60 / 132)
    assert sliced.memory_bandwidth_bytes_per_s == pytest.approx(
        row.memory_bandwidth_bytes_per_s * 40 * GIB / row.memory_bytes
    )
    assert sliced.compute_units == 60 and sliced.memory_bytes == 40 * GIB
    assert "a MIG slice here: 60 of its 132 SMs" in sliced.source
    assert (
        mig_slice(acc, 132, 80 * GIB) is acc and mig_slice(acc, None, None) is acc
    )  # the whole GPU: unchanged


def test_detect_local_reads_a_slices_sms(monkeypatch):
    torch = pytest.importorskip("torch")
    from microbatch.measure import cpu

    props = SimpleNamespace(
        name="NVIDIA A100-SXM4-80GB MIG 1g.10gb", total_memory=10 * GIB, multi_processor_count=14
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    acc = cpu.detect_local()
    row = ACCELERATORS["a100-80gb"]
    assert acc is not None and acc.compute_units == 14
    assert acc.peak_flops["bf16"] == pytest.approx(row.peak_flops["bf16"] * 14 / 108)  # was the whole A100's
