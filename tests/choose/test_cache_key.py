"""The tune cache answers only for the measurement it holds: every input that changes a measurement
changes the key, and an answer served from the cache says so (issue 30)."""

from __future__ import annotations

import os
import warnings

import pytest

torch = pytest.importorskip("torch")

from microbatch.choose.tune import tune  # noqa: E402
from microbatch.choose.tune.cache import (  # noqa: E402
    CachedAnswer,
    batch_structure,
    callable_identity,
    optimizer_identity,
)
from microbatch.measure.timing import TimingConfig  # noqa: E402

FAST = TimingConfig(warmup=0, min_repeats=1, max_repeats=1, max_time_s=0.2, rel_tol=1.0)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(50, 8)
        self.out = torch.nn.Linear(8, 50)

    def forward(self, x):
        return self.out(self.emb(x))


def _batches(seq):
    return lambda b: torch.randint(0, 50, (b, seq))


def _tune(model, make_batch, **kw):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CachedAnswer)
        r = tune(model, make_batch, max_micro_batch=2, timing=FAST, tolerance=0.0, **kw)
    said = [str(w.message) for w in caught if issubclass(w.category, CachedAnswer)]
    return r, said


def test_the_same_call_is_answered_from_the_cache_and_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("MICROBATCH_CACHE_DIR", str(tmp_path))
    model = Net()
    first, said = _tune(model, _batches(8))
    assert first.cached == 0 and first.cache is None and said == []
    again, said = _tune(model, _batches(8))
    assert again.probes == 0 and again.cached == len(again.points) == 2
    assert again.cache is not None and again.cache.points == 2 and again.cache.measured == 0
    assert again.to_dict()["cache"]["points"] == 2
    assert len(said) == 1 and "2 of 2 points from the cache" in said[0] and "use_cache=False" in said[0]
    assert again.cache.oldest_s is not None and again.cache.oldest_s <= first.wall_time_s + 1e12


def test_only_the_batch_changed_measures_again(tmp_path, monkeypatch):
    """The issue's case: the same module and settings fed sequences 4x longer."""
    monkeypatch.setenv("MICROBATCH_CACHE_DIR", str(tmp_path))
    model = Net()
    _tune(model, _batches(8))
    longer, said = _tune(model, _batches(32))
    assert longer.cached == 0 and longer.probes >= 2 and said == []  # measured again, all of it


@pytest.mark.parametrize(
    "change",
    ["loss", "optimizer", "optimizer_lr", "threads", "checkpointing", "precision"],
)
def test_each_setting_that_changes_a_measurement_is_in_the_key(tmp_path, monkeypatch, change):
    monkeypatch.setenv("MICROBATCH_CACHE_DIR", str(tmp_path))
    model = Net()
    make = _batches(8)

    def ce(m, x):
        return torch.nn.functional.cross_entropy(m(x)[:, :-1].flatten(0, 1), x[:, 1:].flatten())

    def ce_smoothed(m, x):
        return torch.nn.functional.cross_entropy(
            m(x)[:, :-1].flatten(0, 1), x[:, 1:].flatten(), label_smoothing=0.1
        )

    base = dict(loss_fn=ce, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), threads=1)
    _tune(model, make, **base)
    same, _ = _tune(model, make, **dict(base, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3)))
    assert same.cached == 2  # a new optimizer object with the same settings: the same measurement
    changed = {
        "loss": dict(base, loss_fn=ce_smoothed),
        "optimizer": dict(base, optimizer=torch.optim.SGD(model.parameters(), lr=1e-3)),
        "optimizer_lr": dict(base, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2)),
        "threads": dict(base, threads=2),
        "checkpointing": dict(base, checkpointing="auto"),
        "precision": dict(base, precision="bf16-mixed"),
    }[change]
    r, said = _tune(model, make, **changed)
    assert r.cached == 0 and said == []


def test_a_new_probe_revision_measures_again(tmp_path, monkeypatch):
    """Points cached before the probes changed how they measure (decoding timed on the steady heap, the built-in
    cache's dtype under autocast) came back at the same version: the probes' revision is in the key."""
    from microbatch.choose.tune import cache

    monkeypatch.setenv("MICROBATCH_CACHE_DIR", str(tmp_path))
    model = Net()
    _tune(model, _batches(8))
    assert cache.versions()["probes"] == str(cache.PROBE_REVISION)
    monkeypatch.setattr(cache, "PROBE_REVISION", cache.PROBE_REVISION + 1)
    r, said = _tune(model, _batches(8))
    assert r.cached == 0 and said == []


