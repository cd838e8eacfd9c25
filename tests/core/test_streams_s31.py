"""Which outputs are streams, written in place (a helper's review, 2026-12-07): every path under /dev or /proc was,
so a user's file in /dev/shm (a tmpfs folder of regular files) was appended to without --force and a result written
twice there stopped parsing; a /proc path that cannot be written passed the checks made before the work."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from microbatch.cli import main
from microbatch.files import is_stream, write_text

SHM = Path("/dev/shm")


def test_what_is_a_stream(tmp_path):
    assert is_stream("/dev/stdout") and is_stream("/dev/fd/1") and is_stream("/proc/self/fd/2")
    assert is_stream("/dev/null")  # a character device
    fifo = tmp_path / "f"
    os.mkfifo(fifo)
    assert is_stream(fifo)
    plain = tmp_path / "a.json"
    plain.write_text("{}")
    assert not is_stream(plain) and not is_stream(tmp_path / "new.json") and not is_stream(tmp_path)
    assert not is_stream("/proc/no-such-file")


@pytest.mark.skipif(not SHM.is_dir() or not os.access(SHM, os.W_OK), reason="no writable /dev/shm")
def test_a_file_in_dev_shm_is_a_file(tmp_path, capsys):
    mine = SHM / f"microbatch-test-{os.getpid()}.svg"
    try:
        mine.write_text("<svg>mine</svg>")
        assert main(["simulate", "--schedule", "1f1b", "-p", "2", "-m", "4", "--svg", str(mine)]) == 2
        assert mine.read_text() == "<svg>mine</svg>"  # a user's file: refused without --force, as in /tmp
        assert "give --force" in capsys.readouterr().err
        mine.unlink()
        for _ in range(2):  # written twice: replaced whole, not appended
            assert main(["simulate", "--schedule", "1f1b", "-p", "2", "-m", "4", "--svg", str(mine)]) == 0
        assert mine.read_text().count("<svg") == 1
        path = SHM / f"microbatch-test-{os.getpid()}.json"
        for _ in range(2):
            write_text(path, json.dumps({"n": 1}))
        assert json.loads(path.read_text()) == {"n": 1}
        path.unlink()
    finally:
        mine.unlink(missing_ok=True)


def test_a_proc_path_is_refused_before_the_work(capsys):
    assert (
        main(["simulate", "--schedule", "1f1b", "-p", "2", "-m", "4", "--svg", "/proc/microbatch-x.svg"]) == 2
    )
    err = capsys.readouterr().err
    assert "cannot be written" in err and "makespan" not in err
