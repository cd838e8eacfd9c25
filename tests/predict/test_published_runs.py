"""The development set of published runs (tests/data/published_runs.json) and the uncalibrated
step-time error on it (bench/bench_published.py; issue 17)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from microbatch.model import get_model

ROOT = Path(__file__).resolve().parents[2]
DATA = json.loads((ROOT / "tests" / "data" / "published_runs.json").read_text())
DEV_TOLERANCE = 0.10
"""Every row within 10% (the model today: mean 3.0%, max 6.5% over the 18 rows, 9 too fast; before issue
17's terms mean 9.5%, max 19.4%, all too fast). A guard against drift, not the target (mean 3.5%, max 8%,
judged on a held-out set)."""
DEV_MEAN_TOLERANCE = 0.05
"""Mean |error| over all rows within 5% (today 3.0%)."""


def _bench():
    spec = importlib.util.spec_from_file_location("bench_published", ROOT / "bench" / "bench_published.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_row_names_its_source_and_is_consistent():
    sec = DATA["narayanan_2021_table1"]
    assert sec["_url"].startswith("https://arxiv.org/abs/2104.04473")
    for r in sec["rows"]:
        assert (
            r["gpus"] % (r["tp"] * r["pp"]) == 0
            and r["global_batch"] % (r["gpus"] // (r["tp"] * r["pp"])) == 0
        )
        assert r["hidden"] % r["heads"] == 0
        # parameters 12·L·h²·(1 + 13/(12h) + (V + s)/(12·L·h)) (Narayanan et al. 2021 Eq. 2) match the name
        # (rounded to 2–3 digits in the table: 1.65 → "1.7")
        L, h, V, s = r["layers"], r["hidden"], sec["vocab"], sec["seq"]
        params = 12 * L * h * h * (1 + 13 / (12 * h) + (V + s) / (12 * L * h))
        assert params / 1e9 == pytest.approx(r["params_b"], rel=0.03)
    assert DATA["not_covered"] and not DATA["nemo_dgx_h100_bf16"]["rows"]
    k = DATA["korthikanti_2022_table5"]
    assert k["_url"].startswith("https://arxiv.org/abs/2205.05198")
    for r in k["rows"]:
        assert r["gpus"] == r["tp"] * r["pp"]  # one pipeline, no data parallelism
        assert r["global_batch"] % r["micro_batch"] == 0 and r["layers"] % (r["pp"] * r["virtual"]) == 0
        assert r["selective_s"] < r["full_s"]  # the paper's point: selective recompute is faster


def test_measured_step_time_by_hand_and_the_errors_stay_within_the_guard():
    bench = _bench()
    # 529.6B: 96·2520·2048·105·20480²·(1 + 2048/(6·20480) + 51200/(16·105·20480)) / (163e12 · 2520)
    by_hand = (
        96
        * 2520
        * 2048
        * 105
        * 20480**2
        * (1 + 2048 / (6 * 20480) + 51200 / (16 * 105 * 20480))
        / (163e12 * 2520)
    )
    assert by_hand == pytest.approx(54.08, abs=0.01)
    rows = bench.narayanan_rows(DATA)
    assert len(rows) == len(DATA["narayanan_2021_table1"]["rows"])
    r530 = next(r for r in rows if r["gpus"] == 2520)
    assert r530["measured_step_s"] == pytest.approx(by_hand, rel=1e-12)
    for r in rows:
        assert abs(r["error_pct"]) <= 100 * DEV_TOLERANCE, r


def test_korthikanti_rows_errors_and_the_recompute_saving():
    bench = _bench()
    rows = bench.narayanan_rows(DATA) + bench.korthikanti_rows(DATA)
    assert len(rows) == 18
    errs = [abs(r["error_pct"]) for r in rows]
    assert max(errs) <= 100 * DEV_TOLERANCE and sum(errs) / len(errs) <= 100 * DEV_MEAN_TOLERANCE, errs
    k = {r["model"]: r for r in rows if r["source"].startswith("Korthikanti")}
    for name in ("22B", "175B", "530B", "1T"):
        full, sel = k[f"gpt-{name} ful"], k[f"gpt-{name} sel"]
        measured = full["measured_step_s"] / sel["measured_step_s"]  # 1.29, 1.32, 1.30, 1.32
        predicted = full["predicted_step_s"] / sel["predicted_step_s"]
        # the saving of selective recompute + sequence parallelism, predicted within 6% of the measured one
        assert predicted == pytest.approx(measured, rel=0.06), (name, measured, predicted)
    # no systematic sign: some rows too fast, some too slow
    assert 0 < sum(r["error_pct"] < 0 for r in rows) < len(rows)


def test_megatron_bridge_moe_rows_load_sizes_match_and_each_gets_an_error():
    """Issue 29: the Megatron-Bridge MoE rows load, their shapes' totals are the published sizes (3%), and the
    bench predicts every covered row (errors printed, nothing fitted)."""
    bench = _bench()
    sec = DATA["megatron_bridge_moe"]
    assert len(sec["rows"]) == 7
    for name, table in sec["shapes"].items():
        shape = bench.moe_shape(name, 4096, table)
        assert shape.moe is not None
        assert shape == get_model(name)  # the registry's entry is the shape the rows were predicted with
        assert shape.param_count() / 1e9 == pytest.approx(table["published_total_b"], rel=0.03), name
        # the active size as published: with the input embedding (Qwen3 3.3B, DeepSeek-V3 37B) or without it
        # (GPT-OSS's model card: 5.1B of our 5.7B; its embedding is 201,088 × 2,880 = 0.58B)
        active, embedding = shape.active_param_count() / 1e9, shape.vocab * shape.hidden / 1e9
        assert min(
            abs(active - table["published_active_b"]), abs(active - embedding - table["published_active_b"])
        ) < (0.03 * table["published_active_b"]), name
    for r in sec["rows"]:
        d = r["gpus"] // (r["tp"] * r["pp"] * r["cp"])
        assert d * r["tp"] * r["pp"] * r["cp"] == r["gpus"] and d % r["ep"] == 0
        assert r["global_batch"] % (d * r["micro_batch"]) == 0
        # the table's GA follows from the layout (one 25.11 row's does not, and says so)
        assert (r["global_batch"] // (d * r["micro_batch"]) == r["ga"]) != ("_ga_note" in r), r
    rows = bench.moe_bridge_rows(DATA)
    assert len(rows) == len(sec["rows"])
    # DeepSeek-V3 25.09: 8192 · 4096 / (1297 · 1024) s
    ds = next(r for r in rows if r["model"].startswith("deepseek-v3"))
    assert ds["measured_step_s"] == pytest.approx(8192 * 4096 / (1297 * 1024), rel=1e-12)
    for r in rows:
        assert r["predicted_step_s"] > 0 and r["error_pct"] == pytest.approx(
            100 * (r["predicted_step_s"] / r["measured_step_s"] - 1)
        )
    assert any("235B" in n["what"] and "EP 32" in n["why"] for n in DATA["not_covered"])


def test_megatron_bridge_dense_rows_as_their_recipes_run_them():
    """Issue 28: the DGX-H100 FP8 dense rows, stated with the recipe's tensor-parallel communication overlap
    (Megatron-Bridge llama3 recipes: CommOverlapConfig(tp_comm_overlap=True)), the FA3-class attention ceiling,
    fused kernels and, for the 405B, vp 8 over stages of 15, 16 x 6, 15 layers: every row within 15%, mean
    within 12%. Today +12.4%, +10.3%, +10.3% and the 405B rows −6.7%, −3.8%, mean 8.7% (the GEMMs beside the
    overlapped TP collectives slowed by σ as beside any other; +12.4, +7.6, +7.6, −10.2, −7.7 without), with TE's attention
    at cuDNN's measured curve (TE prefers FusedAttention on Hopper+; since this session cuDNN 9.19's, CUDNN_919_HOPPER,
    which moved the rows to +8.6%, +8.2%, −7.4%, +8.2%, −4.6%, mean 7.4%) and TE's current
    scaling (te-current: casts fused with their transposes, FP8 weights cast once a step); +16.1%, +11.6%,
    +11.8%, −2.1%, +1.6% with torchao's per-GEMM casts; +13.7%, +10.3%, +10.5%, −2.6%, +1.0% at FA3's
    attention, the class assumed before; at the Hopper rows'
    sustained clock (hardware_clocks.HOPPER_BURST_TO_SUSTAINED, 0.847) with the SP re-gather under the
    backward GEMMs (TE's bulk overlap); before the clock +1.8%, +1.8%, +1.9%, −8.1%, −4.8%, mean 3.7%: these FP8
    rows agreed with the burst rate the kernel terms were measured at, the Megatron-LM README's BF16 rows and a
    recorded H200 tune did not."""
    bench = _bench()
    rows = bench.bridge_rows(DATA)
    assert len(rows) == len(DATA["megatron_bridge_dgx_h100_fp8"]["rows"]) == 5
    for r in rows:
        assert abs(r["error_pct"]) <= 15.0, r
        if r["model"] == "llama-3.1-405b":
            assert r["assumed"].startswith("interleaved-1f1b v8")  # stated as it ran, not dropped to v = 1
    assert sum(abs(r["error_pct"]) for r in rows) / len(rows) <= 12.0
    assert bench.embedding_split(126, 8) == (15,) + (16,) * 6 + (15,)
    assert bench.embedding_split(126, 16) == (7,) + (8,) * 14 + (7,)
    assert bench.embedding_split(80, 8) is None


def test_llama3_rows_as_the_report_ran_them():
    """Issue 28: Llama 3 Table 4 stated as the report (§3.3.2, read in this session) says it ran: interleaved
    1F1B (the planner had picked ZB-H1), the stage split, the all-gather context parallelism, no activation
    checkpointing at 8K, FSDP sharding optimizer state and gradients with FP32 gradients reduce-scattered after
    every micro-batch (pipeline_grad_reduce "each"), on Llama's own blocks (RMSNorm, rotary, no dropout: the
    table shape had been built with Megatron's GPT defaults). Every row fits, as it ran, and is within 10%
    (today +6.3%, +5.2%, −7.1%, the last micro-batch's reduce-scatter tail included; before, at the planner's full recompute and dropout, +24.3%, +23.1%, +13.1%)."""
    bench = _bench()
    rows = bench.llama3_rows(DATA)
    assert len(rows) == 3 and bench.LLAMA3_SCHEDULE == ("interleaved-1f1b",)
    for r in rows:
        assert r["assumed"].startswith("interleaved-1f1b v"), r
        assert r["fits"] and abs(r["error_pct"]) <= 10.0, r
        if r["seq"] == 8192:
            assert " none Z2" in r["assumed"], r  # as stated, not the planner's choice
    assert any(r["error_pct"] < 0 for r in rows) and any(r["error_pct"] > 0 for r in rows)
    # the 128k row pays the all-gather's exposure (more than a ring's); the rows without CP are unchanged
    ring = bench.llama3_rows(DATA, cp_comm="ring")
    for a, b in zip(rows, ring, strict=True):
        if a["seq"] == 131072:
            assert a["predicted_step_s"] > b["predicted_step_s"]
        else:
            assert a["predicted_step_s"] == b["predicted_step_s"]


def test_llama3_table_shape_and_flop_count():
    """The table's 405B is the registry's Llama 3.1 405B (Llama's blocks, not GPT's), and the step's model FLOPs
    are the MFU the report cites (Chowdhery et al. 2023, PaLM: 6N + 12·L·H·Q·T per token, attention counted
    full) with N without the input embedding, within 0.001% (0.5% with it)."""
    bench = _bench()
    from microbatch.model import get_model
    from microbatch.predict.roofline import model_flops_per_step

    sec = DATA["llama3_2024_table4"]
    for s in (8192, 131072):
        shape = bench._llama("", s, sec["shape"])
        assert shape == get_model("llama-3.1-405b", seq=s)
        n = shape.layers_params(0, shape.layers) + shape.output_params()
        palm = s * (6 * n + 12 * shape.layers * shape.hidden * s)
        assert model_flops_per_step(shape, 1, s) == pytest.approx(palm, rel=1e-5)
        with_embedding = palm + 6 * s * shape.embedding_params()
        assert model_flops_per_step(shape, 1, s) == pytest.approx(with_embedding, rel=5e-3)
    stated = [r.get("recompute") for r in sec["rows"]]
    assert stated == ["none", "none", None]  # 8K rows: "without activation checkpointing"; 128K: not stated


def test_the_model_against_the_flat_fraction_of_peak_rule_by_dense_development_source():
    """Issue 28's comparison: each dense source's mean |error| below that of every FLOP at 50% of peak with no
    communication (bench_published.flat_rule_s; by hand for one row), and over all dense rows pooled. Llama 3
    Table 4 stated as it ran (no recompute at 8K, its FSDP): 6.2% against the rule's 18.5%."""
    bench = _bench()
    rows = (
        bench.narayanan_rows(DATA)
        + bench.korthikanti_rows(DATA)
        + bench.bridge_rows(DATA)
        + bench.megatron_readme_rows(DATA)
        + bench.llama3_rows(DATA)
        + bench.nemo_long_rows(DATA)
        + bench.nemo_2407_rows(DATA)
    )
    r = rows[0]  # Narayanan 1.7B: model FLOPs × 4/3 (full recompute) over 50% of 32 A100s' 312 TFLOP/s
    from microbatch.predict.roofline import model_flops_per_step

    sec = DATA["narayanan_2021_table1"]
    first = sec["rows"][0]
    shape = bench.ModelShape(name="x", layers=first["layers"], hidden=first["hidden"], heads=first["heads"],
                             vocab=sec["vocab"], seq=sec["seq"])  # fmt: skip
    flat = (
        model_flops_per_step(shape, first["global_batch"], sec["seq"])
        * 4
        / 3
        / (0.5 * 312e12 * first["gpus"])
    )
    assert r["flat_error_pct"] == pytest.approx(100 * (flat / r["measured_step_s"] - 1))
    by_source: dict[str, list[dict]] = {}
    for row in rows:
        by_source.setdefault(row["source"].split(" 2")[0], []).append(row)
    assert set(by_source) == {
        "Narayanan",
        "Korthikanti",
        "Megatron-Bridge",
        "Megatron-LM README",
        "Llama 3 Table 4",
        "NeMo",
    }
    for source, part in by_source.items():
        ours = sum(abs(x["error_pct"]) for x in part) / len(part)
        rule = sum(abs(x["flat_error_pct"]) for x in part) / len(part)
        assert ours < rule, (source, ours, rule)
    pooled = sum(abs(x["error_pct"]) for x in rows) / len(rows)
    assert pooled < sum(abs(x["flat_error_pct"]) for x in rows) / len(rows)


def test_megatron_lm_readme_rows_transcribed_and_predicted():
    """Issue 28's 'Megatron-LM README tables' (H100, Megatron-Core r0.8.0): each row's parameter count is that
    of a GPT block with a 4h GeLU MLP and untied embeddings (12·L·h² + 2·V·h, the table's size within 3%),
    its MFU is its TFLOP/s over the H100's 989.4 (BF16) within rounding, the step time is Megatron's own FLOP
    count over the published rate (by hand for the 1.7B row), and every row gets a prediction that fits.
    Today 7 of 9 rows are predicted too fast (mean |error| 7.0%, see BENCHMARKS.md): a guard of 25% per row."""
    bench = _bench()
    sec = DATA["megatron_lm_readme_2024"]
    V, s = sec["vocab"], sec["seq"]
    assert (V, s) == (131072, 4096) and len(sec["rows"]) == 9
    for r in sec["rows"]:
        L, h = r["layers"], r["hidden"]
        assert (12 * L * h * h + 2 * V * h) / 1e9 == pytest.approx(r["params_b"], rel=0.03)
        assert 100 * r["tflops_per_gpu"] / 989.4 == pytest.approx(r["mfu_pct"], abs=0.6)
        assert r["gpus"] == r["tp"] * r["pp"] * r["dp"] and r["global_batch"] % r["dp"] == 0
    # 1.7B: 12·192·4096·24·2048²·((1 + 1 + 4096/2048) + 4 + 131072/(2·24·2048)) / (408.8e12 · 48)
    by_hand = 12 * 192 * 4096 * 24 * 2048**2 * (4 + 4 + 131072 / (2 * 24 * 2048)) / (408.8e12 * 48)
    rows = bench.megatron_readme_rows(DATA)
    assert rows[0]["measured_step_s"] == pytest.approx(by_hand, rel=1e-12)
    assert by_hand == pytest.approx(0.4519, abs=1e-3)
    for r in rows:
        assert r["fits"] and abs(r["error_pct"]) <= 25.0, r


def test_nemo_long_sequence_rows_transcribed_counted_and_predicted():
    """Issue 28's NeMo performance tables, the long-sequence one (LLAMA2-7B FP8 on DGX-H100, NeMo 24.03, 4K to 1M
    tokens with context parallelism): the layouts multiply to the GPU count and every batch is 4M tokens; the
    measured step uses NeMo's FLOP count of the time, attention counted full — NeMo 24.07's own table gives
    tokens/s and TFLOP/s for LLAMA2-7B at 4,096, whose ratio is model_flops_per_step's count within 0.5% and 7%
    off the causal one. Predicted with TE's cuDNN attention and delayed scaling: every row fits, mean |error|
    13.1% (flat rule 37.9%), too fast 13–20% from 32K on (see BENCHMARKS.md: the gap follows attention's share
    of the step)."""
    bench = _bench()
    from microbatch.model import get_model
    from microbatch.predict.roofline import model_flops_per_step

    sec = DATA["nemo_long_sequence_2024"]
    assert len(sec["rows"]) == 9
    for r in sec["rows"]:
        assert r["tp"] * r["pp"] * r["dp"] * r["cp"] == r["gpus"] == r["seq_k"]
        assert r["global_batch"] * r["seq_k"] * 1024 == 4 * 2**20
    shape = get_model("llama-2-7b")
    per_token = model_flops_per_step(shape, 1, 4096) / 4096
    assert 776e12 / 16847 == pytest.approx(per_token, rel=5e-3)  # NeMo 24.07, LLAMA2-7B, 8 GPUs, s 4096
    causal = per_token - 6 * shape.layers * 4096 * shape.hidden  # the s² term halved
    assert abs(776e12 / 16847 / causal - 1) > 0.07
    rows = bench.nemo_long_rows(DATA)
    assert all(r["fits"] and abs(r["error_pct"]) <= 25.0 for r in rows), rows
    assert sum(abs(r["error_pct"]) for r in rows) / len(rows) <= 15.0
    assert sum(abs(r["error_pct"]) for r in rows) < sum(abs(r["flat_error_pct"]) for r in rows)


def test_nemo_b200_long_sequence_rows_transcribed_counted_and_predicted():
    """The same NeMo document's DGX-B200 table (LLAMA3-8B FP8, NeMo 25.04, 8K to 1M tokens): GPUs are the layout's
    TP·CP·DP (the table's first version; its rewrite copied the H100 table's GPU column), every batch is 4M tokens,
    and the measured step uses NeMo 2.0's FLOP formula of that date, attention full (by hand for LLAMA3-8B: 12 +
    12·8/32 + 18·14336/4096 + 12·s/h + 6·V/(L·h) per h² per token per layer). Not used to build anything: the
    prediction's error follows attention's share of the step as the H100 table's does, −4% at 8K to −25% at 1M
    (BENCHMARKS.md); a guard of 30% per row, and every row fits as it ran."""
    bench = _bench()
    from microbatch.model import get_model
    from microbatch.predict.roofline import model_flops_per_step

    sec = DATA["nemo_long_sequence_b200_2025"]
    assert [r["seq_k"] for r in sec["rows"]] == [8, 16, 32, 64, 128, 256, 512, 1024]
    for r in sec["rows"]:
        assert r["tp"] * r["pp"] * r["dp"] * r["cp"] == r["gpus"] and r["pp"] == 1
        assert r["global_batch"] * r["seq_k"] * 1024 == 4 * 2**20
    shape = get_model("llama-3-8b")
    L, h, s = shape.layers, shape.hidden, 8192
    nemo = s * L * h * h * (12 + 12 * 8 / 32 + 18 * 14336 / h + 12 * s / h + 6 * 128256 / (L * h))
    assert model_flops_per_step(shape, 1, s) == pytest.approx(nemo, rel=1e-9)
    rows = bench.nemo_long_rows(DATA, "nemo_long_sequence_b200_2025")
    first = rows[0]
    assert first["measured_step_s"] == pytest.approx(512 * nemo / (1671e12 * 2), rel=1e-9)
    assert all(r["fits"] and abs(r["error_pct"]) <= 30.0 for r in rows), rows
    assert sum(abs(r["error_pct"]) for r in rows) < sum(abs(r["flat_error_pct"]) for r in rows)


def test_cudnn_frontend_llama_rows_transcribed_and_predicted_at_the_locked_clock():
    """cudnn-frontend's Llama-3.2-1B training benchmark (Hugging Face's eager model, one GPU, cuDNN SDPA): the rows are
    the README's tables (seconds per iteration, 3 decimals), every batch holds 12,288 to 18,432 tokens, and each row is
    predicted at the clock the benchmark locked (1,500 MHz on the H200, 1,665 on the B200) against the burst clock the
    kernel terms stand at (1,980, 1,965), the rate following 0.75 of the clock's fall: the predicted step at the
    locked clock is longer than at the row's sustained clock by at most their ratio. Stated as it
    ran (SGD without momentum, the loss over the bf16 logits), the H200 rows are within 3% (−0.8..+1.4% today; +7..+14%
    before the optimizer's passes and the loss's dtype were stated); the B200 rows, −11..−25% today, get a guard of
    30% (BENCHMARKS.md)."""
    bench = _bench()
    sec = DATA["cudnn_frontend_llama32_1b_2025"]
    readme = {("h200", 16384): 0.424, ("h200", 768): 0.329, ("b200", 16384): 0.285, ("b200", 1024): 0.139}
    for r in sec["rows"]:
        assert 12288 <= r["batch"] * r["seq"] <= 18432
        if (r["gpu"], r["seq"]) in readme:
            assert r["step_s"] == pytest.approx(readme[(r["gpu"], r["seq"])], abs=5e-4)
    rows = bench.cudnn_llama_rows(DATA)
    assert len(rows) == 12 and all(r["fits"] and abs(r["error_pct"]) <= 30.0 for r in rows), rows
    assert all(abs(r["error_pct"]) <= 3.0 for r in rows if r["gpu"] == "h200"), rows
    from dataclasses import replace

    from microbatch.hardware import get_accelerator
    from microbatch.model import get_model
    from microbatch.predict.plan import PlanConfig, make_plan

    h200 = get_accelerator("h200")
    cfg = PlanConfig(shape=get_model("llama-3.2-1b").with_seq(1024), gpu=h200, global_batch=12, micro_batches=(12,),
                     recompute=("none",), choose="fastest", memory_headroom=0.0)  # fmt: skip
    sustained = make_plan(cfg).fastest
    held = 1 - 0.75 * (1 - 1500 / 1980)
    locked = make_plan(replace(cfg, gpu=h200.with_overrides(sustained_clock_fraction=held))).fastest
    assert sustained is not None and locked is not None
    ratio = locked.step_time_s / sustained.step_time_s
    assert 1.0 < ratio <= h200.sustained_clock_fraction / held + 1e-9


def test_nemo_2407_rows_transcribed_and_predicted():
    """Issue 28's NeMo performance tables, NeMo 24.07 on DGX-H100 in FP8 (12 pre-training rows): the table's
    TFLOP/s per GPU over its tokens/s is each model's FLOPs per token as NeMo counts them (attention full: our
    model_flops_per_step within 1%), the layouts divide the GPUs, and each row is predicted with its launcher
    config's settings and TE's delayed scaling. Today mean |error| 5.2% (flat rule 26.6%); the Nemotron-340B row
    (+17%, exposed TP8 communication per its config) is the only one past 10%. Every row fits, as it ran: the
    optimizer state is NeMo's distributed Adam's (the 340B row's bf16 state, 2 + 2 + 4/d B per parameter; with
    ZeRO's 16 B it would need 84 GiB)."""
    bench = _bench()
    from microbatch.predict.roofline import model_flops_per_step

    sec = DATA["nemo_2407_dgx_h100_fp8"]
    rows = bench.nemo_2407_rows(DATA)
    assert len(rows) == len(sec["rows"]) == 12
    for r, src in zip(rows, sec["rows"], strict=True):
        shape = bench.nemo_shape(src["model"], src["seq"], src["tp"], sec["shapes"])
        per_token = model_flops_per_step(shape, 1, src["seq"]) / src["seq"]
        assert src["tflops_per_gpu"] * 1e12 / src["tokens_per_s_per_gpu"] == pytest.approx(
            per_token, rel=0.01
        )
        assert src["gpus"] % (src["tp"] * src["pp"] * src["cp"]) == 0
        assert r["predicted_step_s"] > 0 and abs(r["error_pct"]) <= 25.0, r
    assert bench.nemo_shape("gpt3-5b", 2048, 1, sec["shapes"]).vocab == 50304  # 50,257 padded to 128
    assert bench.nemo_shape("gpt3-175b", 2048, 4, sec["shapes"]).vocab == 50688  # to 512 at TP 4
    mean = sum(abs(r["error_pct"]) for r in rows) / len(rows)
    assert mean <= 8.0 and mean < sum(abs(r["flat_error_pct"]) for r in rows) / len(rows)
    assert all(r["fits"] for r in rows), [r for r in rows if not r["fits"]]
    assert bench.nemo_optimizer_state("bf16") == {
        "grad_dtype": "half", "moments_dtype": "bf16", "master_weights": "none"
    }  # fmt: skip
    assert bench.nemo_optimizer_state() == {
        "grad_dtype": "half", "moments_dtype": "fp32", "master_weights": "remainder"
    }  # fmt: skip
    assert bench.nemo_optimizer_state("fp32", "fp32")["grad_dtype"] == "fp32"


def test_deepspeed_azure_row_transcribed_and_predicted():
    """DeepSpeed's published throughput (issue 28's development sources): the Azure post's 175B ZeRO-3 row. The
    measured step by hand from the post's formula; the prediction as DeepSpeed's ZeRO-3 runs it, within the 15%
    this one row is known to miss by (11.8% too fast: the dense A100 rows' GEMM and elementwise terms predict 74%
    of peak where the run reached 65.5%; no term found for the gap, none fitted), and ahead of the flat rule."""
    bench = _bench()
    sec = DATA["deepspeed_azure_2022"]
    assert "2022-07-26-deepspeed-azure.md" in sec["_source"] and "run-175b.sh" in sec["_setup"]
    (r,) = sec["rows"]
    # 96·8192·512·96·12288²·(1 + 512/(6·12288) + 50304/(16·96·12288)) / (204.49e12 · 256)
    by_hand = (
        96 * 8192 * 512 * 96 * 12288**2 * (1 + 512 / 73728 + 50304 / (16 * 96 * 12288)) / (204.49e12 * 256)
    )
    assert by_hand == pytest.approx(112.57, abs=0.01)
    (row,) = bench.deepspeed_azure_rows(DATA)
    assert row["measured_step_s"] == pytest.approx(by_hand, rel=1e-12)
    assert row["fits"] and "Z3" in row["assumed"] and row["d"] == 256 and row["micro_batch"] == 32
    assert -15.0 < row["error_pct"] < 0.0
    assert abs(row["error_pct"]) < abs(row["flat_error_pct"])
