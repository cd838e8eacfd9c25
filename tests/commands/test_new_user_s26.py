"""What a new user typed on the first day (a session's walkthrough): GPU names as nvidia-smi prints them, a device
whose name holds another's, sizes with units in --gpu-set, a hand-written config.json without model_type, a config's
longest context taken as the training length, a micro-batch that does not divide B in noise, the advice when nothing
fits, and recommend re-choosing tune's result under tune's own settings."""

from __future__ import annotations

import json

import pytest
from _cli import run, run_json

from microbatch.errors import ConfigError
from microbatch.hardware import get_accelerator
from microbatch.hardware_names import device_key


@pytest.mark.parametrize(
    ("printed", "row"),
    [("NVIDIA H100 80GB HBM3", "h100-sxm"), ("NVIDIA A100-SXM4-40GB", "a100-40gb"), ("NVIDIA H200", "h200"),
     ("NVIDIA L4", "l4"), ("NVIDIA H100 PCIe", "h100-pcie")],
)  # fmt: skip
def test_a_gpu_named_as_nvidia_smi_prints_it(printed, row):
    assert get_accelerator(printed).name == row


def test_a_name_holding_another_parts_name_is_not_that_part():
    assert device_key("NVIDIA L40S") is None and device_key("NVIDIA L40") is None  # were l4
    assert device_key("NVIDIA GH200 480GB") is None  # was h200 (141 GiB of HBM3e; a GH200 has 96 GB of HBM3)
    assert device_key("NVIDIA L4") == "l4" and device_key("NVIDIA H200") == "h200"
    with pytest.raises(ConfigError, match="gpu_set"):
        get_accelerator("L40S")


def test_gpu_set_memory_takes_a_size_and_refuses_a_bare_small_number(capsys):
    d = run_json(["plan", "--model", "llama-2-7b", "--gpu", "h100", "--gpu-set", "memory_bytes=80GB", "-B", "8",
                  "-t", "2"], capsys)  # fmt: skip
    assert d["memory_budget_bytes"] == pytest.approx(
        80e9 * (1 - d["memory_headroom"])
    )  # 80 GB, headroom kept
    code, _, err = run(["plan", "--model", "llama-2-7b", "--gpu", "h100", "--gpu-set", "memory_bytes=80", "-B", "8"],
                       capsys)  # fmt: skip
    assert code == 2 and "80 bytes, under 1 GiB" in err and "memory_bytes=80GiB" in err


def test_a_hand_written_config_says_what_it_was_built_as(tmp_path, capsys):
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({"hidden_size": 512, "intermediate_size": 1376, "num_attention_heads": 8,
                                "num_hidden_layers": 4, "vocab_size": 1000}))  # fmt: skip
    notes = run_json(["memory", "--hf-config", str(bare), "-b", "1"], capsys)["notes"]
    assert any("no model_type" in n and "GPT-2" in n for n in notes)
    assert any("s = 2,048: no length in the config" in n for n in notes)
    long = tmp_path / "long.json"
    long.write_text(json.dumps({"model_type": "llama", "hidden_size": 512, "intermediate_size": 1376,
                                "num_attention_heads": 8, "num_hidden_layers": 4, "vocab_size": 1000,
                                "max_position_embeddings": 131072}))  # fmt: skip
    eager = ["--layer-kernels", "eager"]  # else a note says transformers' eager layers keep more (2026-12-07)
    notes = run_json(["memory", "--hf-config", str(long), "-b", "1", *eager], capsys)["notes"]
    assert (
        notes == [n for n in notes if "131,072" in n and "max_position_embeddings" in n] and len(notes) == 1
    )
    assert "notes" not in run_json(
        ["memory", "--hf-config", str(long), "-b", "1", "--seq", "512", *eager], capsys
    )


def test_noise_refuses_a_micro_batch_that_does_not_divide_the_global_batch(capsys):
    code, _, err = run(["noise", "--model", "tiny", "-B", "16", "-b", "5"], capsys)
    assert code == 2 and "does not divide global batch 16" in err and "1, 2, 4, 8" in err


def test_when_nothing_fits_the_advice_reaches_a_nodes_tensor_parallel_and_drops_what_does_not_help():
    from microbatch.model import get_model
    from microbatch.predict.plan import what_would_fit
    from microbatch.predict.plan_config import PlanConfig

    cfg = PlanConfig(
        shape=get_model("llama-3-70b"), gpu=get_accelerator("l4"), global_batch=64, data_parallel=8
    )
    advice = what_would_fit(cfg)
    fitting = [(a.setting, a.value) for a in advice.alternatives if a.fits]
    assert ("tensor_parallel", 8) in fitting  # it tried 2 and 4 only, and said nothing fits
    assert all(
        a.fits or a.best.peak_memory_bytes < advice.smallest.peak_memory_bytes for a in advice.alternatives
    )


