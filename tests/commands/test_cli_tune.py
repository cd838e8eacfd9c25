"""`microbatch recommend` and `microbatch tune`: JSON by value, bad input exits 2 with one line."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from _cli import run, run_json

from microbatch.model import get_model

SEED = [
    {"micro_batch": 1, "throughput": 1000},
    {"micro_batch": 4, "throughput": 3200},
    {"micro_batch": 8, "throughput": 5000},
    {"micro_batch": 16, "throughput": 5600},
]


def test_recommend_seed_json(tmp_path, capsys):
    f = tmp_path / "seed.json"
    f.write_text(json.dumps([dict(p, peak_memory_bytes=10**6 + 10**5 * p["micro_batch"]) for p in SEED]))
    d = run_json(
        [
            "recommend",
            "--measurements",
            str(f),
            "--global-batch",
            "512",
            "--data-parallel",
            "4",
            "--memory-budget",
            "3MB",
        ],
        capsys,
    )
    assert d["micro_batch"] == 8
    assert d["grad_accum"] == 512 // (8 * 4)
    assert d["throughput"] == 5000
    assert d["fraction_of_best"] == pytest.approx(5000 / 5600)
    assert d["peak_memory_bytes"] == 10**6 + 8 * 10**5
    assert d["fastest_fitting"]["micro_batch"] == 16 and d["fastest_fitting"]["grad_accum"] == 8
    assert d["memory_fit"]["intercept_bytes"] == pytest.approx(10**6)
    assert d["memory_fit"]["slope_bytes_per_sample"] == pytest.approx(10**5)
    # (3e6 · 0.9 − 1e6) / 1e5 = 17
    assert d["max_fitting_micro_batch"] == 17
    assert d["rule"] == "fraction" and d["tolerance"] == 0.15


def test_recommend_csv_and_rules(tmp_path, capsys):
    f = tmp_path / "c.csv"
    f.write_text(
        "micro_batch,throughput,peak_memory_bytes,oom\n1,1000,,\n4,3200,,\n8,5000,,\n16,5600,,\n32,,,true\n"
    )
    assert run_json(["recommend", "-m", str(f)], capsys)["micro_batch"] == 8
    assert run_json(["recommend", "-m", str(f), "--tolerance", "0.05"], capsys)["micro_batch"] == 16
    assert run_json(["recommend", "-m", str(f), "--rule", "gain"], capsys)["micro_batch"] == 8
    code, out, err = run(["recommend", "-m", str(f)], capsys)
    assert code == 0 and "knee" in out and "b_m = 8" in out and "out of memory" in out


def test_recommend_reference_bound(tmp_path, capsys):
    # T = b / (0.05 + 0.004·b): affine step time, bound 1/0.004 = 250 per s
    f = tmp_path / "affine.json"
    f.write_text(
        json.dumps([{"micro_batch": b, "throughput": b / (0.05 + 0.004 * b)} for b in (1, 2, 4, 8, 16)])
    )
    measured = run_json(["recommend", "-m", str(f)], capsys)
    bound = run_json(["recommend", "-m", str(f), "--reference", "bound"], capsys)
    assert measured["reference"] == "measured" and measured["throughput_bound"] is None
    assert bound["reference"] == "bound"
    assert bound["reference_throughput"] == pytest.approx(250.0)
    assert bound["throughput_bound"]["fitted_on"] == [1, 2, 4, 8, 16]
    # best measured 140.4: 8 (97.6) is below 0.85 x 140.4 = 119.3, so 16; against 250 nothing is
    # within 15% (212.5): the fastest is chosen and the text says how far it is from the bound
    assert measured["micro_batch"] == 16 and bound["micro_batch"] == 16
    assert bound["fraction_of_reference"] == pytest.approx((16 / (0.05 + 0.064)) / 250.0)
    code, out, _ = run(["recommend", "-m", str(f), "--reference", "bound"], capsys)
    assert code == 0 and "no b_m past 16 runs faster than 250.0" in out and "of the bound" in out
    # the line the knee had to clear: an exact line has no error, so two standard errors are 0
    assert (
        "the knee had to reach (1 − 0.15)·(1 + 0.0%) = 85.0% of it (two standard errors of that fit)" in out
    )
    # with 1 and 2 only there is no bound: the fixed 5% margin, said so
    f.write_text(json.dumps([{"micro_batch": 1, "throughput": 50.0}, {"micro_batch": 2, "throughput": 90.0}]))
    code, out, _ = run(["recommend", "-m", str(f), "--reference", "bound"], capsys)
    assert "(1 − 0.15)·(1 + 5.0%) = 89.2% of it (no fit to take it from)" in out
    code, _, err = run(["recommend", "-m", str(f), "--reference", "projected"], capsys)
    assert code == 2


def test_recommend_reads_tune_result_json(tmp_path, capsys):
    f = tmp_path / "result.json"
    f.write_text(json.dumps({"points": SEED, "model": "x"}))
    assert run_json(["recommend", "-m", str(f)], capsys)["micro_batch"] == 8


@pytest.mark.parametrize(
    "content,suffix,msg",
    [
        ("mb,throughput\n1,3\n", "csv", "missing column"),
        ("micro_batch,throughput\n1,fast\n", "csv", "not a number"),
        ("micro_batch,throughput\n0,3\n", "csv", "micro_batch"),
        ('[{"micro_batch": 2, "throughput": -5}]', "json", "throughput"),
        ('{"rows": []}', "json", "points"),
        ("[1, 2", "json", "not valid JSON"),
    ],
)
def test_recommend_bad_files_exit_2(tmp_path, capsys, content, suffix, msg):
    f = tmp_path / f"bad.{suffix}"
    f.write_text(content)
    code, out, err = run(["recommend", "-m", str(f)], capsys)
    assert code == 2
    assert msg in err and err.count("\n") == 1 and "Traceback" not in err


def test_recommend_missing_file_and_bad_budget(tmp_path, capsys):
    code, _, err = run(["recommend", "-m", str(tmp_path / "nope.json")], capsys)
    assert code == 2 and "does not exist" in err
    f = tmp_path / "s.json"
    f.write_text(json.dumps(SEED))
    code, _, err = run(["recommend", "-m", str(f), "--memory-budget", "lots"], capsys)
    assert code == 2 and "not a size" in err


def test_tune_json_tiny_child_process(tmp_path, monkeypatch, capsys):
    """The real CLI path: probes in a child process under the budget; result.json written."""
    monkeypatch.setenv("MICROBATCH_CACHE_DIR", str(tmp_path / "cache"))
    d = run_json(
        [
            "tune",
            "--model",
            "tiny",
            "--seq",
            "32",
            "--max-micro-batch",
            "4",
            "--repeats",
            "2",
            "--memory-budget",
            "2GiB",
            "--global-batch",
            "16",
            "--out",
            str(tmp_path / "out"),
        ],
        capsys,
    )
    assert d["model"] == "tiny" and d["seq"] == 32 and d["mode"] == "train"
    pts = d["points"]
    assert [p["micro_batch"] for p in pts] == [1, 2, 4][: len(pts)]
    assert all(not p["oom"] and p["peak_memory_bytes"] > 0 for p in pts)
    # the probe child timed each on glibc's steady heap, as a training process runs (where glibc has the calls)
    from microbatch.measure.hostmem import _libc

    assert {p["timed_heap"] for p in pts} == ({"steady"} if _libc() is not None else {None})
    assert not any("mapped afresh" in n for n in d["notes"])
    assert d["micro_batch"] in [p["micro_batch"] for p in pts]
    assert d["grad_accum"] == 16 // d["micro_batch"]
    assert d["memory_budget_bytes"] == 2 * 2**30 and d["oom_events"] == 0
    assert d["static_bytes"] > 0
    saved = json.loads((tmp_path / "out" / "result.json").read_text())
    assert saved["points"] == pts and saved["torch_version"] == d["torch_version"]
    # what validate needs to check the model it is given and to time the CPU as the probes ran
    assert saved["model_shape"]["hidden"] == 64 and saved["model_shape"]["seq"] == 32 and "threads" in saved
    # the built-in GPT applies no dropout: the shape measured says so (tiny's registry entry trains with it)
    assert saved["model_shape"]["dropout"] is False and get_model("tiny").dropout is True
    # recommend reads it back and agrees, given the same choice settings (tune's reference is the bound;
    # recommend's default, the best measured, may choose a smaller b_m on the same points)
    again = ["recommend", "-m", str(tmp_path / "out" / "result.json"), "--reference", d["reference"],
             "--memory-budget", "2GiB", "--global-batch", "16"]  # fmt: skip
    assert run_json(again, capsys)["micro_batch"] == d["micro_batch"]


@pytest.mark.parametrize(
    "args,msg",
    [
        (["--model", "no-such"], "unknown model"),
        (["--model", "tiny", "--seq", "0"], "seq"),
        (["--model", "tiny", "--seq", "-3"], "seq"),
        (["--model", "tiny", "--memory-budget", "20MB"], r"static memory: it needs at least"),
        (["--model", "tiny", "--device", "tpu"], "device"),
        (["--hf-config", "/no/such/config.json", "--seq", "8"], "is not a file"),
    ],
)
def test_tune_bad_input_exit_2(tmp_path, monkeypatch, capsys, args, msg):
    monkeypatch.setenv("MICROBATCH_CACHE_DIR", str(tmp_path))
    code, out, err = run(["tune", *args], capsys)
    assert code == 2, err
    assert msg.split("(")[0] in err or __import__("re").search(msg, err)
    assert "Traceback" not in err


def test_tune_b1_out_of_memory_says_so(tmp_path, monkeypatch, capsys):
    """A budget above the static memory but below what b_m = 1 needs."""
    monkeypatch.setenv("MICROBATCH_CACHE_DIR", str(tmp_path))
    from microbatch.measure.childprobe import ChildProber
    from microbatch.measure.spec import ProbeSpec
    from microbatch.measure.timing import TimingConfig

    spec = ProbeSpec(model="small", seq=128, timing=TimingConfig(warmup=0, min_repeats=1, max_repeats=1))
    p = ChildProber(spec)
    p.start()
    static = p.static_bytes
    p.close()
    # b_m = 1 needs ~24.6 MiB above the static memory; the static memory itself moves by 0.5-1.1 MiB
    # from one child process to the next (a 1 MiB margin fell under the next child's static once)
    code, out, err = run(
        ["tune", "--model", "small", "--seq", "128", "--memory-budget", str(static + 8 * 2**20)], capsys
    )
    assert code == 2, err
    assert "micro-batch 1 is already out of memory" in err and "checkpointing" in err and "--seq" in err


def test_help_mentions_longest_sequence_and_no_torch_import():
    out = subprocess.run(
        [sys.executable, "-m", "microbatch", "tune", "--help"], capture_output=True, text=True
    )
    assert out.returncode == 0 and "LONGEST sequence" in out.stdout
    code = "import sys, microbatch.cli, microbatch.choose.knee; assert 'torch' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_the_shape_a_tune_file_records_says_the_dropout_that_ran() -> None:
    """The built-in GPT runs none; the Hugging Face GPT-2 layout (learned positions) runs the shape's, as GPT-2's 0.1
    or off; its Llama layout (rotary) has no residual dropout and runs none."""
    from dataclasses import replace

    pytest.importorskip("transformers")
    from microbatch.choose.tune.config import ProbeConfig
    from microbatch.commands.tune import with_provenance
    from microbatch.measure.hf import hf_config_from_shape

    def recorded(model: str, backend: str) -> bool:
        d = with_provenance({}, {"model": model}, ProbeConfig(backend=backend, threads=1))
        assert d["threads"] == 1
        return bool(d["model_shape"]["dropout"])

    assert get_model("tiny").dropout and not get_model("llama-2-7b").dropout
    assert [recorded("tiny", "builtin"), recorded("tiny", "hf"), recorded("llama-2-7b", "hf")] == [
        False,
        True,
        False,
    ]
    tiny = get_model("tiny")
    assert hf_config_from_shape(tiny).resid_pdrop == hf_config_from_shape(tiny).attn_pdrop == 0.1
    off = hf_config_from_shape(replace(tiny, dropout=False))
    assert (off.resid_pdrop, off.embd_pdrop, off.attn_pdrop) == (0.0, 0.0, 0.0)


def test_tune_without_a_terminal_says_what_runs_while_a_probe_says_nothing(tmp_path, monkeypatch, capsys):
    """A long first probe (the child, the model, a set-up step) was silence in a log: a line comes every
    HEARTBEAT_S seconds without news (here 0.2 s, so each probe of this run outlasts it); a refusal, before any
    work, stays one line."""
    import microbatch.commands._heartbeat as hb

    monkeypatch.setattr(hb, "HEARTBEAT_S", 0.2)
    monkeypatch.setenv("MICROBATCH_CACHE_DIR", str(tmp_path / "cache"))
    code, _, err = run(
        ["tune", "--model", "tiny", "--seq", "32", "--max-micro-batch", "2", "--no-cache"], capsys
    )
    assert code == 0, err
    lines = err.splitlines()
    first = [
        i for i, s in enumerate(lines) if s.startswith("tune: probing b_m = 1 (the first probe also starts")
    ]
    point = [i for i, s in enumerate(lines) if s.startswith("tune: b_m = 1:")]
    assert first and point and first[0] < point[0]  # said before the first point arrived
    assert re.search(r"\[\d+ s\]$", lines[first[0]])
    code, _, err = run(["tune", "--model", "no-such-model"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "tune: probing" not in err


def test_tune_whose_points_all_miss_the_latency_limit_shows_and_returns_them(capsys):
    """Measured, but no b_m meets --max-latency-ms: the points were lost unless --out or the cache held them (the
    JSON error had none, the text no table) and the budget was a raw byte count; the walk stops at the first step
    over the limit (a larger one is slower)."""
    from microbatch.cli import main

    args = ["tune", "--model", "tiny", "--seq", "32", "--max-micro-batch", "4", "--max-latency-ms", "1e-6",
            "--no-cache", "--repeats", "3"]  # fmt: skip
    assert main(args) == 2
    out, err = capsys.readouterr()
    assert re.search(r"^\s+1\s+[\d,.]+\s+[\d.]+\s", out, re.M)  # the measured point's row
    assert re.search(
        r"peak memory <= [\d.]+ [KMGT]iB and step time <= 1e-06 ms \(the shortest step measured [\d.,]+ ms\); measured: 1;",
        err,
    )
    assert main([*args, "--json"]) == 2
    d = json.loads(capsys.readouterr().out)
    assert d["kind"] == "bad_input" and [p["micro_batch"] for p in d.get("points", ())] == [1], (
        d
    )  # d: what it said
    assert d["points"][0]["step_time_s"] > 0
