"""Bad input to ``microbatch pipeline`` is refused before any rank starts, in one line, exit 2.

A ``module:function`` model is imported and built in the launching process; host memory counts the
batch, the activations and torch's receive buffers that grow with m·b_m·s; a run whose compute
cannot finish before its deadline is refused; SIGTERM stops every rank as Ctrl-C does.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from microbatch.errors import ConfigError, PipelineError
from microbatch.run.pipeline import fit
from microbatch.run.pipeline.config import PipelineConfig
from microbatch.run.pipeline.launch import check_splittable, run_pipeline
from microbatch.run.pipeline.resolved import resolve
from microbatch.run.pipeline.warm import COLD_ENV

torch = pytest.importorskip("torch")


@pytest.fixture
def no_process(monkeypatch):
    """Any process started fails the test: "before any process" checked as such, not by the clock
    (a wall-clock bound moves with the machine's load). The profile, the calibrations and the ranks
    start theirs through subprocess.Popen, the ranks on the CPU are forked from the fork server."""
    from _helpers import refuse_processes  # here: the ranks import this module as a factory

    return refuse_processes(monkeypatch)


GIB = 1024**3
HERE = "test_pipeline_refusals"  # this module, as module:function factories name it


# -- factories for --model module:function ------------------------------------------------


def stack():
    nn = torch.nn
    return nn.Sequential(nn.Embedding(64, 8), nn.Linear(8, 8), nn.Linear(8, 64))


def one_layer():
    return torch.nn.Linear(8, 8)


class _WithOutside(torch.nn.Module):
    """embed, layers and head, and a final norm the model's own forward would apply: outside the chain run."""

    def __init__(self):
        super().__init__()
        nn = torch.nn
        self.embed, self.layers, self.head = (
            nn.Embedding(64, 8),
            nn.ModuleList([nn.Linear(8, 8)]),
            nn.Linear(8, 64),
        )
        self.norm = nn.LayerNorm(8)


def outside_norm():
    return _WithOutside()


def prints_when_built():  # as training scripts log a model's size
    print("built a model of", sum(p.numel() for p in stack().parameters()), "parameters")
    return stack()


class _PositionsFirst(torch.nn.Module):
    """A position table registered before the token table, in the first layer."""

    def __init__(self):
        super().__init__()
        self.pos, self.tok = torch.nn.Embedding(16, 8), torch.nn.Embedding(64, 8)

    def forward(self, idx):
        return self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))


def positions_first():
    return torch.nn.Sequential(_PositionsFirst(), torch.nn.Linear(8, 8), torch.nn.Linear(8, 64))


def no_embedding():
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 64))


def needs_an_argument(width):
    return torch.nn.Linear(width, width)


NOT_A_FUNCTION = 3


def not_chaining():  # the second layer expects 16 features, the first gives 8
    nn = torch.nn
    return nn.Sequential(nn.Embedding(64, 8), nn.Linear(16, 8), nn.Linear(8, 64))


class _Hangs(torch.nn.Module):
    def forward(self, x):
        while True:
            time.sleep(0.05)


def hangs():  # its middle layer never returns
    nn = torch.nn
    return nn.Sequential(nn.Embedding(64, 8), _Hangs(), nn.Linear(8, 64))


