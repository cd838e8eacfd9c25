"""One JSON envelope: every command's --json is ``{"command", "version", ...result}``, checked by value;
a bad input with --json is ``{"error", "kind": "bad_input"}`` on stdout and exit 2; ``report``
reads every command's JSON back."""

from __future__ import annotations

import json

import click
import pytest
from _cli import run, run_json

import microbatch
from microbatch.cli import COMMANDS, group, main

GIB = 2**30
VERSION = microbatch.__version__


def test_every_command_takes_json():
    ctx = click.Context(group)
    for name in COMMANDS:
        cmd = group.get_command(ctx, name)
        assert any("--json" in p.opts for p in cmd.params), name


def test_batch(capsys):
    d = run_json(["batch", "-B", "512", "-b", "8", "-d", "4"], capsys)
    assert (d["global_batch"], d["micro_batch"], d["grad_accum"], d["data_parallel"]) == (512, 8, 16, 4)


def test_bubble(capsys):
    d = run_json(["bubble", "-p", "4", "-m", "4"], capsys)
    assert d["bubble_fraction"] == pytest.approx(3 / 7) and d["stages"] == 4 and d["microbatches"] == 4


def test_simulate(capsys):
    d = run_json(["simulate", "-s", "1f1b", "-p", "2", "-m", "2"], capsys)
    assert d["schedule"] == "1f1b" and d["bubble_fraction"] == pytest.approx(1 / 3)
    assert len(d["stage_stats"]) == 2


def test_memory(capsys):
    d = run_json(["memory", "--model", "gpt2", "-p", "2", "-m", "4", "-b", "1"], capsys)
    assert d["model"] == "gpt2" and d["model_shape"]["name"] == "gpt2" and len(d["stages"]) == 2
    assert d["peak_memory_bytes"] == max(s["peak_memory_bytes"] for s in d["stages"])


PLAN = ["plan", "--model", "gpt2", "-B", "64", "-d", "2", "-p", "2"]


def test_plan_and_export(capsys, tmp_path):
    d = run_json([*PLAN[:-2], "--gpu", "a100-80gb"], capsys)  # no pipeline: the Trainer runs none
    rec = d["recommended"]
    assert d["global_batch"] == 64 and rec["micro_batch"] * rec["grad_accum"] * 2 == 64
    assert d["model"] == "gpt2" and d["model_shape"]["name"] == "gpt2" and d["gpu"]["name"] == "a100-80gb"
    f = tmp_path / "plan.json"
    f.write_text(json.dumps(d))
    e = run_json(["export", "--plan", str(f), "--format", "hf"], capsys)
    assert e["format"] == "hf"
    assert e["config"]["per_device_train_batch_size"] == rec["micro_batch"]
    assert e["config"]["gradient_accumulation_steps"] == rec["grad_accum"]
    # written to a file: the same envelope
    assert (
        main(["export", "--plan", str(f), "--format", "hf", "--json", "-o", str(tmp_path / "hf.json")]) == 0
    )
    saved = json.loads((tmp_path / "hf.json").read_text())
    assert saved["command"] == "export" and saved["config"] == e["config"]
    printed = json.loads(capsys.readouterr().out)  # --json always prints its one object on stdout
    assert printed["config"] == e["config"] and printed["output"] == str(tmp_path / "hf.json")


def test_plan_multi_gpu(capsys):
    d = run_json([*PLAN, "--gpu", "h100-sxm,a100-80gb"], capsys)
    assert [p["gpu"]["name"] for p in d["plans"]] == ["h100-sxm", "a100-80gb"]
    assert all("command" not in p for p in d["plans"])  # one envelope, outside


def test_recommend(capsys, tmp_path):
    f = tmp_path / "curve.json"
    f.write_text(
        json.dumps(
            [
                {"micro_batch": 1, "throughput": 1000},
                {"micro_batch": 4, "throughput": 3200},
                {"micro_batch": 8, "throughput": 5000},
                {"micro_batch": 16, "throughput": 5600},
            ]
        )
    )
    d = run_json(["recommend", "-m", str(f), "--tolerance", "0.15", "-B", "64"], capsys)
    assert d["micro_batch"] == 8 and d["grad_accum"] == 8 and d["throughput"] == 5000


