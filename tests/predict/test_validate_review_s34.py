"""validate on edited or foreign tune results (a helper's review, 2026-12-08): a seq that disagrees with the file's
own model_shape, too few points found before this CPU is measured, a file's threads past this machine's cores, and
the sign of err% said in the text."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from microbatch.cpu_quota import usable_cores
from microbatch.errors import ConfigError
from microbatch.hardware import cpu_accelerator
from microbatch.predict.validation import validate_result
from microbatch.show.validation import render_validation, with_summary

TUNE = json.loads((Path(__file__).parents[1] / "data" / "tune_hf_gpt2_cpu.json").read_text())


def _fixed(**kw):
    return cpu_accelerator(flops_per_s=80e9, bytes_per_s=60e9, source="given")


def test_a_seq_that_disagrees_with_the_files_model_shape_is_refused():
    d = copy.deepcopy(TUNE)
    d["seq"] = 2 * d["model_shape"]["seq"]
    with pytest.raises(ConfigError, match=r"seq 512 and model_shape.seq 256 disagree"):
        validate_result(d, cpu_peak_gflops=80, cpu_bandwidth_gbs=60)


def test_too_few_points_are_refused_before_this_cpu_is_measured():
    d = copy.deepcopy(TUNE)
    d["points"] = d["points"][:1]

    def never(**kw):
        raise AssertionError("measured the CPU first")

    with pytest.raises(ConfigError, match="needs at least 3 measured b_m"):
        validate_result(d, measure=never)


def test_a_files_threads_past_the_cores_time_this_cpu_on_its_cores():
    d = copy.deepcopy(TUNE)
    d["threads"] = usable_cores() + 6
    seen = []

    def measure(**kw):
        seen.append(kw.get("threads"))
        return _fixed()

    out = validate_result(d, measure=measure)
    assert seen and all(t <= usable_cores() for t in seen if t is not None)
    assert any(f"the file's {usable_cores() + 6} threads are more than" in n for n in out["warnings"])


def test_the_text_says_what_err_percent_is():
    text = render_validation(with_summary(validate_result(copy.deepcopy(TUNE), measure=_fixed)))
    assert "err% = (predicted − measured) / measured" in text and "mem MiB and step ms are measured" in text


def test_the_threads_note_only_where_this_cpu_is_timed():
    d = copy.deepcopy(TUNE)
    d["threads"] = usable_cores() + 6
    out = validate_result(d, cpu_peak_gflops=80, cpu_bandwidth_gbs=60)  # both given: nothing timed here
    assert not any("threads are more than" in w for w in out["warnings"])