def _tune_result(path):
    points = [{"micro_batch": b, "throughput": r, "peak_memory_bytes": 1e8 * b, "step_time_s": b / r}
              for b, r in ((1, 100.0), (2, 150.0), (4, 190.0), (8, 200.0), (16, 400.0))]  # fmt: skip
    path.write_text(json.dumps({"command": "tune", "version": "0.1.0", "points": points, "global_batch": 8,
                                "data_parallel": 1, "reference": "measured", "rule": "fraction",
                                "tolerance": 0.15}))  # fmt: skip


def test_recommend_rechooses_a_tune_result_under_its_own_settings(tmp_path, capsys):
    _tune_result(tmp_path / "result.json")
    d = run_json(["recommend", "--measurements", str(tmp_path)], capsys)
    assert d["micro_batch"] == 4 and d["grad_accum"] == 2  # under tune's B = 8: 16 does not divide it
    assert any("--global-batch 8" in n for n in d["notes"])
    assert run_json(["recommend", "--measurements", str(tmp_path), "-B", "16"], capsys)["micro_batch"] == 16
    plain = tmp_path / "points.json"
    plain.write_text(json.dumps(json.loads((tmp_path / "result.json").read_text())["points"]))
    assert (
        run_json(["recommend", "--measurements", str(plain)], capsys)["micro_batch"] == 16
    )  # a list: no settings


@pytest.mark.parametrize(
    ("typed", "meant"),
    [("meta-llama/Llama-2-7b-hf", "llama-2-7b"), ("mistralai/Mistral-7B-v0.1", "mistral-7b"),
     ("llama3-8b", "llama-3-8b")],
)  # fmt: skip
def test_a_hub_name_is_answered_with_the_registry_name_meant(typed, meant, capsys):
    code, _, err = run(["memory", "--model", typed, "-b", "1"], capsys)
    assert code == 2 and f"(did you mean {meant}?)" in err


def test_a_name_with_a_slash_is_not_called_a_file(capsys):
    code, _, err = run(["pipeline", "--model", "meta-llama/Llama-2-7b-hf"], capsys)
    assert code == 2 and "is a file" not in err and "neither a built-in preset nor module:function" in err


def test_a_negative_rate_says_the_rule_it_breaks(tmp_path, capsys):
    f = tmp_path / "c.csv"
    f.write_text("micro_batch,throughput\n1,-5\n2,10\n")
    code, _, err = run(["recommend", "-m", str(f)], capsys)
    assert code == 2 and "below 0: a measured rate is > 0" in err and ">= 0" not in err


def test_a_bare_list_of_points_names_no_model(tmp_path, capsys):
    f = tmp_path / "seed.json"
    f.write_text(json.dumps([{"micro_batch": 1, "throughput": 1000}, {"micro_batch": 4, "throughput": 3200}]))
    code, _, err = run(["validate", "--calibration", str(f)], capsys)
    assert code == 2 and "names no model" in err and "(none)" not in err


@pytest.mark.parametrize(
    "args",
    [["bubble", "-p", "4", "-m", "8", "--stages", "2"], ["bubble", "-p4", "-m", "8", "--stages=2"],
     ["plan", "--model", "gpt2", "--gpu", "a100", "-B", "8", "--global-batch", "16"]],
)  # fmt: skip
def test_one_option_given_two_values_is_refused(args, capsys):
    code, _, err = run(args, capsys)
    assert code == 2 and "both set" in err and "give it once" in err


def test_one_option_given_twice_alike_runs(capsys):
    assert run(["bubble", "-p", "4", "-m", "8", "--stages", "4"], capsys)[0] == 0


def test_reduce_dtype_with_a_zero_stage_it_cannot_change_is_refused(capsys):
    code, _, err = run(["plan", "--model", "gpt2", "--gpu", "a100", "-B", "16", "-d", "8", "--zero", "1",
                        "--reduce-dtype", "half"], capsys)  # fmt: skip
    assert code == 2 and "would change nothing" in err and "--reduce-dtype" in err
    code, _, err = run(["plan", "--model", "gpt2", "--gpu", "a100", "-B", "16", "-d", "8", "--zero", "2",
                        "--reduce-dtype", "half"], capsys)  # fmt: skip
    assert code == 2 and "would change nothing" in err  # ZeRO 2 without a pipeline: DeepSpeed's buckets
    assert (
        run(
            [
                "plan",
                "--model",
                "gpt2",
                "--gpu",
                "a100",
                "-B",
                "16",
                "-d",
                "2",
                "-p",
                "2",
                "--zero",
                "2",
                "--reduce-dtype",
                "half",
            ],
            capsys,
        )[0]
        == 0
    )  # FSDP under the pipeline: it acts


def test_recommend_says_nothing_of_settings_it_did_not_read_or_the_user_did_not_give(tmp_path, capsys):
    _tune_result(tmp_path / "result.json")
    given = run_json(["recommend", "--measurements", str(tmp_path), "-B", "8"], capsys)
    assert not any(
        "settings of the tune" in n for n in given.get("notes", [])
    )  # no empty "settings ...: " note
    data = json.loads((tmp_path / "result.json").read_text())
    data.update(reference="bound", rule="gain", memory_headroom=0.2)  # a tune run with --rule gain
    (tmp_path / "result.json").write_text(json.dumps(data))
    notes = run_json(["recommend", "--measurements", str(tmp_path)], capsys)["notes"]
    assert not any("had nothing to act on" in n for n in notes)  # the file's own, not flags the user gave


