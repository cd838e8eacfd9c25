"""A new user's mistakes (a sweep of every command, 2026-12-08): a --gpu-set figure given twice, a layer split that
names another number of stages."""

from __future__ import annotations

from microbatch.cli import main


def _run(capsys, *args):
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_a_gpu_set_figure_given_twice_is_refused(capsys):
    code, _, err = _run(capsys, "plan", "--model", "llama-2-7b", "--gpu", "a100-80gb", "-B", "64", "-p", "4",
                        "--gpu-set", "memory_bytes=80GiB", "--gpu-set", "memory_bytes=40GiB")  # fmt: skip
    assert code == 2 and "gives memory_bytes twice" in err  # the last won silently: planned at 40 GiB


def test_a_split_naming_other_stages_says_which_p(capsys):
    code, _, err = _run(capsys, "memory", "--model", "gpt2", "-b", "4", "--layers-per-stage", "3,3,3,3")
    assert code == 2 and "it names 4 stages: give --pipeline-parallel 4 with it" in err
