"""Pipeline memory that can disagree with the prediction: saved storages actually alive per rank,
an injected leak, GPipe against 1F1B as m grows, DualPipeV on torch's runtime, and refusing a run
that cannot fit before any process starts."""

from __future__ import annotations

import pytest

from microbatch.errors import ConfigError
from microbatch.run.pipeline.config import PipelineConfig
from microbatch.run.pipeline.fit import check_fits, predicted_host_bytes
from microbatch.run.pipeline.launch import run_pipeline
from microbatch.run.pipeline.resolved import resolve

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
    return [row.measured_peak_bytes for row in rep.memory]


def test_live_bytes_count_a_storage_once_and_release_it_when_the_last_tensor_dies():
    from microbatch.run.pipeline.instrument import LiveBytes

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
    per_mb = leaky.measured.stage_stats[0].activation_bytes_per_microbatch
    c0, l0 = clean.memory[0], leaky.memory[0]
    assert l0.counted_bytes == c0.counted_bytes  # the count is blind to the leak
    assert l0.predicted_bytes == pytest.approx(c0.predicted_bytes)
    assert l0.measured_peak_bytes > 1.3 * l0.predicted_bytes
    assert l0.measured_peak_bytes - c0.measured_peak_bytes >= 0.8 * per_mb  # one micro-batch more
    assert abs(c0.error_pct) <= 10  # without the leak, rank 0 is within 10%


@pytest.mark.timeout(300)
def test_gpipe_memory_grows_with_m_and_1f1b_does_not_measured():
    g2, g4 = run(schedule="gpipe", stages=2, microbatches=2), run(schedule="gpipe", stages=2, microbatches=4)
    f2, f4 = run(schedule="1f1b", stages=2, microbatches=2), run(schedule="1f1b", stages=2, microbatches=4)
    for a, b in zip(_measured(g2), _measured(g4), strict=True):
        assert b > 1.6 * a  # 4 micro-batches held against 2 (saved storages alive, not counted)
    for a, b in zip(_measured(f2), _measured(f4), strict=True):
        assert b == pytest.approx(a, rel=0.1)  # 1F1B holds p − i whatever m
    assert _measured(g4)[0] > 1.6 * _measured(f4)[0]
    # what 1F1B's rank 1 gains from m = 2 to 4 is torch's runtime, not activations: one receive
    # buffer (b_m·s·h·4 bytes) per micro-batch, measured through the same hooks
    from microbatch.run.pipeline.memory import boundary_bytes

    buf = boundary_bytes(resolve(PipelineConfig(schedule="1f1b", stages=2, microbatches=2)))
    assert _measured(f4)[1] - _measured(f2)[1] == pytest.approx(2 * buf, rel=0.05)
    assert _measured(g4)[1] - _measured(g2)[1] > 10 * 2 * buf  # GPipe: the activations as well


@pytest.mark.timeout(200)
def test_dualpipev_runs_on_torch_with_unsplit_gradients_and_torchs_order():
    rep = run(schedule="dualpipev", stages=2, microbatches=4, virtual=2, check_gradients=True)
    assert rep.gradients_match is True, rep.max_grad_rel_error
    assert rep.order_matches_torch, rep.executed_order
    assert {it.kind for it in rep.timeline} == {"F", "B", "I", "W"}
    assert [s.virtual_stages for s in rep.measured.stage_stats] == [[0, 3], [1, 2]]
    # memory along torch's order with each stage's own bytes (rank 0 holds the small embedding and
    # head stages: the registry's 2p + 1 chunks × the rank's mean stage predicted +24%..+48%)
    for row in rep.memory:
        assert abs(row.error_pct) <= 10, row


def _old_rule_bytes(rep, rank):
    """The prediction before issue 16's second pass: the registry's in-flight chunks × the rank's
    mean saved bytes per micro-batch, plus the received inputs beyond the in-flight count."""
    from microbatch.run.pipeline.memory import boundary_bytes
    from microbatch.run.pipeline.resolved import resolve

    cfg = PipelineConfig(
        schedule=rep.schedule,
        stages=rep.stages,
        microbatches=rep.microbatches,
        virtual=rep.virtual,
    )
    st = rep.measured.stage_stats[rank]
    rule = resolve(cfg).rule
    chunks = rule.in_flight(rank, cfg.stages, cfg.microbatches, cfg.virtual)
    fed = 1 if rank > 0 else 0
    return chunks * st.activation_bytes_per_microbatch + fed * (cfg.microbatches - chunks) * boundary_bytes(
        resolve(cfg)
    )


