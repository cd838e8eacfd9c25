"""Issue 18, scripted: every bad input is refused up front (exit 2, one line naming the value, the
rule and the fix), and no computed result is lost. Each case runs in-process and in well under a
second, before any model is built or any probe starts; the Ctrl-C case runs a real tune in a
subprocess and sends it SIGINT (bounded by timeouts).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from microbatch.cli import main

T5 = {"model_type": "t5", "d_model": 512, "num_layers": 6, "num_heads": 8, "vocab_size": 32128,
      "is_encoder_decoder": True}  # fmt: skip
BERT = {"model_type": "bert", "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
        "vocab_size": 30522, "max_position_embeddings": 512}  # fmt: skip
SEED = [
    {"micro_batch": 1, "throughput": 1000},
    {"micro_batch": 4, "throughput": 3200},
    {"micro_batch": 8, "throughput": 5000},
    {"micro_batch": 16, "throughput": 5600},
]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MICROBATCH_CACHE_DIR", str(tmp_path / "cache"))


def check_refused(args, capsys, *patterns):
    """Run the CLI: exit 2, one line on stderr starting 'error:', matching every pattern."""
    t0 = time.process_time()  # CPU time: what the refusal cost; a loaded machine does not stretch it
    code = main(args)
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert code == 2, err
    assert len(lines) == 1, err
    for pat in patterns:
        assert re.search(pat, lines[0]), (pat, lines[0])
    assert time.process_time() - t0 < 20  # refused up front, not after probing
    return lines[0]


def write(tmp_path, name, obj):
    p = tmp_path / name
    p.write_text(json.dumps(obj) if not isinstance(obj, str) else obj)
    return str(p)


# 1. tune --out to a folder that cannot be written: refused before the run
def test_1_tune_out_unwritable(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    check_refused(["tune", "--model", "tiny", "--out", str(blocker / "sub")], capsys,
            r"--out '.*a-file/sub' cannot be written", r"give --out a folder you can write to")  # fmt: skip


def test_1_result_kept_when_writing_fails_late(tmp_path):
    """keep_result: the folder vanished after the check; the result goes beside and the line says where."""
    from microbatch.commands._common import keep_result

    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    path, why = keep_result(blocker / "result.json", {"knee": 8}, command="tune")
    assert why is not None and str(path) in why and "could not write" in why
    d = json.loads(Path(path).read_text())
    assert d["command"] == "tune" and d["knee"] == 8
    os.unlink(path)


# 2. noise with a global batch whose token ids alone exceed the host
def test_2_noise_huge_global_batch(capsys):
    check_refused(["noise", "--model", "tiny", "-B", "1000000000", "-b", "1", "--steps", "1"], capsys,
            r"B_global 1000000000", r"tokens \d", r"over 80% of the available memory", r"lower --global-batch")  # fmt: skip


def test_2_noise_prediction_counts_the_tokens():
    from microbatch.commands.noise import predicted_bytes
    from microbatch.model import get_model

    shape = get_model("tiny")
    a, b = predicted_bytes(shape, 1000, 1), predicted_bytes(shape, 2000, 1)
    assert b["tokens"] == 2 * a["tokens"] == 2 * 16 * 1000 * shape.seq
    assert a["model_state"] == 12 * shape.param_count()


# 4. a sequence longer than the model allows
def test_4_noise_long_sequence(capsys):
    check_refused(["noise", "--model", "tiny", "--seq", "100000", "-B", "16", "-b", "4", "--steps", "2"], capsys,
            r"seq 100000", r"activations \d", r"lower --micro-batch or --seq")  # fmt: skip


def test_4_memory_and_tune_refuse_seq_past_positions(capsys):
    check_refused(["memory", "--model", "gpt2", "--seq", "100000", "--gpu", "h100", "-b", "1"], capsys,
            r"--seq 100000 is longer than model gpt2's 1024 learned positions", r"use --seq 1024 or less")  # fmt: skip
    check_refused(["tune", "--model", "gpt2", "--seq", "4096"], capsys, r"--seq 4096 is longer .* 1024")


# 5. static memory predicted before the model is built
def test_5_tune_model_too_big_for_the_budget(capsys):
    line = check_refused(["tune", "--model", "llama-2-7b", "--max-micro-batch", "2", "--memory-budget", "16GiB"],
                   capsys, r"llama-2-7b \(6\.74 B parameters\)", r"16 B/param", r"memory budget 16\.00 GiB")  # fmt: skip
    need = float(re.search(r"needs ([\d.]+) GiB", line).group(1))
    from microbatch.model import get_model

    assert need == pytest.approx(16 * get_model("llama-2-7b").param_count() / 2**30, abs=0.01)
    # a tiny model against a tiny budget reads in units that show the numbers (was "0.00 B
    # parameters needs 0.00 GiB ... budget 0.00 GiB")
    check_refused(["tune", "--model", "tiny", "--memory-budget", "1KB"], capsys,
                  r"tiny \(136,960 parameters\) needs 2\.09 MiB", r"memory budget 1000 B")  # fmt: skip


def test_5_static_bytes_rule():
    from microbatch.choose.tune.preflight import static_train_bytes

    assert static_train_bytes(1000, "train") == 16_000  # fp32 weights 4 + grads 4 + AdamW 8
    assert static_train_bytes(1000, "decode") == 4_000


def test_5_demo_checks_its_model(capsys):
    check_refused(["demo", "--model", "no-such-model", "--quick"], capsys, r"no-such-model")


# 6. encoder and encoder-decoder configs are refused, with what is supported and why
@pytest.mark.parametrize("cfg,kind", [(T5, "encoder-decoder"), (BERT, "encoder")])
def test_6_hf_config_not_decoder_only(tmp_path, capsys, cfg, kind):
    path = write(tmp_path, "config.json", cfg)
    pats = [kind, r"supports decoder-only causal language models", r"AutoModelForCausalLM"]
    check_refused(["tune", "--hf-config", path, "--seq", "128"], capsys, *pats)
    check_refused(["memory", "--hf-config", path, "--gpu", "h100", "-b", "1"], capsys, *pats)


# 7. transformers missing: say which extra to install
def test_7_transformers_missing(tmp_path, capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "transformers" else real(n, *a)
    )
    cfg = dict(BERT, model_type="llama", hidden_act="silu", num_key_value_heads=12, intermediate_size=2048)
    path = write(tmp_path, "config.json", cfg)
    check_refused(["tune", "--hf-config", path, "--seq", "64"], capsys, r"pip install 'microbatch\[hf\]'")
    check_refused(
        ["tune", "--model", "tiny", "--backend", "hf"], capsys, r"--backend hf needs .*transformers"
    )


# 8. tune's settings, all checked before the first probe
@pytest.mark.parametrize(
    "args,patterns",
    [
        (["--threads", "-1"], [r"--threads must be a whole number >= 1, got -1"]),
        (["--threads", "0"], [r"--threads must be a whole number >= 1, got 0"]),
        (["--start", "16", "--max-micro-batch", "4"], [r"--start 16 is above --max-micro-batch 4", r"use --start 4"]),
        (["-B", "7", "-d", "2"], [r"--global-batch 7 is not divisible by --data-parallel 2", r"e\.g\. 6 or 8"]),
        (["-B", "6", "--start", "4", "--max-micro-batch", "5"], [r"leaves 6 samples per replica", r"no divisor of 6 \(1, 2, 3, 6\) lies from --start 4 to --max-micro-batch 5",
                                                                  r"a --start that divides 6"]),
        (["-B", "6", "--start", "8"], [r"leaves 6 samples per replica", r"use --start 1"]),
        (["--max-latency-ms", "-5"], [r"--max-latency-ms -5\.0 must be > 0"]),
        (["--clock", "process", "--threads", "2"], [r"--clock process with --threads 2"]),
    ],
)  # fmt: skip
def test_8_tune_settings(capsys, args, patterns):
    check_refused(["tune", "--model", "tiny", *args], capsys, *patterns)


# 9. Ctrl-C keeps the partial result and exits 130 saying what was kept
@pytest.mark.timeout(240)
def test_9_sigint_keeps_the_partial_result(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, MICROBATCH_CACHE_DIR=str(tmp_path / "cache"), PYTHONUNBUFFERED="1")
    args = [sys.executable, "-m", "microbatch.cli", "tune", "--model", "tiny", "--seq", "32", "--no-cache",
            "--reference", "measured", "--patience", "50", "--max-micro-batch", "4096", "--out", str(out)]  # fmt: skip
    # Ctrl-C as a terminal sends it, whatever this test runs under: a shell's background job
    # (`.ci/run &`) starts with SIGINT ignored, the ignore is inherited, and a Python started so
    # installs no KeyboardInterrupt handler (the tune then ran on, probing, past the 60 s)
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    try:
        assert proc.stderr is not None
        seen = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            seen.append(line)
            if sum(ln.startswith("tune: b_m =") for ln in seen) >= 2:  # 18: one line per probe, not a tty
                break
        assert sum(ln.startswith("tune: b_m =") for ln in seen) >= 2, "".join(seen)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, stderr
    assert re.search(r"interrupted: kept the \d+ point\(s\) measured \(b_m 1, 2", stderr), stderr
    assert str(out / "result.json") in stderr
    d = json.loads((out / "result.json").read_text())
    assert d["command"] == "tune" and d["interrupted"] is True
    assert [p["micro_batch"] for p in d["points"]][:2] == [1, 2]
    assert "knee" in stdout


# 10. CLI messages speak in flags
def test_10_batch_speaks_in_flags(capsys):
    line = check_refused(["batch", "-B", "512", "-b", "8", "-g", "3", "-d", "4"], capsys,
                   r"-B 512 != -b 8 × -g 3 × -d 4 = 96", r"give three of -B, -b, -g, -d")  # fmt: skip
    assert "solve()" not in line


def test_10_library_speaks_in_parameters():
    from microbatch.batch import BatchConfig
    from microbatch.errors import ConfigError

    with pytest.raises(
        ConfigError, match=r"give three of global_batch, micro_batch, grad_accum, data_parallel"
    ):
        BatchConfig(global_batch=512, micro_batch=8, grad_accum=3, data_parallel=4)


# 11. recommend: a folder, an empty file, repeats, points left out
def test_11_recommend_folder_and_empty(tmp_path, capsys):
    check_refused(["recommend", "-m", str(tmp_path)], capsys, r"is a folder", r"give a JSON or CSV file")
    check_refused(
        ["recommend", "-m", write(tmp_path, "e.csv", "")], capsys, r"is empty", r"micro_batch,throughput"
    )


def test_11_recommend_refuses_repeats(tmp_path, capsys):
    path = write(tmp_path, "r.csv", "micro_batch,throughput\n4,100\n8,100\n8,120\n")
    check_refused(
        ["recommend", "-m", path],
        capsys,
        r"micro_batch 8 appears 2 times \(lines 3, 4\)",  # as an editor numbers the file's lines
        r"refused, not averaged",
    )


def test_11_recommend_says_which_points_were_left_out(tmp_path, capsys):
    path = write(tmp_path, "seed.json", SEED)
    assert main(["recommend", "-m", path, "-B", "100", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["micro_batch"] == 4
    assert [x["micro_batch"] for x in d["left_out"]] == [8, 16]
    assert "does not divide global batch 100" in d["left_out"][0]["why"]
    assert main(["recommend", "-m", path, "-B", "100"]) == 0
    assert (
        "left out: b_m 8, 16 (b_m × d = b_m × 1 does not divide global batch 100)" in capsys.readouterr().out
    )


# 13. report accepts a plan result (one GPU or several)
def test_13_report_accepts_plan(tmp_path, capsys):
    args = ["plan", "--model", "llama-3-8b", "--global-batch", "1024", "--data-parallel", "16",
            "--pipeline-parallel", "4", "--json"]  # fmt: skip
    assert main([*args, "--gpu", "a100-80gb,h100-sxm"]) == 0
    cmp_path = write(tmp_path, "cmp.json", capsys.readouterr().out)
    html = tmp_path / "r.html"
    assert main(["report", cmp_path, "--out", str(html), "--no-png", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["sections"] == ["plan"]  # one result: the comparison, then each accelerator's plan
    text = html.read_text()
    assert "a100-80gb, p = 4" in text and "h100-sxm, p = 4" in text and "compared across accelerators" in text


# 16. a settled knee does not also say the curve had not flattened
def test_16_settled_knee_has_no_flatten_note():
    from microbatch.show.recommendation import render_recommendation

    d = {"micro_batch": 8, "rule": "fraction", "tolerance": 0.15, "throughput": 90.0, "fraction_of_best": 0.9,
         "peak_memory_bytes": None, "fastest_fitting": {"micro_batch": 16, "throughput": 100.0,
         "peak_memory_bytes": None}, "flattened": False}  # fmt: skip
    assert "had not flattened" in render_recommendation(d)
    settled = dict(d, stop_reason="knee settled: no micro-batch past 16 can beat 110/s")
    assert "had not flattened" not in render_recommendation(settled)


# 17. defaults that measure well: chosen from the cores, and said
def test_17_timing_defaults_follow_the_cores():
    from microbatch.commands.tune import SMALL_CPU, cpu_timing_defaults

    threads, clock, line = cpu_timing_defaults(None, None, cores=2)
    assert (threads, clock) == (1, "process") and "2 cores detected" in line
    threads, clock, line = cpu_timing_defaults(None, None, cores=SMALL_CPU + 1)
    assert (threads, clock) == (None, "wall") and f"{SMALL_CPU + 1} cores detected" in line
    assert cpu_timing_defaults(1, None, cores=64)[:2] == (1, "process")
    assert cpu_timing_defaults(None, "process", cores=64)[:2] == (1, "process")
    assert cpu_timing_defaults(8, None, cores=64)[:2] == (8, "wall")


# 19. found by a sweep of every command with bad input (2026-12-01)
def test_19_click_usage_errors_are_one_line_with_the_fix(capsys):
    line = check_refused(["batch", "-B", "1.5", "-b", "1"], capsys, r"'1\.5' is not a valid integer")
    assert line.endswith("see 'microbatch batch --help'") and "Usage:" not in line
    check_refused(["nosuchcmd"], capsys, r"No such command 'nosuchcmd'; see 'microbatch --help'")
    assert main([]) == 2  # no command: the help itself, not an error line around it
    assert capsys.readouterr().err.startswith("Usage: microbatch")
    assert main(["memory", "--model", "tiny", "--json"]) == 2  # a missing option, as JSON: one object
    out = json.loads(capsys.readouterr().out)
    assert out["kind"] == "bad_input" and "--micro-batch" in out["error"]


@pytest.mark.parametrize(
    "args,patterns",
    [
        (["-b", "0"], [r"micro-batch must be a whole number >= 1, got 0; give"]),  # was taken as "not given"
        (["-p", "2", "-v", "0"], [r"virtual must be a whole number >= 1, got 0"]),
        (["-d", "100000"], [r"use global batch 100000, or a data-parallel among"]),  # not "100000 or 100000"
        (
            ["--gpu-set", "bf16=0"],
            [r"'bf16=0': 0 FLOP/s is outside \[1e\+09, 1e\+17\] FLOP/s; give the figure in FLOP/s"],
        ),
    ],
)
def test_19_plan_refuses_zero_as_a_value(capsys, args, patterns):
    check_refused(["plan", "--model", "tiny", "--gpu", "a100-80gb", "-B", "64", *args], capsys, *patterns)


def test_19_report_names_the_file_and_checks_out_first(tmp_path, capsys):
    plan = write(tmp_path, "plan.json", "")
    assert main(["plan", "--model", "gpt2", "--gpu", "a100-80gb", "-B", "64", "--json"]) == 0
    Path(plan).write_text(capsys.readouterr().out)
    null = write(tmp_path, "null.json", "null")
    check_refused(
        ["report", null, "--out", str(tmp_path / "r.html")],
        capsys,
        r"null\.json' holds a JSON null \(null\), not an object",
    )
    empty = write(tmp_path, "list.json", "[]")
    check_refused(
        ["report", empty, "--out", str(tmp_path / "r.html")], capsys, r"list\.json holds an empty list"
    )
    blocker = write(tmp_path, "afile", "x")
    check_refused(
        ["report", plan, "--out", f"{blocker}/x.html"], capsys, r"--out .*afile.* cannot be written"
    )
    assert not list(tmp_path.glob("*.html"))
    # a bad input leaves no output folder behind: the inputs are read before --out's folder is made
    check_refused(["report", null, "--out", str(tmp_path / "new" / "r.html")], capsys, r"null\.json")
    assert not (tmp_path / "new").exists()


def test_19_validate_checks_its_options_before_measuring(tmp_path, capsys, monkeypatch):
    import microbatch.measure.cpu as cpu

    def measured(**_):
        raise AssertionError("the CPU was measured before the options were checked")

    monkeypatch.setattr(cpu, "measure_cpu", measured)
    f = write(tmp_path, "r.json", {"points": SEED})
    for args, pat in (
        (["--cpu-peak-gflops", "0"], r"--cpu-peak-gflops must be a finite number > 0, got 0\.0; give"),
        (["--cpu-bandwidth-gbs", "nan"], r"--cpu-bandwidth-gbs must be a finite number > 0, got nan"),
        (["--cpu-threads", "0"], r"--cpu-threads must be a whole number >= 1, got 0"),
        (["--fit-on", "1"], r"--fit-on 1 must be at least 2.*give --fit-on 2 or more"),
    ):
        check_refused(["validate", "--calibration", f, *args], capsys, pat)
    cpu = write(tmp_path, "cpu.json", {"device": "cpu", "model": "tiny", "seq": 64, "precision": "fp32",
                                       "points": SEED})  # fmt: skip
    check_refused(["validate", "--calibration", cpu, "--memory", "allocated"], capsys,
                  r"measured on cpu, which has no allocator count.*use --memory peak")  # fmt: skip


def test_19_noise_refuses_before_importing_torch():
    code = (
        "import sys; from microbatch.cli import main; rc = main(['noise', '-B', '0']); "
        "sys.exit(10 if 'torch' in sys.modules else rc)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr


def test_19_tune_threads_and_device(capsys):
    import torch

    check_refused(
        ["tune", "--model", "tiny", "--threads", "100000"],
        capsys,
        r"threads 100000 is more than the \d+ core",
    )
    if not torch.cuda.is_available():
        check_refused(
            ["tune", "--model", "tiny", "--device", "cuda:99"], capsys, r"--device cuda:99: no CUDA"
        )


def test_19_recommend_inputs(tmp_path, capsys):
    null = write(tmp_path, "null.json", "null")
    check_refused(["recommend", "-m", null], capsys, r"null\.json: expected an object with a 'points' list")
    check_refused(["recommend", "-m", ""], capsys, r"--measurements '' names no file")
    f = write(tmp_path, "c.json", SEED)
    check_refused(["recommend", "-m", f, "-B", "7", "-d", "2"], capsys,
                  r"global batch 7 is not divisible by data-parallel 2.*use a global batch of 6 or 8")  # fmt: skip


def test_19_demo_refuses_a_model_over_its_budget_before_any_step(tmp_path, capsys):
    line = check_refused(["demo", "--model", "llama-2-7b", "--out", str(tmp_path / "d")], capsys,
                         r"over the demo's 4\.00 GiB.*use --model tiny, small, gpt2, or tune it")  # fmt: skip
    assert "microbatch tune --model llama-2-7b --memory-budget" in line