def test_key_parts_are_what_they_claim():
    assert batch_structure({"input_ids": torch.zeros(2, 8, dtype=torch.long), "n": 3}) == {
        "input_ids": ["tensor", [2, 8], "torch.int64", "cpu"],
        "n": 3,
    }
    assert batch_structure((torch.zeros(1, 4),)) != batch_structure((torch.zeros(1, 5),))

    def f(m, x):
        return x.sum()

    def g(m, x):
        return x.mean()

    assert callable_identity(f) != callable_identity(g)
    assert callable_identity(None) is None
    p = [torch.nn.Parameter(torch.zeros(2))]
    a = optimizer_identity(torch.optim.AdamW(p, lr=1e-3, weight_decay=0.1))
    b = optimizer_identity(torch.optim.AdamW(p, lr=1e-3, weight_decay=0.0))
    assert a is not None and b is not None and a != b and a["class"].endswith("AdamW")
    assert "params" not in a["groups"][0]


def test_models_the_probes_cannot_train_are_refused_before_any_probe(tmp_path, monkeypatch):
    """Issue 32 item 5: torch's own messages named neither the model nor the fix."""
    from microbatch.errors import ConfigError

    monkeypatch.setenv("MICROBATCH_CACHE_DIR", str(tmp_path))
    frozen = Net().requires_grad_(False)
    with pytest.raises(ConfigError, match=r"Net has no trainable parameter.*requires_grad_\(True\)"):
        tune(frozen, _batches(8), max_micro_batch=2, timing=FAST)
    with torch.device("meta"):
        meta = Net()
    with pytest.raises(
        ConfigError, match=r"parameter 'emb.weight' and 2 more of Net is on the meta device.*to_empty"
    ):
        tune(meta, _batches(8), max_micro_batch=2, timing=FAST)


def test_a_nan_loss_is_said(tmp_path, monkeypatch):
    from microbatch.choose.tune import NonFiniteLoss

    monkeypatch.setenv("MICROBATCH_CACHE_DIR", str(tmp_path))
    model = Net()
    with pytest.warns(NonFiniteLoss, match=r"loss of the first probing step was nan"):
        r = tune(model, _batches(8), loss_fn=lambda m, x: m(x).sum() * float("nan"), max_micro_batch=2,
                 timing=FAST)  # fmt: skip
    assert r.notes and "nan" in r.notes[0] and r.to_dict()["notes"] == list(r.notes)
    assert all(torch.isfinite(p).all() for p in model.parameters())  # put back as it was
    ok = tune(model, _batches(8), max_micro_batch=2, timing=FAST, use_cache=False)
    assert ok.notes == ()


@pytest.mark.parametrize("change", ["frozen", "omp_threads", "affinity"])
def test_what_the_module_and_the_process_hold_is_in_the_key(tmp_path, monkeypatch, change):
    """A helper's runs answered from the cache: the model with its first layer frozen (19% faster in truth), and the
    same tune under OMP_NUM_THREADS=2 or on one core of two (taskset)."""
    from microbatch.choose.tune import cache

    monkeypatch.setenv("MICROBATCH_CACHE_DIR", str(tmp_path))
    model, make = Net(), _batches(8)
    _tune(model, make)
    if change == "frozen":
        model.emb.weight.requires_grad_(False)
    elif change == "omp_threads":
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
    else:
        monkeypatch.setattr("microbatch.hardware.usable_cores", lambda: 1)
    r, said = _tune(model, make)
    assert r.cached == 0 and said == [], change
    assert cache.host_identity()["cores"] >= 1