def test_split_backward_under_the_hooks_frees_what_it_saved():
    """Identity saved-tensor hooks made torch's split backward leak (the saved tensor holds its
    grad_fn, whose node holds the saved tensor: a cycle the collector cannot see); the hooks hold
    a detached alias, so after I and W nothing of the micro-batch is left alive."""
    import torch.nn.functional as F

    from microbatch.run.pipeline.instrument import StageRecorder, _saved_bytes_hooks, split_backward_kept

    pytest.importorskip("torch.distributed.pipelining._backward")
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    torch.manual_seed(0)
    body = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32))
    head = torch.nn.Sequential(torch.nn.LayerNorm(32), torch.nn.Linear(32, 512))
    target = torch.randint(0, 512, (64,))

    def loss_fn(out, tgt):
        return F.cross_entropy(out.float(), tgt, reduction="sum")

    rec = StageRecorder(rank=0)
    skip = {t.untyped_storage().data_ptr() for t in [*head.parameters(), target]}
    for _ in range(3):
        inp = torch.randn(64, 32, requires_grad=True)
        with _saved_bytes_hooks(skip, {}, rec, None):
            loss = loss_fn(head(inp), target)
        assert rec.live.bytes > 64 * 512 * 4  # the softmax over the vocabulary, at least
        _, groups = stage_backward_input([loss], None, [inp], iter(list(head.parameters())))
        stage_backward_weight(iter(list(head.parameters())), groups)
        del loss, groups, inp
    assert rec.live.bytes == 0, rec.live.bytes  # identity hooks: 3 micro-batches' softmax alive
    head.zero_grad()
    # I frees the loss side of the last stage (kept < half); a middle stage keeps all until W
    assert split_backward_kept(head, torch.randn(64, 32, requires_grad=True), first=False,
                               loss_fn=loss_fn, target=target) < 0.5  # fmt: skip
    assert split_backward_kept(body, torch.randn(64, 32, requires_grad=True), first=False) == pytest.approx(
        1.0
    )
    assert all(p.grad is None for p in [*head.parameters(), *body.parameters()])


@pytest.mark.timeout(200)
def test_zero_bubble_and_interleaved_memory_within_10_percent_where_the_old_rule_missed():
    """ZB-H1's last stage frees its loss side at I; interleaved ranks hold stages of different size.
    The prediction walks torch's order with each stage's bytes; the registry's chunks × the rank's
    mean (the old prediction) misses by more than 10% on these ranks."""
    zb = run(schedule="zb-h1", stages=2, microbatches=4)
    il = run(schedule="interleaved-1f1b", stages=2, microbatches=4, virtual=2)
    for rep in (zb, il):
        for row in rep.memory:
            assert abs(row.error_pct) <= 10, (rep.schedule, row)
    meas = zb.memory[1].measured_peak_bytes
    old = _old_rule_bytes(zb, 1)
    assert abs(meas - old) / old > 0.1, (meas, old)


@pytest.mark.timeout(200)
def test_the_embedding_only_rank_holds_the_shared_token_ids_once():
    """At p = 4 rank 0 holds only the embedding; its saved token ids are views of one batch tensor,
    held once whatever the number of micro-batches in flight (the old prediction: 3× measured)."""
    rep = run(schedule="1f1b", stages=4, microbatches=4)
    row = rep.memory[0]
    assert abs(row.error_pct) <= 10, row
    assert row.measured_peak_bytes < 0.6 * _old_rule_bytes(rep, 0)


def test_a_model_too_large_for_the_host_is_refused_with_the_numbers():
    cfg = PipelineConfig(model="llama-2-7b", stages=2, microbatches=4)
    with pytest.raises(
        ConfigError,
        # model state 126 GiB (2 copies + gradients and Adam) + activations in flight 49 GiB + Adam's CPU
        # temporaries 2 GiB (2 × the 500 MiB token table a rank) + the rest
        match=r"llama-2-7b \(6\.74 B parameters.* needs about 177\.\d+ GiB.* but 24\.00 GiB is available; "
        r"use a smaller model",
    ):
        check_fits(resolve(cfg), available=24 * 1024**3)
    pred = predicted_host_bytes(resolve(cfg), 1_000_000)
    assert pred["model_copies"] == 2 * 4e6 and pred["gradients_and_adam"] == 3 * 4e6
    assert check_fits(resolve(PipelineConfig(model="tiny")), available=24 * 1024**3) is not None


