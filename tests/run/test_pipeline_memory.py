"""Pipeline memory that can disagree with the prediction: saved storages actually alive per rank,
an injected leak, GPipe against 1F1B as m grows, DualPipeV on torch's runtime, and refusing a run
that cannot fit before any process starts."""

from __future__ import annotations

import pytest

from microbatch.errors import ConfigError
from microbatch.run.launch import run_pipeline
from microbatch.run.pipeline_config import PipelineConfig
from microbatch.run.pipeline_fit import check_fits, predicted_host_bytes

torch = pytest.importorskip("torch")

_RUNS: dict = {}


def run(**kw):
    kw.setdefault("steps", 1)  # memory is measured in every step, the first included
    kw.setdefault("timeout_s", 60)
    key = tuple(sorted(kw.items()))
    if key not in _RUNS:
        _RUNS[key] = run_pipeline(PipelineConfig(**kw), deadline_s=150)
    return _RUNS[key]


def _measured(rep):
    return [row["measured_peak_bytes"] for row in rep["memory"]]


def test_live_bytes_count_a_storage_once_and_release_it_when_the_last_tensor_dies():
    from microbatch.run.instrument import LiveBytes

    live = LiveBytes()
    a = torch.zeros(256)  # 1 KiB
    view = a[:10]
    live.track(a, set())
    live.track(view, set())  # same storage: counted once
    assert live.bytes == live.peak == 1024
    del a
    assert live.bytes == 1024  # the view still holds the storage
    del view
    assert live.bytes == 0 and live.peak == 1024
    w = torch.zeros(8)
    live.track(w, {w.untyped_storage().data_ptr()})  # a parameter: never counted
    assert live.bytes == 0


@pytest.mark.timeout(200)
def test_an_injected_leak_makes_measured_exceed_predicted(monkeypatch):
    """Rank 0 keeps each micro-batch's saved tensors until the next backward ends: one micro-batch
    too long. The schedule's count cannot see it; the memory measured does."""
    clean = run(schedule="1f1b", stages=2, microbatches=4)
    monkeypatch.setenv("MICROBATCH_PIPELINE_FAULT", "0:leak")
    leaky = run_pipeline(PipelineConfig(schedule="1f1b", stages=2, microbatches=4, steps=1, timeout_s=60))
    per_mb = leaky["measured"]["stage_stats"][0]["activation_bytes_per_microbatch"]
    c0, l0 = clean["memory"][0], leaky["memory"][0]
    assert l0["counted_bytes"] == c0["counted_bytes"]  # the count is blind to the leak
    assert l0["predicted_bytes"] == pytest.approx(c0["predicted_bytes"])
    assert l0["measured_peak_bytes"] > 1.3 * l0["predicted_bytes"]
    assert l0["measured_peak_bytes"] - c0["measured_peak_bytes"] >= 0.8 * per_mb  # one micro-batch more
    assert abs(c0["error_pct"]) <= 10  # without the leak, rank 0 is within 10%


@pytest.mark.timeout(300)
def test_gpipe_memory_grows_with_m_and_1f1b_does_not_measured():
    g2, g4 = run(schedule="gpipe", stages=2, microbatches=2), run(schedule="gpipe", stages=2, microbatches=4)
    f2, f4 = run(schedule="1f1b", stages=2, microbatches=2), run(schedule="1f1b", stages=2, microbatches=4)
    for a, b in zip(_measured(g2), _measured(g4), strict=True):
        assert b > 1.6 * a  # 4 micro-batches held against 2 (saved storages alive, not counted)
    for a, b in zip(_measured(f2), _measured(f4), strict=True):
        assert b == pytest.approx(a, rel=0.1)  # 1F1B holds p − i whatever m
    assert _measured(g4)[0] > 1.6 * _measured(f4)[0]


@pytest.mark.timeout(200)
def test_dualpipev_runs_on_torch_with_unsplit_gradients_and_torchs_order():
    rep = run(schedule="dualpipev", stages=2, microbatches=4, virtual=2, check_gradients=True)
    assert rep["gradients_match"] is True, rep["max_grad_rel_error"]
    assert rep["order_matches_torch"], rep["executed_order"]
    assert {it["kind"] for it in rep["timeline"]} == {"F", "B", "I", "W"}
    assert [s["virtual_stages"] for s in rep["measured"]["stage_stats"]] == [[0, 3], [1, 2]]


def test_a_model_too_large_for_the_host_is_refused_with_the_numbers():
    cfg = PipelineConfig(model="llama-2-7b", stages=2, microbatches=4)
    with pytest.raises(
        ConfigError,
        match=r"llama-2-7b \(6\.74 B parameters.* needs about 126\.\d+ GiB.* but 24\.00 GiB is available",
    ):
        check_fits(cfg, available=24 * 1024**3)
    pred = predicted_host_bytes(cfg, 1_000_000)
    assert pred["model_copies"] == 2 * 4e6 and pred["gradients_and_adam"] == 3 * 4e6
    assert check_fits(PipelineConfig(model="tiny"), available=24 * 1024**3) is not None


def test_cli_refuses_llama_before_starting_any_process(capsys):
    import time

    from microbatch.cli import main
    from microbatch.run.pipeline_fit import available_host_bytes

    avail = available_host_bytes()
    if avail is None or avail > 120 * 1024**3:
        pytest.skip("this host could hold llama-2-7b on two ranks")
    t0 = time.monotonic()
    assert main(["pipeline", "-p", "2", "-m", "4", "--model", "llama-2-7b"]) == 2
    assert "llama-2-7b" in capsys.readouterr().err and time.monotonic() - t0 < 10


@pytest.mark.parametrize(
    "args,pattern",
    [
        (
            ["--trace", "missing_dir/t.json"],
            r"--trace missing_dir/t.json: the folder .*missing_dir does not exist",
        ),
        (["--svg", "missing_dir/x.svg"], r"--svg missing_dir/x.svg: the folder .*missing_dir does not exist"),
        (["--png", "out.svg"], r"--png out.svg: the suffix .svg names another format"),
    ],
)
def test_cli_checks_output_paths_before_the_run(args, pattern, capsys):
    from microbatch.cli import main

    assert main(["pipeline", "-p", "2", "-m", "4", *args]) == 2
    assert __import__("re").search(pattern, capsys.readouterr().err)