def test_an_out_of_memory_point_holds_only_under_a_budget_no_larger(tmp_path, monkeypatch):
    """An out-of-memory at 400 MiB came back '(cached)' at 2 GiB, and the run then said to raise the budget it had
    just raised. A point the limit shaped (out of memory, or timed on the tracking heap) holds under a budget no
    larger than the one it met; one the limit did not touch holds under any."""
    import os

    from microbatch.choose.tune.cache import holds_under, load_points, save_points
    from microbatch.measure.probes import Measurement

    monkeypatch.setenv("MICROBATCH_CACHE_DIR", str(tmp_path))
    oom = Measurement(micro_batch=256, oom=True)
    tracked = Measurement(micro_batch=128, throughput=10.0, timed_heap="tracking")
    fine = Measurement(micro_batch=64, throughput=20.0, timed_heap="steady")
    points = {(256, False): oom, (128, False): tracked, (64, False): fine}
    save_points("k", {}, points, budgets={k: 400 * 2**20 for k in points})
    assert set(load_points("k", budget_bytes=2 * 2**30)) == {(64, False)}  # a larger budget measures again
    assert set(load_points("k", budget_bytes=300 * 2**20)) == set(points)  # a smaller one: they still hold
    assert set(load_points("k", budget_bytes=None)) == {(64, False)}  # no limit at all
    assert not holds_under({"oom": True}, 1.0)  # saved before budgets were: measured again
    assert holds_under({"oom": True, "budget_bytes": None}, None) and holds_under(
        {"oom": True, "budget_bytes": None}, 1.0
    )
    # read back under a smaller budget and saved again, a point keeps the budget it met, not the smaller one
    budgets: dict = {}
    kept = load_points("k", budget_bytes=300 * 2**20, budgets=budgets)
    save_points("k", {}, kept, budgets=budgets)
    assert set(load_points("k", budget_bytes=400 * 2**20)) == set(points)
    umask = os.umask(0o022)
    os.umask(umask)
    assert (tmp_path / "tune-k.json").stat().st_mode & 0o777 == 0o666 & ~umask  # as a file written plainly


@pytest.mark.parametrize(
    "row",
    [{"micro_batch": 1}, {"micro_batch": 1, "throughput": "fast"}, {"micro_batch": "2", "throughput": 3.0},
     {"micro_batch": 0, "throughput": 3.0}, {"micro_batch": 1, "throughput": float("nan")},
     {"micro_batch": 1, "throughput": 3.0, "oom": "no"}, {"micro_batch": 1, "throughput": -3.0}, [1, 2],
     {"micro_batch": 1, "throughput": 3.0, "memory_method": 5},
     {"micro_batch": 1, "throughput": 3.0, "memory_method": ["vmhwm"]},
     {"micro_batch": 1, "throughput": 3.0, "peak_memory_bytes": -5},
     {"micro_batch": 1, "throughput": 3.0, "step_time_s": -0.01}, {"micro_batch": 1, "throughput": 3.0, "error": 0}],
)  # fmt: skip
def test_a_point_of_the_wrong_shape_is_left_out_not_a_crash_later(tmp_path, monkeypatch, row):
    """A cache file that parses but holds ``{"micro_batch": 1}`` or ``"throughput": "fast"`` ended every later run
    with that key in a traceback (rc 1) until the file was deleted."""
    import json

    from microbatch.choose.tune.cache import load_points, well_formed

    monkeypatch.setenv("MICROBATCH_CACHE_DIR", str(tmp_path))
    good = {"micro_batch": 4, "throughput": 5.0, "step_time_s": 0.1}
    (tmp_path / "tune-k.json").write_text(json.dumps({"key": {}, "points": [row, good]}))
    assert not well_formed(row) and well_formed(good)
    assert list(load_points("k")) == [(4, False)]


