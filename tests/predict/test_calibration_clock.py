"""A tune calibration's efficiency is applied on the clock basis it was fitted at.

The Hopper rows' ``sustained_clock_fraction`` went from 1 to 0.847 (``HOPPER_BURST_TO_SUSTAINED``); an
efficiency fitted at 1 and applied on peak × 0.847 predicted steps ~15% slower. A calibration records the
fraction it was fitted at, and a plan on the same row runs at it. The points are the step times recorded on
an H200 for gpt2-xl (tests/predict/test_calibrate.py's ``H200_GPT2_XL``), with synthetic peak memory.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from microbatch.cli import main
from microbatch.errors import ConfigError
from microbatch.hardware import Accelerator, get_accelerator
from microbatch.hardware_clocks import HOPPER_BURST_TO_SUSTAINED, power_limited_clock
from microbatch.model import get_model
from microbatch.predict.apply_calibration import AppliedCalibration, apply_calibration, calibrated_accelerator
from microbatch.predict.calibrate import Calibration, analytic_memory_line, calibrate
from microbatch.predict.roofline import DEFAULT_EFFICIENCY
from microbatch.predict.steptime import predict_step_time_s
from microbatch.records import read_measurements

SHAPE = get_model("gpt2-xl")  # s = 1024
PREC = "bf16-mixed"
# gpt2-xl, s = 1024, bf16-mixed, micro-step seconds measured on an H200 (as in test_calibrate.py)
H200_GPT2_XL = {1: 0.06718227005004883, 2: 0.08288684844970703, 4: 0.12530278778076173,
                8: 0.22955801391601563, 16: 0.4261376037597656}  # fmt: skip
BMS = (1, 2, 4, 8, 16)


def _tune(device_name: str = "NVIDIA H200", times: dict[int, float] = H200_GPT2_XL) -> dict[str, Any]:
    """A tune-like result: the recorded step times, peak memory on a line (activations × 1.2 + 1 GiB)."""
    static, per_sample = analytic_memory_line(SHAPE, precision=PREC)
    pts = [
        {"micro_batch": b, "throughput": b / times[b], "peak_memory_bytes": static + 1.2 * per_sample * b + 2**30,
         "step_time_s": times[b], "oom": False}
        for b in BMS
    ]  # fmt: skip
    return {"points": pts, "model": SHAPE.name, "seq": SHAPE.seq, "precision": PREC, "checkpointing": "off",
            "device": "cuda", "device_name": device_name, "mode": "train"}  # fmt: skip


def _saved(acc: Accelerator, *, old: bool = False) -> tuple[Calibration, dict[str, Any]]:
    """A calibration fitted against ``acc`` and its file (``old``: without the clock field, as written before)."""
    cal = calibrate(read_measurements(_tune()), acc)
    d = json.loads(json.dumps(cal.to_dict()))
    if old:
        d.pop("sustained_clock_fraction", None)
    return cal, d


def _step(app: AppliedCalibration, gpu: Accelerator, b: int) -> float:
    return predict_step_time_s(
        SHAPE, b, app.accelerator or gpu, seq=1024, precision=PREC, efficiency=app.efficiency
    )


def _apply(d: dict[str, Any], gpu: Accelerator) -> AppliedCalibration:
    return apply_calibration(d, shape=SHAPE, precision=PREC, gpu=gpu)


def test_a_file_without_the_field_loads_at_fraction_1():
    _, d = _saved(get_accelerator("h200"), old=True)
    assert Calibration.from_dict(d).sustained_clock_fraction == 1.0
    for bad in (0, -1, 2.0, float("nan")):
        with pytest.raises(ConfigError, match="sustained_clock_fraction"):
            Calibration.from_dict({**d, "sustained_clock_fraction": bad})


def test_a_fit_on_h200_records_its_clock_and_round_trips_to_the_same_step_time():
    h200 = get_accelerator("h200")
    cal, d = _saved(h200)
    assert cal.sustained_clock_fraction == pytest.approx(HOPPER_BURST_TO_SUSTAINED, rel=1e-12)
    assert Calibration.from_dict(d) == cal and d["sustained_clock_fraction"] == cal.sustained_clock_fraction
    app = _apply(d, h200)
    assert app.accelerator is None and not any("clock fraction" in n for n in app.notes)
    assert app.efficiency == cal.efficiency
    for b in (8, 16, 64):
        before = predict_step_time_s(SHAPE, b, h200, seq=1024, precision=PREC, efficiency=cal.efficiency)
        assert _step(app, h200, b) == pytest.approx(before, rel=1e-12)
    # the same with the points fitted here (a tune result given to the plan)
    assert _apply(_tune(), h200).accelerator is None


def test_an_old_file_fitted_at_1_predicts_what_the_old_code_did():
    h200, at_1 = get_accelerator("h200"), get_accelerator("h200", sustained_clock_fraction=1.0)
    cal, d = _saved(h200, old=True)
    app = _apply(d, h200)
    assert app.accelerator is not None and app.accelerator.sustained_clock_fraction == pytest.approx(
        1.0, rel=1e-12
    )
    assert any("fitted at clock fraction 1 " in n and "h200" in n and "0.847" in n for n in app.notes), (
        app.notes
    )
    for b in (8, 16, 64):
        old = predict_step_time_s(SHAPE, b, at_1, seq=1024, precision=PREC, efficiency=cal.efficiency)
        assert _step(app, h200, b) == pytest.approx(old, rel=1e-9)
        # without the clock basis the plan would be ~15% slower (0.847 applied on top of the fit)
        unfixed = predict_step_time_s(SHAPE, b, h200, seq=1024, precision=PREC, efficiency=cal.efficiency)
        assert unfixed > 1.05 * old


def test_an_old_file_really_fitted_at_1_keeps_its_error_on_the_recorded_probes():
    # the reviewer's case: fitted on b_m 1-16 when the H200 row had 1; applied now, its error at b_m 8 and 16
    # is what it was (-3.8% and 0.0%), not +8.2% and +12.3%
    _, d = _saved(get_accelerator("h200", sustained_clock_fraction=1.0), old=True)
    app = _apply(d, get_accelerator("h200"))
    err = {b: _step(app, get_accelerator("h200"), b) / H200_GPT2_XL[b] - 1 for b in (8, 16)}
    assert err[8] == pytest.approx(-0.037, abs=0.005) and err[16] == pytest.approx(0.0, abs=1e-6), err


def test_an_old_h100_96gb_file_was_fitted_at_its_500_w_clock_not_1():
    # that row had the power-limit law before the Hopper factor: power_limited_clock(500, 700, 700) = 0.863
    row = get_accelerator("h100-96gb")
    was = power_limited_clock(500, 700, 700)
    assert row.sustained_clock_fraction == pytest.approx(HOPPER_BURST_TO_SUSTAINED * was, rel=1e-12)
    cal, d = _saved(row, old=True)
    assert Calibration.from_dict(d).sustained_clock_fraction == pytest.approx(was, rel=1e-12)
    app = _apply(d, row)
    assert app.accelerator is not None
    assert app.accelerator.sustained_clock_fraction == pytest.approx(was, rel=1e-12)
    old = get_accelerator("h100-96gb", sustained_clock_fraction=was)
    want = predict_step_time_s(SHAPE, 16, old, seq=1024, precision=PREC, efficiency=cal.efficiency)
    assert _step(app, row, 16) == pytest.approx(want, rel=1e-9)
    # fitted today: its row's clock, nothing changes
    assert _saved(row)[0].sustained_clock_fraction == row.sustained_clock_fraction
    assert _apply(_saved(row)[1], row).accelerator is None


def test_a_power_limit_given_for_the_plan_still_scales_the_old_basis():
    h200 = get_accelerator("h200")
    low = h200.with_overrides(power_limit_w=500)
    assert low.sustained_clock_fraction < h200.sustained_clock_fraction
    _, d = _saved(h200, old=True)
    app = _apply(d, low)
    assert app.accelerator is not None
    want = low.sustained_clock_fraction / HOPPER_BURST_TO_SUSTAINED
    assert app.accelerator.sustained_clock_fraction == pytest.approx(want, rel=1e-12)
    assert app.accelerator.power_limit_w == 500
    # a file fitted today, or points fitted here against the same limited board: no second scaling
    _, new = _saved(h200)
    assert _apply(new, low).accelerator is None and _apply(_tune(), low).accelerator is None


def test_on_an_a100_nothing_changes_and_no_note_is_added():
    a100 = get_accelerator("a100-80gb")
    cal, d = _saved(a100)
    assert cal.sustained_clock_fraction == 1.0
    _, old = _saved(a100, old=True)
    new_app, old_app = _apply(d, a100), _apply(old, a100)
    for app in (new_app, old_app):
        assert app.accelerator is None and app.efficiency == cal.efficiency
        assert not any("clock fraction" in n for n in app.notes)
    assert new_app.notes == old_app.notes
    assert calibrated_accelerator(Calibration.from_dict(old), a100) == (None, [])


def test_a_calibration_for_another_accelerator_keeps_the_default_efficiency():
    _, d = _saved(get_accelerator("h200"), old=True)
    h100 = get_accelerator("h100-sxm")
    app = _apply(d, h100)
    assert app.accelerator is None and app.efficiency == DEFAULT_EFFICIENCY
    assert any("NOT applied" in n for n in app.notes) and not any("clock fraction" in n for n in app.notes)


def _plan(path: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[dict[str, Any], str]:
    args = ["plan", "--model", "gpt2-xl", "--gpu", "h200", "-B", "16", "-b", "16", "--calibration", str(path)]
    assert main([*args, "--json", *extra]) == 0
    out = json.loads(capsys.readouterr().out)
    assert main([*args, *extra]) == 0
    return out, capsys.readouterr().out


def test_plan_with_an_old_calibration_file_says_so_and_runs_at_its_clock(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    _, old = _saved(get_accelerator("h200"), old=True)
    _, new = _saved(get_accelerator("h200"))
    (tmp_path / "old.json").write_text(json.dumps(old))
    (tmp_path / "new.json").write_text(json.dumps(new))
    o, text = _plan(tmp_path / "old.json", capsys)
    n, text_new = _plan(tmp_path / "new.json", capsys)
    assert any("fitted at clock fraction 1 " in x for x in o["calibration_notes"]), o["calibration_notes"]
    assert "note: kernel efficiency was fitted at clock fraction 1 " in text
    assert o["calibration"]["sustained_clock_fraction"] == 1.0  # what plan --json writes back says so
    assert not any("clock fraction" in x for x in n["calibration_notes"]) and "clock fraction" not in text_new
    # the same efficiency on the old file's clock (1, not 0.847): the compute-bound step is faster
    assert o["recommended"]["step_time_s"] < 0.95 * n["recommended"]["step_time_s"]
