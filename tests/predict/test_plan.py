"""The planner: the seed's worked selection, consistency with the memory model, lints, advice, CLI."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
from _published import PUBLISHED

from microbatch.cli import main
from microbatch.errors import ConfigError
from microbatch.hardware import get_accelerator
from microbatch.model import get_model, resolve_model
from microbatch.predict.memory import MemoryConfig, estimate_memory
from microbatch.predict.plan import PlanConfig, compare_gpus, lint, make_plan, search_layouts
from microbatch.predict.plan_advice import Advice, BubbleNotBuried, HoldsEveryMicrobatch
from microbatch.show.plan_report import (
    explain,
    explain_result,
    lint_sentence,
    plan_advice,
    plan_dict,
    plan_lints,
    plan_table_rows,
)

A100 = get_accelerator("a100-80gb")


def _words(lints) -> list[str]:
    return [lint_sentence(x) for x in lints]


def _cfg(**kw) -> PlanConfig:
    base = dict(shape=get_model("gpt2"), gpu=A100, global_batch=64, pipeline_parallel=4)
    base.update(kw)
    return PlanConfig(**base)


def test_seed_worked_selection():
    seed = PUBLISHED["seed_worked_selection"] if PUBLISHED else {
        "pipeline_stages": 4, "schedule": "1f1b", "per_replica_batch": 64,
        "candidates": [{"micro_batch": 2, "microbatches": 32, "bubble_fraction": 0.085714},
                       {"micro_batch": 4, "microbatches": 16, "bubble_fraction": 0.157895}],
    }  # fmt: skip
    plan = make_plan(
        _cfg(pipeline_parallel=seed["pipeline_stages"], schedules=(seed["schedule"],),
             global_batch=seed["per_replica_batch"])
    )  # fmt: skip
    best_at = {}
    for c in plan.candidates:
        best_at.setdefault(c.micro_batch, c)
    for want in seed["candidates"]:
        got = best_at[want["micro_batch"]]
        assert got.microbatches == want["microbatches"]
        assert got.bubble_fraction == pytest.approx(want["bubble_fraction"], abs=1e-6)
    table = "\n".join(" | ".join(r) for r in plan_table_rows(plan))
    assert "| 32 | 1f1b" in table and "8.6%" in table and "| 16 | 1f1b" in table and "15.8%" in table
    # 1F1B needs m >= p: b_m = 32 (m = 2) and 64 (m = 1) are not offered under 1F1B
    assert all(c.microbatches >= 4 for c in plan.candidates)


def test_every_candidate_keeps_the_global_batch_and_the_fastest_is_fastest_fit():
    plan = make_plan(_cfg(data_parallel=2, global_batch=128))
    assert plan.evaluated > 50
    for c in plan.candidates:
        assert c.micro_batch * c.grad_accum * c.data_parallel == 128
        assert c.fits == (c.peak_memory_bytes <= A100.memory_bytes * 0.9)
    fits = [c for c in plan.candidates if c.fits]
    assert plan.fastest is not None and plan.recommended is plan.knee
    # the ranking breaks ties at 6 digits (plan._rank_key), so equal-time candidates may differ in the last bit
    assert plan.fastest.step_time_s == pytest.approx(min(c.step_time_s for c in fits), rel=1e-9)
    assert {c.zero for c in plan.candidates} == {0, 1, 2, 3}
    assert {c.schedule for c in plan.candidates} >= {"gpipe", "1f1b", "zb-h1", "interleaved-1f1b"}


def test_screening_memory_equals_the_memory_model():
    shape = get_model("llama-2-7b")
    plan = make_plan(_cfg(shape=shape, global_batch=64, data_parallel=2, pipeline_parallel=4))
    for c in plan.candidates[::7]:
        est = estimate_memory(
            shape,
            MemoryConfig(
                micro_batch=c.micro_batch, pipeline_parallel=4, virtual=c.virtual, microbatches=c.microbatches,
                schedule=c.schedule, data_parallel=2, zero=c.zero, recompute=c.recompute,
            ),
        )  # fmt: skip
        assert c.peak_memory_bytes == pytest.approx(est.peak_bytes, rel=1e-9), c
        assert c.memory == pytest.approx(est.peak_stage.breakdown(), rel=1e-9)


def test_uneven_split_is_checked_at_every_stage_and_simulated():
    plan = make_plan(_cfg(layers_per_stage=(2, 3, 3, 4), schedules=("1f1b",), recompute=("none",)))
    shape = get_model("gpt2")
    for c in plan.candidates:
        est = estimate_memory(
            shape, MemoryConfig(micro_batch=c.micro_batch, pipeline_parallel=4, microbatches=c.microbatches,
                                layers_per_stage=(2, 3, 3, 4)),
        )  # fmt: skip
        assert c.peak_memory_bytes == pytest.approx(est.peak_bytes)
        assert c.simulated == c.fits


def test_simulated_leaders_agree_with_closed_form_for_balanced_stages():
    # no logits/embedding imbalance to speak of: the simulator's makespan ≈ the closed form
    cfg = _cfg(schedules=("1f1b",), recompute=("none",), simulate_top=0)
    closed = {c.micro_batch: c for c in make_plan(cfg).candidates}
    sim = make_plan(replace(cfg, simulate_top=3))
    leaders = [c for c in sim.candidates if c.simulated]
    assert len(leaders) >= 3  # the three fastest, the knee, and the contenders whose floor could beat them
    for c in leaders:
        assert c.step_time_s == pytest.approx(closed[c.micro_batch].step_time_s, rel=0.02)


def test_zero3_communication_favours_larger_micro_batches():
    slow = get_accelerator("a100-80gb", inter_node_bytes_per_s=2e9)
    cfg = PlanConfig(shape=get_model("llama-2-7b"), gpu=slow, global_batch=512, data_parallel=16, seq=2048,
                     recompute=("none",), simulate_top=0)  # fmt: skip
    step = {}
    for z in (0, 3):
        for c in make_plan(replace(cfg, zero=(z,))).candidates:
            step[(z, c.micro_batch)] = c.step_time_s
    # ZeRO-3 all-gathers weights every micro-step: 4× fewer micro-steps, ~4× less exposed traffic
    assert step[(3, 1)] / step[(3, 4)] > 3
    assert step[(0, 1)] / step[(0, 4)] < 1.2


def test_lints():
    few = make_plan(_cfg(micro_batches=(8,), schedules=("1f1b",)))  # m = 8 < 4p = 16
    assert any("m = 8 < 4p = 16" in x and "b_m = 4 gives m = 16" in x for x in plan_lints(few))
    gp = make_plan(_cfg(micro_batches=(2,), schedules=("gpipe", "1f1b"), recompute=("none",)))
    gpipe = next(c for c in gp.candidates if c.schedule == "gpipe")
    assert any("GPipe holds all m = 32" in x and "1F1B" in x for x in _words(lint(gp, gpipe)))
    wrong = replace(gp.candidates[0], grad_accum=16)
    assert any("global batch changed" in x for x in _words(lint(gp, wrong)))
    tiny_m = make_plan(_cfg(micro_batches=(32,), schedules=("gpipe",)))
    assert any("m = 2 < p = 4" in x and "use b_m <= 16 so that m >= p" in x for x in plan_lints(tiny_m))
    # fewer sequences per replica than stages: no b_m reaches m >= p, so the fix is the batch or p
    short = make_plan(_cfg(global_batch=4, data_parallel=2, micro_batches=(1,), schedules=("gpipe",)))
    assert any(
        "m = 2 < p = 4" in x
        and "B_global / d = 2 per replica gives m <= 2 at any b_m" in x
        and "raise B_global to d·p = 8 or more, or use p <= 2" in x
        and "use b_m" not in x
        for x in plan_lints(short)
    ), plan_lints(short)
    # predict gives the numbers, show the words
    assert [x for x in few.lints if isinstance(x, BubbleNotBuried)] == [
        BubbleNotBuried(microbatches=8, stages=4, bubble_pct=few.lints[0].bubble_pct, better_micro_batch=4,
                        better_microbatches=16, better_bubble_pct=100 * 3 / 19)
    ]  # fmt: skip
    held = next(x for x in lint(gp, gpipe) if isinstance(x, HoldsEveryMicrobatch))
    assert (held.schedule, held.lighter, held.microbatches) == ("gpipe", "1f1b", 32)
    assert held.lighter_peak_bytes is not None and held.lighter_peak_bytes < gpipe.peak_memory_bytes


def test_zero_2_or_3_with_pipeline_stages_names_the_frameworks_and_the_flag():
    base = _cfg(micro_batches=(2,), schedules=("1f1b",), recompute=("none",))
    z3 = make_plan(replace(base, zero=(3,)))
    msgs = [x for x in _words(lint(z3, z3.candidates[0])) if "pipeline stages runs in torchtitan" in x]
    assert len(msgs) == 1 and "plan with zero 1" in msgs[0] and "ZeRO 3 with p = 4" in msgs[0], msgs
    assert "--" not in msgs[0]  # the library names the parameter; the command passes its flag in
    zero_lint = next(x for x in lint(z3, z3.candidates[0]) if "torchtitan" in lint_sentence(x))
    assert lint_sentence(zero_lint, words={"zero": "--zero"}) == msgs[0].replace(
        "with zero 1", "with --zero 1"
    ).replace("here: zero left", "here: --zero left")
    # ZeRO 1 was not searched (zero fixed to 3): not "none fits", which would say it was tried
    assert "(not planned here: zero left ZeRO 0 and 1 out)" in msgs[0] and "none fits" not in msgs[0]
    both = make_plan(replace(base, zero=(1, 3)))
    (said,) = [
        x for x in _words(lint(both, next(c for c in both.candidates if c.zero == 3))) if "torchtitan" in x
    ]
    assert "the best of those here: ZeRO 1" in said
    z1 = make_plan(replace(base, zero=(1,)))
    assert not any("torchtitan" in x for x in _words(lint(z1, z1.candidates[0])))
    flat = make_plan(replace(base, zero=(3,), pipeline_parallel=1, schedules=None))
    assert not any(
        "torchtitan" in x for x in _words(lint(flat, flat.candidates[0]))
    )  # no pipeline: nothing to say


def test_nothing_fits_says_what_would():
    cfg = PlanConfig(shape=get_model("llama-2-7b"), gpu=get_accelerator("l4"), global_batch=64,
                     pipeline_parallel=4)  # fmt: skip
    plan = make_plan(cfg)
    assert plan.recommended is None
    assert plan_advice(plan)[0].startswith("nothing fits in 20.2 GiB (22.5 GiB")  # 23,034 MiB
    assert any(
        "pipeline-parallel 8" in a and "would fit" in a and "GiB at b_m" in a for a in plan_advice(plan)
    )
    assert "nothing fits" in explain(plan)
    assert (
        isinstance(plan.advice, Advice) and plan.advice.smallest.peak_memory_bytes > plan.advice.budget_bytes
    )
    assert any(a.setting == "pipeline_parallel" and a.value == 8 and a.fits for a in plan.advice.alternatives)
    assert plan_dict(plan)["advice"] == plan_advice(plan)  # plan --json writes the words
    d = json.loads(json.dumps(plan.to_dict()))  # the data read back says the same
    assert explain_result(d) == explain(plan) and explain_result(plan_dict(plan)) == explain(plan)


def test_bad_input():
    with pytest.raises(ConfigError, match=r"global batch 100 is not divisible by data-parallel 8.*96 or 104"):
        _cfg(global_batch=100, data_parallel=8)
    with pytest.raises(ConfigError, match="tensor-parallel 5 does not divide heads 12"):
        _cfg(tensor_parallel=5)
    with pytest.raises(ConfigError, match="pipeline-parallel 16 > layers 12"):
        _cfg(pipeline_parallel=16)
    with pytest.raises(ConfigError, match="micro-batch 3 does not divide the per-replica batch"):
        _cfg(micro_batches=(3,))
    with pytest.raises(ConfigError, match="must be a whole number >= 1"):
        _cfg(global_batch=-64)
    # interleaving with no even split of the layers: the layers are the cause, not the batch
    with pytest.raises(
        ConfigError, match=r"can split layers 12 over stages 5.*use pipeline_parallel among \[2, 3, 4, 6\]"
    ):
        make_plan(_cfg(pipeline_parallel=5, schedules=("interleaved-1f1b",)))


def test_compare_gpus_and_search():
    plans = compare_gpus(_cfg(), [A100, get_accelerator("h100-sxm")])
    assert plans[1].recommended.tokens_per_s > plans[0].recommended.tokens_per_s
    best, evaluated, feasible = search_layouts(get_model("gpt2"), A100, global_batch=64, num_gpus=8)
    assert evaluated >= feasible > 0 and best.fits
    assert best.data_parallel * best.pipeline_parallel * best.tensor_parallel == 8


def test_cli_plan_json(capsys):
    rc = main(["plan", "--model", "gpt2", "--gpu", "a100-80gb", "--global-batch", "64", "--pipeline-parallel", "4",
               "--schedule", "1f1b", "--json"])  # fmt: skip
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    keys = {"micro_batch", "microbatches", "grad_accum", "schedule", "virtual", "recompute", "zero",
            "bubble_fraction", "peak_memory_bytes", "memory", "step_time_s", "tokens_per_s", "mfu", "fits"}  # fmt: skip
    assert keys <= set(out["recommended"]) and all(keys <= set(c) for c in out["candidates"])
    for k in ("global_batch", "data_parallel", "pipeline_parallel", "tensor_parallel", "model", "gpu"):
        assert k in out
    assert (
        out["model"] == "gpt2" and out["model_shape"]["name"] == "gpt2" and out["gpu"]["name"] == "a100-80gb"
    )
    assert out["recommended"]["micro_batch"] * out["recommended"]["grad_accum"] == 64


def test_plan_data_has_no_prose_and_the_words_come_from_show(capsys):
    plan = make_plan(_cfg(schedules=("1f1b",)))
    d = plan.to_dict()
    assert "explanation" not in d  # Plan.to_dict is data only
    assert explain_result(json.loads(json.dumps(d))) == explain(plan)  # the words, from the data read back
    rc = main(["plan", "--model", "gpt2", "--gpu", "a100-80gb", "-B", "64", "-p", "4", "--schedule", "1f1b",
               "--json"])  # fmt: skip
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert "--" not in explain(plan)  # the library names the parameters; the command passes its flags in
    assert out["explanation"] == explain(plan, words={"zero": "--zero", "choose": "--choose"})
    assert "(--choose fastest takes the fastest)" in out["explanation"]
    assert out["recommended"]["step_time_s"] == d["recommended"]["step_time_s"]


def test_one_step_time_rule_for_the_planner_and_the_calibration():
    """With one stage the planner's pipeline time is m micro-steps of the calibration's rule."""
    from microbatch.predict.steptime import predict_step_time_s

    for precision, recompute in (("bf16-mixed", "none"), ("fp32", "full")):
        cfg = _cfg(
            pipeline_parallel=1, precision=precision, recompute=(recompute,), zero=(0,), simulate_top=0
        )
        for c in make_plan(cfg).candidates:
            one = predict_step_time_s(
                cfg.shape, c.micro_batch, A100, precision=precision, checkpointing=recompute == "full"
            )
            assert c.time["pipeline_s"] == pytest.approx(c.microbatches * one, rel=1e-12)


def test_cli_plan_compare_and_errors(capsys):
    rc = main(["plan", "--model", "gpt2", "--gpu", "a100-40gb,h100-sxm", "-B", "64", "-p", "2", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["gpu"] for r in out["comparison"]] == ["a100-40gb", "h100-sxm"]
    assert main(["plan", "--model", "gpt2", "--gpu", "v100", "-B", "64"]) == 2
    assert "unknown accelerator 'v100'" in capsys.readouterr().err
    assert main(["plan", "--model", "llama-2-7b", "--gpu", "l4", "-B", "64", "-p", "4"]) == 2
    captured = capsys.readouterr()
    assert "would fit" in captured.out and captured.err.startswith("error: nothing fits")
    # with --json: one object, the plan kept with the error in it, exit 2
    assert main(["plan", "--model", "llama-2-7b", "--gpu", "l4", "-B", "64", "-p", "4", "--json"]) == 2
    out = json.loads(capsys.readouterr().out)  # fails on a second object ("Extra data")
    assert out["kind"] == "does_not_fit" and out["error"].startswith("nothing fits")
    assert out["recommended"] is None and len(out["candidates"]) > 0


def test_gpu_overrides_on_the_command_line(capsys):
    args = ["plan", "--model", "gpt2", "--gpu", "a100-80gb", "-B", "64", "-d", "8", "--json"]
    assert main(args) == 0
    fast = json.loads(capsys.readouterr().out)
    assert (
        main([*args, "--gpu-set", "intra_node_bytes_per_s=1e9", "--gpu-set", "inter_node_bytes_per_s=1e9"])
        == 0
    )
    slow = json.loads(capsys.readouterr().out)
    assert slow["gpu"]["intra_node_bytes_per_s"] == 1e9
    assert slow["recommended"]["step_time_s"] > fast["recommended"]["step_time_s"]


def test_planner_modules_do_not_import_torch():
    import subprocess
    import sys

    code = (
        "import sys, microbatch.predict.plan, microbatch.show.export, microbatch.commands.plan, microbatch.commands.memory, "
        "microbatch.commands.export; print(sorted(m for m in ('torch', 'matplotlib') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_cli_table_shows_the_seed_worked_selection(capsys):
    assert (
        main(["plan", "--model", "gpt2", "--gpu", "a100-80gb", "-B", "64", "-p", "4", "--schedule", "1f1b"])
        == 0
    )
    out = capsys.readouterr().out
    rows = {
        line.split()[0].rstrip("*+"): line.split()
        for line in out.splitlines()
        if line[:3].strip().rstrip("*+").isdigit()
    }
    assert rows["2"][1] == "32" and rows["2"][6] == "8.6%"
    assert rows["4"][1] == "16" and rows["4"][6] == "15.8%"
    assert "Recommended b_m =" in out


# -- the knee (issue 17) ------------------------------------------------------------------------------
def test_knee_constants_equal_tunes():
    from microbatch.choose.bound import BOUND_MARGIN
    from microbatch.choose.config import DEFAULT_TOLERANCE
    from microbatch.predict.plan import PLAN_MARGIN, PLAN_TOLERANCE

    assert (PLAN_TOLERANCE, PLAN_MARGIN) == (DEFAULT_TOLERANCE, BOUND_MARGIN)


def test_plan_recommends_the_knee_not_the_far_past_fastest():
    # the README's case: b_m = 16 is the fastest by ~1% for ~50 GiB more; the knee is b_m = 1
    cfg = PlanConfig(shape=get_model("llama-3.2-1b"), gpu=get_accelerator("h100"), global_batch=256,
                     data_parallel=8, seq=2048)  # fmt: skip
    plan = make_plan(cfg)
    fast, knee = plan.fastest, plan.recommended
    assert fast is not None and knee is not None and plan.knee is knee
    fits = [c for c in plan.candidates if c.fits]
    assert fast.step_time_s == min(c.step_time_s for c in fits)
    assert fast.micro_batch >= 8 * knee.micro_batch
    line = (1 - 0.15) * (1 + 0.05) * fast.tokens_per_s
    assert knee.tokens_per_s >= line
    # nothing within the line uses less memory than the knee, past the 1% the prediction cannot tell apart
    from microbatch.predict.plan_choice import MEMORY_TIE

    assert all(
        c.peak_memory_bytes * (1 + MEMORY_TIE) >= knee.peak_memory_bytes
        for c in fits
        if c.tokens_per_s >= line
    )
    text = explain(plan)
    assert re.search(rf"Fastest: b_m = {fast.micro_batch}\b.*\(choose fastest takes the fastest\)", text)
    assert not any("far past the kernel-efficiency knee" in x for x in plan_lints(plan))
    # --choose fastest gives the old answer, and names the knee beside it
    pf = make_plan(replace(cfg, choose="fastest"))
    assert pf.recommended is not None and pf.recommended.micro_batch == fast.micro_batch
    assert re.search(rf"Knee: b_m = {knee.micro_batch}\b", explain(pf))
    # the JSON carries both, and explain_result says the same as explain
    d = plan.to_dict()
    assert d["fastest"]["micro_batch"] == fast.micro_batch and d["knee"]["micro_batch"] == knee.micro_batch
    assert explain_result(json.loads(json.dumps(d))) == text


def test_knee_takes_the_larger_micro_batch_when_it_is_needed():
    # ZeRO-3 across nodes at fixed B: b_m = 1 exposes the weight gathers of 8x the micro-steps. Nodes with
    # one 100 Gb/s link shared by their 8 GPUs (12.5e9 / 8 per GPU): the 8 ranks of a node share it
    gpu = get_accelerator("a100-80gb").with_overrides(inter_node_bytes_per_s=12.5e9 / 8)
    cfg = PlanConfig(shape=get_model("llama-2-7b"), gpu=gpu, global_batch=512, data_parallel=64,
                     seq=2048, zero=(3,), recompute=("none",), micro_batches=(1, 8))  # fmt: skip
    plan = make_plan(cfg)
    by_b = {c.micro_batch: c for c in plan.candidates}
    assert by_b[1].fits and by_b[8].fits
    assert by_b[1].step_time_s > 2 * by_b[8].step_time_s  # the gathers are exposed
    assert plan.recommended is not None and plan.recommended.micro_batch == 8
    # a pipeline whose bubble b_m = 1 buries: the knee does not give up throughput for memory
    plan_p = make_plan(_cfg(shape=get_model("llama-2-7b"), global_batch=64, pipeline_parallel=8,
                            schedules=("1f1b",), recompute=("none",), zero=(0,)))  # fmt: skip
    rec, fast = plan_p.recommended, plan_p.fastest
    assert rec is not None and fast is not None
    assert rec.tokens_per_s >= (1 - 0.15) * (1 + 0.05) * fast.tokens_per_s


def test_knee_candidate_rule_by_hand():
    from microbatch.predict.plan import knee_candidate

    plan = make_plan(_cfg(data_parallel=2, global_batch=128))
    k = knee_candidate(plan.candidates, tolerance=0.0, margin=0.0)
    assert k.tokens_per_s == max(c.tokens_per_s for c in plan.candidates if c.fits)
    k5 = knee_candidate(plan.candidates, tolerance=0.5, margin=0.0)
    assert k5.peak_memory_bytes <= k.peak_memory_bytes
    with pytest.raises(ConfigError, match="choose 'slowest'"):
        _cfg(choose="slowest")
    with pytest.raises(ConfigError, match="tolerance"):
        _cfg(tolerance=1.5)


def test_cli_plan_choose_flag(capsys):
    args = [
        "plan",
        "--model",
        "llama-3.2-1b",
        "--gpu",
        "h100",
        "-B",
        "256",
        "-d",
        "8",
        "--seq",
        "2048",
        "--json",
    ]
    assert main(args) == 0
    knee = json.loads(capsys.readouterr().out)
    assert main([*args, "--choose", "fastest"]) == 0
    fast = json.loads(capsys.readouterr().out)
    assert knee["recommended"]["micro_batch"] == knee["knee"]["micro_batch"] == 1
    assert (
        fast["recommended"]["micro_batch"] == fast["fastest"]["micro_batch"] == knee["fastest"]["micro_batch"]
    )
    assert knee["choose"] == "knee" and fast["choose"] == "fastest"


def test_dp_overlap_term_by_hand():
    from microbatch.predict.roofline import allreduce_time_s, group_bandwidth, reduce_scatter_time_s

    shape = get_model("llama-2-7b")
    base = dict(shape=shape, gpu=A100, global_batch=256, data_parallel=32, seq=2048, micro_batches=(1,),
                recompute=("none",), simulate_top=0)  # fmt: skip
    for z in (0, 1):
        on = make_plan(PlanConfig(**base, zero=(z,))).candidates[0]
        off = make_plan(PlanConfig(**base, zero=(z,), dp_overlap=False)).candidates[0]
        n = shape.param_count()  # p = t = 1: every parameter on every GPU
        bw = group_bandwidth(A100, 32, 1)  # 32 ranks cross nodes: the network's bandwidth
        reduce = (reduce_scatter_time_s if z == 1 else allreduce_time_s)(2 * n, 32, bw)
        gather = 0.0 if z == 0 else 2 * n * 31 / 32 / bw
        assert off.time["dp_comm_s"] == pytest.approx(reduce + gather, rel=1e-9)
        assert on.time["dp_comm_s"] < off.time["dp_comm_s"]
        assert off.step_time_s - on.step_time_s == pytest.approx(off.time["dp_comm_s"] - on.time["dp_comm_s"])


# -- DualPipeV in the planner ----------------------------------------------------------------------------


def test_plan_dualpipev_candidates_and_their_memory_by_hand():
    """gpt2 (12 layers, tied embeddings), p = 3, B = 48: DualPipeV is offered with v = 2 for every b_m
    with m >= 2p = 6 (b_m <= 8); rank 0 holds 4 layers in two chunks, the embedding and the output layer
    (no second copy of the tied embedding: the V brings the head back to rank 0) and 2p + 1 = 7 chunks
    of 2 layers in flight; stage 0 holds 2p = 6 micro-batches of embedding activations (rank 0's warm-up) and
    stage 2p − 1 one of output activations (its backward follows its forward), counted on the order below."""
    from microbatch.predict.activations import (
        embedding_activation_bytes,
        layer_activation_bytes,
        output_activation_bytes,
    )

    shape = get_model("gpt2")
    plan = make_plan(_cfg(global_batch=48, pipeline_parallel=3, simulate_top=0))
    dpv = [c for c in plan.candidates if c.schedule == "dualpipev"]
    assert sorted({c.micro_batch for c in dpv}) == [1, 2, 3, 4, 6, 8] and {c.virtual for c in dpv} == {2}
    c = next(c for c in dpv if c.micro_batch == 2 and c.recompute == "none")
    assert c.microbatches == 24 and c.peak_stage == 0
    n0 = 4 * shape.layer_params() + shape.embedding_params() + shape.output_params()
    assert c.memory["weights"] == 2 * n0 and c.memory["gradients"] == 2 * n0  # bf16 weights, half grads
    assert c.memory["optimizer"] == 12 * n0  # fp32 master + two Adam moments
    acts = (
        layer_activation_bytes(shape, 2, dtype_bytes=2) * 4 * 7 / 2
        + embedding_activation_bytes(shape, 2) * 6
        + output_activation_bytes(shape, 2, dtype_bytes=2) * 1
    )
    assert c.memory["activations"] == pytest.approx(acts, rel=1e-12)
    assert c.peak_memory_bytes == pytest.approx(16 * n0 + acts, rel=1e-12)
    # 1F1B on the same layers keeps its last stage's copy of the tied embedding: more weights there
    one = next(
        x for x in plan.candidates if x.schedule == "1f1b" and x.micro_batch == 2 and x.recompute == "none"
    )
    last = 4 * shape.layer_params() + shape.output_params() + shape.vocab * shape.hidden
    assert max(n0, last) * 16 <= one.peak_memory_bytes


def test_plan_dualpipev_step_time_is_its_closed_form_and_the_leaders_are_simulated():
    from microbatch.predict.candidate import _v_stage_times, make_context
    from microbatch.schedules.registry import generate
    from microbatch.schedules.simulate import dualpipev_closed_form_holds, dualpipev_idle_time, simulate

    cfg = _cfg(global_batch=24, pipeline_parallel=6, simulate_top=1, schedules=("dualpipev",))
    ctx = make_context(cfg)
    kinds = set()
    for c in make_plan(cfg).candidates:
        tm = _v_stage_times(ctx, c.micro_batch, c.recompute)
        f, i, w = tm.f[0], tm.i[0], tm.w[0]  # stage 0's chunk: layers only
        assert dualpipev_closed_form_holds(f, i, w)  # the step-time rule gives W <= I
        if c.simulated:  # replayed per virtual stage (the head on stage 2p − 1, rank 0)
            res = simulate(generate("dualpipev", 6, c.microbatches, 2), forward_time=tm.f, input_time=tm.i,
                           weight_time=tm.w)  # fmt: skip
            assert c.time["pipeline_s"] == res.makespan and res.makespan <= c.microbatches * tm.Tk + tm.sumT
        else:
            closed = c.microbatches * tm.Tk + dualpipev_idle_time(6, f, i, w)
            assert c.time["pipeline_s"] == pytest.approx(closed, rel=1e-12)
        kinds.add(c.simulated)
    assert kinds == {True, False}


def test_plan_recommends_dualpipev_only_when_it_wins_under_its_rules():
    """gpt2, p = 6, B = 24: at b_m 2 (m = 12 = 2p) DualPipeV, simulated, is faster than every other schedule
    simulated (ZB-H1 at b_m 2 by 1.4%: its closed form, 7% slower, overstated its bubble) and is the fastest that fits, holding more than 1F1B at the same b_m
    (2p + 1 chunks of a rank's layers on rank 0). The least memory within τ is interleaved 1F1B at b_m 1, v 2,
    simulated; the knee is DualPipeV at that b_m, faster for under 1% of the device more (the knee's tie at one b_m).
    Its rules: m >= 2p (B = 11 leaves m <= 11 < 12),
    2p | layers (p = 4: 12 % 8), an even split; and it must fit."""
    fast = make_plan(_cfg(global_batch=24, pipeline_parallel=6, choose="fastest"))
    rec = fast.recommended
    assert rec is not None and rec.schedule == "dualpipev" and rec.simulated and rec.micro_batch == 2
    others = [c for c in fast.candidates if c.fits and c.schedule != "dualpipev"]
    assert rec.step_time_s < 0.99 * min(c.step_time_s for c in others if c.simulated)
    # m = 12 < 4p: 1F1B's bubble is not buried there, DualPipeV's (a few per cent) is
    one = next(c for c in others if (c.schedule, c.micro_batch) == ("1f1b", 2))
    assert any("is not buried" in x for x in _words(lint(fast, one))) and not any(
        "is not buried" in x for x in plan_lints(fast)
    )
    assert rec.peak_memory_bytes > one.peak_memory_bytes  # 2p + 1 chunks against 1F1B's p
    knee = fast.knee
    # the least memory within the line is interleaved 1F1B at b_m 1, v 2; DualPipeV at the same b_m holds under 1% of
    # the device more (2026-12-07: a choice at one b_m within 1% of the budget is the faster's) and is the knee
    from microbatch.predict.plan_choice import MEMORY_TIE

    assert knee is not None and (knee.schedule, knee.micro_batch, knee.virtual) == ("dualpipev", 1, 2)
    assert knee.simulated  # settled against the line by the simulator, not its closed form
    least = next(
        c
        for c in fast.candidates
        if (c.schedule, c.micro_batch, c.virtual) == ("interleaved-1f1b", 1, 2) and c.fits
    )
    budget = fast.config.memory_budget_bytes
    assert least.peak_memory_bytes < knee.peak_memory_bytes <= least.peak_memory_bytes + MEMORY_TIE * budget
    assert knee.tokens_per_s > least.tokens_per_s
    assert make_plan(_cfg(global_batch=24, pipeline_parallel=6)).recommended == knee
    # too little memory for it: the fastest that fits is another schedule
    tight = make_plan(_cfg(global_batch=24, pipeline_parallel=6, choose="fastest",
                           memory_headroom=1 - 0.95 * rec.peak_memory_bytes / A100.memory_bytes))  # fmt: skip
    assert tight.recommended is not None and tight.recommended.schedule != "dualpipev"
    same = [
        c for c in tight.candidates if (c.schedule, c.micro_batch, c.recompute) == ("dualpipev", 2, "none")
    ]
    assert same and not any(c.fits for c in same)
    assert all(c.step_time_s >= tight.recommended.step_time_s for c in tight.candidates if c.fits)
    # outside its rules it is not a candidate at all
    for kw in (dict(global_batch=11, pipeline_parallel=6), dict(global_batch=64, pipeline_parallel=4),
               dict(global_batch=64, pipeline_parallel=2, layers_per_stage=(4, 8))):  # fmt: skip
        assert not any(c.schedule == "dualpipev" for c in make_plan(_cfg(**kw)).candidates), kw
    assert any(
        c.schedule == "dualpipev" for c in make_plan(_cfg(global_batch=64, pipeline_parallel=2)).candidates
    )


def test_cli_plan_schedule_dualpipev(capsys):
    args = ["plan", "--model", "gpt2", "--gpu", "a100-80gb", "-B", "48", "-p", "3", "--schedule", "dualpipev"]
    assert main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {(c["schedule"], c["virtual"]) for c in out["candidates"]} == {("dualpipev", 2)}
    assert {c["micro_batch"] for c in out["candidates"]} == {1, 2, 3, 4, 6, 8}  # m >= 2p = 6
    assert out["recommended"]["schedule"] == "dualpipev" and out["recommended"]["simulated"]
    assert main(args) == 0
    assert re.search(r"dualpipev, v = 2", capsys.readouterr().out)


def test_plan_flags_of_issue_28_reach_the_step_time(capsys):
    """``plan --compile`` (fused norms and activations), ``--parallel-block`` and ``--no-dropout`` each
    shorten the predicted step of the same layout, by the term they change."""
    import json

    from microbatch.cli import main

    def step(*extra: str) -> float:
        args = ["plan", "--model", "gpt2-large", "--gpu", "h100-sxm", "-B", "8", "-t", "4", "-b", "2",
                "--recompute", "none", "--zero", "0", "--json", *extra]  # fmt: skip
        assert main(args) == 0
        d = json.loads(capsys.readouterr().out)
        return float(d["recommended"]["step_time_s"])

    base = step()
    assert step("--compile") < base  # elementwise at the streaming rate, not the eager kernels' measured one
    assert step("--parallel-block") < base  # one TP all-reduce per layer and pass
    assert step("--no-dropout") < base  # gpt2 trains with dropout: two masked passes fewer
    assert step("--dropout") == pytest.approx(base)


def test_advice_skips_a_layout_no_schedule_can_serve(capsys):
    """When nothing fits, an alternative layout with no servable schedule (p = 32 with m = 16 under 1F1B) is left
    out of the advice instead of failing on an empty list (found in review, 2026-12-04)."""
    cfg = PlanConfig(shape=get_model("llama-3-70b"), gpu=get_accelerator("h100-sxm"), global_batch=128,
                     data_parallel=8, pipeline_parallel=4, schedules=("1f1b",), micro_batches=(1,), zero=(0,),
                     recompute=("full",))  # fmt: skip
    plan = make_plan(cfg)
    assert plan.recommended is None and plan.advice is not None
    settings = {(a.setting, a.value) for a in plan.advice.alternatives}
    assert ("pipeline_parallel", 8) in settings and ("pipeline_parallel", 32) not in settings
    assert any(a.fits for a in plan.advice.alternatives)
    rc = main(["plan", "--model", "llama-3-70b", "--gpu", "h100-sxm", "-B", "128", "-d", "8", "-p", "4",
               "--schedule", "1f1b", "-b", "1", "--zero", "0", "--recompute", "full"])  # fmt: skip
    assert rc == 2 and "would fit" in capsys.readouterr().out  # nothing fits: exit 2, the advice printed


def test_seq_is_the_shape_s_length_as_on_the_command_line():
    """PlanConfig(seq=...) checks and resizes the model as ``--seq`` does: past a learned table it is refused,
    and a learned-position model without a limit plans with its table at the planned length (the CLI's)."""
    with pytest.raises(ConfigError, match="seq 4096 is longer than model gpt2's 1024 learned positions"):
        PlanConfig(shape=get_model("gpt2"), gpu=A100, global_batch=8, seq=4096)
    api = PlanConfig(shape=get_model("small"), gpu=A100, global_batch=8, seq=4096)
    cli = PlanConfig(shape=resolve_model("small", seq=4096), gpu=A100, global_batch=8)
    assert api.shape == cli.shape and api.shape.seq == 4096
    a, c = make_plan(api), make_plan(cli)
    assert [(x.peak_memory_bytes, x.step_time_s) for x in a.candidates] == [
        (x.peak_memory_bytes, x.step_time_s) for x in c.candidates
    ]


def test_the_planner_leaves_one_round_zb_h1_to_simulate():
    """ZB-H1 at m < p (one round, which torch runs) has no closed form; timing it by event simulation in the hot
    loop cost the 530B search 100x (77,400 -> 727 candidates per CPU second), so the planner leaves it out and
    keeps it from m = p on, where Qi et al.'s Table 2 form holds."""
    cfg = PlanConfig(shape=get_model("gpt2"), gpu=get_accelerator("a100-80gb"), global_batch=8, data_parallel=1,
                     pipeline_parallel=4, micro_batches=(1, 2, 4), schedules=("zb-h1", "gpipe"))  # fmt: skip
    cands = make_plan(cfg).candidates
    zb = {c.microbatches for c in cands if c.schedule == "zb-h1"}
    assert zb and min(zb) >= 4 and {c.microbatches for c in cands if c.schedule == "gpipe"} >= {2}
