"""Bad inputs a read-only sweep of every command found escaping as tracebacks, hangs or wrong exits (2026-12-05):
each is now one line on stderr naming the value, the rule and the fix, with exit 2, before any work."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_bad_inputs import check_refused, write

from microbatch.cli import main

DEEP = "[" * 100_000
"""A JSON document nested past what the parser follows (it recursed into a RecursionError)."""


@pytest.mark.parametrize(
    "args",
    [
        ["memory", "--hf-config", "{deep}", "-b", "4"],
        ["recommend", "-m", "{deep}"],
        ["plan", "--model", "gpt2", "--gpu", "a100-80gb", "-B", "64", "--calibration", "{deep}"],
        ["validate", "--calibration", "{deep}", "--cpu-peak-gflops", "100", "--cpu-bandwidth-gbs", "10"],
        ["export", "--plan", "{deep}", "--format", "deepspeed"],
        ["export", "--tune", "{deep}", "--format", "hf"],
        ["report", "{deep}", "--out", "{tmp}/r.html"],
    ],
)
def test_a_file_nested_too_deep_is_named_not_a_traceback(tmp_path, capsys, args):
    deep = write(tmp_path, "deep.json", DEEP)
    args = [a.replace("{deep}", deep).replace("{tmp}", str(tmp_path)) for a in args]
    check_refused(args, capsys, r"deep\.json", r"nested deeper than the \d+ levels")


@pytest.mark.parametrize("content,words", [("42", "a JSON number \\(42\\)"), ("null", "a JSON null \\(null\\)"),
                                           ('"hello"', 'a JSON string \\("hello"\\)')])  # fmt: skip
def test_a_calibration_file_holding_a_bare_value_is_refused(tmp_path, capsys, content, words):
    f = write(tmp_path, "v.json", content)
    check_refused(["plan", "--model", "gpt2", "--gpu", "a100-80gb", "-B", "64", "--calibration", f], capsys,
                  r"calibration file '.*v\.json' holds " + words + ", not an object")  # fmt: skip


def test_a_calibration_precision_that_is_not_a_word_is_refused(tmp_path, capsys):
    f = write(tmp_path, "c.json", {"points": [{"micro_batch": 1, "throughput": 1.0}], "precision": ["fp32"],
                                   "device": "cpu", "model": "tiny", "seq": 64})  # fmt: skip
    check_refused(["validate", "--calibration", f, "--cpu-peak-gflops", "100", "--cpu-bandwidth-gbs", "10"],
                  capsys, r"precision \['fp32'\] is not known")  # fmt: skip


def test_an_empty_path_is_named_empty(capsys):
    check_refused(["export", "--plan", "", "--format", "deepspeed"], capsys, r"--plan is an empty path")


@pytest.mark.parametrize("cmd", [["simulate", "-p", "4", "-m", "8", "-s", "1f1b", "--forward-time", "1e-320"],
                                 ["bubble", "-p", "4", "-m", "4", "-s", "zb-h1", "--forward-time", "1e-320",
                                  "--input-time", "1e-320", "--weight-time", "1e-320"]])  # fmt: skip
def test_subnormal_op_times_draw_no_diagram_but_answer(capsys, cmd):
    assert main(cmd) == 0
    assert "(timeline too short to draw:" in capsys.readouterr().out


@pytest.mark.parametrize("setting", ["bf16=1e-300", "memory_bandwidth_bytes_per_s=1e-300"])
def test_a_rate_below_one_per_second_is_refused(capsys, setting):
    check_refused(["plan", "--model", "gpt2", "--gpu", "a100-80gb", "-B", "64", "--gpu-set", setting], capsys,
                  r"1e-300 (FLOP|bytes)/s is outside \[1e\+0[69], 1e\+1[47]\]")  # fmt: skip


def test_a_shape_past_any_model_is_refused_before_its_divisors_are_searched(capsys):
    check_refused(["plan", "--layers", str(10**20), "--hidden", "64", "--heads", "4", "--vocab", "512", "--seq",
                   "64", "--gpu", "a100-80gb", "-B", "64"], capsys, r"--layers 100,000,000,000,000,000,000 is past "
                  r"100,000")  # fmt: skip


@pytest.mark.parametrize(
    "field,value,words",
    [
        ("zero", 9, r"zero must be a ZeRO stage 0, 1, 2 or 3, got 9"),
        ("zero", "1", r"zero must be a ZeRO stage 0, 1, 2 or 3, got '1'"),
        ("pipeline_parallel", 0, r"pipeline_parallel must be a whole number in 1\.\.2\^53, got 0"),
        ("tensor_parallel", "x", r"tensor_parallel must be a whole number in 1\.\.2\^53, got 'x'"),
        ("virtual", 0, r"virtual must be a whole number >= 1, got 0"),
        ("sequence_parallel", "x", r"sequence_parallel must be true or false, got 'x'"),
    ],
)
def test_export_refuses_a_hand_edited_candidate(tmp_path, capsys, field, value, words):
    assert main(["plan", "--model", "gpt2", "--gpu", "a100-80gb", "-B", "64", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    plan["recommended"][field] = value
    f = write(tmp_path, "plan.json", plan)
    for fmt in ("deepspeed", "torchtitan"):
        check_refused(["export", "--plan", f, "--format", fmt], capsys, words)


def test_a_comparison_without_plans_and_an_error_envelope_are_refused(tmp_path, capsys):
    check_refused(["export", "--plan", write(tmp_path, "m.json", {"command": "plan", "plans": []}), "--format",
                   "deepspeed"], capsys, r"the comparison's plans is \[\], not a list of plans")  # fmt: skip
    assert main(["plan", "--model", "gpt2", "--gpu", "nosuch", "-B", "64", "--json"]) == 2
    failed = write(tmp_path, "failed.json", capsys.readouterr().out)
    for args in (["export", "--plan", failed, "--format", "deepspeed"], ["report", failed, "--out",
                                                                         str(tmp_path / "r.html")]):  # fmt: skip
        check_refused(args, capsys, r"records a failed `microbatch plan` \(unknown accelerator 'nosuch'")


def test_simulate_names_the_count_that_overflows(capsys):
    check_refused(["simulate", "-p", "4", "-m", "8", "-s", "interleaved", "-v", "1000000"], capsys,
                  r"^error: --virtual = 1000000: .* use --virtual 15,625 or fewer")  # fmt: skip


def test_a_memory_budget_under_a_byte_says_so(tmp_path, capsys):
    f = write(tmp_path, "m.csv", "micro_batch,throughput,peak_memory_bytes\n1,10,100\n2,18,200\n4,30,400\n")
    check_refused(["recommend", "-m", f, "--memory-budget", "0.5"], capsys, r"'0\.5' is less than one byte")


def test_a_plan_in_which_nothing_fits_is_still_reported_and_named_by_export(tmp_path, capsys):
    """It carries an error beside what it computed: the report reads it, export says nothing fits."""
    assert main(["plan", "--model", "llama-2-70b", "--gpu", "l4", "-B", "8", "--json"]) == 2
    nofit = write(tmp_path, "nofit.json", capsys.readouterr().out)
    assert main(["report", nofit, "--out", str(tmp_path / "r.html")]) == 0
    capsys.readouterr()
    check_refused(
        ["export", "--plan", nofit, "--format", "deepspeed"], capsys, r"the plan has no recommendation"
    )


def test_export_notes_an_optimizer_and_a_loss_no_config_sets(tmp_path, capsys):
    assert main(["plan", "--model", "gpt2", "--gpu", "a100-80gb", "-B", "64", "--optimizer", "sgd-plain",
                 "--loss-dtype", "half", "--json"]) == 0  # fmt: skip
    f = write(tmp_path, "p.json", capsys.readouterr().out)
    assert main(["export", "--plan", f, "--format", "hf", "--json"]) == 0
    notes = json.loads(capsys.readouterr().out)["notes"]
    assert any("sgd-plain optimizer" in n for n in notes) and any("half logits" in n for n in notes)


def test_a_memory_budget_past_any_number_of_bytes_is_refused(tmp_path, capsys):
    f = write(tmp_path, "m.csv", "micro_batch,throughput,peak_memory_bytes\n1,10,100\n2,18,200\n")
    check_refused(["recommend", "-m", f, "--memory-budget", "1e300t"], capsys, r"is past any device.s memory")


# Options that changed nothing beside the flag that gives them meaning (refused now, as --fp8-recipe without fp8 is)
PLAN = ["plan", "--model", "gpt2", "--gpu", "h100-sxm", "-B", "64"]


@pytest.mark.parametrize("cmd", [[*PLAN, "--capacity-factor", "1.25"], ["memory", "--model", "gpt2", "-b", "2",
                                                                       "--capacity-factor", "1.25"]])  # fmt: skip
def test_a_capacity_factor_on_a_dense_model_is_refused(capsys, cmd):
    check_refused(cmd, capsys, r"--capacity-factor 1\.25 pads the routed experts' buffers, and gpt2 is dense")


def test_a_capacity_factor_on_a_moe_model_is_taken(capsys):
    args = ["memory", "--model", "gpt2", "-b", "2", "--experts", "8", "--top-k", "2", "--json"]
    assert main(args) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*args, "--capacity-factor", "2"]) == 0
    padded = json.loads(capsys.readouterr().out)
    assert padded["memory"]["activations"] > plain["memory"]["activations"]  # the expert buffers padded 2×


def test_a_context_exchange_without_context_parallelism_is_refused(capsys):
    check_refused([*PLAN, "--cp-comm", "ulysses"], capsys,
                  r"--cp-comm ulysses is how context-parallel ranks exchange .* and --context-parallel is 1")  # fmt: skip
    assert main([*PLAN, "-c", "2", "--cp-comm", "ring", "--json"]) == 0  # with -c it is taken


@pytest.mark.parametrize("cmd", [[*PLAN, "--recompute", "full"], ["memory", "--model", "gpt2", "-b", "2",
                                                                 "--recompute", "full"]])  # fmt: skip
def test_recompute_every_past_the_layers_is_refused(capsys, cmd):
    check_refused([*cmd, "--recompute-every", "13"], capsys,
                  r"--recompute-every 13 is more than the model's 12 layers .*: no layer would be recomputed")  # fmt: skip
    assert main([*cmd, "--recompute-every", "12", "--json"]) == 0  # layer 12 recomputed: taken
    capsys.readouterr()
    # torchtitan counts every K-th layer of each stage: 4 stages of 3 layers recompute none at K = 6
    check_refused([*cmd, "-p", "4", "--recompute-every", "6"], capsys,
                  r"--recompute-every 6 is more than the 3 layers of the largest stage")  # fmt: skip


def test_a_chart_that_cannot_be_written_gives_an_error_with_the_result(capsys):
    assert main(["simulate", "-p", "4", "-m", "8", "-s", "1f1b", "--svg", "/dev/full", "--json"]) == 1
    obj = json.loads(capsys.readouterr().out)
    assert obj["kind"] == "failure" and "could not write --svg /dev/full" in obj["error"]
    assert obj["makespan"] > 0 and obj["closed_form"]["bubble_ratio"] == pytest.approx(3 / 8)


@pytest.mark.timeout(120)
@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (Linux)")
def test_a_pipeline_chart_that_cannot_be_written_keeps_the_run_and_names_the_failure(capsys):
    args = ["pipeline", "-p", "2", "-m", "2", "--steps", "1", "--no-predict", "--svg", "/dev/full", "--json"]
    assert main(args) == 1
    cap = capsys.readouterr()
    obj = json.loads(cap.out)
    assert obj["kind"] == "failure" and obj["error"].startswith("could not write --svg /dev/full")
    assert obj["measured"]["step_time_s"] > 0  # the run's result is kept beside the error
    assert f"error: {obj['error']}" in cap.err
