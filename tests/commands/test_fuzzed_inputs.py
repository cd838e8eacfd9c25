"""Inputs a fuzzing helper found mishandled (session of 2026-12-05): each refused in one line (exit 2, the JSON
envelope under --json), or answered rightly, where it gave a traceback, wrong numbers or a false message."""

from __future__ import annotations

import json

import pytest

from microbatch.cli import main


def refused(args: list[str], capsys: pytest.CaptureFixture[str], pattern: str) -> str:
    import re

    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0] and re.search(pattern, err[0]), err
    assert main([*args, "--json"]) == 2
    assert json.loads(capsys.readouterr().out)["kind"] == "bad_input"
    return err[0]


@pytest.mark.parametrize(
    "flags,says",
    [
        (["-e", "0"], "--expert-parallel must be a whole number >= 1, got 0"),
        (["-c", "0"], "--context-parallel must be a whole number >= 1, got 0"),
        (
            ["--recompute", "full", "--recompute-every", "0"],
            "--recompute-every must be a whole number >= 1, got 0",
        ),
    ],
)
def test_zero_is_refused_where_it_read_as_one(capsys, flags, says):
    # `value or 1` turned 0 into 1 before the configs' checks (-1 was refused)
    err = refused(
        ["plan", "--model", "llama-2-7b", "--gpu", "a100-80gb", "-B", "64", "-p", "4", *flags], capsys, says
    )
    assert err.startswith("error: --") and "1 or more" in err  # the flag named, and the fix