class _Routes(torch.nn.Module):
    """A layer whose forward needs its data (a MoE router's nonzero), which the meta device cannot run."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        chosen = (x.sum(-1) > 0).nonzero()
        return self.lin(x) + 0 * chosen.numel()


def routes():
    nn = torch.nn
    return nn.Sequential(nn.Embedding(64, 8), _Routes(), nn.Linear(8, 64))


def returns_a_tuple():  # nn.GRU returns (output, hidden)
    nn = torch.nn
    return nn.Sequential(nn.Embedding(64, 8), nn.GRU(8, 8, batch_first=True), nn.Linear(8, 64))


def no_logits():  # ends at the hidden width, not the vocabulary
    nn = torch.nn
    return nn.Sequential(nn.Embedding(64, 8), nn.Linear(8, 8))


class _RealOnly(torch.nn.Module):
    """A layer that cannot be built on the meta device (it reads its weight's values)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.scale = float(self.lin.weight.abs().sum().item()) + 1.0

    def forward(self, x):
        return self.lin(x) / self.scale


def real_only_stack():
    nn = torch.nn
    return nn.Sequential(nn.Embedding(64, 8), _RealOnly(), nn.Linear(4, 64))


# -- 1. the model factory, checked in the parent --------------------------------------------


@pytest.mark.parametrize(
    "model,pattern",
    [
        (
            "os:system",
            r"model factory os:system failed when called with no arguments \(TypeError: .*\); a model "
            r"factory takes no arguments and returns a torch\.nn\.Module",
        ),
        (
            "os:getcwd",
            r"model factory os:getcwd returned an object of type str \('.*'\), not a torch\.nn\.Module",
        ),
        (
            f"{HERE}:outside_norm",
            r"parameters norm\.weight, norm\.bias are in none of the layers the pipeline runs .* "
            r"move them into a layer",
        ),
        (
            "nosuchmod_xyz:fn",
            r"module 'nosuchmod_xyz' cannot be imported \(ModuleNotFoundError: .*\); install it or put its "
            r"folder on PYTHONPATH",
        ),
        (f"{HERE}:missing", rf"module '{HERE}' has no attribute 'missing'; give module:function"),
        (f"{HERE}:NOT_A_FUNCTION", r"names 3 \(of type int\), which cannot be called"),
        (f"{HERE}:needs_an_argument", r"failed when called with no arguments \(TypeError: .*width"),
        (f"{HERE}:one_layer", r"cannot split a Linear into stages"),
        (f"{HERE}:no_embedding", r"without an nn\.Embedding; the pipeline feeds token ids"),
        ("nosuchmod_xyz:", r"model 'nosuchmod_xyz:' is not module:function"),
    ],
)
def test_a_bad_model_factory_is_refused_naming_it(model, pattern):
    with pytest.raises(ConfigError, match=pattern):
        check_splittable(resolve(PipelineConfig(model=model)))


def test_a_factory_that_prints_leaves_stdout_to_the_result_and_the_token_table_is_found(capsys):
    """What a factory prints went to stdout before the JSON (three times: the launcher builds it to check it); the
    vocabulary was read from the first nn.Embedding registered, a position table here (a pipeline sweep's findings)."""
    from microbatch.run.pipeline.split import inspect_factory

    assert inspect_factory(f"{HERE}:prints_when_built").units == 3
    fit.check_fits(resolve(PipelineConfig(model=f"{HERE}:prints_when_built", global_batch=16)),
                   available=24 * GIB, flops_per_s=1e9)  # fmt: skip
    out = capsys.readouterr()
    assert out.out == "" and "built a model of" in out.err
    assert inspect_factory(f"{HERE}:positions_first").vocab == 64
    fit.check_fits(resolve(PipelineConfig(model=f"{HERE}:positions_first", global_batch=16)),
                   available=24 * GIB, flops_per_s=1e9)  # fmt: skip  # logits of 64: the token table's


def test_a_good_factory_is_built_on_the_meta_device_and_counted():
    from microbatch.run.pipeline.split import inspect_factory

    check_splittable(resolve(PipelineConfig(model=f"{HERE}:stack")))
    info = inspect_factory(f"{HERE}:stack")
    assert (info.units, info.vocab, info.meta) == (3, 64, True)
    assert info.params == sum(p.numel() for p in stack().parameters())
    with pytest.raises(ConfigError, match=r"4 stages .* returns only 3 layers"):
        check_splittable(resolve(PipelineConfig(model=f"{HERE}:stack", stages=4)))
    pred = fit.check_fits(resolve(PipelineConfig(model=f"{HERE}:stack")), available=24 * GIB, flops_per_s=1e9)
    assert pred["model_copies"] == 2 * 4 * info.params
    # the CPU Adam step's temporaries: 2 × its largest tensor (the 64 × 8 table and head) a rank, not 2 × the model
    assert info.largest == 512 and pred["step_temporaries"] == 2 * 2 * 4 * 512


@pytest.mark.timeout(60)
@pytest.mark.parametrize("predict", [[], ["--no-predict"]])
def test_cli_refuses_a_bad_factory_in_one_line_before_any_process(capsys, no_process, predict):
    from microbatch.cli import main

    t0 = time.monotonic()
    assert main(["pipeline", "-p", "2", "--model", "os:getcwd", *predict]) == 2
    err = capsys.readouterr().err
    assert re.fullmatch(r"error: model factory os:getcwd returned an object of type str .*\n", err), err
    assert no_process == []
    assert time.monotonic() - t0 < 8  # ~0.1 s of work (before: 19 s, then an AttributeError in a rank)


@pytest.mark.parametrize(
    "model,pattern",
    [
        (f"{HERE}:not_chaining", r"layer 1 \(Linear\) fails on layer 0's output, a tensor of shape \(4, 16, 8\) "
                                 r"\(RuntimeError: .*\); each layer must take the previous layer's output"),
        (f"{HERE}:returns_a_tuple", r"layer 1 \(GRU\) returns a tuple, not one tensor; pipelining passes one "
                                    r"tensor between stages"),
        (f"{HERE}:no_logits", r"the last layer returns shape \(4, 16, 8\) for token ids \(4, 16\); the loss "
                              r"needs logits \(4, 16, 64\)"),
        (f"{HERE}:real_only_stack", r"layer 2 \(Linear\) fails on layer 1's output"),  # built for real
    ],
)  # fmt: skip
def test_a_factory_whose_layers_do_not_chain_is_refused_before_any_process(model, pattern):
    """Issue 32: before, these failed after about 22 s, inside the per-stage profile, with a traceback."""
    cfg = PipelineConfig(model=model, global_batch=16)  # m = 4: b_m = 4, s = 16 (FACTORY_SEQ)
    check_splittable(resolve(cfg))  # they import, build and split: only running them shows the fault
    with pytest.raises(ConfigError, match=pattern):
        fit.check_fits(resolve(cfg), available=24 * GIB, flops_per_s=1e9)
    fit.check_fits(
        resolve(PipelineConfig(model=f"{HERE}:stack", global_batch=16)), available=24 * GIB, flops_per_s=1e9
    )


@pytest.mark.timeout(60)
def test_cli_refuses_a_factory_that_does_not_chain_in_one_line(capsys, no_process):
    from microbatch.cli import main

    t0 = time.monotonic()
    assert main(["pipeline", "-p", "2", "--model", f"{HERE}:returns_a_tuple"]) == 2
    err = capsys.readouterr().err
    assert re.fullmatch(
        r"error: model factory \S+:returns_a_tuple: layer 1 \(GRU\) returns a tuple.*\n", err
    ), err
    assert no_process == []
    assert time.monotonic() - t0 < 8  # ~0.1 s of work (before: 22 s, in the per-stage profile)


@pytest.mark.parametrize(
    "timeout,pattern",
    [
        ("0.001", r"--timeout 0\.001 is too short for the ranks to start.*give --timeout 10 or more"),
        ("9.9", r"--timeout 9\.9 is too short"),
        ("1e300", r"--timeout 1e\+300 is over the limit of 1,000,000 s .*give --timeout 1000000 or less"),
        ("1000001", r"--timeout 1000001 is over the limit of 1,000,000 s"),  # the value typed, not 1e+06
    ],
)
def test_a_timeout_the_ranks_cannot_start_in_is_refused_before_they_start(
    capsys, monkeypatch, timeout, pattern
):
    """Issue 32: --timeout 0.001 started the ranks and died on a socket timeout."""
    from _helpers import refuse_processes  # here: the ranks import this module as a factory

    from microbatch.cli import main

    refuse_processes(monkeypatch)  # the profile, the calibrations, the ranks: none before the timeout's check
    assert main(["pipeline", "--timeout", timeout]) == 2
    err = capsys.readouterr().err
    assert re.fullmatch(r"error: " + pattern + r".*\n", err), err
    fit.check_timeout(PipelineConfig(timeout_s=fit.MIN_TIMEOUT_S))  # the minimum itself is taken


# -- 2. memory that grows with m, b_m and s; seq past the positions; compute past the deadline ------


def test_host_memory_counts_the_batch_activations_and_receive_buffers():
    from microbatch.model import get_model
    from microbatch.predict.activations import (
        embedding_activation_bytes,
        layer_activation_bytes,
        output_activation_bytes,
    )

    shape = get_model("tiny")
    s, h = shape.seq, shape.hidden
    one = (
        shape.layers * layer_activation_bytes(shape, 1, dtype_bytes=4)
        + embedding_activation_bytes(shape, 1)
        + output_activation_bytes(shape, 1, dtype_bytes=4)
    )
    gpipe = fit.predicted_host_bytes(resolve(PipelineConfig(schedule="gpipe", microbatches=4)), 1000, shape)
    assert gpipe["activations"] == pytest.approx(4 * one)  # GPipe holds all m
    f1b = fit.predicted_host_bytes(resolve(PipelineConfig(schedule="1f1b", microbatches=4)), 1000, shape)
    assert f1b["activations"] == pytest.approx((2 + 1) / 2 * one)  # 1F1B: min(m, p - r)
    assert f1b["batch"] == 2 * 5 * 4 * (s + 1) * 8
    assert f1b["receive_buffers"] == 2 * 1 * 4 * (1 * s * h * 4)
    eight = fit.predicted_host_bytes(resolve(PipelineConfig(schedule="1f1b", microbatches=8)), 1000, shape)
    assert eight["batch"] == 2 * f1b["batch"] and eight["receive_buffers"] == 2 * f1b["receive_buffers"]


def test_a_trillion_microbatches_are_refused_with_the_numbers():
    cfg = PipelineConfig(stages=2, microbatches=10**12)
    with pytest.raises(
        ConfigError,
        match=r"model tiny .* m = 1000000000000, b_m = 1, s = 64 needs about \d+\.\d+ GiB of host memory "
        r"\(.*token ids of the batch on every rank \d+\.\d+ GiB.*\) but 24\.00 GiB is available; use fewer "
        r"micro-batches",
    ):
        fit.check_fits(resolve(cfg), available=24 * GIB, flops_per_s=1e12)


@pytest.mark.timeout(60)
def test_cli_refuses_a_trillion_microbatches_before_any_process(capsys, no_process):
    from microbatch.cli import main

    t0 = time.monotonic()
    assert main(["pipeline", "-p", "2", "-m", "1000000000000", "--no-predict"]) == 2
    assert "needs about" in capsys.readouterr().err
    assert no_process == []
    assert time.monotonic() - t0 < 8  # ~0.1 s of work (before: a rank died after 4.7 s allocating 520 TB)


def test_seq_past_the_learned_positions_is_refused():
    check_splittable(resolve(PipelineConfig(model="gpt2", seq=1024)))
    with pytest.raises(ConfigError, match=r"seq 2048 is longer than model gpt2's 1024 learned positions; .*"
                       r"use seq 1024 or less"):  # fmt: skip
        check_splittable(resolve(PipelineConfig(model="gpt2", seq=2048)))


def test_a_run_whose_compute_passes_the_deadline_is_refused():
    # small at s = 100000 (SDPA holds no s×s scores, so it fits in memory) is ~7.5e14 FLOPs in 3 steps:
    # over an hour even at 100 GFLOP/s on each of 2 cores; before, it ran silently past 120 s
    cfg = PipelineConfig(model="small", seq=100_000)
    with pytest.raises(
        ConfigError,
        match=r"3 step\(s\) of model small \(B = 4, s = 100000\) are .* FLOPs: at least .* s on \d+ cores? .* past "
        r"the deadline of 180 s \(120 s of timeout_s \+ 60 s allowed for start-up\); lower steps, seq or "
        r"global_batch, or raise timeout_s well above \d+ s",
    ):
        fit.check_duration(resolve(cfg), flops_per_s=1e11)
    with pytest.raises(ConfigError, match=r"1000000000000 step\(s\) of model tiny"):
        fit.check_duration(resolve(PipelineConfig(steps=10**12, timeout_s=20)), flops_per_s=1e11)
    fit.check_duration(resolve(PipelineConfig(model="small")), flops_per_s=1e9)  # the default run passes


# -- 5. every message gives the fix -----------------------------------------------------------


@pytest.mark.parametrize(
    "kw,pattern",
    [
        ({"seq": 0}, r"seq must be a whole number >= 1, got 0; give seq 1 or more"),
        ({"global_batch": 0}, r"global_batch .* got 0; give global_batch a multiple of m = 4"),
        (
            {"timeout_s": 0.0},
            r"timeout_s must be a finite number > 0, got 0\.0; give timeout_s 10 s or more \(the command's default is 300",
        ),
        ({"timeout_s": float("nan")}, r"timeout_s must be a finite number > 0, got nan; give timeout_s"),
    ],
)
def test_bad_numbers_are_refused_with_the_fix(kw, pattern):
    with pytest.raises(ConfigError, match=pattern):
        PipelineConfig(**kw)


# -- 3, 4. the launcher: the deadline's parts, SIGTERM --------------------------------------------


@pytest.mark.timeout(60)
def test_the_deadline_message_names_the_start_up_allowance(monkeypatch):
    import microbatch.run.pipeline.launch as launch

    real = subprocess.Popen
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]  # ranks that never finish
    import microbatch.run.pipeline.config as pipeline_config

    monkeypatch.setattr(pipeline_config, "STARTUP_S", 1.0)  # the one allowance, read by cfg.deadline()
    monkeypatch.setattr(fit, "MIN_TIMEOUT_S", 0.1)  # a short run, for the deadline
    monkeypatch.setenv(COLD_ENV, "1")  # ranks as new interpreters, so that they can be replaced by sleepers
    monkeypatch.setattr(launch.subprocess, "Popen", lambda args, **kw: real(sleeper, **kw))
    with pytest.raises(
        PipelineError,
        match=r"deadline of 2 s \(0\.5 s of timeout_s \+ 1 s allowed for start-up\); ranks \[0, 1\]",
    ):
        run_pipeline(PipelineConfig(timeout_s=0.5))


