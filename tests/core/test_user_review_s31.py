"""A new user's review (a helper, 2026-12-07). Which outputs are streams, written in place: every path under /dev or /proc was,
so a user's file in /dev/shm (a tmpfs folder of regular files) was appended to without --force and a result written
twice there stopped parsing; a /proc path that cannot be written passed the checks made before the work. A factory given where a registry name
is read, a pad token past the vocabulary, and the memory table of a small model (every column 0.00G)."""

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


def test_a_factory_given_where_a_registry_name_is_read_is_pointed_to_the_python_api(capsys):
    assert main(["memory", "--model", "mymodel:build", "-b", "1"]) == 2
    err = capsys.readouterr().err
    assert (
        "unknown model 'mymodel:build'" in err
        and "read by pipeline alone" in err
        and "microbatch.tune(" in err
    )
    assert main(["memory", "--model", "llama-3-8", "-b", "1"]) == 2
    assert "pipeline alone" not in capsys.readouterr().err  # a misspelt name is not told about factories


def test_a_pad_token_past_the_vocabulary_is_refused_before_transformers(tmp_path, capsys):
    cfg = tmp_path / "phi3.json"
    cfg.write_text(json.dumps({"model_type": "phi3", "vocab_size": 4096, "hidden_size": 64, "num_hidden_layers": 2,
                               "num_attention_heads": 4, "intermediate_size": 128, "pad_token_id": 32000}))  # fmt: skip
    assert main(["memory", "--hf-config", str(cfg), "-b", "1", "--seq", "64"]) == 2
    assert "pad_token_id 32000 is not below the vocabulary of 4096" in capsys.readouterr().err
    cfg.write_text(cfg.read_text().replace("32000", "0"))
    assert main(["memory", "--hf-config", str(cfg), "-b", "1", "--seq", "64"]) == 0


def test_the_memory_table_reads_in_the_peak_s_unit(capsys):
    assert main(["memory", "--model", "tiny", "-b", "4", "--seq", "64", "--precision", "fp32"]) == 0
    out = capsys.readouterr().out
    assert "0.00G" not in out and "MiB on stage 0" in out
    row = next(line for line in out.splitlines() if line.rstrip().endswith("<- peak"))
    assert all(cell.endswith("M") for cell in row.split()[3:9])


def test_a_result_kept_after_an_interrupt_says_its_kind():
    from microbatch.envelope import envelope

    assert envelope({"points": [1], "interrupted": True}, "tune")["kind"] == "interrupted"
    assert "kind" not in envelope({"points": [1], "interrupted": False}, "tune")
    assert envelope({"interrupted": True, "kind": "failure"}, "pipeline")["kind"] == "failure"  # its own kept


def test_a_link_to_stdout_is_stdout(tmp_path, capsys):
    link = tmp_path / "link.svg"
    link.symlink_to("/dev/stdout")
    assert is_stream(link)
    assert main(["simulate", "-p", "2", "-m", "4", "-s", "1f1b", "--svg", str(link), "--json"]) == 2
    assert "would share stdout" in capsys.readouterr().err


def test_a_family_without_a_padding_index_takes_any_pad_token(tmp_path, capsys):
    cfg = tmp_path / "neox.json"
    cfg.write_text(json.dumps({"model_type": "gpt_neox", "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 2,
                               "num_attention_heads": 4, "intermediate_size": 128, "pad_token_id": 512}))  # fmt: skip
    assert (
        main(["memory", "--hf-config", str(cfg), "-b", "1", "--seq", "64"]) == 0
    )  # its embedding has no padding_idx


def test_memory_on_a_gpu_it_does_not_fit_exits_2_as_plan_does(capsys):
    """`memory ... --gpu X && launch` went ahead: "does NOT fit" exited 0 (a new user's review)."""
    assert main(["memory", "--model", "llama-2-70b", "-b", "1", "--gpu", "l4", "--json"]) == 2
    d = json.loads(capsys.readouterr().out)
    assert d["kind"] == "does_not_fit" and d["fits"] is False and "does not fit" in d["error"]
    assert main(["memory", "--model", "gpt2", "-b", "1", "--gpu", "h100-80gb"]) == 0
