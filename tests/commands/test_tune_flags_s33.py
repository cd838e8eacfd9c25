"""What the reviews of 2026-12-07 (evening) found in tune's timing flags: each fixed with a test that fails without it."""

from __future__ import annotations

import json

import pytest

from microbatch.cli import main
from microbatch.commands.tune import _timing


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    rc = main(list(args))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_a_wall_clock_given_is_kept():
    """--clock wall without --repeats was taken as "not given": on a CPU of 4 cores or fewer the rule then picked one
    thread and the process clock, while the output said "wall clock (as given)"."""
    timing = _timing("cpu", None, "wall")
    assert timing is not None and timing.clock == "wall"
    assert _timing("cpu", None, None) is None  # nothing given: the device's rule decides


def test_tune_times_with_the_clock_it_says(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    rc, out, err = _run(capsys, "tune", "--model", "tiny", "--mode", "decode", "--seq", "64", "--clock", "wall",
                        "--max-micro-batch", "1", "--no-cache", "--out", str(tmp_path / "r"), "--json")  # fmt: skip
    assert rc == 0, err
    result = json.loads(out)
    assert {p["clock"] for p in result["points"]} == {"wall"}
    assert "wall clock (as given)" in result["timing_choice"]


def test_a_decode_table_says_what_its_tokens_are(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    """The decode throughput leaves the prefill out (generated tokens over decode steps); the table said only
    "throughput" and "step ms", and the prefill's time was in the JSON alone."""
    rc, out, err = _run(capsys, "tune", "--model", "tiny", "--mode", "decode", "--seq", "64", "--max-micro-batch", "2",
                        "--no-cache", "--out", str(tmp_path / "r"))  # fmt: skip
    assert rc == 0, err
    head = next(line for line in out.splitlines() if line.strip().startswith("b_m"))
    assert "decode tok/s" in head and "ms/token" in head and "prefill ms" in head
    row = next(line for line in out.splitlines() if line.split()[:1] == ["2"])
    prefill_ms = float(row.split("MiB")[1].split()[0])
    assert prefill_ms > 0


def test_a_decode_tune_that_meets_no_limit_still_labels_its_table(
    capsys: pytest.CaptureFixture[str], tmp_path
):
    rc, out, err = _run(capsys, "tune", "--model", "tiny", "--mode", "decode", "--seq", "64", "--max-micro-batch", "2",
                        "--max-latency-ms", "0.000001", "--no-cache", "--out", str(tmp_path / "r"))  # fmt: skip
    assert rc == 2, err
    head = next(line for line in out.splitlines() if line.strip().startswith("b_m"))
    assert "decode tok/s" in head and "prefill ms" in head
