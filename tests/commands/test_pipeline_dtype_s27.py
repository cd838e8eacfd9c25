"""``pipeline --dtype``: the weights' dtype on every rank from the command line (a bf16 factory ran in float32, the
API alone could say otherwise); host memory and the gradient check's tolerance follow it."""

from __future__ import annotations

import pytest
from _cli import run_json

pytest.importorskip("torch")


@pytest.mark.timeout(240)
def test_the_dtype_given_is_the_ranks_and_their_memory_follows(capsys):
    args = ["pipeline", "-p", "2", "-m", "2", "--model", "tiny", "--steps", "2", "--no-predict"]
    f32 = run_json(args, capsys)
    bf16 = run_json([*args, "--dtype", "bfloat16"], capsys)
    t32, t16 = f32["host_memory"]["predicted_terms"], bf16["host_memory"]["predicted_terms"]
    assert t16["model_copies"] == pytest.approx(t32["model_copies"] / 2)  # 2 bytes a weight, not 4
    assert bf16["grad_tolerance"] > f32["grad_tolerance"]
    assert bf16["losses"] != f32["losses"]  # the ranks ran another precision
