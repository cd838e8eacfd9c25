"""Issue 31: a library error speaks the caller's vocabulary. Called from Python it names the parameter
(``expert_parallel``) and no flag; the same mistake on the command line names the flag the user typed
(``--expert-parallel``), in the error line and in the ``--json`` error object
(:func:`microbatch.commands._flags.cli_message`)."""

from __future__ import annotations

import re

import pytest
from test_bad_inputs_32 import check_refused

import microbatch
from microbatch.commands._flags import cli_message, cli_text, flag_for
from microbatch.errors import ConfigError, check_positive_int
from microbatch.hardware import get_accelerator
from microbatch.model import get_model, resolve_model

FLAG = re.compile(r"(?<![\w-])--[a-z]")


def _api_error(call):
    with pytest.raises(ConfigError) as info:
        call()
    text = str(info.value)
    assert not FLAG.search(text), text  # a Python caller is never told to pass a flag
    return info.value


def test_expert_parallel_on_a_dense_model():
    e = _api_error(
        lambda: microbatch.plan(
            microbatch.PlanConfig(
                shape=get_model("gpt2"),
                gpu=get_accelerator("h100-sxm"),
                global_batch=64,
                data_parallel=2,
                expert_parallel=2,
            )
        )  # fmt: skip
    )
    assert re.search(
        r"expert_parallel 2 needs a mixture-of-experts model .*give experts E and top_k K", str(e)
    )
    assert "expert_parallel" in e.params


def test_expert_parallel_on_a_dense_model_cli(capsys):
    line = check_refused(
        ["plan", "--model", "gpt2", "--gpu", "h100", "-B", "64", "-d", "2", "-e", "2"],
        capsys,
        r"--expert-parallel 2 needs a mixture-of-experts model",
        r"give --experts E and --top-k K, .* or drop --expert-parallel",
    )
    assert "expert_parallel" not in line and "top_k" not in line


def test_context_parallel_needs_a_divisible_sequence(capsys):
    cfg = microbatch.MemoryConfig(micro_batch=1, context_parallel=3)
    e = _api_error(lambda: microbatch.estimate_memory(get_model("gpt2"), cfg))
    assert re.search(r"context_parallel 3 needs seq 1024 divisible by 2 × 3 = 6.* or another seq$", str(e))
    check_refused(["memory", "--model", "gpt2", "--gpu", "h100", "-b", "1", "-c", "3"], capsys,
                  r"--context-parallel 3 needs --seq 1024 divisible by 2 × 3 = 6", r"or another --seq$")  # fmt: skip


def test_a_sequence_past_the_learned_positions(capsys):
    e = _api_error(lambda: resolve_model("gpt2", seq=4096))
    assert str(e).startswith(
        "seq 4096 is longer than model gpt2's 1024 learned positions; use seq 1024 or less"
    )
    check_refused(["memory", "--model", "gpt2", "--seq", "4096", "--gpu", "h100", "-b", "1"], capsys,
                  r"^error: --seq 4096 is longer than model gpt2's 1024 learned positions; use --seq 1024 or less")  # fmt: skip


def test_a_missing_config_file(tmp_path, capsys):
    missing = str(tmp_path / "none.json")
    e = _api_error(lambda: resolve_model(hf_config=missing))
    assert str(e).startswith(f"hf_config {missing!r} is not a file")
    check_refused(["memory", "--hf-config", missing, "--gpu", "h100", "-b", "1"], capsys,
                  rf"^error: --hf-config '{re.escape(missing)}' is not a file")  # fmt: skip


def test_a_split_backward_needs_both_times(capsys):
    from microbatch.schedules.registry import generate

    e = _api_error(lambda: microbatch.simulate(generate("zb-h1", 2, 4), forward_time=1.0, backward_time=2.0))
    assert "input_time and weight_time are required" in str(e)
    check_refused(["simulate", "-p", "2", "-m", "4", "-s", "zb-h1", "--forward-time", "1", "--backward-time", "2"],
                  capsys, r"--input-time and --weight-time are required")  # fmt: skip


def test_the_rewrite_touches_only_the_parameters_named():
    e = ConfigError(
        "seq 5 in '/data/seq/x' ('seq'); shape.seq and model's seq=3 stay; sequence stays; use seq 4",
        params=("seq",),
    )
    assert cli_message(e, "memory") == (
        "--seq 5 in '/data/seq/x' ('seq'); shape.seq and model's seq=3 stay; sequence stays; use --seq 4"
    )
    assert cli_message(ConfigError("seq 5 is bad"), "memory") == "seq 5 is bad"  # no params: unchanged
    # a parameter the command stores under another name, and a value in the flag's words
    assert flag_for("memory_budget_bytes", "tune") == "--memory-budget"
    assert flag_for("out_path", "report") == "--out" and flag_for("out_dir", "demo") == "--out"
    assert (
        cli_text("use memory_key 'peak_memory_bytes' now", ("memory_key",), "validate")
        == "use --memory peak now"
    )
    assert flag_for("cpu_peak_gflops", None) == "--cpu-peak-gflops"  # no command: the name with dashes


def test_the_checkers_carry_the_parameter():
    with pytest.raises(ConfigError) as info:
        check_positive_int("micro_batch", 0)
    assert info.value.params == ("micro_batch",)
    assert cli_message(info.value, "memory").startswith("--micro-batch must be a whole number >= 1, got 0")
    with pytest.raises(ConfigError) as info:
        check_positive_int("expert imbalance", 0)
    assert info.value.params == ()  # a phrase is not a parameter
