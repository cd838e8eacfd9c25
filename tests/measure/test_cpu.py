"""This machine, measured (issue 31: moved out of the accelerator table, which stays pure)."""

from __future__ import annotations

import os

import torch

import microbatch.hardware as hardware
from microbatch.hardware import usable_cores
from microbatch.measure.cpu import detect_local, measure_cpu


def test_the_table_measures_nothing():
    for name in ("measure_cpu", "_measure_cpu", "detect_local"):
        assert not hasattr(hardware, name), name


def test_measure_cpu_times_a_matmul_and_a_copy_and_restores_the_threads():
    before = torch.get_num_threads()
    acc = measure_cpu(n=256, repeats=2, threads=1)
    assert torch.get_num_threads() == before
    assert acc.name == "cpu" and acc.gpus_per_node == 1 and acc.sustained_clock_fraction == 1.0
    peak = acc.flops("fp32")
    assert acc.flops("bf16") == acc.flops("fp16") == peak
    # a 2-core VM's fp32 matmul: more than 10 MFLOP/s, less than 100 TFLOP/s; a copy between 10 MB/s and 10 TB/s
    assert 1e7 < peak < 1e14 and 1e7 < acc.memory_bandwidth_bytes_per_s < 1e13
    assert acc.source.startswith("measured here: 256x256 fp32 matmul") and "(1 thread)" in acc.source


def test_usable_cores_is_this_process_affinity():  # os only, no timing (microbatch.cpu_quota): see issue 31
    from microbatch.cpu_quota import quota_cores

    n = usable_cores()
    assert 1 <= n <= (os.cpu_count() or n)
    if hasattr(os, "sched_getaffinity"):  # at most the container's CPU quota, where one is set
        quota = quota_cores()
        assert n == min(len(os.sched_getaffinity(0)), quota or len(os.sched_getaffinity(0)))


def test_detect_local_without_cuda_is_none():
    if torch.cuda.is_available():
        acc = detect_local()
        assert acc is None or acc.memory_bytes > 0
    else:
        assert detect_local() is None
