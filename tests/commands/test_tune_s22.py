"""What a tune sweep found: a b_m measured with checkpointing on is marked and its advice says so, the memory fit
takes one mode, "flattened" means what the search stops on, an HF config transformers cannot build is refused
before any probe, --start moves to a divisor of B/d, an unwritable cache is noted, a --out named like a file and
another command's result under bench-gpu's --out are refused, and the child's memory limit binds at the budget."""

from __future__ import annotations

import json
import sys

import pytest
from _cli import run

from microbatch.batch import first_micro_batch
from microbatch.choose.config import ChoiceConfig
from microbatch.choose.curve import CurvePoint
from microbatch.choose.knee import flattened, recommend_measured
from microbatch.choose.memory_fit import fit_memory
from microbatch.choose.tune.cache import save_points
from microbatch.choose.tune.config import SearchConfig
from microbatch.choose.tune.preflight import walk_sizes
from microbatch.errors import ConfigError
from microbatch.show.recommendation import render_curve, use_line

MiB = 2**20


def _pt(b, t, peak, ckpt=False):
    return CurvePoint(micro_batch=b, throughput=t, peak_memory_bytes=peak * MiB, checkpointing=ckpt)


def test_the_memory_fit_takes_the_mode_of_the_largest_b_m():
    """Plain points rise 8 MiB a b_m; the checkpointed ones 1 MiB from a lower base: a line through both is
    neither's (the helper's sweep: 1.91 MiB a b_m, 'fits to 17', where the plain line said 6)."""
    pts = [_pt(1, 10, 300), _pt(2, 19, 308), _pt(4, 30, 324), _pt(8, 33, 250, True), _pt(16, 34, 258, True)]
    fit = fit_memory(pts)
    assert fit is not None and fit.fitted_on == (8, 16)
    assert fit.slope_bytes_per_sample == pytest.approx(1 * MiB)
    plain = fit_memory(pts[:3])
    assert plain is not None and plain.slope_bytes_per_sample == pytest.approx(8 * MiB, rel=0.05)


def test_flattened_is_the_search_stop_rule_gain_over_the_fastest_below():
    """4 → 8 fell, 8 → 16 rose 19%: the last doubling gained, but 16 gains nothing per doubling over 4, which is
    what the search stops on; the old rule said 'had not flattened' beside 'stopped: throughput flattened'."""
    pts = [_pt(1, 40, 1), _pt(4, 100, 2), _pt(8, 80, 3), _pt(16, 95, 4)]
    assert flattened(pts, 0.05)
    assert not flattened([_pt(1, 40, 1), _pt(4, 100, 2), _pt(8, 130, 3)], 0.05)


def test_a_checkpointed_knee_is_marked_and_its_advice_says_so():
    pts = [_pt(1, 10, 300), _pt(2, 19, 308), _pt(4, 30, 250, True), _pt(8, 31, 258, True)]
    d = recommend_measured(pts, ChoiceConfig(tolerance=0.1)).to_dict()
    assert d["micro_batch"] == 4 and d["checkpointing"] is True
    assert d["fastest_fitting"]["checkpointing"] is True
    rows = render_curve(d, [dict(micro_batch=p.micro_batch, throughput=p.throughput, checkpointing=p.checkpointing,
                                 peak_memory_bytes=p.peak_memory_bytes) for p in pts])  # fmt: skip
    marked = {int(r.split()[0]) for r in rows[1:] if "checkpointed" in r}
    assert marked == {4, 8}
    assert "with activation checkpointing on" in use_line(d)
    plain = recommend_measured(pts[:2], ChoiceConfig(tolerance=0.1)).to_dict()
    assert plain["checkpointing"] is False and "checkpointing" not in use_line(plain)
    with pytest.raises(ConfigError, match="checkpointing must be True or False, got 'yes' at micro_batch 1"):
        CurvePoint(micro_batch=1, throughput=1.0, checkpointing="yes")  # type: ignore[arg-type]


def test_recommend_reads_the_checkpointing_column_into_its_fit(tmp_path, capsys):
    rows = [
        {"micro_batch": 1, "throughput": 10, "peak_memory_bytes": 300 * MiB},
        {"micro_batch": 2, "throughput": 19, "peak_memory_bytes": 308 * MiB},
        {"micro_batch": 4, "throughput": 30, "peak_memory_bytes": 250 * MiB, "checkpointing": True},
        {"micro_batch": 8, "throughput": 31, "peak_memory_bytes": 258 * MiB, "checkpointing": True},
    ]
    f = tmp_path / "c.json"
    f.write_text(json.dumps(rows))
    code, out, _ = run(["recommend", "--measurements", str(f), "--json"], capsys)
    d = json.loads(out)
    assert code == 0 and d["memory_fit"]["fitted_on"] == [4, 8] and d["checkpointing"] is True


