"""A process started with torchrun's or SLURM's variables left in its environment: bench-gpu waited in torch's store
for 30 minutes, deaf to Ctrl-C, or printed a traceback for ``WORLD_SIZE=8`` alone, ``RANK=abc``,
``MASTER_PORT=99999`` (a review, 2026-12-07)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from microbatch.errors import ConfigError
from microbatch.measure.device import launch_env

GOOD = {"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def test_a_launch_is_read_from_its_variables():
    assert launch_env({}) is None and launch_env({"WORLD_SIZE": "1", "RANK": "0"}) is None
    assert launch_env(GOOD) == (1, 2, "127.0.0.1:29500")


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"WORLD_SIZE": "abc"}, r"WORLD_SIZE='abc' in the environment is not a whole number"),
        ({"RANK": ""}, r"WORLD_SIZE=2 is set but RANK is not"),
        ({"MASTER_ADDR": ""}, r"but MASTER_ADDR is not"),
        ({"RANK": "5"}, r"RANK='5' must be a whole number below WORLD_SIZE=2"),
        ({"RANK": "abc"}, r"RANK='abc' must be a whole number"),
        ({"MASTER_PORT": "99999"}, r"MASTER_PORT='99999' must be a port number from 1 to 65535"),
    ],
)
def test_variables_that_describe_no_launch_are_refused_with_the_fix(change, words):
    with pytest.raises(ConfigError, match=words + r".*unset WORLD_SIZE and RANK to run alone"):
        launch_env({**GOOD, **change})


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="signals as Linux sends them")
@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_waiting_for_ranks_that_never_come_stops_on_a_signal(tmp_path, sig):
    env = {**os.environ, **GOOD, "MASTER_PORT": str(29700 + int(sig)), "MICROBATCH_CACHE_DIR": str(tmp_path)}
    p = subprocess.Popen([sys.executable, "-m", "microbatch", "bench-gpu", "--quick", "--json"], env=env, cwd=tmp_path,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    time.sleep(
        8
    )  # torch imported and the join under way (rank 1 waits silently for a rank 0 that never comes)
    assert p.poll() is None
    os.kill(p.pid, sig)
    try:
        out, _ = p.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        pytest.fail("still waiting 30 s after the signal")
    assert p.returncode == 130 and '"kind": "interrupted"' in out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="signals as Linux sends them")
@pytest.mark.timeout(120)
def test_pipeline_waiting_as_one_rank_of_an_outside_launch_stops_on_ctrl_c(tmp_path):
    env = {**os.environ, **GOOD, "MASTER_PORT": "29731", "MICROBATCH_CACHE_DIR": str(tmp_path)}
    args = ["pipeline", "--model", "tiny", "--stages", "2", "--microbatches", "4", "--steps", "2", "--json"]
    p = subprocess.Popen([sys.executable, "-m", "microbatch", *args], env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    time.sleep(8)
    assert p.poll() is None
    os.kill(p.pid, signal.SIGINT)
    try:
        out, err = p.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        pytest.fail("still waiting 30 s after Ctrl-C")
    assert p.returncode == 130, err[-1000:]


def test_a_digit_int_cannot_read_is_refused_too():
    with pytest.raises(ConfigError, match=r"WORLD_SIZE='²'"):  # isdigit says yes, int says no
        launch_env({"WORLD_SIZE": "²"})
