"""What a read-only sweep of plan and memory with their combined flags found (2026-12-06): each refused with the
rule and the fix, or answered the same by both commands."""

from __future__ import annotations

import json

import pytest

from microbatch.cli import main


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    rc = main(list(args))
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("dropout", ["--dropout", "--no-dropout"])
def test_memory_takes_dropout_and_agrees_with_plan(capsys: pytest.CaptureFixture[str], dropout: str) -> None:
    """gpt2 (dropout on by default): memory could not turn it off, so it disagreed with plan --no-dropout."""
    rc, out, _ = _run(capsys, "plan", "--model", "gpt2", "--gpu", "a100-80gb", "-B", "16", "-d", "2", "-b", "4",
                      "--recompute", "none", "--zero", "1", dropout, "--json")  # fmt: skip
    planned = json.loads(out)["recommended"]["peak_memory_bytes"]
    rc2, out2, _ = _run(
        capsys, "memory", "--model", "gpt2", "-b", "4", "-d", "2", "--zero", "1", dropout, "--json"
    )
    assert rc == rc2 == 0 and json.loads(out2)["peak_memory_bytes"] == pytest.approx(planned, rel=1e-12)
    rc3, out3, _ = _run(capsys, "memory", "--model", "gpt2", "-b", "4", "-d", "2", "--zero", "1", "--json")
    default = json.loads(out3)["peak_memory_bytes"]  # the model's default: dropout on
    assert (default == json.loads(out2)["peak_memory_bytes"]) == (dropout == "--dropout")


PLAN = ("plan", "--model", "llama-3-8b", "--gpu", "h100-sxm", "-B", "64", "-d", "8")


@pytest.mark.parametrize(("more", "words"), [
    (("--zero", "1", "--zero3-impl", "fsdp1"), "--zero3-impl fsdp1 says who runs ZeRO 3, and --zero is 1"),
    (("--zero", "dist-opt", "--zero3-impl", "deepspeed"), "give --zero 3 (or auto) with it, or drop --zero3-impl"),
    (("-b", "2", "--precision", "fp8", "--fp8-recipe", "te-current", "--master-weights", "remainder"),
     "--master-weights remainder with --precision fp8 and --fp8-recipe te-current"),
    (("--precision", "fp8", "--master-weights", "remainder"), "use --fp8-recipe te-delayed, or --master-weights fp32"),
    (("--gpu-set", "rated_power_w=1"), "power_limit_w 700 W is above its rated_power_w 1 W"),
])  # fmt: skip
def test_a_setting_that_changes_nothing_or_cannot_run_is_refused(
    capsys: pytest.CaptureFixture[str], more: tuple[str, ...], words: str
) -> None:
    rc, _, err = _run(capsys, *PLAN, *more)
    assert rc == 2 and words in err and err.count("\n") == 1


def test_what_those_refusals_leave_runs(capsys: pytest.CaptureFixture[str]) -> None:
    for more in (("--zero", "3", "--zero3-impl", "fsdp1"), ("--zero3-impl", "fsdp1"),
                 ("-b", "2", "--precision", "fp8", "--fp8-recipe", "te-delayed", "--master-weights", "remainder")):  # fmt: skip
        assert _run(capsys, *PLAN, *more)[0] == 0, more


def test_several_gpus_give_numbers_and_say_where_an_override_went(capsys: pytest.CaptureFixture[str]) -> None:
    args = ("plan", "--model", "llama-3-8b", "--gpu", "a100-80gb,h100-sxm", "-B", "64", "-d", "4", "-t", "2",
            "--seq", "4096")  # fmt: skip
    rc, out, _ = _run(capsys, *args, "--json")
    d = json.loads(out)
    assert rc == 0 and "notes" not in d
    for rec, pl in zip(d["comparison"], d["plans"], strict=True):
        r = pl["recommended"]
        assert rec["gpu"] == pl["gpu"]["name"] and rec["fits"] is True
        assert (rec["micro_batch"], rec["peak_memory_bytes"], rec["mfu"]) == (
            r["micro_batch"], r["peak_memory_bytes"], r["mfu"]
        )  # fmt: skip
    rc, out, _ = _run(capsys, *args, "--gpu-set", "bf16=500e12", "--json")
    assert (
        rc == 0
        and "applied to each accelerator compared (a100-80gb, h100-sxm)" in json.loads(out)["notes"][0]
    )
    rc, text, _ = _run(capsys, *args, "--gpu-set", "bf16=500e12")
    assert text.rstrip().splitlines()[-1].startswith("note: --gpu-set bf16=500e12 applied to each")
    rc, out, _ = _run(capsys, "plan", "--model", "llama-3-8b", "--gpu", "a100-80gb", "-B", "64", "-d", "4",
                      "--gpu-set", "bf16=500e12", "--json")  # fmt: skip
    assert rc == 0 and "notes" not in json.loads(out)  # one accelerator: the override is plainly its own


def test_sigterm_stops_any_command_as_ctrl_c_does(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job scheduler's or timeout's SIGTERM: the command's interrupt path runs (what it measured kept), exit 130 and
    one line; it killed the process with nothing said before (noise, bench-gpu, tune lost their points)."""
    import os
    import signal
    import time

    import click

    from microbatch.cli import LazyGroup

    @click.command("sigterm-probe")
    def probe() -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises at once; never reached
        raise AssertionError("SIGTERM did not interrupt")

    def guard(signum: int, frame: object) -> None:  # without the command's own handler SIGTERM comes here
        raise AssertionError("SIGTERM reached the caller's handler: the command did not take it")

    outer = signal.signal(signal.SIGTERM, guard)
    monkeypatch.setattr(LazyGroup, "get_command", lambda self, ctx, name: probe)  # any name runs the probe
    try:
        rc, out, err = _run(capsys, "batch")
        assert signal.getsignal(signal.SIGTERM) is guard  # the caller's handler put back after the command
    finally:
        signal.signal(signal.SIGTERM, outer)
    assert rc == 130 and err.strip() == "interrupted: signal SIGTERM"