def _calibration(tmp_path):
    pts = [
        {
            "micro_batch": b,
            "throughput": 1024 * b / (0.05 + 0.04 * b),
            "peak_memory_bytes": 2 * GIB + b * 400 * 2**20,
            "step_time_s": 0.05 + 0.04 * b,
            "oom": False,
        }
        for b in (1, 2, 4, 8, 16)
    ]
    d = {
        "points": pts,
        "model": "gpt2",
        "seq": 1024,
        "precision": "bf16-mixed",
        "checkpointing": "off",
        "device": "cuda",
        "device_name": "NVIDIA A100-SXM4-80GB",
        "mode": "train",
    }
    f = tmp_path / "result.json"
    f.write_text(json.dumps(d))
    return f


def test_validate(capsys, tmp_path):
    d = run_json(["validate", "--calibration", str(_calibration(tmp_path))], capsys)
    assert [r["micro_batch"] for r in d["rows"]] == [1, 2, 4, 8, 16]
    assert d["accelerator"]["name"] == "a100-80gb"


def test_memory_on_a_gpu_from_a_cpu_tune_says_what_its_fixed_bytes_are(capsys, tmp_path):
    """`memory --gpu h100-sxm --calibration <a CPU tune>` added the CPU process's resident memory as fixed bytes and
    said "fits" without a word; `plan` says what those bytes stand for on a GPU, and `memory` now says it too."""
    f = _calibration(tmp_path)
    d = json.loads(f.read_text())
    f.write_text(json.dumps({**d, "device": "cpu", "device_name": "AMD EPYC (2 cpus)"}))
    args = ["memory", "--model", "gpt2", "--seq", "1024", "-b", "4", "--calibration", str(f)]
    on_gpu = run_json([*args, "--gpu", "h100-sxm"], capsys)
    assert any("a CPU process's resident memory" in n for n in on_gpu["calibration_notes"])
    here = run_json(args, capsys)  # no GPU named: nothing to say about a CUDA context
    assert not any("CUDA context" in n for n in here["calibration_notes"])


def test_a_calibration_tuned_without_dropout_says_so_on_a_plan_with_it(capsys, tmp_path):
    """tune prices the built-in models without dropout; `memory --model gpt2` plans with it (the registry's): the
    scale was applied to terms 2-3% larger without a word."""
    from dataclasses import replace

    from microbatch.model import get_model

    f = _calibration(tmp_path)
    shape = replace(get_model("gpt2", seq=1024), dropout=False)
    f.write_text(json.dumps({**json.loads(f.read_text()), "model_shape": shape.to_dict()}))
    notes = run_json(
        ["memory", "--model", "gpt2", "--seq", "1024", "-b", "4", "--calibration", str(f)], capsys
    )["calibration_notes"]
    assert any("measured without dropout, the plan is with" in n for n in notes)
    # a file that does not record the shape it measured (the Python API's to_dict): its dropout is not known, so
    # nothing is said of it (the registry's dropout would be a guess)
    f.write_text(json.dumps({k: v for k, v in json.loads(f.read_text()).items() if k != "model_shape"}))
    notes = run_json(
        ["memory", "--model", "gpt2", "--seq", "1024", "-b", "4", "--calibration", str(f)], capsys
    )["calibration_notes"]
    assert not any("dropout" in n for n in notes)


def test_tune_out_file_has_the_envelope_and_feeds_recommend(capsys, tmp_path, monkeypatch):
    """The one probing command, at tiny sizes: stdout and the --out file carry the same envelope."""
    monkeypatch.setenv("MICROBATCH_CACHE_DIR", str(tmp_path / "cache"))
    args = ["tune", "--model", "tiny", "--seq", "16", "--max-micro-batch", "1", "--repeats", "1"]
    d = run_json([*args, "--memory-budget", "2GiB", "--out", str(tmp_path / "out")], capsys)
    assert d["model"] == "tiny" and d["seq"] == 16 and d["memory_budget_bytes"] == 2 * GIB
    assert [p["micro_batch"] for p in d["points"]] == [1]
    saved = json.loads((tmp_path / "out" / "result.json").read_text())
    assert saved == d
    r = run_json(["recommend", "-m", str(tmp_path / "out" / "result.json")], capsys)
    assert r["micro_batch"] == d["micro_batch"]