def test_start_moves_to_the_next_divisor_of_the_per_replica_batch():
    assert first_micro_batch(5, 96) == 6 and first_micro_batch(5, None) == 5 and first_micro_batch(7, 7) == 7
    assert walk_sizes(SearchConfig(start=5, max_micro_batch=64), 96)[:3] == [6, 12, 24]


def test_an_unwritable_cache_is_a_reason_not_an_error(tmp_path, monkeypatch):
    blocker = tmp_path / "afile"
    blocker.write_text("")
    monkeypatch.setenv("MICROBATCH_CACHE_DIR", str(blocker))
    why = save_points("k", {}, {})
    assert why is not None and str(blocker) in why
    monkeypatch.setenv("MICROBATCH_CACHE_DIR", str(tmp_path / "ok"))
    assert save_points("k", {}, {}) is None and (tmp_path / "ok" / "tune-k.json").is_file()


def test_tune_out_named_like_a_file_is_refused_before_any_probe(tmp_path, capsys):
    code, _, err = run(["tune", "--model", "tiny", "--seq", "32", "--out", str(tmp_path / "x.json")], capsys)
    assert code == 2 and "names a .json file, and --out is a folder" in err
    assert not (tmp_path / "x.json").exists()


def test_bench_gpu_out_will_not_replace_another_commands_result(tmp_path, capsys):
    f = tmp_path / "b.json"
    f.write_text(json.dumps({"command": "tune", "version": "0", "points": []}))
    code, _, err = run(["bench-gpu", "--quick", "--out", str(f)], capsys)
    assert code == 2 and "holds a `tune` result" in err and "--force" in err
    assert json.loads(f.read_text())["command"] == "tune"


@pytest.mark.skipif(sys.platform != "linux", reason="the probe child's limit is Linux's RLIMIT_AS")
def test_an_hf_config_transformers_cannot_build_is_refused_before_any_probe(tmp_path, capsys):
    pytest.importorskip("transformers")
    base = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
            "num_hidden_layers": 2, "num_key_value_heads": 4, "vocab_size": 128, "max_position_embeddings": 64}  # fmt: skip
    for extra, says in (
        ({"hidden_act": "swishy"}, "transformers cannot build its model (KeyError: 'swishy')"),
        ({"model_type": "lama"}, "Unrecognized model identifier: lama"),
    ):
        f = tmp_path / "config.json"
        f.write_text(json.dumps({**base, **extra}))
        code, _, err = run(["tune", "--hf-config", str(f), "--seq", "32", "--no-cache"], capsys)
        assert code == 2 and says in err, err
        assert len(err) < 1000  # not transformers' list of every model type it knows (12 kB)


INVARIANT = """
import ctypes, resource
from microbatch.measure import hostmem
hostmem.mark_probe_child()
assert hostmem.tracking_heap() is not None
M = 2**20
real = hostmem.current_rss_bytes() + 512 * M
resource.setrlimit(resource.RLIMIT_AS, (hostmem.virtual_bytes() + 512 * M, resource.RLIM_INFINITY))
hostmem.rebind_limit()  # reads the real budget the limit stands for
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
ptrs = [libc.malloc(60000) for _ in range(3000)]  # under the 64 KiB mmap threshold: the heap
for p in ptrs:
    ctypes.memset(p, 1, 60000)  # resident
for p in ptrs[100:2900]:
    libc.free(ctypes.c_void_p(p))  # a free run in the heap's middle (the last blocks keep it from the top)
hostmem.malloc_trim()  # its pages given back: mapped, not resident
hostmem.replug()  # the free run held, untouched
soft = resource.getrlimit(resource.RLIMIT_AS)[0]
print(len(hostmem._PLUGS), real, soft - (hostmem.virtual_bytes() - hostmem.current_rss_bytes()))
"""


@pytest.mark.skipif(
    sys.platform != "linux", reason="the probe child's limit is Linux's RLIMIT_AS, on glibc's heap"
)
def test_the_childs_limit_stays_the_real_budget_once_the_heap_holds_chunks():
    """The probe child holds the heap's trimmed free chunks (mapped, not resident) before each probe; the limit on
    address space must grow by them, or it binds below the budget (small at b_m 4, 432.5 MiB, refused at 450):
    the limit less what is mapped but not resident stays the real budget (it fell by the held 160 MiB here)."""
    import os
    import subprocess

    from microbatch.measure.childprobe import WORKER_ENV

    out = subprocess.run(
        [sys.executable, "-c", INVARIANT], env={**os.environ, **WORKER_ENV}, capture_output=True, text=True,
        timeout=120, check=True,
    ).stdout.split()  # fmt: skip
    held, real, limit_less_unresident = (int(x) for x in out)
    assert held > 0  # the run was held
    assert abs(limit_less_unresident - real) <= 2 * MiB
