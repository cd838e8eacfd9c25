"""Issue 32, scripted: the classes of bad input a new user hit, each refused up front with one line
(exit 2, the value, the rule and the fix; with --json one error object), in-process and in well under a
second each: tracebacks that reached the user, work done before a refusal, unbounded inputs, a user's
file overwritten, messages that misled. No probe, process or model is started.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest

from microbatch.cli import main

SEED = [
    {"micro_batch": 1, "throughput": 1000},
    {"micro_batch": 4, "throughput": 3200},
    {"micro_batch": 8, "throughput": 5000},
]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MICROBATCH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)


def check_refused(args, capsys, *patterns, limit_s=10.0):
    """exit 2, one 'error:' line on stderr matching every pattern, and with --json the same line as one
    error object on stdout; the line."""
    t0 = time.process_time()  # CPU time: what the refusal cost, which a loaded machine does not stretch
    code = main(args)
    out, err = capsys.readouterr()
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert code == 2, err
    assert len(lines) == 1 and "Traceback" not in err, err
    for pat in patterns:
        assert re.search(pat, lines[0]), (pat, lines[0])
    assert time.process_time() - t0 < limit_s  # refused up front (wall time failed at load ~10)
    assert main([*args, "--json"]) == 2
    obj = json.loads(capsys.readouterr().out)
    assert obj["kind"] == "bad_input" and obj["error"] == lines[0].removeprefix("error: ")
    return lines[0]


def write(path, obj):
    p = Path(path)
    p.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return str(p)


def tune_result(**over):
    d = {"command": "tune", "version": "0.1.0", "micro_batch": 4, "global_batch": 64, "grad_accum": 16,
         "data_parallel": 1, "precision": "fp32", "model": "tiny", "seq": 64, "device": "cpu",
         "points": [dict(p, peak_memory_bytes=1e6 * p["micro_batch"]) for p in SEED]}  # fmt: skip
    d.update(over)
    return d


# 1. tracebacks that reached the user ---------------------------------------------------------------
@pytest.mark.parametrize(
    "bad,pattern",
    [
        (
            {"points": [{"micro_batch": 4, "throughput": "fast"}]},
            r"point 1: throughput 'fast' is not a number",
        ),
        ({"points": [{"micro_batch": "4", "throughput": 5}]}, r"point 1: micro_batch '4' must be a whole"),
        ({"points": ["x"]}, r"point 1 is 'x', not an object"),
        ({"points": "x"}, r"points is a str, not a list"),
        ({"reference_throughput": "x"}, r"reference_throughput 'x' is not a number"),
        ({"micro_batch": 2.5}, r"the knee's micro_batch 2\.5 must be a whole number"),
        # a fuzzing helper's findings: NaN (json reads the literal), negative, twice measured, a knee not measured
        (
            {"points": [{"micro_batch": 4, "throughput": float("nan")}]},
            r"point 1: throughput nan is not finite",
        ),
        ({"points": [{"micro_batch": 4, "throughput": -5}]}, r"point 1: throughput -5 is negative"),
        (
            {"points": [{"micro_batch": 4, "throughput": 5}, {"micro_batch": 4, "throughput": 6}]},
            r"micro_batch 4 measured more than once",
        ),
        ({"micro_batch": 999}, r"the knee micro_batch 999 is not among the points measured \(1, 4, 8\)"),
    ],
)
def test_report_refuses_a_tune_whose_numbers_are_strings(tmp_path, capsys, bad, pattern):
    f = write(tmp_path / "r.json", tune_result(**bad))
    check_refused(
        ["report", f, "--out", str(tmp_path / "r.html"), "--no-png"], capsys, re.escape(f) + ": ", pattern
    )
    assert not (tmp_path / "r.html").exists()


def test_report_passes_the_librarys_own_refusal_through(tmp_path, capsys):
    """A good file with a bad --out: the library's message (the suffix), not 'a field of the wrong kind'."""
    good = write(tmp_path / "good.json", tune_result())
    check_refused(["report", good, "--out", str(tmp_path / "r"), "--no-png"], capsys,
            r"^error: report path .*/r' must end in \.html", r"for example --out report\.html")  # fmt: skip


