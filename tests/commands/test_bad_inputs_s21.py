"""Inputs a read-only sweep of plan, memory, report, export and batch found mishandled (2026-12-06): each refused
with the rule and the fix, or answered without contradicting itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from microbatch.cli import main
from microbatch.show.html import _candidates_table


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    rc = main(list(args))
    out = capsys.readouterr()
    return rc, out.out, out.err


PLAN = ("plan", "--model", "llama-3-8b", "-B", "64", "-d", "8", "--gpu", "h100")


@pytest.mark.parametrize("value", ["fp8=0", "fp8=nan", "fp8=inf", "fp8=-1", "fp8=0.5", "bf16=0.5", "inter_node_achievable=1e-320",
                                   "attention_fraction=1e-320", "attention_ramp=1e-320"])  # fmt: skip
def test_an_override_no_device_has_is_refused_in_one_json(
    capsys: pytest.CaptureFixture[str], value: str
) -> None:
    rc, out, _ = _run(capsys, *PLAN, "--precision", "fp8", "--gpu-set", value, "--json")
    assert rc == 2
    env = json.loads(out)
    assert env["kind"] == "bad_input" and value.split("=")[0] in env["error"]


def test_shape_flags_repair_a_config_file_before_its_rules_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 1000,
                               "num_attention_heads": 3, "vocab_size": 32000}))  # fmt: skip
    rc, _, err = _run(capsys, "memory", "--hf-config", str(cfg), "-b", "1")
    assert rc == 2 and "heads 3 do not divide hidden 1000" in err
    assert _run(capsys, "memory", "--hf-config", str(cfg), "-b", "1", "--heads", "4")[0] == 0
    assert _run(capsys, "memory", "--hf-config", str(cfg), "-b", "1", "--head-size", "100")[0] == 0
    cfg.write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 4096,
                               "num_attention_heads": 32, "num_key_value_heads": 5, "vocab_size": 32000}))  # fmt: skip
    assert _run(capsys, "memory", "--hf-config", str(cfg), "-b", "1")[0] == 2
    rc, out, _ = _run(capsys, "memory", "--hf-config", str(cfg), "-b", "1", "--kv-heads", "8", "--json")
    assert rc == 0 and json.loads(out)["model_shape"]["kv_heads"] == 8


def test_a_latent_attention_key_is_named_as_the_files_not_as_a_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "deepseek_v3", "num_hidden_layers": 4, "hidden_size": 1024,
                               "num_attention_heads": 16, "vocab_size": 32000, "kv_lora_rank": 0}))  # fmt: skip
    rc, _, err = _run(capsys, "memory", "--hf-config", str(cfg), "-b", "1")
    assert rc == 2 and "kv_lora_rank" in err and "--kv-lora-rank" not in err and "config.json" in err


def test_memory_fits_by_the_headroom_plan_keeps(capsys: pytest.CaptureFixture[str]) -> None:
    """76.1 GiB on an 79.6 GiB H100: inside the device, outside the 10% headroom plan keeps — not 'fits'."""
    args = ("memory", "--model", "llama-3-8b", "-b", "1", "-p", "4", "-v", "2", "--recompute", "full",
            "--recompute-every", "8", "--gpu", "h100")  # fmt: skip
    rc, out, _ = _run(capsys, *args, "--json")
    d = json.loads(out)
    # exit 2 (does_not_fit) as plan when nothing fits its headroom (s31: it exited 0, and `memory && launch` went on)
    assert rc == 2 and d["memory_budget_bytes"] < d["peak_memory_bytes"] <= d["gpu_memory_bytes"]
    assert d["fits"] is False and d["fits_device"] is True and d["kind"] == "does_not_fit"
    _, text, _ = _run(capsys, *args)
    assert "does NOT fit in 71.68 GiB" in text and "fits the whole device" in text
    assert "recompute full (one layer in 8)" in text


@pytest.mark.parametrize(("more", "words"), [
    (("--schedule", "dualpipev"), "schedule dualpipev needs pipeline stages"),
    (("-v", "2"), "virtual 2 needs pipeline stages"),
    (("--ep-overlap",), "--ep-overlap hides the expert all-to-alls, and llama-3-8b is dense"),
])  # fmt: skip
def test_a_choice_that_cannot_apply_is_refused(
    capsys: pytest.CaptureFixture[str], more: tuple[str, ...], words: str
) -> None:
    rc, _, err = _run(capsys, *PLAN, *more)
    assert rc == 2 and words in err


def test_hybrid_sharding_with_auto_zero_shards(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run(capsys, "plan", "--model", "tiny", "--gpu", "h100", "-B", "64", "-d", "16", "--shard-degree", "4",
                      "--choose", "fastest", "--json")  # fmt: skip
    assert rc == 0
    assert {c["zero"] for c in json.loads(out)["candidates"]} <= {1, 2, 3}


def test_the_neighbour_words_name_the_layout_they_compare(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run(capsys, "plan", "--model", "mixtral-8x7b", "--gpu", "h100", "-B", "256", "-d", "8", "-p", "4",
                      "--top-k", "3", "--json")  # fmt: skip
    d = json.loads(out)
    rec = d["recommended"]
    table_row = next(
        c for c in d["candidates"] if c["micro_batch"] == 2
    )  # the best at b_m 2, as the table shows
    assert (table_row["schedule"], table_row["virtual"]) != (rec["schedule"], rec["virtual"])
    assert f"Larger b_m = 2 run as the recommendation ({rec['schedule']}" in d["explanation"]


def test_nothing_fits_without_a_pipeline_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = _run(capsys, "plan", "--model", "llama-3-8b", "--gpu", "h100", "-B", "16", "-d", "8", "--zero", "3",
                      "-b", "2", "--recompute", "none", "--seq", "8192")  # fmt: skip
    assert rc == 2 and "at b_m = 2, no pipeline, recompute none" in err


def test_the_report_ranks_rows_that_do_not_fit_by_their_peak() -> None:
    big = {
        "micro_batch": 1,
        "fits": False,
        "step_time_s": 1.0,
        "peak_memory_bytes": 2e11,
        "recompute": "none",
    }
    small = {
        "micro_batch": 1,
        "fits": False,
        "step_time_s": 2.0,
        "peak_memory_bytes": 1e11,
        "recompute": "full",
    }
    html = "".join(_candidates_table([big, small], {}))
    assert "full" in html and ">none<" not in html  # the smaller peak, as plan's table and its advice show


def test_a_hollow_plan_is_refused_by_the_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stub = tmp_path / "stub.json"
    stub.write_text(json.dumps({"command": "plan", "version": "0.1.0"}))
    rc, _, err = _run(capsys, "report", str(stub), "--out", str(tmp_path / "r.html"))
    assert rc == 2 and "no candidates" in err and not (tmp_path / "r.html").exists()


def test_the_fp8_header_names_its_recipe_and_cache(capsys: pytest.CaptureFixture[str]) -> None:
    _, te, _ = _run(capsys, "memory", "--model", "llama-2-7b", "-b", "1", "--precision", "fp8", "--fp8-recipe",
                    "te-delayed")  # fmt: skip
    assert "fp8 te-delayed (2+2+12 = 16 B/param + 2 B a layer parameter of cached FP8 weights)" in te
    _, torchao, _ = _run(capsys, "memory", "--model", "llama-2-7b", "-b", "1", "--precision", "fp8")
    assert "fp8 tensorwise (2+2+12 = 16 B/param)" in torchao


def test_the_expert_group_is_named_as_counted(capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = _run(capsys, "plan", "--model", "mixtral-8x7b", "--gpu", "h100", "-B", "64", "-d", "2", "-c", "2",
                      "-e", "8", "--seq", "4096")  # fmt: skip
    assert rc == 2 and "does not divide data-parallel × context-parallel 2 × 2 = 4" in err


def test_batch_checks_each_range_before_the_identity(capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = _run(capsys, "batch", "-B", "512", "-b", "8", "-g", "0", "-d", "4")
    assert rc == 2 and "--grad-accum must be a whole number >= 1, got 0" in err


def test_an_export_file_named_for_the_other_format_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = tmp_path / "p.json"
    assert (
        main(["plan", "--model", "gpt2", "--gpu", "h100", "-B", "64", "-d", "8", "--zero", "3", "--json"])
        == 0
    )
    plan.write_text(capsys.readouterr().out)
    rc, _, err = _run(
        capsys, "export", "--plan", str(plan), "--format", "torchtitan", "-o", str(tmp_path / "t.json")
    )
    assert rc == 2 and "would hold TOML" in err and not (tmp_path / "t.json").exists()
    assert (
        _run(capsys, "export", "--plan", str(plan), "--format", "deepspeed", "-o", str(tmp_path / "d.toml"))[
            0
        ]
        == 2
    )
    assert (
        _run(capsys, "export", "--plan", str(plan), "--format", "torchtitan", "-o", str(tmp_path / "t.toml"))[
            0
        ]
        == 0
    )


def test_a_v_schedule_no_stage_count_splits_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = _run(capsys, "plan", "--model", "deepseek-v3", "--gpu", "h100", "-B", "4096", "-d", "128", "-p", "16",
                      "-e", "64", "--schedule", "dualpipev")  # fmt: skip
    assert rc == 2 and "no --pipeline-parallel splits 61 layers so" in err and "among []" not in err


def test_moments_for_an_optimizer_without_them_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = _run(capsys, *PLAN, "--optimizer", "sgd-plain", "--moments-dtype", "bf16")
    assert rc == 2 and "sgd-plain keeps none" in err
    assert _run(capsys, *PLAN, "--optimizer", "sgd", "--moments-dtype", "bf16")[0] == 0


def test_memory_takes_a_v_schedules_own_chunks(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run(
        capsys, "memory", "--model", "llama-2-7b", "-b", "1", "-p", "4", "--schedule", "dualpipev", "--json"
    )
    assert rc == 0 and json.loads(out)["config"]["virtual"] == 2


def test_no_pipeline_refuses_a_schedule_in_memory_as_in_plan(capsys: pytest.CaptureFixture[str]) -> None:
    for schedule in ("gpipe", "dualpipev", "zb-h1"):
        rc, _, err = _run(capsys, "memory", "--model", "gpt2", "-b", "1", "--schedule", schedule)
        assert rc == 2 and f"--schedule {schedule} needs pipeline stages" in err
    rc, _, err = _run(
        capsys, "plan", "--model", "gpt2", "--gpu", "h100", "-B", "64", "-p", "4", "--schedule", "dualpipev"
    )
    assert rc == 2 and "among [2, 3, 6]" in err  # p = 1 is no pipeline: not offered


def test_flags_resize_a_windowed_config_and_name_themselves(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    g2 = tmp_path / "config.json"
    g2.write_text(json.dumps({"model_type": "gemma2", "num_hidden_layers": 42, "hidden_size": 3584,
                              "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256,
                              "intermediate_size": 14336, "vocab_size": 256000, "sliding_window": 4096,
                              "max_position_embeddings": 8192}))  # fmt: skip
    rc, out, _ = _run(capsys, "memory", "--hf-config", str(g2), "-b", "1", "--layers", "8", "--json")
    shape = json.loads(out)["model_shape"]
    assert rc == 0 and (shape["layers"], shape["sliding_layers"]) == (
        8,
        4,
    )  # Gemma 2: every other layer windowed
    gpt2 = tmp_path / "gpt2.json"
    gpt2.write_text(
        json.dumps({"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257})
    )
    rc, _, err = _run(capsys, "memory", "--hf-config", str(gpt2), "-b", "1", "--heads", "7")
    assert rc == 2 and "with --heads 7 given: --heads 7 do not divide hidden 768" in err


def test_nothing_fits_on_several_accelerators_names_each(capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = _run(capsys, "plan", "--model", "llama-3-8b", "--gpu", "a100-40gb,h100", "-B", "16", "-d", "8",
                      "--zero", "3", "-b", "2", "--recompute", "none", "--seq", "8192")  # fmt: skip
    assert rc == 2 and "no accelerator fits: on a100-40gb, nothing fits in 36.0 GiB" in err
    assert "on h100-sxm, nothing fits in 71.7 GiB" in err


def test_the_context_parallel_offered_meets_both_ulysses_rules(capsys: pytest.CaptureFixture[str]) -> None:
    """gpt2 at s 1,024 with 12 heads: 2c divides s for c in 2, 4, 8, 16, ...; c divides the heads for 2, 3, 4, 6, 12:
    both offers are the c that meet both rules."""
    for c in ("3", "8"):
        rc, _, err = _run(capsys, "plan", "--model", "gpt2", "--gpu", "h100", "-B", "64", "-d", "2", "-c", c,
                          "--cp-comm", "ulysses")  # fmt: skip
        assert rc == 2 and "--context-parallel among [2, 4]" in err


def test_a_simulation_without_a_timeline_says_why_it_has_no_diagram() -> None:
    from microbatch.show.html_sections import simulate_section

    res = {
        "schedule": "1f1b",
        "stages": 4,
        "microbatches": 8,
        "bubble_fraction": 0.27,
        "peak_in_flight": [4, 3, 2, 1],
    }
    html, figs = simulate_section(res, None, 0)
    assert not figs and "No bubble diagram" in html and "intervals" in html


def test_the_plan_header_names_the_settings_its_table_leaves_unsaid(
    capsys: pytest.CaptureFixture[str],
) -> None:
    _, out, _ = _run(capsys, *PLAN, "--precision", "fp8", "--fp8-recipe", "rowwise", "--recompute", "full",
                     "--recompute-every", "4", "--loss-kernel", "eager")  # fmt: skip
    assert "s = 8192, fp8 rowwise, full recompute of 1 layer in 4, eager loss;" in out.splitlines()[0]
    _, plain, _ = _run(capsys, *PLAN)
    assert "s = 8192;" in plain.splitlines()[0]
    _, state, _ = _run(capsys, *PLAN, "--optimizer", "lion", "--moments-dtype", "bf16")
    assert "s = 8192, optimizer lion, moments_dtype bf16;" in state.splitlines()[0]


def test_interleaved_at_one_stage_per_rank_holds_what_its_order_holds(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """torch's ScheduleInterleaved1F1B with v = 1 warms up 2(p − 1 − r) forwards: bubble, memory and simulate agree."""
    rc, out, _ = _run(capsys, "bubble", "-p", "4", "-m", "8", "-s", "interleaved", "--json")
    rc2, sim, _ = _run(capsys, "simulate", "-p", "4", "-m", "8", "-s", "interleaved-1f1b", "--json")
    assert rc == rc2 == 0
    assert json.loads(out)["peak_in_flight"] == json.loads(sim)["peak_in_flight"] == [7, 5, 3, 1]
    rc, mem, _ = _run(capsys, "memory", "--model", "gpt2", "-b", "1", "-p", "4", "-m", "8", "--schedule",
                      "interleaved-1f1b", "--json")  # fmt: skip
    assert rc == 0 and [s["in_flight"] for s in json.loads(mem)["stages"]] == [7, 5, 3, 1]
