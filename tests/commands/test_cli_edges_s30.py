"""Output paths through a symbolic link whose target's folder is missing or is a file (2026-12-07, 14:40 UTC on)."""

from __future__ import annotations

import json
import os

import pytest

from tests.commands._cli import run

EXPORT = ["export", "--plan", "plan.json", "--format", "deepspeed", "-o"]


def test_a_link_into_a_folder_not_yet_made_is_written_through(plan_json, capsys):
    os.symlink("missing/dir/x.json", plan_json / "link.json")
    code, _, err = run([*EXPORT, "link.json"], capsys)
    assert code == 0, err
    written = json.loads((plan_json / "missing" / "dir" / "x.json").read_text(encoding="utf-8"))
    assert written["train_batch_size"] == 64
    assert os.path.islink(plan_json / "link.json")  # the link kept, its target written


def test_a_link_whose_target_folder_is_a_file_is_refused_before_the_work(plan_json, capsys):
    (plan_json / "afile").write_text("mine\n", encoding="utf-8")
    os.symlink("afile/x.json", plan_json / "link.json")
    code, _, err = run([*EXPORT, "link.json"], capsys)
    assert code == 2 and "afile is a file, not a folder" in err
    assert (plan_json / "afile").read_text(encoding="utf-8") == "mine\n"


def test_memory_takes_the_reduce_dtype_under_a_pipeline_where_fsdp2_holds_the_gradients_in_it(capsys):
    base = ["memory", "--model", "mixtral-8x7b", "-b", "1", "-p", "4", "-m", "8", "-d", "8", "-e", "8", "--zero", "3",
            "--schedule", "1f1b", "--json"]  # fmt: skip
    code, out, _ = run(base, capsys)
    auto = json.loads(out)["memory"]["gradients"]
    code_half, out_half, _ = run([*base, "--reduce-dtype", "half"], capsys)
    assert code == code_half == 0
    assert json.loads(out_half)["memory"]["gradients"] == pytest.approx(auto / 2)  # bf16 held, not fp32
    code, _, err = run([*base, "--reduce-dtype", "half", "--pp-grad-reduce", "each"], capsys)
    assert code == 2 and "the memory would not change" in err  # a shard reduced each micro-batch: no change


def test_a_figure_written_to_dev_stdout_goes_down_the_pipe():
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "microbatch", "simulate", "-p", "4", "-m", "8", "-s", "1f1b", "--svg", "/dev/stdout"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "<svg" in proc.stdout  # /dev/stdout resolves to /proc/<pid>/fd/pipe:[…]: not a folder to probe


def test_plan_and_memory_agree_on_what_changes_nothing_under_a_pipeline(capsys):
    code, _, err = run(["plan", "--model", "gpt2", "--gpu", "a100-80gb", "-B", "64", "-d", "4", "-p", "2", "--zero", "3",
                        "--zero3-impl", "fsdp1"], capsys)  # fmt: skip
    assert code == 2 and "under a pipeline ZeRO 2/3 is FSDP2" in err
    code, _, err = run(["memory", "--model", "gpt2", "-b", "2", "-d", "4", "-p", "2", "--zero", "2",
                        "--pp-grad-reduce", "each", "--reduce-dtype", "half"], capsys)  # fmt: skip
    assert code == 2 and "with --pp-grad-reduce each" in err and "give --zero 3 without a pipeline" not in err


def test_the_advice_under_a_pipeline_tries_zero_1_for_more_data_parallel_ranks(capsys):
    code, out, _ = run(["plan", "--model", "llama-2-70b", "--gpu", "a100-80gb", "-B", "64", "-t", "8", "--recompute",
                        "none", "--zero", "0", "-p", "2", "--memory-headroom", "0.33"], capsys)  # fmt: skip
    line = next(x for x in out.splitlines() if x.startswith("- data-parallel 8"))
    assert "with ZeRO-1" in line and "would fit" in line  # ZeRO-3 there holds its gradients whole in fp32


def test_decoding_takes_its_new_tokens_and_says_what_it_measured(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("MICROBATCH_CACHE_DIR", str(tmp_path))
    code, _, err = run(["tune", "--model", "tiny", "--new-tokens", "8"], capsys)
    assert code == 2 and "--mode is train; give --mode decode" in err
    base = ["tune", "--model", "tiny", "--mode", "decode", "--seq", "24", "--max-micro-batch", "2", "--no-cache",
            "--repeats", "3", "--json"]  # fmt: skip
    code, out, err = run([*base, "--new-tokens", "12"], capsys)
    assert code == 0, err
    res = json.loads(out)
    assert (res["new_tokens"], res["prompt_tokens"], res["seq"]) == (12, 12, 24)
    code, _, err = run([*base, "--new-tokens", "24"], capsys)  # no prompt left
    assert code == 2 and "needs --seq > 24" in err