def test_report_names_the_file_it_cannot_draw(tmp_path, capsys):
    """Any other field of the wrong kind (a plan, a pipeline, a validate result): the file is named,
    with what went wrong, not a traceback."""
    good = write(tmp_path / "good.json", tune_result())
    for name, obj, what in (
        (
            "plan.json",
            {"command": "plan", "version": "x", "recommended": "x", "candidates": 5},
            "candidates is 5",
        ),
        (
            "pipe.json",
            {"command": "pipeline", "version": "x", "measured": 5, "predicted": "x"},
            "a field holds",
        ),
        ("val.json", {"command": "validate", "version": "x", "rows": 5}, "rows is 5, not a list of objects"),
    ):
        bad = write(tmp_path / name, obj)
        check_refused(["report", good, bad, "--out", str(tmp_path / "r.html"), "--no-png"], capsys,
                rf"^error: {re.escape(bad)}: .*{what}")  # fmt: skip


# 3. unbounded inputs --------------------------------------------------------------------------------
def test_recommend_refuses_a_count_a_float_cannot_hold(tmp_path, capsys):
    f = write(tmp_path / "c.json", [{"micro_batch": 10**300, "throughput": 5}, *SEED])
    check_refused(
        ["recommend", "-m", f], capsys, r"micro_batch 1e\+300 is over 2\^53 = 9,007,199,254,740,992"
    )
    # 2^53 itself is exact: taken as it is, not rounded
    f = write(tmp_path / "d.json", [{"micro_batch": 2**53, "throughput": 1e9}, *SEED])
    assert main(["recommend", "-m", f, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["fastest_fitting"]["micro_batch"] == 2**53


def test_library_number_is_exact_up_to_2_53():
    from microbatch.errors import ConfigError
    from microbatch.records import MAX_EXACT_WHOLE, number

    assert number(MAX_EXACT_WHOLE, what="micro_batch", whole=True) == MAX_EXACT_WHOLE
    with pytest.raises(ConfigError, match=r"micro_batch 9007199254740993 is over 2\^53"):
        number(MAX_EXACT_WHOLE + 1, what="micro_batch", whole=True)


@pytest.mark.parametrize(
    "args",
    [
        ["bubble", "-p", "100000000", "-m", "100000000"],
        ["simulate", "-s", "gpipe", "-p", "100001", "-m", "1"],
        ["plan", "--model", "tiny", "--gpu", "h100", "-B", "64", "-p", "100001"],
        ["memory", "--model", "tiny", "--gpu", "h100", "-b", "1", "-p", "100001"],
        ["pipeline", "-p", "100001", "--no-predict"],
    ],
)
def test_stages_are_bounded_in_every_command(capsys, args):
    check_refused(
        args,
        capsys,
        r"stages = 100,0\d*,?\d* is over the limit of 100,000 ranks",
        r"use --stages 100,000 or fewer",
    )


def test_bubble_answers_at_the_stage_limit_in_closed_form(capsys):
    from microbatch.schedules.registry import MAX_STAGES

    assert main(["bubble", "-p", str(MAX_STAGES), "-m", str(10**30), "-s", "1f1b", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert len(d["peak_in_flight"]) == MAX_STAGES and d["peak_in_flight"][:2] == [MAX_STAGES, MAX_STAGES - 1]
    assert d["bubble_fraction"] == pytest.approx((MAX_STAGES - 1) / (10**30 + MAX_STAGES - 1))
    assert d["microbatches"] == 10**30  # an exact int, not a rounded float


@pytest.mark.parametrize(
    "args,flag",
    [
        (["batch", "-B", "100000000000000000000000", "-b", "7"], "--global-batch"),
        (["batch", "-B", "64", "-b", "1000000001"], "--micro-batch"),
        (["plan", "--model", "gpt2", "--gpu", "h100", "-B", "100000000000000000000"], "--global-batch"),
        (["plan", "--model", "gpt2", "--gpu", "h100", "-B", "64", "-d", str(10**10)], "--data-parallel"),
        (["tune", "--model", "tiny", "-B", "100000000000000000000"], "--global-batch"),
        (["memory", "--model", "gpt2", "--gpu", "h100", "-b", str(10**20)], "--micro-batch"),
        (["pipeline", "-B", str(10**12), "--no-predict"], "--global-batch"),
    ],
)
def test_batch_sizes_are_bounded(capsys, args, flag):
    check_refused(
        args,
        capsys,
        rf"'{flag}'",
        r"is over the limit of 1,000,000,000 sequences",
        r"give 1,000,000,000 or less",
    )


def test_recommend_global_batch_is_bounded(tmp_path, capsys):
    f = write(tmp_path / "c.json", SEED)
    check_refused(["recommend", "-m", f, "-B", str(10**20)], capsys, r"over the limit of 1,000,000,000")


# 4. a user's file overwritten -----------------------------------------------------------------------
@pytest.fixture
def plan_file(tmp_path, capsys):
    assert main(["plan", "--model", "gpt2", "--gpu", "a100-80gb", "-B", "64", "--json"]) == 0
    return write(tmp_path / "plan.json", capsys.readouterr().out)


def test_export_never_writes_over_its_input(tmp_path, capsys, plan_file):
    before = Path(plan_file).read_bytes()
    check_refused(["export", "--plan", plan_file, "--format", "deepspeed", "-o", plan_file, "--force"], capsys,
            r"--output .*plan\.json is the input --plan .*plan\.json", r"give --output another file")  # fmt: skip
    os.symlink(plan_file, tmp_path / "link.json")  # the same file by another name
    check_refused(["export", "--plan", str(tmp_path / "link.json"), "--format", "hf", "-o", plan_file], capsys,
            r"is the input --plan")  # fmt: skip
    check_refused(
        ["export", "--plan", plan_file, "--format", "hf", "-o", "./sub/../plan.json"], capsys, r"is the input"
    )
    assert Path(plan_file).read_bytes() == before
    run = tmp_path / "run"
    run.mkdir()
    result = write(run / "result.json", tune_result())
    check_refused(
        ["export", "--tune", str(run), "--format", "hf", "-o", result], capsys, r"is the input --tune"
    )
    assert json.loads(Path(result).read_text())["command"] == "tune"


def test_export_replaces_only_its_own_files_without_force(tmp_path, capsys, plan_file):
    mine = write(tmp_path / "ds.json", '{"train_batch_size": 7}')
    # a bare JSON config carries no mark: one with other keys is refused as possibly the user's (under --json the
    # file would hold the envelope, and the envelope's own rule speaks)
    for extra, says in (([], r"is not a deepspeed config with the keys this export writes"),
                        (["--json"], r"exists and is not a file microbatch wrote")):  # fmt: skip
        assert main(["export", "--plan", plan_file, "--format", "deepspeed", "-o", mine, *extra]) == 2
        captured = capsys.readouterr()
        text = json.loads(captured.out)["error"] if extra else captured.err
        assert re.search(r"--output .*ds\.json " if not extra else "", text) and re.search(says, text), text
        assert "give --force to replace it" in text
    assert json.loads(Path(mine).read_text()) == {"train_batch_size": 7}
    assert main(["export", "--plan", plan_file, "--format", "deepspeed", "-o", mine, "--force"]) == 0
    assert json.loads(Path(mine).read_text())["train_micro_batch_size_per_gpu"] >= 1
    # files we wrote are replaced without --force: the envelope (--json) and the TOML's mark
    for fmt, name, extra in (("hf", "hf.json", ["--json"]), ("torchtitan", "t.toml", [])):
        out = str(tmp_path / name)
        for _ in range(2):
            assert main(["export", "--plan", plan_file, "--format", fmt, "-o", out, *extra]) == 0, (
                capsys.readouterr().err
            )
    capsys.readouterr()
    assert Path(tmp_path / "t.toml").read_text().startswith("# written by microbatch export")


def test_charts_are_replaced_only_when_ours(tmp_path, capsys):
    svg, png = str(tmp_path / "t.svg"), str(tmp_path / "t.png")
    args = ["simulate", "-p", "2", "-m", "2", "-s", "gpipe", "--no-diagram", "--svg", svg, "--png", png]
    for _ in range(2):  # our own chart is replaced on a rerun
        assert main(args) == 0, capsys.readouterr().err
    capsys.readouterr()
    from microbatch.envelope import is_ours

    assert is_ours(svg) and is_ours(png)
    write(svg, "<svg>a drawing of mine</svg>")
    check_refused(args, capsys, r"--svg .*t\.svg exists and is not a file microbatch wrote")
    assert Path(svg).read_text() == "<svg>a drawing of mine</svg>"
    assert main([*args, "--force"]) == 0


def test_report_out_is_never_a_user_file(tmp_path, capsys):
    res = write(tmp_path / "t.json", tune_result())
    html = tmp_path / "r.html"
    for _ in range(2):  # our report is replaced on a rerun
        assert main(["report", res, "--out", str(html), "--no-png"]) == 0
    capsys.readouterr()
    html.write_text("<html>my notes</html>")
    check_refused(
        ["report", res, "--out", str(html), "--no-png"], capsys, r"--out .*r\.html exists and is not a file"
    )
    assert html.read_text() == "<html>my notes</html>"


def test_folders_of_results_keep_the_users_files(tmp_path, capsys):
    """tune --out and demo --out write result files in a folder: one there that is not ours is
    refused before any work (tune and demo have no --force: move it, or write elsewhere)."""
    out = tmp_path / "run"
    out.mkdir()
    write(out / "result.json", {"mine": 1})
    check_refused(["tune", "--model", "tiny", "--out", str(out)], capsys,
            r"--out .*run.*: result\.json exists and is not a file microbatch wrote", r"move it, or write elsewhere")  # fmt: skip
    write(out / "plan.json", "not json")
    check_refused(
        ["demo", "--quick", "--out", str(out)],
        capsys,
        r"plan\.json exists and is not a file microbatch wrote",
    )


def test_pipeline_outputs_checked_before_any_process(tmp_path, capsys):
    trace = write(tmp_path / "trace.json", {"traceEvents": []})
    check_refused(
        ["pipeline", "--trace", trace],
        capsys,
        r"--trace .*trace\.json exists and is not a file microbatch wrote",
    )


def test_is_ours():
    from microbatch.envelope import is_ours, mark_line

    def f(name, text):
        p = Path(name)
        p.write_bytes(text if isinstance(text, bytes) else text.encode())
        return p

    assert is_ours(f("a.json", '{"command": "plan", "version": "0.1.0", "x": 1}'))
    assert is_ours(f("e.json", ""))  # empty: nothing to lose
    assert is_ours(f("s.svg", mark_line("simulate", comment="<!--") + "\n<svg/>"))
    assert not is_ours(f("b.json", '{"command": "plan"}'))  # no version: not the envelope
    assert not is_ours(f("c.json", '[{"command": "plan", "version": "0.1.0"}]'))
    assert not is_ours(f("d.json", "{not json"))
    assert not is_ours(f("m.txt", "microbatch is mentioned here"))
    assert not is_ours(Path("missing"))


# 5. messages that misled ----------------------------------------------------------------------------
def test_a_file_in_the_way_is_called_a_file(tmp_path, capsys):
    blocker = write(tmp_path / "FILE", "x")
    check_refused(["simulate", "-p", "2", "-m", "2", "-s", "gpipe", "--svg", f"{blocker}/x.svg"], capsys,
            r"--svg .*FILE/x\.svg cannot be written: .*FILE is a file, not a folder")  # fmt: skip
    line = check_refused(["tune", "--model", "tiny", "--out", f"{blocker}/sub/deeper"], capsys,
                   r"cannot be written: .*FILE is a file, not a folder")  # fmt: skip
    assert "mkdir" not in line


def test_export_words_what_it_was_given(tmp_path, capsys, plan_file):
    tune = write(tmp_path / "result.json", tune_result())
    line = check_refused(["export", "--plan", tune, "--format", "hf"], capsys,
                   r"--plan .*result\.json holds a tune result", r"give it as --tune .*result\.json")  # fmt: skip
    assert "the plan lacks" not in line
    check_refused(
        ["export", "--tune", plan_file, "--format", "hf"],
        capsys,
        r"holds a plan result",
        r"give it as --plan",
    )
    sim = write(tmp_path / "sim.json", {"command": "simulate", "version": "0.1.0", "makespan": 1})
    check_refused(["export", "--plan", sim, "--format", "hf"], capsys, r"holds a simulate result",
            r"export reads a plan \(--plan.*or a tune \(--tune")  # fmt: skip


# 2. work before refusing: a config.json's own numbers, before transformers is imported ---------------
LLAMA = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
         "vocab_size": 128}  # fmt: skip


@pytest.mark.parametrize(
    "change,pattern",
    [
        ({"num_hidden_layers": "32"}, r"num_hidden_layers \(layers\) is '32', not a whole number >= 1; write it "
                                      r"as a JSON number: \"num_hidden_layers\": 32"),
        ({"num_hidden_layers": -2}, r"num_hidden_layers \(layers\) is -2, not a whole number >= 1"),
        ({"hidden_size": 64.5}, r"hidden_size \(hidden\) is 64\.5, not a whole number"),
        ({"vocab_size": True}, r"vocab_size \(vocab\) is True, not a whole number"),
        ({"max_position_embeddings": "long"}, r"max_position_embeddings \(seq\) is 'long'"),
        ({"num_key_value_heads": 0}, r"num_key_value_heads \(kv_heads\) is 0"),
        ({"num_hidden_layers": None}, r"lacks layers \(looked for layers: num_hidden_layers/n_layer.*\); add it "
                                      r"to the file"),
        ({"hidden_size": 62}, r"heads 4 do not divide hidden 62"),  # a rule between fields: the file named
    ],
)  # fmt: skip
def test_hf_config_fields_are_checked_before_transformers(tmp_path, capsys, monkeypatch, change, pattern):
    import importlib.util

    real = importlib.util.find_spec

    def find_spec(name, *a):
        if name == "transformers" and "hidden_size" not in change:  # the field rule needs the merged config
            raise AssertionError("transformers looked up before the file's numbers were checked")
        return real(name, *a)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    cfg = {k: v for k, v in {**LLAMA, **change}.items() if v is not None}
    f = write(tmp_path / "config.json", cfg)
    check_refused(["memory", "--hf-config", f, "--gpu", "h100", "-b", "1"], capsys, rf"--hf-config '{re.escape(f)}'",
            pattern)  # fmt: skip


def test_validate_refuses_more_threads_than_cores_before_measuring(tmp_path, capsys, monkeypatch):
    """--cpu-threads 10^20 measured the CPU for seconds, then raised torch's ValueError (a traceback)."""
    import microbatch.measure.cpu as cpu
    from microbatch.hardware import usable_cores

    def measured(**_):
        raise AssertionError("the CPU was measured before --cpu-threads was checked")

    monkeypatch.setattr(cpu, "measure_cpu", measured)
    f = write(tmp_path / "r.json", tune_result())
    cores = usable_cores()
    for n in (str(10**20), str(cores + 1)):
        check_refused(["validate", "--calibration", f, "--cpu-threads", n], capsys,
                rf"--cpu-threads {n} is more than the {cores} cores", rf"give --cpu-threads {cores} or fewer")  # fmt: skip


def test_export_of_a_tune_speaks_of_the_tune(tmp_path, capsys):
    bad = write(tmp_path / "t.json", tune_result(global_batch=65))  # 4 × 16 × 1 != 65
    line = check_refused(["export", "--tune", bad, "--format", "hf"], capsys, r"the tune result breaks B_global",
                   r"tune again or fix grad_accum")  # fmt: skip
    assert "plan" not in line
    strings = write(tmp_path / "s.json", tune_result(points=["x"]))  # was an AttributeError traceback
    check_refused(["export", "--tune", strings, "--format", "hf"], capsys, r"point 1 is 'x', not an object")


@pytest.mark.parametrize(
    "change,pattern",
    [
        ({"micro_batch": 10**300}, r"point 3: micro_batch 1e\+300 must be a whole number from 1 to 2\^53"),
        (
            {"peak_memory_bytes": 10**400},
            r"point 3: peak_memory_bytes a 401-digit number must be a number > 0",
        ),
    ],
)
def test_calibration_numbers_past_a_float_are_refused(tmp_path, capsys, change, pattern):
    """validate, plan --calibration and memory --calibration raised OverflowError on these (a traceback)."""
    pts = [dict(micro_batch=b, peak_memory_bytes=1e6 * b, step_time_s=0.01 * b) for b in (1, 2, 4)]
    pts[2].update(change)
    f = write(tmp_path / "cal.json", {"command": "tune", "version": "0.1.0", "device": "cpu", "model": "tiny",
                                      "seq": 64, "precision": "fp32", "points": pts})  # fmt: skip
    check_refused(
        ["validate", "--calibration", f, "--cpu-peak-gflops", "10", "--cpu-bandwidth-gbs", "10"],
        capsys,
        pattern,
    )
    check_refused(
        ["plan", "--model", "tiny", "--gpu", "h100", "-B", "64", "--calibration", f], capsys, pattern
    )
    check_refused(
        ["memory", "--model", "tiny", "--gpu", "h100", "-b", "1", "--calibration", f], capsys, pattern
    )


def test_recommend_refuses_a_number_past_the_largest_float(tmp_path, capsys):
    f = write(
        tmp_path / "c.json", [{"micro_batch": 1, "throughput": 10**400}, *SEED[1:]]
    )  # was OverflowError
    check_refused(
        ["recommend", "-m", f], capsys, r"row 1: throughput a 401-digit number is past the largest float"
    )


def test_report_figures_folder_keeps_the_users_files(tmp_path, capsys):
    res = write(tmp_path / "t.json", tune_result())
    html = tmp_path / "r.html"
    for _ in range(2):  # our PNGs carry the mark: a rerun replaces them
        assert main(["report", res, "--out", str(html)]) == 0, capsys.readouterr().err
    capsys.readouterr()
    figures = tmp_path / "r-figures"
    from microbatch.envelope import is_ours

    assert list(figures.glob("*.png")) and all(is_ours(p) for p in figures.glob("*.png"))
    (figures / "throughput.png").write_bytes(b"\x89PNG my own chart")
    check_refused(["report", res, "--out", str(html)], capsys, r"r-figures, which holds files microbatch did not write "
            r"\(throughput\.png\)", r"give --force")  # fmt: skip
    assert main(["report", res, "--out", str(html), "--no-png"]) == 0  # no figure written there: no refusal


def test_report_reads_a_tune_that_measured_a_b_m_again_with_checkpointing(tmp_path, capsys):
    # tune --checkpointing auto writes b_m 8 twice: out of memory without checkpointing, then measured with it; the
    # twice-measured check refused that ordinary output (a reviewer's finding)
    pts = [{"micro_batch": 4, "throughput": 3200, "checkpointing": False, "peak_memory_bytes": 4e6},
           {"micro_batch": 8, "oom": True, "checkpointing": False},
           {"micro_batch": 8, "throughput": 4000, "checkpointing": True, "peak_memory_bytes": 5e6}]  # fmt: skip
    f = write(tmp_path / "r.json", tune_result(points=pts, micro_batch=8))
    assert main(["report", f, "--out", str(tmp_path / "r.html"), "--no-png"]) == 0, capsys.readouterr().err
