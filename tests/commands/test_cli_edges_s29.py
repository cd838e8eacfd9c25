"""Edges a fuzzer and a Ctrl-C driver found in the command line (a read-only review, 2026-12-07)."""

from __future__ import annotations

import json

import pytest

from tests.commands._cli import run


@pytest.mark.parametrize(
    ("name", "args"),
    [
        ("mine.cfg", ["export", "--plan", "plan.json", "--format", "deepspeed", "-o"]),
        ("mine.svg", ["simulate", "-p", "2", "-m", "2", "-s", "1f1b", "--svg"]),
        ("mine.html", ["report", "plan.json", "--no-png", "--out"]),
    ],
)
def test_a_users_file_reached_through_a_folder_not_yet_made_is_not_replaced(plan_json, capsys, name, args):
    mine = plan_json / "t" / name
    mine.write_text("precious\n", encoding="utf-8")
    code, _, err = run([*args, f"t/new/../{name}"], capsys)
    assert code == 2 and "it may be yours" in err
    assert mine.read_text(encoding="utf-8") == "precious\n"
    assert not (plan_json / "t" / "new").exists()  # refused before anything was made


def test_a_folder_reached_through_a_folder_not_yet_made_is_named_a_folder(plan_json, capsys):
    (plan_json / "t" / "d.svg").mkdir()
    code, _, err = run(["simulate", "-p", "2", "-m", "2", "-s", "1f1b", "--svg", "t/new/../d.svg"], capsys)
    assert code == 2 and "is a folder" in err


def test_an_earlier_export_through_such_a_path_is_still_replaced(plan_json, capsys):
    args = ["export", "--plan", "plan.json", "--format", "deepspeed", "-o"]
    assert run([*args, "t/out.json"], capsys)[0] == 0
    assert run([*args, "t/new/../out.json"], capsys)[0] == 0
    assert json.loads((plan_json / "t" / "out.json").read_text(encoding="utf-8"))["train_batch_size"] == 64


@pytest.mark.parametrize("command", [["bubble", "-m", "4"], ["simulate", "-m", "4", "-s", "1f1b"]])
def test_a_missing_stages_is_said_missing(command, capsys):
    code, _, err = run(command, capsys)
    assert code == 2 and "Missing option '--stages'" in err and "None" not in err


@pytest.mark.parametrize(
    ("item", "words"),
    [
        ("memory_bytes=1KiB", "e.g. memory_bytes=80GiB"),  # said 1KiBGiB
        ("memory_bytes=80", "e.g. memory_bytes=80GiB"),
        ("bf16=1", "'bf16=1': 1 FLOP/s is outside"),  # said 0.846591, the clock-scaled figure
        ("bf16=1e30", "1e+30 FLOP/s is outside"),  # planned at an MFU of 3e-16
        (
            "inter_node_bytes_per_s=25",
            "25 bytes/s is outside [1e+06, 1e+14] bytes/s; give the figure in bytes/s, "
            "e.g. inter_node_bytes_per_s=50e9",
        ),
        ("fp32=67", "e.g. fp32=67e12"),
    ],
)
def test_gpu_set_figures_are_refused_as_given_with_a_usable_example(item, words, capsys):
    code, _, err = run(["plan", "--model", "gpt2", "--gpu", "h100", "-B", "64", "--gpu-set", item], capsys)
    assert code == 2 and words in err and "GiBGiB" not in err


def test_gpu_set_takes_the_figures_of_real_parts(capsys):
    code, out, _ = run(["plan", "--model", "gpt2", "--gpu", "h100", "-B", "64", "--gpu-set", "fp8=4.5e15",
                        "--gpu-set", "memory_bandwidth_bytes_per_s=8e12", "--json"], capsys)  # fmt: skip
    assert code == 0 and json.loads(out)["recommended"] is not None


def test_a_report_refuses_a_hand_edited_negative_setting(plan_json, capsys):
    d = json.loads((plan_json / "plan.json").read_text(encoding="utf-8"))
    (plan_json / "bad.json").write_text(json.dumps({**d, "global_batch": -64}), encoding="utf-8")
    code, _, err = run(["report", "bad.json", "--no-png", "--out", "r.html"], capsys)
    assert code == 2 and "global_batch -64 must be a whole number >= 1" in err
    assert not (plan_json / "r.html").exists()


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "args",
    [
        ["noise", "--model", "tiny", "-B", "8", "-b", "2", "--steps", "2", "--json"],
        ["pipeline", "--model", "tiny", "--stages", "2", "--microbatches", "4", "--steps", "2", "--json"],
    ],
    ids=["noise", "pipeline"],
)
def test_a_closed_stdout_keeps_the_answer_in_a_file(args, tmp_path):
    """``>&-``: the answer was lost (noise, tune: "stdout is closed" and nothing kept), or a pipeline rank crashed
    flushing a stdout that is None and the run's measurements were lost (a review)."""
    import os
    import re
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "microbatch", *args], stderr=subprocess.PIPE, text=True, timeout=220,
                       cwd=tmp_path, preexec_fn=lambda: os.close(1),
                       env={**os.environ, "MICROBATCH_CACHE_DIR": str(tmp_path / "c")})  # fmt: skip
    assert r.returncode == 1, r.stderr[-2000:]
    kept = re.search(r"stdout is closed; the answer was kept in (\S+\.json)", r.stderr)
    assert kept is not None, r.stderr[-2000:]
    with open(kept[1], encoding="utf-8") as f:
        d = json.load(f)
    os.unlink(kept[1])
    assert d["command"] == args[0] and "error" not in d


def test_a_removed_working_folder_is_said_before_anything_runs(tmp_path):
    import subprocess
    import sys

    script = f'mkdir gone && cd gone && rmdir ../gone && exec "{sys.executable}" -m microbatch batch -B 8 -b 2 --json'
    r = subprocess.run(["sh", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "the working folder no longer exists" in json.loads(r.stdout)["error"], (
        r.stderr
    )


def test_a_legal_250_byte_file_name_is_written(plan_json, capsys):
    """The atomic writer's temporary name added ~20 bytes to the user's: a legal 250-byte name ran past 255
    (ENAMETOOLONG on a path the user never gave; bench-gpu lost its file after the whole benchmark, a review)."""
    name = "a" * 245 + ".json"
    code, _, err = run(["export", "--plan", "plan.json", "--format", "deepspeed", "-o", name], capsys)
    assert code == 0, err
    assert json.loads((plan_json / name).read_text(encoding="utf-8"))["train_batch_size"] == 64


def test_a_latin1_stream_gets_plain_letters_not_question_marks(tmp_path):
    import os
    import subprocess
    import sys

    args = ["bubble", "-p", "4", "-m", "8", "-s", "interleaved", "--virtual", "2"]
    r = subprocess.run([sys.executable, "-m", "microbatch", *args], capture_output=True, timeout=60, cwd=tmp_path,
                       env={**os.environ, "PYTHONIOENCODING": "latin-1"})  # fmt: skip
    assert r.returncode == 0 and b"(p-1)/(v" in r.stdout and b"?1)" not in r.stdout  # was (p?1)/(v\xd7m+p?1)


def test_a_long_name_in_multibyte_letters_is_written(tmp_path):
    from microbatch.files import write_text

    name = "😀" * 63  # 63 characters, 252 bytes: the temporary name was cut by characters
    write_text(tmp_path / name, "x")
    assert (tmp_path / name).read_text(encoding="utf-8") == "x"