def test_two_tunes_saving_at_once_write_files_of_their_own(tmp_path, monkeypatch):
    """Both wrote one ``tune-<key>.json.tmp``: one's rename found the file gone, or moved the other's half-written
    file into place (a helper's race of two processes: ~300 failed saves and ~110 unreadable reads each)."""
    import threading

    from microbatch.choose.tune.cache import load_points, save_points
    from microbatch.measure.probes import Measurement

    monkeypatch.setenv("MICROBATCH_CACHE_DIR", str(tmp_path))
    failures: list[str] = []

    def saver(n: int) -> None:
        pts = {(b, False): Measurement(micro_batch=b, throughput=float(n + b)) for b in range(1, 200)}
        for _ in range(40):
            why = save_points("k", {"n": n}, pts)
            if why is not None:
                failures.append(why)

    threads = [threading.Thread(target=saver, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == [] and len(load_points("k")) == 199
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tune.lock", "tune-k.json"]  # no save's file left


def test_a_hugging_face_models_attention_and_checkpointing_are_in_its_fingerprint():
    """Its repr shows neither: a GPT-2 with sdpa, with eager attention and with checkpointing on had one hash. Read
    without transformers' warning on the renamed attribute (a test that turns warnings into errors failed on it)."""
    transformers = pytest.importorskip("transformers")
    from microbatch.choose.tune.cache import module_fingerprint

    cfg = transformers.GPT2Config(
        n_layer=1, n_embd=32, n_head=2, vocab_size=50, bos_token_id=0, eos_token_id=0
    )
    model = transformers.GPT2LMHeadModel(cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        first = module_fingerprint(model)
        model.config._attn_implementation = "eager"
        eager = module_fingerprint(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the enabling call's own deprecation warning, in transformers 5
        enable = (
            getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        )
        enable()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len({first, eager, module_fingerprint(model)}) == 3


def test_two_tunes_sharing_the_cache_keep_each_others_points(tmp_path, monkeypatch):
    """Each save replaced the file with its own process's points: one tune's b_m 1 and 2 were lost when another saved
    4 and 8 (a review, 3 of 3), and a third tune measured them again. A save keeps the others' points; where both hold
    one, the one measured later (a copy read before another process re-measured it does not overwrite it); each point
    says whether the run that saved it had re-measured its knee."""
    from microbatch.choose.tune.cache import load_points, save_points
    from microbatch.measure.probes import Measurement

    monkeypatch.setenv("MICROBATCH_CACHE_DIR", str(tmp_path))

    def pts(*bs, rate=1.0):
        return {(b, False): Measurement(micro_batch=b, throughput=rate * b) for b in bs}

    assert save_points("k", {}, pts(1, 2), stamps={(1, False): 10.0, (2, False): 10.0},
                       unconfirmed={(1, False), (2, False)}) is None  # the first tune, mid-walk  # fmt: skip
    assert (
        save_points("k", {}, pts(2, 4, 8, rate=3.0), stamps={(2, False): 20.0}) is None
    )  # the second, later
    got = load_points("k", meta=(meta := {}))
    assert sorted(got) == [(1, False), (2, False), (4, False), (8, False)]
    assert got[1, False].throughput == 1.0 and got[2, False].throughput == 6.0  # b_m 2: the later measurement
    assert meta == {"unconfirmed": {(1, False)}}
    # a process that read b_m 2 at its old stamp and saves a copy does not overwrite the newer one
    save_points("k", {}, pts(2, 16), stamps={(2, False): 10.0}, unconfirmed={(16, False)})
    got = load_points("k", meta=meta)
    assert got[2, False].throughput == 6.0 and got[16, False].throughput == 16.0
    assert meta == {"unconfirmed": {(1, False), (16, False)}}


@pytest.mark.timeout(120)
def test_processes_saving_at_once_lose_no_point(tmp_path):
    """Four processes, each saving its own 40 points one at a time under one key: every point is in the file at the
    end (the lock keeps a save's read of the others' points and its rename together; without it a review's stress
    kept 222 of 240)."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from microbatch.choose.tune.cache import save_points\n"
        "from microbatch.measure.probes import Measurement\n"
        "n = int(sys.argv[1]); mine = {}\n"
        "for i in range(40):\n"
        "    b = 1000 * n + i + 1\n"
        "    mine[(b, False)] = Measurement(micro_batch=b, throughput=1.0)\n"
        "    assert save_points('k', {}, mine) is None\n"
    )
    env = dict(os.environ, MICROBATCH_CACHE_DIR=str(tmp_path))
    procs = [subprocess.Popen([sys.executable, "-c", script, str(n)], env=env) for n in range(4)]
    assert [p.wait(timeout=100) for p in procs] == [0, 0, 0, 0]
    from microbatch.choose.tune.cache import load_points

    os.environ["MICROBATCH_CACHE_DIR"], before = str(tmp_path), os.environ.get("MICROBATCH_CACHE_DIR")
    try:
        assert len(load_points("k")) == 160
    finally:
        if before is None:
            del os.environ["MICROBATCH_CACHE_DIR"]
        else:
            os.environ["MICROBATCH_CACHE_DIR"] = before


def test_a_fifo_under_the_entrys_name_is_refused_not_waited_on(tmp_path, monkeypatch):
    """The cache's save went through the in-place branch of the shared writer for a path that is not a regular
    file: a FIFO there hung the tune for good, holding the lock (a review). It is refused with the reason now."""
    from microbatch.choose.tune.cache import save_points
    from microbatch.measure.probes import Measurement

    monkeypatch.setenv("MICROBATCH_CACHE_DIR", str(tmp_path))
    os.mkfifo(tmp_path / "tune-k.json")
    why = save_points("k", {}, {(1, False): Measurement(micro_batch=1, throughput=1.0)})
    assert why is not None and "not a regular file" in why


READER = """import json, sys
bad = 0
for _ in range(600):
    try:
        json.loads(open(sys.argv[1]).read())
    except ValueError:
        bad += 1
print(600, bad)
"""


def test_a_tune_results_save_is_whole_to_a_reader_beside_it(tmp_path):
    """``TuneResult.save`` wrote ``result.json`` in place: a ``recommend`` reading beside a loop of saves found it empty
    26 times in 28 (a review). It writes through :func:`microbatch.files.write_text` now: a reader sees the earlier
    file or the new one, whole."""
    import subprocess
    import sys

    from microbatch.choose.config import ChoiceConfig
    from microbatch.choose.knee import recommend
    from microbatch.choose.result import TuneResult
    from microbatch.choose.tune.search import curve_point
    from microbatch.measure.probes import Measurement

    pts = [Measurement(micro_batch=b, throughput=t, step_time_s=b / t, peak_memory_bytes=10**9 + b)
           for b, t in {1: 100.0, 2: 190.0, 4: 330.0, 8: 360.0}.items()]  # fmt: skip
    rec = recommend([curve_point(p) for p in pts], ChoiceConfig(reference="measured"))
    result = TuneResult(points=pts * 400, recommendation=rec, model="m", seq=8, mode="train", device="cpu",
                        device_name="cpu", precision="fp32", checkpointing="off", torch_version="x",
                        memory_budget_bytes=None, memory_method="vmhwm", stop_reason="flat", skipped=[],
                        interrupted=False, oom_events=0, probes=4, cached=0, wall_time_s=1.0)  # fmt: skip
    path = result.save(tmp_path)
    reader = subprocess.Popen(
        [sys.executable, "-c", READER, str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        while reader.poll() is None:
            result.save(tmp_path)
        out, err = reader.communicate(timeout=60)
    finally:
        if reader.poll() is None:
            reader.kill()
    reads, bad = map(int, out.split())
    assert reads == 600 and bad == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["result.json"]  # no part file left


def test_the_cache_folder_without_a_home(monkeypatch, tmp_path):
    """No HOME and no passwd entry (``docker run --user 12345``): Path.home() raised and tune ended in a traceback;
    ``HOME=`` put the cache at the root's ``/.cache``; XDG_CACHE_HOME was not read (a review)."""
    import tempfile
    from pathlib import Path

    from microbatch.choose.tune import cache

    monkeypatch.delenv("MICROBATCH_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.cache_dir() == tmp_path / "xdg" / "microbatch"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/not/taken")
    monkeypatch.setenv("HOME", "")
    assert cache.cache_dir().parent == Path(tempfile.gettempdir())

    def no_home() -> Path:
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setenv("HOME", "/x")
    monkeypatch.setattr(Path, "home", staticmethod(no_home))
    assert cache.cache_dir().name.startswith("microbatch-cache-")
    monkeypatch.setenv("MICROBATCH_CACHE_DIR", str(tmp_path / "mine"))
    assert cache.cache_dir() == tmp_path / "mine"


def test_the_temporary_cache_folder_is_this_users_own(monkeypatch, tmp_path):
    """Its name is predictable: a folder another user made there first (or one anyone may write in) would let them
    plant points or refuse the writes; a private one is made instead (a review)."""
    import os
    import stat
    import tempfile

    from microbatch.choose.tune import cache

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(cache, "_PRIVATE", [])
    mine = cache._private_temp_cache()
    assert (
        mine == tmp_path / f"microbatch-cache-{os.getuid()}" and stat.S_IMODE(os.stat(mine).st_mode) == 0o700
    )
    os.chmod(mine, 0o777)  # as another user's planted folder would be, writable by all
    other = cache._private_temp_cache()
    assert other != mine and other.parent == tmp_path and stat.S_IMODE(os.stat(other).st_mode) == 0o700
