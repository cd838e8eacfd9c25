"""A CLI sweep's findings on the deeper paths (2026-12-06), each refused up front in one line (exit 2, the value,
the rule and the fix) or answered at once: a traceback, overflowed answers given as fits, a plan that ran for minutes
on a global batch it accepts, absurd sizes exported, report errors that named Python's exceptions or drew empty
sections, a timeout message that gave the wrong default. (The config.json keys: tests/core/test_hf_key_checks.py.)"""

from __future__ import annotations

import json
import time

import pytest
from test_bad_inputs_32 import check_refused, write

from microbatch.cli import main


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MICROBATCH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)


@pytest.mark.parametrize("value", ["1e308", "1e300", "9"])
def test_a_capacity_factor_past_every_token_is_refused(capsys, value):
    # 1e308 overflowed to a traceback (OverflowError in the GEMM waves), 1e300 to "inf s, peak -0.0 GiB: fits"
    for cmd in (["plan", "--gpu", "h100-sxm", "-B", "64"], ["memory", "-b", "1"]):
        check_refused([*cmd, "--model", "mixtral-8x7b", "-d", "8", "--capacity-factor", value], capsys,
                      r"--capacity-factor .* is outside \(0, E = 8\]", r"1\.25")  # fmt: skip
    main(["plan", "--model", "mixtral-8x7b", "--gpu", "h100-sxm", "-B", "64", "-d", "8", "-e", "8", "--capacity-factor",
          "8", "--json"])  # fmt: skip  # E itself (every copy held: padded runs take more than E/K) is planned
    answer = json.loads(capsys.readouterr().out)
    assert "capacity" not in answer.get("error", "") and answer.get("candidates")


@pytest.mark.parametrize(
    "setting,pattern",
    [
        (
            "attention_ramp=1e308",
            r"attention_ramp must be in \[0.001, 100\]",
        ),  # was 5.5e306 s a step, recommended
        (
            "sustained_clock_fraction=1e-300",
            r"sustained_clock_fraction must be in \[0\.1, 1\.25\]",
        ),  # was peak_flops
    ],
)
def test_gpu_settings_past_any_device_are_refused_by_their_own_name(capsys, setting, pattern):
    check_refused(["plan", "--model", "llama-2-7b", "--gpu", "h100-sxm", "-B", "64", "--gpu-set", setting], capsys,
                  pattern)  # fmt: skip


def test_a_plan_of_a_million_micro_batches_answers_without_simulating_them(capsys):
    """B = 10^6 at p = 8 ran for minutes and gigabytes (the kept candidates' schedules simulated: 2.4·10^7
    actions); past the planner's limit a candidate keeps its analytic time."""
    from microbatch.predict.candidate import PLAN_SIMULATED_ACTIONS

    t0 = time.process_time()
    assert (
        main(["plan", "--model", "llama-2-7b", "--gpu", "h100-sxm", "-B", "1000000", "-p", "8", "--json"])
        == 0
    )
    assert time.process_time() - t0 < 30  # 0.5 s here
    rec = json.loads(capsys.readouterr().out)["recommended"]
    assert rec["microbatches"] * 8 * 2 > PLAN_SIMULATED_ACTIONS and rec["simulated"] is False
    assert main(["plan", "--model", "llama-2-7b", "--gpu", "h100-sxm", "-B", "512", "-p", "8", "--json"]) == 0
    assert (
        json.loads(capsys.readouterr().out)["recommended"]["simulated"] is True
    )  # small ones still simulated


@pytest.fixture
def plan(capsys):
    assert main(["plan", "--model", "gpt2", "--gpu", "a100-80gb", "-B", "64", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize(
    "key,value", [("data_parallel", 10**30), ("pipeline_parallel", 10**30), ("tensor_parallel", 10**20)]
)
def test_export_refuses_sizes_no_run_has(tmp_path, capsys, plan, key, value):
    rec = dict(plan["recommended"], **{key: value})
    if key == "data_parallel":
        rec["global_batch"] = rec["micro_batch"] * rec["grad_accum"] * value  # B = b_m·g·d kept
    path = write(tmp_path / "plan.json", dict(plan, recommended=rec))
    check_refused(["export", "--plan", path, "--format", "deepspeed", "-o", str(tmp_path / "ds.json")], capsys,
                  rf"the plan's {key} must be a whole number in 1\.\.2\^53, got 1e\+(30|20)")  # fmt: skip


def test_export_names_what_to_give_not_a_class(tmp_path, capsys):
    path = write(tmp_path / "cfg.json", {"model_type": "qwen3_moe", "num_hidden_layers": 2})
    line = check_refused(["export", "--plan", path, "--format", "hf", "-o", str(tmp_path / "hf.json")], capsys,
                         r"the plan lacks", r"the JSON the plan command writes")  # fmt: skip
    assert "Candidate" not in line


@pytest.mark.parametrize(
    "result,pattern",
    [
        (
            {"command": "plan", "recommended": "fast"},
            r"the plan's recommended is 'fast', not a candidate object",
        ),
        ({"command": "plan", "candidates": [1, 2, 3]}, r"candidates is \[1, 2, 3\], not a list of objects"),
        ({"command": "simulate"}, r"a simulate result with no schedule and no stages"),
        ({"command": "validate", "points": [1, 2]}, r"a validate result with no rows"),
        ({"command": "pipeline", "stages": "x"}, r"a pipeline result without device, executed_order"),
    ],
)
def test_report_names_the_field_not_pythons_exception(tmp_path, capsys, result, pattern):
    path = write(tmp_path / "r.json", dict(result, version="0.1.0"))
    line = check_refused(["report", path, "--out", str(tmp_path / "r.html")], capsys, pattern)
    assert "Error:" not in line and "__init__" not in line and not (tmp_path / "r.html").exists()


def test_the_timeout_message_gives_the_commands_default(capsys):
    for value in ("nan", "5"):
        check_refused(["pipeline", "-p", "2", "--timeout", value], capsys, r"the command's default is 300")
