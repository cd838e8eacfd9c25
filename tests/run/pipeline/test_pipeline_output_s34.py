"""The pipeline command's one JSON object (a helper's review, 2026-12-08): a model whose forward prints in the
launcher's own process (profiling, the layer check, the saved-bytes measurement), torchrun's other ranks on a failure,
and a measurement after the run that fails without losing the run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

NOISY = textwrap.dedent(
    """
    import torch

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(16, 16)

        def forward(self, x):
            print("forward!", tuple(x.shape))
            return torch.tanh(self.lin(x))

    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(16, 32)

        def forward(self, x):
            return self.lin(x)

    def noisy():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Embedding(32, 16), Block(), Block(), Head())
    """
)


def _cli(tmp_path, *args, env=None):
    (tmp_path / "mymodels.py").write_text(NOISY)
    return subprocess.run(
        [sys.executable, "-m", "microbatch", *args], capture_output=True, text=True, timeout=240, cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(tmp_path), **(env or {})},
    )  # fmt: skip


@pytest.mark.timeout(260)
def test_a_forward_that_prints_leaves_stdout_one_json_object(tmp_path):
    r = _cli(
        tmp_path, "pipeline", "-p", "2", "-m", "2", "--steps", "1", "--model", "mymodels:noisy", "--json"
    )
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)  # printed lines before it made it unreadable
    assert out["stages"] == 2 and "forward!" in r.stderr


def test_only_rank_0_writes_an_error_envelope_under_torchrun(capsys, monkeypatch):
    from microbatch.cli import main

    env = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999", "TORCHELASTIC_RUN_ID": "x"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("MICROBATCH_WORKER", raising=False)
    got = {}
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        code = main(["pipeline", "-p", "3", "-m", "0", "--json"])  # bad input: refused on every rank
        got[rank] = (code, *capsys.readouterr())
    assert got["0"][0] == got["1"][0] == 2
    assert json.loads(got["0"][1])["kind"] == "bad_input" and got["1"][1] == ""
    assert "error:" in got["1"][2]  # said on its own stderr
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")  # variables left in a shell: the lone process answers
    assert main(["pipeline", "-p", "3", "-m", "0", "--json"]) == 2
    assert json.loads(capsys.readouterr()[0])["kind"] == "bad_input"


def test_a_failed_measurement_after_the_run_keeps_the_run(monkeypatch):
    from microbatch.errors import PipelineError
    from microbatch.run.pipeline import memory

    def fails(*a, **k):
        raise PipelineError(
            "measuring the stages' saved bytes on one process failed (IndexError: x), after the run"
        )

    from microbatch.run.pipeline.config import PipelineConfig
    from microbatch.run.pipeline.resolved import resolve

    monkeypatch.setattr("microbatch.run.pipeline.stage_profile.stage_saved_bytes", fails)
    run = resolve(PipelineConfig(model="tiny", stages=2, microbatches=2))
    ranks = [_rank(0, run), _rank(1, run)]
    with pytest.raises(PipelineError):
        memory.memory_rows(run, ranks, [0])  # no notes to say it in: raised
    notes: list[str] = []
    rows = memory.memory_rows(run, ranks, [0], notes=notes)
    assert [r.measured_peak_bytes for r in rows] == [100.0, 100.0] and all(
        r.predicted_bytes is None for r in rows
    )
    assert notes and "after the run" in notes[0]


def _rank(r, run):
    step = {"peak_activation_bytes": 100.0, "counted_activation_bytes": 2, "live_bytes_after_step": 0,
            "host_peak_bytes": None, "order": []}  # fmt: skip
    layers = run.layers_per_stage if hasattr(run, "layers_per_stage") else [1, 1]
    return {"rank": r, "layers_per_stage": list(layers), "steps": [step]}


def test_one_step_says_its_figures_are_the_warm_up_steps():
    from dataclasses import replace

    from microbatch.run.pipeline.report import PipelineReport
    from microbatch.run.pipeline.summary import figure_notes

    data = json.loads((Path(__file__).parents[2] / "data" / "pipeline_result_v0_1f1b.json").read_text())
    report = PipelineReport.from_json(data)
    one = figure_notes(replace(report, steps=1, measured_steps=1))
    assert any(n.startswith("one step: its figures are the first step's") for n in one)
    assert not any(n.startswith("one step") for n in figure_notes(replace(report, steps=3, measured_steps=2)))