@pytest.mark.parametrize("rec", [[1], "x", 5])
def test_export_of_a_plan_whose_recommendation_is_not_a_candidate(tmp_path, capsys, rec):
    assert main(["plan", "--model", "gpt2", "--gpu", "a100-80gb", "-B", "64", "-d", "8", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    plan["recommended"] = rec
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    refused(
        ["export", "--plan", str(path), "--format", "deepspeed"],
        capsys,
        "the plan's recommended is .*, not a candidate",
    )


def test_export_replaces_its_own_json_config_and_refuses_another(tmp_path, capsys):
    # a JSON config has no room for the 'written by microbatch' mark: re-exporting was refused as "not a file
    # microbatch wrote", which was false
    assert main(["plan", "--model", "gpt2", "--gpu", "a100-80gb", "-B", "64", "-d", "8", "--json"]) == 0
    plan = tmp_path / "plan.json"
    plan.write_text(capsys.readouterr().out)
    out = tmp_path / "ds.json"
    args = ["export", "--plan", str(plan), "--format", "deepspeed", "-o", str(out)]
    assert main(args) == 0 and main(args) == 0  # the second replaces the first
    capsys.readouterr()
    written = json.loads(out.read_text())
    assert written["train_micro_batch_size_per_gpu"] >= 1
    mine = tmp_path / "mine.json"
    mine.write_text(json.dumps({"train_batch_size": 8, "my_own": True}))
    err = refused(["export", "--plan", str(plan), "--format", "deepspeed", "-o", str(mine)][:-2] + ["-o", str(mine)],
                  capsys, "is not a deepspeed config with the keys this export writes")  # fmt: skip
    assert "give --force" in err and json.loads(mine.read_text())["my_own"] is True
    assert main(["export", "--plan", str(plan), "--format", "deepspeed", "-o", str(mine), "--force"]) == 0
    assert "my_own" not in json.loads(mine.read_text())


@pytest.mark.parametrize(
    "csv,says",
    [
        # an unquoted thousands separator read 1,000 as 1 (csv put the 000 aside): a 1000x wrong curve, no word
        (
            "micro_batch,throughput\n1,1,000\n4,3,200\n8,5,000\n",
            r"line 2 has 3 cells, the header 2; write numbers",
        ),
        ("micro_batch,throughput\n1,1000\n4,3200,99\n8,5000\n", r"line 3 has 3 cells"),
        # the last of two same-named columns was used
        (
            "micro_batch,throughput,micro_batch\n1,1000,2\n4,3200,8\n",
            r"names column\(s\) micro_batch more than once",
        ),
        ("micro_batch;throughput\n1;1000\n", r"separates its columns with ';'"),
    ],
)
def test_recommend_refuses_a_csv_whose_cells_do_not_line_up(tmp_path, capsys, csv, says):
    path = tmp_path / "m.csv"
    path.write_text(csv)
    err = refused(["recommend", "-m", str(path)], capsys, says)
    assert err.startswith(f"error: {path}: ")  # the file named


def test_recommend_bound_on_rates_too_small_to_invert(tmp_path, capsys):
    # b/T overflowed at T ~ 1e-320: a NaN line was taken as the bound ("nan%") and moved the knee from 4 to 8
    pts = [{"micro_batch": b, "throughput": t} for b, t in ((1, 1.0), (2, 2.0), (4, 3.0), (8, 3.1))]
    tiny = [{**p, "throughput": p["throughput"] * 1e-320} for p in pts]
    knees = []
    for i, points in enumerate((pts, tiny)):
        path = tmp_path / f"m{i}.json"
        path.write_text(json.dumps(points))
        assert main(["recommend", "-m", str(path), "--reference", "bound", "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert "nan" not in json.dumps(out).lower()
        knees.append(out["micro_batch"])
    assert knees == [4, 4]


def test_recommend_does_not_send_the_user_past_an_out_of_memory(tmp_path, capsys):
    # every b_m above the knee ran out of memory, and the note still said "a larger b_m may be faster"
    path = tmp_path / "m.csv"
    path.write_text("micro_batch,throughput,oom\n1,1000,\n4,3200,TRUE\n8,,yes\n")
    assert main(["recommend", "-m", str(path)]) == 0
    out = capsys.readouterr().out
    assert "a larger b_m may be faster" not in out and "the larger b_m ran out of memory" in out
    path.write_text(
        "micro_batch,throughput\n1,1000\n2,1900\n"
    )  # not flattened, nothing ran out: the note stays
    assert main(["recommend", "-m", str(path)]) == 0
    assert "a larger b_m may be faster" in capsys.readouterr().out
    assert main(["recommend", "-m", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["out_of_memory_above"] is False


def test_recommend_under_a_latency_limit_bounds_only_what_the_limit_leaves_in(tmp_path, capsys):
    """Fitted on the b_m under --max-latency-ms, the bound read "no b_m past 8 runs faster than T" beside measured
    b_m 16 and 32 that did, and the note "a larger b_m may be faster" beside them: both now say the limits."""
    path = tmp_path / "lat.csv"
    rows = ((1, 1000), (2, 1900), (4, 3500), (8, 6000), (16, 9000), (32, 12000))
    path.write_text("micro_batch,throughput,step_time_s\n" + "".join(f"{b},{t},{b / t}\n" for b, t in rows))
    assert main(["recommend", "-m", str(path), "--reference", "bound", "--max-latency-ms", "1.5"]) == 0
    out = capsys.readouterr().out
    assert "bound: no b_m past 8 within the limits runs faster than" in out
    # 6,000/s is 28% of the line's 21,135: the knee falls back to the best measured, and the line says so
    assert (
        "of it (two standard errors of that fit): no measured b_m reached it, so the knee is the best measured"
        in out
    )
    assert (
        "a larger b_m may be faster" not in out
        and "the larger b_m measured (16, 32) are past the limits" in out
    )
    assert main(["recommend", "-m", str(path), "--reference", "bound"]) == 0  # no limit: the plain statement
    out = capsys.readouterr().out
    assert "bound: no b_m past 32 runs faster than" in out


@pytest.mark.parametrize(
    "points,says",
    [
        ([{"micro_batch": 1, "throughput": "abc"}], r"row 1: throughput 'abc' is not a number"),
        ([{"micro_batch": True, "throughput": 5}], r"row 1: micro_batch True is not a number"),
        (
            [{"micro_batch": 1, "throughput": "1,000"}],
            r"throughput '1,000' is not a number; write numbers without",
        ),
    ],
)
def test_a_cell_that_is_not_a_number_is_named_by_its_field(tmp_path, capsys, points, says):
    path = tmp_path / "m.json"
    path.write_text(json.dumps(points))
    err = refused(["recommend", "-m", str(path)], capsys, says)
    assert err.startswith(f"error: {path}: row 1: ")  # the file and the row named


@pytest.mark.parametrize(
    "heads,kv,t", [(12, 4, 5), (12, 4, 6), (12, 4, 8), (32, 8, 3), (40, 8, 16), (96, 8, 12)]
)
def test_every_tensor_parallel_offered_passes_both_head_rules(heads, kv, t):
    # 3 and 6 were offered for 12 heads and 4 kv heads, and failed the kv rule next
    import re

    from microbatch.errors import ConfigError
    from microbatch.model import from_flags
    from microbatch.shape import check_tensor_parallel

    shape = from_flags(layers=2, hidden=heads * 64, heads=heads, kv_heads=kv, vocab=100, seq=128)
    with pytest.raises(ConfigError) as e:
        check_tensor_parallel(shape, t)
    offered = [int(x) for x in re.search(r"among ([0-9, ]+)$", str(e.value)).group(1).split(", ")]
    assert offered and t not in offered
    for good in offered:
        check_tensor_parallel(shape, good)


PLAN7B = ["plan", "--model", "llama-2-7b", "--gpu", "a100-80gb", "-B", "64", "-p", "4"]


@pytest.mark.parametrize(
    "flags,says",
    [
        # a v the named schedule does not run: dropped without a word (1f1b, zb-h1, dualpipev 4) or refused
        # quoting interleaving's rule (dualpipev 3)
        (
            ["--schedule", "dualpipev", "-v", "3"],
            r"virtual 3 is run by none of --schedule dualpipev \(dualpipev holds 2",
        ),
        (["--schedule", "dualpipev", "-v", "4"], r"virtual 4 is run by none of --schedule dualpipev"),
        (["--schedule", "1f1b", "-v", "2"], r"1f1b holds 1 stage per rank\); use virtual 1"),
        (["--schedule", "zb-h1", "-v", "2"], r"zb-h1 holds 1 stage per rank"),
        # the split given is the obstacle, not p (the p offered included the one given)
        (
            ["--layers-per-stage", "4,12,12,4", "--schedule", "dualpipev"],
            r"takes no --layers-per-stage; drop",
        ),
        # the message counted m at b_m 1 and asked for a global batch already given
        (
            ["-b", "16", "--schedule", "dualpipev"],
            r"m = B/\(d·b_m\) = 4 micro-batches \(b_m 16\).*raise the global batch to 128 \(m = 8\) or give a smaller --micro-batch",
        ),
    ],
)
def test_plan_names_the_schedule_rule_that_fails(capsys, flags, says):
    import re

    assert re.search(says, refused([*PLAN7B, *flags], capsys, says))


def test_plan_runs_the_v_its_schedules_take(capsys):
    for flags in (["--schedule", "dualpipev", "-v", "2"], ["--schedule", "interleaved-1f1b", "-v", "2"]):
        assert main([*PLAN7B, *flags, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["recommended"]["virtual"] == 2


def test_a_v_one_of_several_named_schedules_runs_is_taken():
    from microbatch.hardware import get_accelerator
    from microbatch.model import get_model
    from microbatch.predict.plan import PlanConfig, make_plan

    cfg = PlanConfig(shape=get_model("llama-2-7b"), gpu=get_accelerator("a100-80gb"), global_batch=64,
                     pipeline_parallel=4, schedules=("1f1b", "interleaved-1f1b"), virtuals=(2,))  # fmt: skip
    assert {c.virtual for c in make_plan(cfg).candidates} == {1, 2}  # -v is "only this v for interleaving"


def test_what_would_fit_is_what_that_plan_then_recommends(capsys):
    # the hints came from a pass without simulation taking the fastest: 33.6 GiB and 69,745 tokens/s for -p 8,
    # a row the -p 8 plan never showed
    import re

    args = ["plan", "--model", "llama-2-7b", "--gpu", "h100-sxm", "-B", "64"]
    assert main(args) == 2
    captured = capsys.readouterr()
    err = captured.out + captured.err
    hint = re.search(
        r"pipeline-parallel 8 \(8 GPUs, not 1\) would fit: ([0-9.]+) GiB at b_m = (\d+), (\S+), .*?([0-9,]+) tokens/s",
        err,
    )
    assert hint, err
    assert main([*args, "-p", "8", "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)["recommended"]
    assert float(hint.group(1)) == pytest.approx(rec["peak_memory_bytes"] / 2**30, abs=0.05)
    assert int(hint.group(2)) == rec["micro_batch"] and hint.group(3) == rec["schedule"]
    assert int(hint.group(4).replace(",", "")) == pytest.approx(rec["tokens_per_s"], abs=1)


def test_torchtitan_export_writes_an_uneven_split_as_module_lists(tmp_path, capsys):
    # the split was dropped, with a note saying it "was not read from the input" (it was in the plan file)
    import tomllib

    assert main(["plan", "--model", "llama-2-7b", "--gpu", "h100-sxm", "-B", "64", "-p", "4",
                 "--layers-per-stage", "7,9,9,7", "--json"]) == 0  # fmt: skip
    plan = tmp_path / "plan.json"
    plan.write_text(capsys.readouterr().out)
    assert main(["export", "--plan", str(plan), "--format", "torchtitan"]) == 0
    cfg = tomllib.loads(capsys.readouterr().out)
    parts = cfg["parallelism"]["module_fqns_per_model_part"]
    layers = [[m for m in part if m.startswith("layers.")] for part in parts]
    assert [len(x) for x in layers] == [7, 9, 9, 7]
    assert [m for x in layers for m in x] == [f"layers.{i}" for i in range(32)]
    assert parts[0][0] == "tok_embeddings" and parts[-1][-2:] == ["norm", "output"]
    assert "pipeline_parallel_layers_per_stage" not in cfg["parallelism"]


@pytest.mark.parametrize("fmt", ["hf", "lightning"])
def test_a_pipeline_plan_is_refused_by_trainers_that_run_none(tmp_path, capsys, fmt):
    # exported with exit 0 and a note: one process per rank holding the whole 7B model (117 GiB on an 80 GB GPU)
    # ZeRO 1: DeepSpeed's pipeline engine runs a bf16 model at stage 0 through its bf16 optimizer (refused there)
    assert main(["plan", "--model", "llama-2-7b", "--gpu", "a100-80gb", "-B", "64", "-p", "4", "--zero", "1",
                 "--json"]) == 0  # fmt: skip
    plan = tmp_path / "plan.json"
    plan.write_text(capsys.readouterr().out)
    refused(["export", "--plan", str(plan), "--format", fmt], capsys,
            r"runs no pipeline parallelism: each process would hold the whole model .* p = 4 stages")  # fmt: skip
    assert main(["export", "--plan", str(plan), "--format", "deepspeed"]) == 0  # the framework that runs it


@pytest.mark.parametrize(
    "args,says",
    [
        (["plan", "--model", "gpt2", "--gpu", "h100-sxm", "-B", "8", "--gpu-set", "gpus_per_node=1.5"],
         r"'gpus_per_node=1\.5': '1\.5' is not a whole number"),
        (["plan", "--model", "gpt2", "--gpu", "h100-sxm", "-B", "8", "--gpu-set", "name=foo"],
         r"name is not a figure to override; known: "),
        (["memory", "--model", "gpt2", "-b", "1", "--gpu", ""], r"--gpu '' names no accelerator; memory checks one"),
        (["memory", "--model", "gpt2", "-b", "1", "--gpu", "a100-80gb,h100-sxm"],
         r"names more than one accelerator; memory checks one .* plan --gpu a,b"),
    ],
)  # fmt: skip
def test_accelerator_inputs_are_refused_for_what_is_wrong_with_them(capsys, args, says):
    # '1.5' and 'foo' were "not a number"; memory ignored an empty --gpu and called two known names unknown
    err = refused(args, capsys, says)
    assert "not a number" not in err and "unknown accelerator" not in err  # the old, wrong reasons


def test_expert_parallel_offers_name_the_data_parallel_they_need(capsys):
    # at d = 1 the only EP offered was 1: the ones that divide the 8 experts need a data-parallel they divide
    err = refused(
        ["memory", "--model", "mixtral-8x7b", "-b", "1", "-e", "3"],
        capsys,
        r"use --expert-parallel among \[1\]",
    )
    assert "at data-parallel 1 (2, 4, 8 with a data-parallel they divide)" in err


def test_tune_keeps_the_points_no_limit_is_met_by(tmp_path, capsys):
    # measured b_m 1 and 2, then "no measured micro-batch meets ..." with nothing printed and --out left empty (now
    # b_m 1 only: its step is over the limit, and a larger one is slower)
    out = tmp_path / "run"
    args = ["tune", "--model", "tiny", "--max-micro-batch", "2", "--no-cache", "--max-latency-ms", "0.0001",
            "--out", str(out)]  # fmt: skip
    import re

    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # progress lines above it
    assert re.search(r"^error: no measured micro-batch meets .*; the 1 measured point\(s\) are kept in ", err)
    assert str(out / "result.json") in err and "Traceback" not in err
    kept = json.loads((out / "result.json").read_text())
    assert [p["micro_batch"] for p in kept["points"]] == [1] and kept["micro_batch"] is None
    assert (
        main(["recommend", "-m", str(out / "result.json"), "--json"]) == 0
    )  # the points choose without the limit
    assert json.loads(capsys.readouterr().out)["micro_batch"] == 1
    # report and export of the kept file say what it is (they read "no knee ... give the whole JSON a tune wrote",
    # and "the tune chose b_m = None without a global batch")
    refused(
        ["report", str(out), "--out", str(tmp_path / "r.html")],
        capsys,
        r"the points of a tune that chose nothing \(no measured micro-batch meets .*\); choose from them",
    )
    refused(
        ["export", "--tune", str(out), "--format", "hf"],
        capsys,
        r"the tune chose no b_m \(no measured micro-batch",
    )


def test_bench_gpu_on_the_cpu_times_several_threads_by_the_wall_clock(capsys):
    # the thread clock counts the calling thread only: --threads 8 on 2 cores read 0.716 TFLOP/s against 0.097
    import time

    from microbatch.hardware import usable_cores
    from microbatch.measure.microbench_config import cpu_clock

    assert cpu_clock(1) is time.thread_time and cpu_clock(2) is time.perf_counter
    n = usable_cores()
    refused(["bench-gpu", "--quick", "--threads", str(n + 1)], capsys,
            rf"--threads {n + 1} is more than the {n} core\(s\) this process may use")  # fmt: skip
    refused(["bench-gpu", "--quick", "--budget-s", "inf"], capsys, r"--budget-s inf must be a finite number")


@pytest.mark.parametrize(
    "args,says",
    [
        (
            ["tune", "--model", "tiny", "--out", ""],
            r"--out '' names no folder",
        ),  # wrote nothing, said nothing
        (["demo", "--quick", "--out", ""], r"--out '' names no folder"),  # wrote into the working folder
        (["simulate", "-p", "2", "-m", "2", "-s", "gpipe", "--svg", ""], r"--svg '' names no file"),
        (["bench-gpu", "--quick", "--out", ""], r"--out '' names no file"),
    ],
)
def test_an_empty_output_name_is_refused(capsys, args, says):
    err = refused(args, capsys, says)
    assert "give a" in err  # the fix: a folder or file name


@pytest.mark.parametrize("bms", ["", "1,,2", "1,1"])
def test_bench_gpu_micro_batches_are_distinct_sizes(capsys, bms):
    # '' ran the default, '1,,2' dropped the empty item, '1,1' timed every GEMM twice
    err = refused(
        ["bench-gpu", "--quick", "--micro-batches", bms],
        capsys,
        "is not a list of distinct positive integers",
    )
    assert f"--micro-batches {bms!r}" in err  # the value given, quoted as given


def test_a_float_micro_batch_size_is_said_to_be_one():
    import torch

    from microbatch.errors import ConfigError
    from microbatch.run.accumulate.microbatches import split

    with pytest.raises(ConfigError, match=r"got 4\.0 \(a float: give an int\)"):
        split(torch.zeros(4, 2), 4.0)


def test_export_keeps_a_hand_written_config_with_the_same_top_level_keys(tmp_path, capsys):
    # same top-level keys, and an offload setting of the user's nested inside: not an earlier export (a reviewer)
    assert main(["plan", "--model", "gpt2", "--gpu", "a100-80gb", "-B", "64", "-d", "8", "--json"]) == 0
    plan = tmp_path / "plan.json"
    plan.write_text(capsys.readouterr().out)
    out = tmp_path / "ds.json"
    assert main(["export", "--plan", str(plan), "--format", "deepspeed", "-o", str(out)]) == 0
    mine = json.loads(out.read_text())
    mine["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    out.write_text(json.dumps(mine))
    assert main(["export", "--plan", str(plan), "--format", "deepspeed", "-o", str(out)]) == 2
    assert "not a deepspeed config with the keys this export writes" in capsys.readouterr().err
    assert json.loads(out.read_text())["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}


def test_recommend_reads_a_csv_with_trailing_commas(tmp_path, capsys):
    # spreadsheets write them; the extra-cells check took them for an unquoted thousands separator (a reviewer)
    path = tmp_path / "m.csv"
    path.write_text("micro_batch,throughput,\n1,100,\n2,180,\n4,200,\n")
    assert main(["recommend", "-m", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["micro_batch"] in (2, 4)


def test_tune_wraps_only_the_no_point_meets_refusal():
    # the driver made every refusal of the choice "none meets a limit" (with "0 measured point(s) are kept")
    from microbatch.choose.curve import CurvePoint
    from microbatch.choose.knee import recommend
    from microbatch.errors import ConfigError, NoChoiceError

    with pytest.raises(ConfigError) as e:
        recommend([CurvePoint(micro_batch=1, oom=True)])
    assert not isinstance(e.value, NoChoiceError)