@pytest.mark.timeout(120)
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads processes from /proc")
def test_sigterm_stops_every_rank():
    from _helpers import alive, rank_pids  # here: the ranks import this module as a factory

    env = {**os.environ, "MICROBATCH_PIPELINE_FAULT": "1:hang", "OMP_NUM_THREADS": "1"}
    cli = subprocess.Popen(
        [sys.executable, "-m", "microbatch", "pipeline", "-p", "2", "-m", "2", "--steps", "2",
         "--no-predict", "--timeout", "60"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    workers: list[int] = []
    try:
        t_end = time.monotonic() + 60
        while len(workers) < 2 and cli.poll() is None and time.monotonic() < t_end:
            time.sleep(0.1)
            workers = rank_pids(cli.pid)
        assert len(workers) == 2, f"ranks not started (exit {cli.poll()})"
        time.sleep(1.0)
        cli.send_signal(signal.SIGTERM)
        rc = cli.wait(timeout=30)
        t_end = time.monotonic() + 10
        while any(map(alive, workers)) and time.monotonic() < t_end:
            time.sleep(0.1)
        assert [w for w in workers if alive(w)] == [], "ranks survived SIGTERM"
        assert rc == 130 and "interrupted" in (cli.stderr.read() if cli.stderr else "")
    finally:
        for w in workers:  # only the ranks this test started
            if alive(w):
                os.kill(w, signal.SIGKILL)
        if cli.poll() is None:
            cli.kill()
            cli.wait()


def test_a_factory_that_imports_from_the_working_folder_when_called_passes_the_check(tmp_path, monkeypatch):
    """The ranks run ``python -c`` in the working folder, so a factory may import a sibling module
    inside its body; the launcher's check must see the same path (it removed the folder before the
    call once, and refused a factory that trains)."""
    (tmp_path / "mb_factory_mod.py").write_text(
        "def build():\n    import mb_factory_helper\n    return mb_factory_helper.make()\n"
    )
    (tmp_path / "mb_factory_helper.py").write_text(
        "import torch.nn as nn\n\ndef make():\n    return nn.Sequential(nn.Embedding(50, 8), nn.Linear(8, 8), nn.Linear(8, 50))\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    from microbatch.run.pipeline.split import inspect_factory

    assert inspect_factory("mb_factory_mod:build").units == 3
    assert str(tmp_path) not in sys.path  # put back as it was


def test_a_reloaded_factory_module_is_inspected_again(tmp_path, monkeypatch):
    """In a long-lived process (a notebook) a user edits the factory and reloads its module; the check
    must see the new model (the cache was keyed by the spec alone and answered the old one)."""
    import importlib

    from microbatch.run.pipeline.split import inspect_factory

    mod = tmp_path / "mb_factory_reload.py"
    layers = "nn.Embedding(50, 8), {}nn.Linear(8, 50)"
    mod.write_text(f"import torch.nn as nn\n\ndef build():\n    return nn.Sequential({layers.format('')})\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.delitem(sys.modules, "mb_factory_reload", raising=False)
    assert inspect_factory("mb_factory_reload:build").units == 2
    assert inspect_factory("mb_factory_reload:build").units == 2  # unchanged: the same answer
    mod.write_text(
        "import torch.nn as nn\n\ndef build():\n    return nn.Sequential("
        + layers.format("nn.Linear(8, 8), nn.Linear(8, 8), ")
        + ")\n"
    )
    importlib.reload(sys.modules["mb_factory_reload"])
    assert inspect_factory("mb_factory_reload:build").units == 4
    monkeypatch.delitem(sys.modules, "mb_factory_reload")


@pytest.mark.parametrize("seed", ["100000000000000000000", "-1"])
def test_a_seed_torch_cannot_hold_is_refused_before_the_ranks_start(capsys, monkeypatch, seed):
    """Issue 32: --seed 10^20 started the ranks, which died on 'Overflow when unpacking long long'."""
    from _helpers import refuse_processes  # here: the ranks import this module as a factory

    from microbatch.cli import main

    refuse_processes(monkeypatch)  # none before the seed's check
    assert main(["pipeline", "--seed", seed, "--no-predict"]) == 2
    err = capsys.readouterr().err
    assert re.fullmatch(
        rf"error: --seed {seed} is outside 0 \.\. 4,294,967,295 .*give --seed between 0 and 4294967295\n", err
    )
    fit.check_seed(PipelineConfig(seed=fit.MAX_SEED))  # the largest is taken
    torch.Generator().manual_seed(1_000_003 * (fit.MAX_SEED + 1) + 10**6)  # and torch holds what it derives


@pytest.mark.timeout(120)
def test_sigterm_before_the_ranks_run_is_an_interrupt_too():
    """SIGTERM in a phase with no ranks running (the checks, the before-run prediction between its calibration
    runs) is an interrupt as in the run: exit 130 and the phase said, not the process killed (exit -15, no word).
    The prediction here sends it to its own process."""
    script = (
        "import os, signal, sys\n"
        "import microbatch.run.pipeline.before_run as br\n"
        "def predict(run):\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    raise AssertionError('SIGTERM did not interrupt')\n"
        "br.predict_resolved = predict\n"
        "from microbatch.cli import main\n"
        "sys.exit(main(['pipeline', '-p', '2', '-m', '2', '--steps', '2']))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=90,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert done.returncode == 130, (done.returncode, done.stderr[-2000:])
    assert "interrupted" in done.stderr


@pytest.mark.timeout(120)
def test_leftover_torchrun_variables_say_so_and_fail_in_one_line():
    """RANK and WORLD_SIZE left in a shell (by torchrun or SLURM) put ``pipeline`` into outside-launch mode: it waited
    the whole --timeout without a word, then printed a 49-line traceback (``DistStoreError``). Now a line says why
    it waits, and the failure is one ``error:`` line naming the address and the fix."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    env.pop("TORCHELASTIC_RUN_ID", None)
    cmd = [sys.executable, "-m", "microbatch", "pipeline", "--stages", "2", "--steps", "1", "--no-predict"]
    out = subprocess.run([*cmd, "--timeout", "3"], env=env, capture_output=True, text=True, timeout=100)
    assert out.returncode == 1, out
    assert f"joins the process group at 127.0.0.1:{port}" in out.stderr
    assert f"error: rank 0 of 2 could not join the process group at 127.0.0.1:{port}" in out.stderr
    assert "unset RANK and WORLD_SIZE" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.timeout(60)
def test_the_layer_check_before_the_ranks_is_bounded_by_the_deadline(monkeypatch):
    """The check that the factory's layers chain ran the user's forward with no deadline: a layer that hangs held
    the launcher past --timeout + 60 s (a helper's run, still hung at 60 s with --timeout 10) while every later
    phase stops at the deadline."""
    run = resolve(PipelineConfig(model=f"{HERE}:hangs", global_batch=16))
    t0 = time.monotonic()
    with pytest.raises(
        PipelineError, match=r"checking the model's layers on one micro-batch passed its deadline of 2 s"
    ):
        fit.check_fits(
            run, available=24 * GIB, flops_per_s=1e9, deadline_s=2.0
        )  # the caller's deadline, passed on
    assert time.monotonic() - t0 < 20


def test_the_layer_check_leaves_a_timer_the_caller_had_running():
    """The check's guard set the process's real-time timer to 0 on its way out: a caller's (pytest-timeout's signal
    method) 500 s read (0.0, 0.0) afterwards."""
    fired = []
    previous = signal.signal(signal.SIGALRM, lambda *a: fired.append(a))
    try:
        signal.setitimer(signal.ITIMER_REAL, 500.0)
        fit.check_fits(resolve(PipelineConfig(model=f"{HERE}:stack", global_batch=16)), available=24 * GIB,
                       flops_per_s=1e9)  # fmt: skip
        left, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 400 < left <= 500 and fired == []
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_the_scheduler_probes_busy_loops_ignore_ctrl_c_and_none_outlives_an_interrupt(monkeypatch):
    """A Ctrl-C while the launcher timed the scheduler's slice printed a KeyboardInterrupt traceback from each of its
    busy loops (they share the launcher's process group), some after the 'interrupted:' line, and left them running."""
    from microbatch.run.pipeline import calibrate

    loop = subprocess.Popen(
        [sys.executable, "-c", calibrate._SPIN, "1.0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(0.5)  # the interpreter is up and spinning
    loop.send_signal(signal.SIGINT)
    out, err = loop.communicate(timeout=30)
    assert loop.returncode == 0 and "Traceback" not in err and out.strip().startswith("[")

    started: list[subprocess.Popen] = []
    real = subprocess.Popen

    def popen(*a, **kw):
        started.append(real(*a, **kw))
        return started[-1]

    def interrupted(self, *a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(real, "communicate", interrupted)
    monkeypatch.setattr(calibrate.subprocess, "Popen", popen)
    with pytest.raises(KeyboardInterrupt):
        calibrate.scheduler_slice_s(2, seconds=5.0)
    assert len(started) == 3 and all(p.poll() is not None for p in started)


class _Raises(torch.nn.Module):
    def forward(self, x):
        raise ValueError("this layer refuses odd batches")


def raises_its_own():  # a layer whose forward raises an error of its own
    nn = torch.nn
    return nn.Sequential(nn.Embedding(64, 8), _Raises(), nn.Linear(8, 64))


def test_a_layer_that_raises_its_own_error_is_not_called_a_size_mismatch():
    """The check's advice was "make consecutive layers' sizes match" whatever the layer raised."""
    with pytest.raises(
        ConfigError, match=r"ValueError: this layer refuses odd batches\); if it is not a mismatch of sizes"
    ) as e:
        fit.check_fits(resolve(PipelineConfig(model=f"{HERE}:raises_its_own", global_batch=16)), available=24 * GIB,
                       flops_per_s=1e9)  # fmt: skip
    assert "sizes match" not in str(e.value)


def test_three_taken_ports_leave_no_folder_behind(monkeypatch):
    """The rendezvous port taken three times: the error was clear, but the run's temporary folder stayed behind,
    unnamed (a helper's runs)."""
    from microbatch.run.pipeline import launch

    made = []
    real = launch.tempfile.mkdtemp
    monkeypatch.setattr(launch.tempfile, "mkdtemp", lambda **kw: made.append(real(**kw)) or made[-1])

    def taken(*a, **kw):
        raise launch._PortTaken()

    monkeypatch.setattr(launch, "_launch_once", taken)
    with pytest.raises(PipelineError, match="three free ports were taken"):
        launch.run_resolved(resolve(PipelineConfig(stages=2, steps=1)))
    assert len(made) == 1 and not os.path.exists(made[0])


def test_a_layer_that_needs_its_data_is_not_refused_by_the_check_on_the_meta_device():
    """A router's ``nonzero`` (or ``.item()``) cannot run on the meta device the check builds the model on: such a
    factory was refused with "make consecutive layers' sizes match" though it runs on the ranks."""
    fit.check_fits(resolve(PipelineConfig(model=f"{HERE}:routes", global_batch=16)), available=24 * GIB,
                   flops_per_s=1e9)  # fmt: skip