def test_cli_refuses_llama_before_starting_any_process(capsys, monkeypatch):
    import time

    from _helpers import refuse_processes

    from microbatch.cli import main

    refuse_processes(monkeypatch)  # "before any process" checked as such, not only by the clock
    from microbatch.run.pipeline.fit import available_host_bytes

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
            ["--trace", "pyproject.toml/t.json"],
            r"--trace pyproject.toml/t.json cannot be written: .*pyproject.toml is a file, not a folder",
        ),
        (["--svg", "pyproject.toml/x.svg"], r"--svg pyproject.toml/x.svg cannot be written: .*is a file"),
        (["--png", "out.svg"], r"--png out.svg: the suffix .svg names another format"),
    ],
)
def test_cli_checks_output_paths_before_the_run(args, pattern, capsys):
    from microbatch.cli import main

    assert main(["pipeline", "-p", "2", "-m", "4", *args]) == 2
    assert __import__("re").search(pattern, capsys.readouterr().err)


@pytest.mark.timeout(300)
def test_the_uncalibrated_prediction_is_within_15_percent_of_the_measured_peak():
    """predict/memory's Korthikanti et al. per-layer formula (fp32, the registry's in-flight rule, the
    embedding and head terms), with nothing measured, against the saved storages the ranks actually
    held: measured -3.8% / -1.4% (GPipe m = 4, ranks 0 / 1) and -3.5% / +10.2% (1F1B) on the dev
    machine — byte counts, the same on any machine. 15% keeps a x1.5 (-26% at best) or x0.75
    (+33% at least) out, and the formula's known misses on tiny (rank 1's loss and softmax) in."""
    for schedule in ("gpipe", "1f1b"):
        rep = run(schedule=schedule, stages=2, microbatches=4)
        for row in rep.memory:
            assert row.uncalibrated_bytes is not None, row
            assert abs(row.uncalibrated_error_pct) <= 15, (schedule, row)
            measured = row.measured_peak_bytes
            assert row.uncalibrated_error_pct == pytest.approx(
                100 * (measured - row.uncalibrated_bytes) / row.uncalibrated_bytes
            )


def test_the_calibration_is_measured_on_one_process_not_read_from_the_runs_hooks():
    """The calibrated prediction takes each stage's bytes of one micro-batch from a one-process
    forward of the split (stage_saved_bytes), so what the run's hooks report does not move it: a
    run whose hooks read every micro-batch 1.5x larger gets the same prediction, and its measured
    peak 1.5x over the prediction shows as +50% error (reading the hooks, it showed 0%)."""
    from microbatch.run.pipeline.memory import memory_rows
    from microbatch.run.pipeline.stage_profile import stage_saved_bytes

    cfg = PipelineConfig(schedule="gpipe", stages=2, microbatches=2)
    prof = stage_saved_bytes(resolve(cfg), [2, 2])
    assert prof[0]["shared"] > 0  # the batch's token ids, a view per micro-batch: held once
    order = {0: ["0F0", "0F1", "0B0", "0B1"], 1: ["1F0", "1F1", "1B0", "1B1"]}
    buf = 1 * 64 * 64 * 4  # tiny's boundary: b_m·s·h fp32, received per micro-batch by rank 1
    # GPipe holds both micro-batches: the shared storages once, the received inputs, the rest twice
    honest = [
        prof[0]["shared"] + 2 * prof[0]["own"],
        prof[1]["shared"] + 2 * buf + 2 * (prof[1]["own"] - buf),
    ]

    def ranks(scale):
        return [
            {
                "rank": r,
                "layers_per_stage": [2, 2],
                "steps": [
                    {
                        "intervals": [(a[1], r, int(a[2]), 0.0, 1.0) for a in order[r]],
                        "per_microbatch_bytes": [scale * (prof[r]["own"] + prof[r]["shared"])] * 2,
                        "per_microbatch_shared_bytes": [0, scale * prof[r]["shared"]],
                        "peak_activation_bytes": scale * honest[r],
                        "counted_activation_bytes": 0,
                        "live_bytes_after_step": 0,
                        "order": order[r],
                    }
                ],
            }
            for r in range(2)
        ]

    same, big = memory_rows(resolve(cfg), ranks(1.0), [0]), memory_rows(resolve(cfg), ranks(1.5), [0])
    for r in range(2):
        assert same[r].predicted_bytes == pytest.approx(honest[r]) == big[r].predicted_bytes
        assert same[r].error_pct == pytest.approx(0.0, abs=1e-9)
        assert big[r].error_pct == pytest.approx(50.0)