def _results(capsys, tmp_path, commands):
    """Each command's --json output saved to a file."""
    runs = {
        "batch": ["batch", "-B", "512", "-b", "8", "-d", "4"],
        "bubble": ["bubble", "-p", "4", "-m", "4"],
        "simulate": ["simulate", "-s", "1f1b", "-p", "2", "-m", "2", "--intervals"],
        "memory": ["memory", "--model", "gpt2", "-p", "2", "-m", "4", "-b", "1"],
        "plan": [*PLAN, "--gpu", "h100-sxm,a100-80gb"],
        "validate": ["validate", "--calibration", str(_calibration(tmp_path))],
    }
    files = []
    for name in commands:
        files.append(tmp_path / f"{name}.json")
        files[-1].write_text(json.dumps(run_json(runs[name], capsys)))
    return [str(f) for f in files]


def test_report_reads_results_by_command_multi_gpu_plan_included(capsys, tmp_path):
    """report recognises each result by its command field; a multi-GPU plan shows its comparison and each
    accelerator's plan (one section: the command line's report reached the comparison only when given an object)."""
    files = _results(capsys, tmp_path, ["simulate", "plan", "validate"])
    out = tmp_path / "r.html"
    rep = run_json(["report", *files, "--out", str(out), "--no-png"], capsys)
    assert rep["html"] == str(out) and rep["figures"] == []
    assert rep["sections"] == ["plan", "simulate", "validate"]
    html = out.read_text()
    assert "on h100-sxm" in html and "on a100-80gb" in html  # both accelerators' plans
    assert "Plans compared across accelerators" in html
    assert "id='fig-bubble-sim-1'" in html  # the simulated bubble chart, from --intervals (the second result)
    assert "time (forward = 1)" in html  # its time axis says its unit
    # given as an object (the library's call), the comparison keeps its table too
    from microbatch.show.html import build_report

    comparison = json.loads((tmp_path / "plan.json").read_text())
    built = build_report([comparison], tmp_path / "c.html", png=False)
    text = built.html_path.read_text()
    assert built.sections == ["plan"] and "Plans compared across accelerators" in text
    assert "on h100-sxm" in text and "on a100-80gb" in text


def test_report_reads_every_command(capsys, tmp_path):
    """Commands without figures of their own (batch, bubble, memory, export, report) become tables."""
    files = _results(capsys, tmp_path, ["batch", "bubble", "memory"])
    plan = tmp_path / "plan1.json"
    plan.write_text(json.dumps(run_json([*PLAN, "--gpu", "a100-80gb"], capsys)))
    files.append(str(tmp_path / "export.json"))
    assert main(["export", "--plan", str(plan), "--format", "deepspeed", "--json", "-o", files[-1]]) == 0
    assert json.loads(capsys.readouterr().out)["output"] == files[-1]
    first = tmp_path / "first.html"
    files.append(str(tmp_path / "report.json"))
    (tmp_path / "report.json").write_text(
        json.dumps(run_json(["report", str(plan), "--out", str(first), "--no-png"], capsys))
    )
    out = tmp_path / "r.html"
    rep = run_json(["report", *files, "--out", str(out), "--no-png"], capsys)
    assert rep["sections"] == ["batch", "bubble", "memory", "export", "report"]
    html = out.read_text()
    assert "<td>grad_accum</td><td>16</td>" in html  # batch
    assert "<td>bubble_fraction</td><td>0.4286</td>" in html  # bubble: 3/7
    assert "<td>model</td><td>gpt2</td>" in html and "<h3>stages</h3>" in html  # memory
    assert "train_micro_batch_size_per_gpu" in html  # export
    assert str(first) in html  # report


@pytest.mark.parametrize(
    "args,msg",
    [
        (["batch", "-B", "500", "-b", "8", "-d", "4"], r"not divisible"),
        (["bubble", "-p", "x", "-m", "4"], r"not a valid integer"),
        (["batch", "--no-such-flag"], r"No such option"),
        (["memory", "--model", "no-such-model", "-p", "2", "-m", "4", "-b", "1"], r"no-such-model"),
    ],
)
def test_bad_input_is_an_error_object_and_exit_2(capsys, args, msg):
    import re

    code, out, err = run([*args, "--json"], capsys)
    assert code == 2
    d = json.loads(out)
    assert d["kind"] == "bad_input" and re.search(msg, d["error"])
    assert d["command"] == args[0] and d["version"] == VERSION
    assert re.search(msg, err)  # the message on stderr too
    assert "Traceback" not in err


def test_bad_input_without_json_prints_nothing_on_stdout(capsys):
    code, out, err = run(["batch", "-B", "500", "-b", "8", "-d", "4"], capsys)
    assert code == 2 and out == "" and "not divisible" in err