def test_an_interrupt_says_interrupted_once():
    from microbatch.choose.tune import NOTHING_MEASURED
    from microbatch.cli import _interrupted

    assert (
        _interrupted(NOTHING_MEASURED) == NOTHING_MEASURED
    )  # was "interrupted: interrupted before any point ..."
    assert _interrupted("kept 3 points") == "interrupted: kept 3 points" and _interrupted("") == "interrupted"


def test_a_hundred_ranks_in_flight_fit_one_line(capsys):
    code, out, _ = run(["bubble", "-p", "100", "-m", "100", "--no-diagram"], capsys)
    line = next(x for x in out.splitlines() if "peak in flight" in x)
    assert code == 0 and "(84 ranks)" in line and len(line) < 160


def test_memory_refuses_zero3_flags_where_they_change_nothing_and_records_them(capsys):
    code, _, err = run(["memory", "--model", "llama-2-7b", "-b", "1", "-d", "8", "--zero", "1", "--reduce-dtype", "half"],
                       capsys)  # fmt: skip
    assert code == 2 and "the memory would not change" in err
    code, _, err = run(["memory", "--model", "llama-2-7b", "-b", "1", "-d", "8", "--zero", "3", "-p", "2",
                        "--zero3-impl", "deepspeed"], capsys)  # fmt: skip
    assert code == 2 and "FSDP2 whatever it says" in err
    d = run_json(["memory", "--model", "llama-2-7b", "-b", "1", "-d", "8", "--zero", "3", "--reduce-dtype", "half"],
                 capsys)  # fmt: skip
    assert d["config"]["reduce_dtype"] == "half" and d["config"]["zero3_impl"] == "fsdp2"


def test_recommend_names_the_file_for_a_bad_value_it_read(tmp_path, capsys):
    _tune_result(tmp_path / "result.json")
    data = json.loads((tmp_path / "result.json").read_text())
    data.update(global_batch=64, data_parallel=2)
    (tmp_path / "result.json").write_text(json.dumps(data))
    code, _, err = run(["recommend", "--measurements", str(tmp_path), "-d", "3"], capsys)
    assert code == 2 and "settings of the tune that wrote" in err and "--global-batch 64" in err
    data.update(memory_budget_bytes="4GiB x", memory_headroom="0.1x")  # no traceback for what a file says
    (tmp_path / "result.json").write_text(json.dumps(data))
    code, _, err = run(["recommend", "--measurements", str(tmp_path)], capsys)
    assert code == 2 and "Traceback" not in err


def test_export_says_when_the_plan_priced_another_zero3_runner(capsys, tmp_path):
    plan = tmp_path / "p.json"
    d = run_json(["plan", "--model", "gpt2", "--gpu", "a100", "-B", "16", "-d", "8", "--zero", "3"], capsys)
    plan.write_text(json.dumps(d))
    code, _, err = run(["export", "--plan", str(plan), "--format", "deepspeed"], capsys)
    assert code == 0 and "priced ZeRO-3 as fsdp2" in err and "--zero3-impl deepspeed" in err
    code, _, err = run(["export", "--plan", str(plan), "--format", "torchtitan"], capsys)
    assert code == 0 and "priced ZeRO-3" not in err  # torchtitan runs FSDP2


def test_repeated_options_compare_values_and_on_off_pairs(capsys):
    assert (
        run(["bubble", "-p", "4", "-p", "04", "-m", "8", "--no-diagram"], capsys)[0] == 0
    )  # one value, two words
    code, _, err = run(["plan", "--model", "gpt2", "--gpu", "a100", "-B", "16", "--flash-attention",
                        "--no-flash-attention"], capsys)  # fmt: skip
    assert code == 2 and "--flash-attention and --no-flash-attention both set one option" in err
    code, out, _ = run(["bubble", "-p", "4", "-p", "2", "--help"], capsys)
    assert code == 0 and "Usage" in out  # the help answers
    d = run_json(["simulate", "-p", "17", "-m", "17", "-s", "1f1b"], capsys)
    assert (
        len(d["peak_in_flight"]) == 17
    )  # the JSON keeps every rank; the text shows 17 (four or more hidden only)


def test_a_schedule_and_its_alias_are_one_value(capsys):
    assert run(["bubble", "-p", "4", "-m", "8", "-s", "gpipe", "-s", "GPipe", "--no-diagram"], capsys)[0] == 0
    code, _, _ = run(["bubble", "-p", "4", "-m", "8", "-v", "2", "-s", "interleaved", "-s", "interleaved-1f1b",
                      "--no-diagram"], capsys)  # fmt: skip
    assert code == 0
    code, _, err = run(["bubble", "-p", "4", "-m", "8", "-s", "gpipe", "-s", "1f1b", "--no-diagram"], capsys)
    assert code == 2 and "both set one option" in err