@pytest.mark.timeout(200)
def test_zbv_and_zero_bubble_interleaved_memory_is_predicted_within_10_percent():
    """The walk along torch's order needs no in-flight rule; it was gated on one and left zbv and
    zb-interleaved with v = 2 without a prediction (null). Their uncalibrated one stays null, with the
    reason :func:`uncalibrated_gap` gives."""
    from microbatch.run.pipeline.memory import uncalibrated_gap

    for sched in ("zbv", "zb-interleaved"):
        rep = run(schedule=sched, stages=2, microbatches=4, virtual=2)
        for row in rep.memory:
            assert row.predicted_bytes is not None and abs(row.error_pct) <= 10, (sched, row)
            assert row.uncalibrated_bytes is None
        cfg = PipelineConfig(schedule=sched, stages=2, microbatches=4, virtual=2)
        why = uncalibrated_gap(resolve(cfg), list(rep.layers_per_stage))
        assert why is not None and f"not {sched} with v = 2" in why
    one = PipelineConfig(schedule="1f1b", stages=2, microbatches=4)
    assert uncalibrated_gap(resolve(one), list(resolve(one).split or ())) is None


@pytest.mark.timeout(300)
def test_a_factory_model_whose_stage_ends_in_a_view_runs_and_is_predicted(monkeypatch):
    """test_pipeline:make_stack cut [1, 3, 1] ends its middle stage in nn.Linear on a (b, s, h) input: a view.
    torch's split backward detaches stage outputs in place and refused it (zb-h1 failed on rank 1: "Can't
    detach views in-place", pytorch issue 142229); the stage now copies such an output. Its memory is
    predicted from the measured received inputs (a factory has no shape): exact on 1F1B, where the calibrated
    walk had counted no received input on the fed ranks and was 11% under on the GPT tiny given as a factory;
    within 10% on zb-h1, where the last stage's input saved through a view lives until W (it was freed at I
    in the walk: +59%)."""
    import os

    here = os.path.dirname(os.path.abspath(__file__))
    monkeypatch.setenv("PYTHONPATH", here + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for sched in ("zb-h1", "1f1b"):
        rep = run(schedule=sched, stages=3, microbatches=6, model="test_pipeline:make_stack", seq=16,
                  check_gradients=True)  # fmt: skip
        assert rep.gradients_match is True, sched
        for row in rep.memory:  # zb-h1: the last stage's input, saved through a view, is freed at W, not I
            assert row.predicted_bytes is not None and abs(row.error_pct) <= (1 if sched == "1f1b" else 10), (
                row
            )
    rep = run(schedule="1f1b", stages=2, microbatches=4, model="test_pipeline:make_gpt_tiny", seq=16)
    assert [abs(row.error_pct) <= 1 for row in rep.memory] == [True, True], rep.memory


@pytest.mark.parametrize(
    "model,stages,schedule,virtual",
    [("small", 2, "1f1b", 1), ("small", 4, "1f1b", 1), ("small", 2, "dualpipev", 2)],
)
def test_each_rank_holds_the_parameters_its_stages_build(model, stages, schedule, virtual):
    """The host prediction's per-rank parameters (gradients and Adam's moments are kept for each) against the
    model the ranks build, split as they split it: the tied token table is held by the first and last stages'
    ranks — twice over two ranks, once where DualPipeV's V gives rank 0 both ends."""
    from microbatch.measure.gpt import build_model
    from microbatch.run.pipeline.host_terms import largest_param, rank_largest, rank_params
    from microbatch.run.pipeline.split import model_units, split_units

    run_ = resolve(
        PipelineConfig(model=model, stages=stages, microbatches=4, schedule=schedule, virtual=virtual)
    )
    built = build_model(run_.shape)
    modules = split_units(model_units(built), list(run_.split))
    held = []
    for r in range(stages):
        distinct = {id(p): p.numel() for s in run_.stages_of(r) for p in modules[s].parameters()}
        held.append(sum(distinct.values()))
    assert rank_params(run_, run_.shape) == held
    table = run_.shape.vocab * run_.shape.hidden
    together = run_.placement[0] == run_.placement[-1]  # one rank holds both ends of the model
    assert sum(held) == run_.shape.param_count() + (0 if together else table)
    assert largest_param(run_.shape, 0) == max(p.numel() for p in built.parameters())
    biggest = [
        max(p.numel() for s in run_.stages_of(r) for p in modules[s].parameters()) for r in range(stages)
    ]
    assert (
        rank_largest(run_, run_.shape) == biggest
    )  # the end ranks' token table, the middle ranks' block matrix


def test_the_host_prediction_counts_each_ranks_parameters_and_the_cpu_adam_step():
    """gradients and Adam: 3 copies of what each rank holds (the tied table on two ranks); the step's temporaries:
    2 × the largest parameter per rank (torch's single-tensor Adam on the CPU); processes: the forked rank's
    resident bytes, a new interpreter's with MICROBATCH_COLD_RANKS=1, nccl's upper bound (host terms only)."""
    import os

    from microbatch.run.pipeline import host_terms, warm

    shape_run = resolve(PipelineConfig(model="small", stages=2, microbatches=4))
    shape = shape_run.shape
    params = shape.param_count()
    pred = predicted_host_bytes(shape_run, params, shape)
    table = shape.vocab * shape.hidden
    assert pred["gradients_and_adam"] == 3 * 4 * (params + table)
    assert pred["step_temporaries"] == 2 * 2 * 4 * table  # the token table is small's largest tensor
    # forked where the warm server will fork the ranks: not asked cold, and none of warm_ranks' other reasons (a
    # server broken or started under other settings by an earlier test in this worker, a removed working folder)
    forked = warm.warm_ranks("gloo")
    assert not (forked and warm.cold_asked(os.environ))
    want = host_terms.FORKED_PROCESS_BYTES if forked else host_terms.GLOO_PROCESS_BYTES
    assert pred["processes"] == 2 * want
    nccl = predicted_host_bytes(
        resolve(PipelineConfig(model="small", stages=2, backend="nccl")), params, shape
    )
    assert nccl["processes"] == 2 * host_terms.PROCESS_BYTES
    assert nccl["gradients_and_adam"] == nccl["step_temporaries"] == 0  # on the GPUs
    factory = predicted_host_bytes(shape_run, params)  # no shape: the split is not known before the ranks
    assert (
        factory["gradients_and_adam"] == 3 * 4 * params and factory["step_temporaries"] == 2 * 2 * 4 * params
    )
    read = predicted_host_bytes(shape_run, params, largest=1000)  # the inspection's largest tensor
    assert read["step_temporaries"] == 2 * 2 * 4 * 1000


@pytest.mark.timeout(200)
def test_the_ranks_host_peak_is_predicted_from_above_within_the_page_cache_share():
    """The ranks' peak resident sets (VmHWM, read by the kernel) against the check before the run, on every run this
    file made (GPipe, 1F1B, DualPipeV with the tied table's two ends on rank 0 and the gradient check's reference
    model, ZB-H1, interleaved, p 2 and 4; the last in the file, so they are all cached): +1.5% on `tiny` p 2 from a
    fresh install, -20.8% where the libraries' pages are partly out of the page cache; with one 400 MiB a process and
    those pages out of the cache, -35%. (BENCHMARKS.md.)"""
    run(
        schedule="1f1b", stages=2, microbatches=4
    )  # cached by the tests above; run here when this test runs alone
    for key, rep in _RUNS.items():
        h = rep.host_memory
        # never short by more than 10% (the check must not let through a run that cannot fit); over by up to the
        # shared libraries' pages a partly cold page cache leaves unmapped (~65 MiB a rank: host_terms)
        assert h is not None and -25 <= h.error_pct <= 10, (key, h)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "kw",
    [
        {"schedule": "zb-h1", "stages": 4, "microbatches": 8},  # the last rank: -10.0% before
        {"schedule": "zbv", "stages": 2, "microbatches": 8, "virtual": 2},  # the V's bottom rank: +8.5%
        {"schedule": "dualpipev", "stages": 2, "microbatches": 8, "virtual": 2},  # +7.0%
    ],
    ids=["zb-h1", "zbv", "dualpipev"],
)
def test_zero_bubble_and_v_schedules_memory_to_the_byte(kw):
    """Every rank within 2% (a review's tiny runs: 0.0% on every rank after the two fixes): the example input was
    made to require grad in place on the CPU (the kept-bytes probe then missed the stage input's saved alias and
    counted it as held from I to W), and the V's bottom rank holds its locally handed inputs in receive buffers too."""
    rep = run(model="tiny", **kw)
    for row in rep.memory:
        assert abs(row.error_pct) <= 2, (kw, row)
