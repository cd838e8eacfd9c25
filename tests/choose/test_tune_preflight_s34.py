"""tune refuses, before any probe on a CPU, a first probe that cannot end within its timeout even at a bound no CPU
core reaches (a new user's sweep, 2026-12-08: a long --seq probed for ten minutes before failing)."""

from __future__ import annotations

import json

import pytest

from microbatch.choose.tune.preflight import CPU_CORE_FLOPS_BOUND, check_smallest_time
from microbatch.cli import main
from microbatch.errors import ConfigError
from microbatch.model import get_model
from microbatch.predict.roofline import model_flops_per_step


def test_the_bound_by_hand():
    shape = get_model("gpt2")
    flops = model_flops_per_step(shape.with_seq(300_000), 1, 300_000)
    seconds = 2 * flops / (CPU_CORE_FLOPS_BOUND * 2)
    assert seconds > 600
    with pytest.raises(ConfigError, match=rf"at least {seconds:,.0f} s on 2 cores"):
        check_smallest_time(shape, seq=300_000, start=1, mode="train", timeout_s=600, cores=2)
    check_smallest_time(
        shape, seq=300_000, start=1, mode="train", timeout_s=seconds * 1.01, cores=2
    )  # within
    check_smallest_time(get_model("tiny"), seq=64, start=1, mode="train", timeout_s=600, cores=2)
    check_smallest_time(
        shape, seq=65_536, start=1, mode="train", timeout_s=600, cores=2
    )  # slow, not impossible
    # a decode step runs the forward alone: a third of the training step's FLOPs
    check_smallest_time(shape, seq=300_000, start=1, mode="decode", timeout_s=seconds / 3 * 1.01, cores=2)


def test_the_command_refuses_before_probing(capsys):
    code = main(["tune", "--model", "tiny", "--seq", "2000000", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 2 and out["kind"] == "bad_input" and "past the probe timeout" in out["error"]


def test_widths_past_any_model_are_refused():
    from microbatch.model import ModelShape

    with pytest.raises(ConfigError, match=r"hidden 1,000,000,000 is past 1,048,576"):
        ModelShape(layers=4, hidden=10**9, heads=8, vocab=1000, seq=128)
    with pytest.raises(ConfigError, match=r"vocab 100,000,000 is past 16,777,216"):
        ModelShape(layers=4, hidden=64, heads=8, vocab=10**8, seq=128)
    ModelShape(
        layers=4, hidden=18_432, heads=48, ffn_hidden=73_728, vocab=262_144, seq=10**7
    )  # today's widest


def test_a_model_that_cannot_fit_says_so_before_its_time(capsys):
    code = main(["tune", "--model", "tiny", "--seq", "100000000", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 2 and "needs about" in out["error"]  # the memory's reason, not the time's


def test_an_in_process_tune_has_no_probe_timeout_to_check():
    from microbatch.choose.tune import tune_model

    with pytest.raises(Exception) as err:  # noqa: PT011 - anything but the time check
        tune_model("small", seq=1_000_000, in_process=True, probe_timeout_s=1, memory_budget_bytes=1)
    assert "past the probe timeout" not in str(err.value)
