"""The one reader of result files: the envelope's ``command`` first, key-guessing for old files."""

from __future__ import annotations

import json

import pytest

from microbatch.cli import main
from microbatch.errors import ConfigError
from microbatch.records import classify, flag, load_json, load_results, number, positive, true_or_false


def test_classify_reads_the_command_before_the_keys():
    # keys that look like a tune result, but the envelope says plan: the envelope wins
    assert classify({"command": "plan", "points": [], "micro_batch": 1}) == "plan"
    assert classify({"command": "recommend", "points": [], "micro_batch": 4}) == "recommend"
    assert classify({"command": "memory", "stages": []}) == "memory"
    # files written before the envelope: guessed from the keys, as before
    assert classify({"points": [], "micro_batch": 1}) == "tune"
    assert classify({"recommended": {}, "candidates": []}) == "plan"
    assert classify({"plans": [], "comparison": []}) == "plan"
    with pytest.raises(ConfigError, match="cannot tell which command"):
        classify({"foo": 1})


def test_load_results_keeps_a_multi_gpu_plan_whole(tmp_path, capsys):
    args = ["plan", "--model", "gpt2", "--gpu", "a100-40gb,h100-sxm", "-B", "64", "-p", "2", "--json"]
    assert main(args) == 0
    path = tmp_path / "plans.json"
    path.write_text(capsys.readouterr().out)
    got = load_results([path])  # one result: the report compares its plans, then shows each
    assert [k for k, _ in got] == ["plan"]
    assert [r["gpu"]["name"] for r in got[0][1]["plans"]] == ["a100-40gb", "h100-sxm"]
    bad = json.loads(path.read_text())
    bad["plans"][1] = {"gpu": 1}  # each plan still checked, and named
    path.write_text(json.dumps(bad))
    with pytest.raises(ConfigError, match=r"plans\[1\]"):
        load_results([path])


def test_load_json_names_the_file_and_the_fix(tmp_path):
    with pytest.raises(ConfigError, match=r"result file .*nope.json' does not exist; give files"):
        load_json(tmp_path / "nope.json")
    with pytest.raises(ConfigError, match=r"result file '/dev/null' is not a regular file; give files"):
        load_json("/dev/null")  # exists, but is a device
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="is not JSON .* at line 1"):
        load_json(bad)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "result.json").write_text(json.dumps({"points": []}))
    assert load_json(tmp_path / "run") == {"points": []}  # a directory means its result.json
    assert load_json([1, 2]) == [1, 2]


def test_field_checks():
    assert number("2", what="micro_batch", whole=True) == 2.0 and number("") is None
    with pytest.raises(ConfigError, match="micro_batch 2.5 must be a whole number"):
        number(2.5, what="micro_batch", whole=True)
    with pytest.raises(ConfigError, match="not a number"):
        number(True)
    with pytest.raises(ConfigError, match="must be finite"):
        number("inf")
    assert positive(3, where="x") == 3.0 and positive(None, where="x") is None
    for bad in (0, -1, "3", True, float("nan")):
        with pytest.raises(ConfigError, match="must be a number > 0"):
            positive(bad, where="point 1: step_time_s")
    assert flag("on") is True and flag("full") is True and flag("off") is False and flag("auto") is None
    assert true_or_false("yes", where="oom") is True and true_or_false("", where="oom") is False
    with pytest.raises(ConfigError, match="oom 'maybe' must be true or false"):
        true_or_false("maybe", where="oom")
