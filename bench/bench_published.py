"""Uncalibrated step-time error on the development set of published runs (issues 17 and 28).

Reads ``tests/data/published_runs.json`` (Narayanan et al. 2021 Table 1; Korthikanti et al. 2022 Table 5, full
recompute and sequence parallelism + selective recompute; Megatron-Bridge's DGX-H100 FP8 dense Llama rows; the
Llama 3 report's Table 4; Megatron-Bridge's DGX-H100 and DGX-B200 mixture-of-experts rows, issue 29; DeepSpeed's
Azure post's ZeRO-3 175B row);
for each fully or partly specified row it builds the planner's configuration (model, accelerator,
B_global, t, p, d = GPUs/(t·p)), predicts the step time
with the default (uncalibrated) roofline efficiencies, and prints the error against the measured
step time, row by row, then the error by source, accelerator and sequence band, the share of rows
predicted too fast and the worst rows, beside each group the error of the flat rule the issue compares
against (every FLOP at 50% of peak, no communication: :func:`flat_rule_s`). Where the source leaves a choice open (Narayanan et al. 2021
Table 1 gives no micro-batch size or schedule) the script states the value it assumed. Development
sources only: the held-out set of issue 28 is not read here.

Run: .venv/bin/python bench/bench_published.py [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from microbatch.hardware import get_accelerator  # noqa: E402
from microbatch.hardware_clocks import RATE_PER_CLOCK  # noqa: E402
from microbatch.model import ModelShape, get_model  # noqa: E402
from microbatch.moe import Experts  # noqa: E402
from microbatch.predict.attention import CUDNN_919_HOPPER, CUDNN_HOPPER_CEILING  # noqa: E402
from microbatch.predict.gemm import DEFAULT_EFFICIENCY  # noqa: E402
from microbatch.predict.plan import PlanConfig, make_plan  # noqa: E402
from microbatch.predict.roofline import model_flops_per_step  # noqa: E402

DATA = Path(__file__).resolve().parents[1] / "tests" / "data" / "published_runs.json"
FUSED = replace(DEFAULT_EFFICIENCY, fused_elementwise=True)
"""Megatron-LM's fused LayerNorm and bias-GELU kernels (every development row's framework; Llama 3's assumed)."""


def eq3_hardware_flops(B: int, s: int, L: int, h: int, V: int) -> float:
    """Narayanan et al. 2021 Eq. 3: FLOPs per step with full recomputation."""
    return 96.0 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))


def narayanan_rows(data: dict, micro_batch: int = 1) -> list[dict]:
    sec = data["narayanan_2021_table1"]
    gpu = get_accelerator(sec["gpu"])
    s, V = sec["seq"], sec["vocab"]
    out = []
    for r in sec["rows"]:
        L, h, a, t, p, n, B = (
            r["layers"],
            r["hidden"],
            r["heads"],
            r["tp"],
            r["pp"],
            r["gpus"],
            r["global_batch"],
        )
        d = n // (t * p)
        shape = ModelShape(name=f"gpt-{r['params_b']}B", layers=L, hidden=h, heads=a, vocab=V, seq=s)
        measured = eq3_hardware_flops(B, s, L, h, V) / (r["tflops_per_gpu"] * 1e12 * n)
        cfg = PlanConfig(
            shape=shape, gpu=gpu, global_batch=B, data_parallel=d, pipeline_parallel=p, tensor_parallel=t,
            micro_batches=(micro_batch,), recompute=("full",), zero=(0,) if d > 1 else None, flash_attention=False, dp_overlap=False,
            schedules=("1f1b",), memory_headroom=0.0, choose="fastest", efficiency=FUSED,
        )  # fmt: skip
        plan = make_plan(cfg)
        c = plan.fastest or plan.candidates[0]
        err = 100 * (c.step_time_s / measured - 1)
        out.append({
            "source": "Narayanan 2021 Table 1", "gpu": gpu.name, "seq": s, "model": shape.name, "gpus": n, "t": t, "p": p, "d": d,
            "global_batch": B, "micro_batch": micro_batch, "assumed": "b_m, 1F1B, full recompute",
            "measured_step_s": measured, "predicted_step_s": c.step_time_s, "error_pct": err, "fits": c.fits,
            "flat_error_pct": 100 * (flat_rule_s(cfg, "full") / measured - 1),
        })  # fmt: skip
    return out


def korthikanti_rows(data: dict) -> list[dict]:
    """Korthikanti et al. 2022 Table 5: measured iteration times, full recompute and SP + selective."""
    sec = data["korthikanti_2022_table5"]
    gpu = get_accelerator(sec["gpu"])
    s, V = sec["seq"], sec["vocab"]
    out = []
    for r in sec["rows"]:
        L, h, a, t, p, n, B, b, v = (
            r["layers"], r["hidden"], r["heads"], r["tp"], r["pp"], r["gpus"], r["global_batch"],
            r["micro_batch"], r["virtual"],
        )  # fmt: skip
        d = n // (t * p)
        shape = ModelShape(name=f"gpt-{r['model']}", layers=L, hidden=h, heads=a, vocab=V, seq=s)
        for rc, measured in (("full", r["full_s"]), ("selective", r["selective_s"])):
            cfg = PlanConfig(
                shape=shape, gpu=gpu, global_batch=B, data_parallel=d, pipeline_parallel=p, tensor_parallel=t,
                sequence_parallel=rc == "selective", micro_batches=(b,), recompute=(rc,),
                zero=(0,) if d > 1 else None, flash_attention=False, dp_overlap=False,
                schedules=("interleaved-1f1b",) if v > 1 else ("1f1b",), virtuals=(v,) if v > 1 else None,
                memory_headroom=0.0, choose="fastest", efficiency=FUSED, precision=sec["precision"],
            )  # fmt: skip
            plan = make_plan(cfg)
            c = plan.fastest or plan.candidates[0]
            out.append({
                "source": "Korthikanti 2022 Tab 5", "gpu": gpu.name, "seq": s, "model": f"{shape.name} {rc[:3]}", "gpus": n, "t": t, "p": p,
                "d": d, "global_batch": B, "micro_batch": b, "virtual": v, "recompute": rc,
                "measured_step_s": measured, "predicted_step_s": c.step_time_s,
                "error_pct": 100 * (c.step_time_s / measured - 1), "fits": c.fits,
                "flat_error_pct": 100 * (flat_rule_s(cfg, rc) / measured - 1),
            })  # fmt: skip
    return out


def _llama(name: str, seq: int, table: dict | None = None) -> ModelShape:
    """A Llama model: the registry's, or one from a table's widths with Llama's blocks (RMSNorm, rotary
    positions, SwiGLU, no biases, no dropout: the Llama 3 report's Table 3 and its architecture section)."""
    if table is None:
        return get_model(name, seq=seq)
    t = table
    return ModelShape(
        name=t["name"], layers=t["layers"], hidden=t["hidden"], heads=t["heads"], kv_heads=t["kv"],
        ffn_hidden=t["ffn"], vocab=t["vocab"], seq=seq, gated_mlp=True, bias=False, norm="rmsnorm", activation="silu",
        learned_positions=False, dropout=False,
    )  # fmt: skip


def embedding_split(layers: int, stages: int) -> tuple[int, ...] | None:
    """The stages as the 126-layer 405B runs split them: one layer fewer on the first and the last stage,
    which also hold the embedding and the output layer and loss, when layers + 2 divide evenly (126 + 2 =
    16 x 8 = 8 x 16: Llama 3's pipeline; Megatron-Bridge's 405B recipe counts the same "128 effective
    layers" with account_for_embedding_in_pipeline_split / account_for_loss_in_pipeline_split). None when
    they do not."""
    if stages < 2 or (layers + 2) % stages:
        return None
    n = (layers + 2) // stages
    return (n - 1,) + (n,) * (stages - 2) + (n - 1,)


def _fastest(cfg: PlanConfig) -> tuple[float, bool, str, float]:
    """(step, fits, how, the flat rule's step) of the planner's fastest candidate."""
    plan = make_plan(cfg)
    c = plan.fastest or min(plan.candidates, key=lambda x: x.step_time_s)
    how = f"{c.schedule} v{c.virtual} {c.recompute} Z{c.zero}"
    if not c.fits:  # a run that ran, predicted not to fit: said in the row, counted in the summary
        how += f" (peak {c.peak_memory_bytes / 2**30:.1f} GiB: predicted not to fit)"
    return c.step_time_s, c.fits, how, flat_rule_s(cfg, c.recompute)


FLAT_FRACTION = 0.5
"""The flat rule the issue compares against: every FLOP at 50% of the dense peak, no communication
(llm-analysis's README efficiency)."""


def flat_rule_s(cfg: PlanConfig, recompute: str) -> float:
    """Step seconds by the flat rule: the FLOPs the step runs (model FLOPs, + one forward under full
    recompute) over 50% of the GPUs' peak at the run's precision."""
    s = cfg.seq or cfg.shape.seq
    flops = model_flops_per_step(cfg.shape, cfg.global_batch, s) * (4 / 3 if recompute == "full" else 1.0)
    gpus = cfg.tensor_parallel * cfg.pipeline_parallel * cfg.data_parallel * cfg.context_parallel
    dtype = "fp8" if cfg.precision == "fp8" else ("fp16" if cfg.precision.startswith("fp16") else "bf16")
    return flops / (FLAT_FRACTION * cfg.gpu.flops(dtype) * gpus)


def bridge_rows(data: dict) -> list[dict]:
    """Megatron-Bridge DGX-H100 FP8 dense rows: step = GBS·s / (tokens/s/GPU · GPUs)."""
    sec = data["megatron_bridge_dgx_h100_fp8"]
    # the recipes overlap tensor-parallel communication with the GEMMs (Megatron-Bridge
    # recipes/llama/llama3.py: CommOverlapConfig(tp_comm_overlap=True) with Transformer Engine userbuffers;
    # scripts/performance/configs/llama/llama3_llm_pretrain.py sets the H100 userbuffers config): async_tp
    # Transformer Engine's cuDNN fused attention on Hopper (TE prefers FusedAttention there), as the 25.11 and 26.02
    # containers' cuDNN (9.15 on) runs it: cuDNN 9.19's measured curve (BRIDGE_CUDNN)
    gpu = get_accelerator(sec["gpu"], attention_fraction=BRIDGE_CUDNN[0], attention_ramp=BRIDGE_CUDNN[1])
    table405 = data["llama3_2024_table4"]["shape"]
    out = []
    for r in sec["rows"]:
        s, n, t, p, c, v = r["seq"], r["gpus"], r["tp"], r["pp"], r["cp"], r["vp"]
        shape = _llama(r["model"], s, table405 if r["model"] == table405["name"] else None)
        d = n // (t * p * c)
        note, split = "", None
        if v > 1 and shape.layers % (
            p * v
        ):  # Megatron splits unevenly (the 405B's 126 layers over 8 x 8 chunks)
            split = embedding_split(shape.layers, p)
            if split is None:
                v, note = 1, f"v{r['vp']} not expressible ({shape.layers} layers): "
        cfg = PlanConfig(
            shape=shape, gpu=gpu, global_batch=r["global_batch"], data_parallel=d, pipeline_parallel=p,
            tensor_parallel=t, sequence_parallel=t > 1, async_tp=t > 1, context_parallel=c,
            micro_batches=(r["micro_batch"],), layers_per_stage=split,
            zero=(3,) if r["fsdp"] else (1,), zero3_impl="megatron", cp_comm="ring", flash_attention=True,
            precision=sec["precision"],
            fp8_recipe=sec["fp8_recipe"], schedules=("interleaved-1f1b",) if v > 1 else ("1f1b",),
            virtuals=(v,) if v > 1 else None, memory_headroom=0.0, choose="fastest", efficiency=FUSED,
        )  # fmt: skip
        pred, fits, how, flat = _fastest(cfg)
        measured = r["global_batch"] * s / (r["tokens_per_s_per_gpu"] * n)
        out.append({
            "source": f"Megatron-Bridge {r['container']}", "gpu": gpu.name, "seq": s, "model": shape.name,
            "gpus": n, "t": t, "p": p, "d": d, "global_batch": r["global_batch"], "micro_batch": r["micro_batch"],
            "assumed": note + how, "measured_step_s": measured, "predicted_step_s": pred,
            "error_pct": 100 * (pred / measured - 1), "fits": fits, "flat_error_pct": 100 * (flat / measured - 1),
        })  # fmt: skip
    return out


def deepspeed_azure_rows(data: dict) -> list[dict]:
    """DeepSpeed's Azure post (2022): GPT-3 175B on 256 A100 80 GB under ZeRO-3 data parallelism alone, fp16, full
    recompute, b_m 32 at s 512 (its stated peak); step = the post's FLOPs (Eq. 3) / (TFLOPs/GPU · GPUs). DeepSpeed's
    ZeRO-3 computes from its gathered buffers (``zero3_impl`` deepspeed); nothing fitted."""
    sec = data["deepspeed_azure_2022"]
    gpu = get_accelerator(sec["gpu"])
    V = sec["vocab"]
    out = []
    for r in sec["rows"]:
        L, h, a, s, n, b = r["layers"], r["hidden"], r["heads"], r["seq"], r["gpus"], r["micro_batch"]
        d, B = n // (r["tp"] * r["pp"]), n * b
        shape = ModelShape(name=r["model"], layers=L, hidden=h, heads=a, vocab=V, seq=s)
        cfg = PlanConfig(
            shape=shape, gpu=gpu, global_batch=B, data_parallel=d, tensor_parallel=r["tp"],
            pipeline_parallel=r["pp"], micro_batches=(b,), zero=(r["zero"],), zero3_impl="deepspeed",
            recompute=("full",), precision=sec["precision"], flash_attention=False, memory_headroom=0.0,
            choose="fastest", efficiency=FUSED,
        )  # fmt: skip
        pred, fits, how, flat = _fastest(cfg)
        measured = eq3_hardware_flops(B, s, L, h, V) / (r["tflops_per_gpu"] * 1e12 * n)
        out.append({
            "source": "DeepSpeed Azure 2022", "gpu": gpu.name, "seq": s, "model": shape.name, "gpus": n,
            "t": r["tp"], "p": r["pp"], "d": d, "global_batch": B, "micro_batch": b, "assumed": how,
            "measured_step_s": measured, "predicted_step_s": pred, "error_pct": 100 * (pred / measured - 1),
            "fits": fits, "flat_error_pct": 100 * (flat / measured - 1),
        })  # fmt: skip
    return out


def megatron_flops(
    B: int, s: int, L: int, h: int, V: int, a: int, kv: int | None = None, ffn: int | None = None
) -> float:
    """FLOPs per step as Megatron-LM counts them (megatron/training/training.py ``num_floating_point_operations``,
    core_v0.8.0): 12·B·s·L·h²·((1 + kv/a + s/h) + f/h + V/(2·L·h)) for a GeLU MLP of width f, attention counted
    full (not causal), no recompute."""
    f = ffn or 4 * h
    return 12.0 * B * s * L * h * h * ((1 + (kv or a) / a + s / h) + f / h + V / (2 * L * h))


def megatron_readme_rows(data: dict) -> list[dict]:
    """Megatron-LM README's H100 weak-scaling table (Megatron-Core r0.8.0, BF16): step = Megatron's FLOPs /
    (TFLOP/s per GPU · GPUs); b_m, schedule and recompute the planner's fastest that fits; nothing fitted."""
    sec = data["megatron_lm_readme_2024"]
    # Transformer Engine's fused attention (cuDNN) on Hopper: cuDNN's measured curve, as for the Bridge rows
    gpu = get_accelerator(sec["gpu"], attention_fraction=CUDNN_HOPPER_CEILING)
    s, V = sec["seq"], sec["vocab"]
    out = []
    for r in sec["rows"]:
        L, h, a, t, p, d, n, B = (r["layers"], r["hidden"], r["heads"], r["tp"], r["pp"], r["dp"], r["gpus"],
                                  r["global_batch"])  # fmt: skip
        shape = ModelShape(name=f"gpt-{r['params_b']:g}B", layers=L, hidden=h, heads=a, vocab=V, seq=s)
        cfg = PlanConfig(
            shape=shape, gpu=gpu, global_batch=B, data_parallel=d, pipeline_parallel=p, tensor_parallel=t,
            sequence_parallel=t > 1, async_tp=t > 1, zero=(1,), grad_dtype="fp32", flash_attention=True,
            precision=sec["precision"], schedules=("1f1b", "interleaved-1f1b") if p > 1 else None,
            memory_headroom=0.0, choose="fastest", efficiency=FUSED,
        )  # fmt: skip
        plan = make_plan(cfg)
        c = plan.fastest or plan.candidates[0]
        measured = megatron_flops(B, s, L, h, V, a) / (r["tflops_per_gpu"] * 1e12 * n)
        out.append({
            "source": "Megatron-LM README 2024", "gpu": gpu.name, "seq": s, "model": shape.name, "gpus": n, "t": t,
            "p": p, "d": d, "global_batch": B, "micro_batch": c.micro_batch,
            "assumed": f"b_m {c.micro_batch} {c.schedule} v{c.virtual} {c.recompute} (the planner's fastest)",
            "measured_step_s": measured, "predicted_step_s": c.step_time_s, "error_pct": 100 * (c.step_time_s / measured - 1),
            "fits": c.fits, "flat_error_pct": 100 * (flat_rule_s(cfg, c.recompute) / measured - 1),
        })  # fmt: skip
    return out


def moe_shape(name: str, seq: int, table: dict) -> ModelShape:
    """A Megatron-Bridge MoE row's model: the built-in or the recorded shape (every layer MoE, SwiGLU)."""
    if table.get("builtin"):
        return get_model(name, seq=seq)
    t = table
    return ModelShape(
        name=name, layers=t["layers"], hidden=t["hidden"], heads=t["heads"], head_size=t.get("head_size"), kv_heads=t["kv"],
        ffn_hidden=t["expert_ffn"], vocab=t["vocab"], seq=seq, gated_mlp=True, bias=t["bias"], norm="rmsnorm", activation="silu",
        qk_norm=name.startswith("qwen3"),  # Qwen3's q_norm and k_norm (what its eager layers keep)
        learned_positions=False, dropout=False, sliding_window=t.get("sliding_window"),
        sliding_layers=t.get("sliding_layers"),
        moe=Experts(experts=t["experts"], top_k=t["top_k"], expert_ffn_hidden=t["expert_ffn"],
                    shared_experts=t["shared_experts"]),
    )  # fmt: skip


def moe_bridge_rows(data: dict) -> list[dict]:
    """Megatron-Bridge MoE rows (issue 29): step = GBS·s / (tokens/s/GPU · GPUs); nothing fitted."""
    sec = data["megatron_bridge_moe"]
    out = []
    for r in sec["rows"]:
        s, n, t, p, c, v, e = r["seq"], r["gpus"], r["tp"], r["pp"], r["cp"], r["vp"], r["ep"]
        hopper = r["system"].startswith("h100")
        gpu = (
            get_accelerator(r["system"], attention_fraction=BRIDGE_CUDNN[0], attention_ramp=BRIDGE_CUDNN[1])
            if hopper
            else get_accelerator(r["system"])
        )
        shape = moe_shape(r["model"], s, sec["shapes"][r["model"]])
        d = n // (t * p * c)
        note = "fp8 assumed: " if r.get("assumed_precision") else ""
        if v > 1 and shape.layers % (p * v):
            v, note = 1, note + f"v{r['vp']} not expressible ({shape.layers} layers): "
        cfg = PlanConfig(
            shape=shape, gpu=gpu, global_batch=r["global_batch"], data_parallel=d, pipeline_parallel=p,
            tensor_parallel=t, sequence_parallel=t > 1, context_parallel=c, cp_comm="ring", expert_parallel=e,
            ep_overlap=r.get("ep_overlap", False), **r.get("optimizer_state", {}),
            micro_batches=(r["micro_batch"],), zero=(1,), flash_attention=True, precision=r["precision"],
            fp8_recipe=MEGATRON_FP8_RECIPES[r["fp8_recipe"] or "tensorwise"], schedules=("interleaved-1f1b",) if v > 1 else ("1f1b",),
            virtuals=(v,) if v > 1 else None, memory_headroom=0.0, choose="fastest", efficiency=FUSED,
        )  # fmt: skip
        pred, fits, how, flat = _fastest(cfg)
        measured = r["global_batch"] * s / (r["tokens_per_s_per_gpu"] * n)
        out.append({
            "source": f"MB MoE {r['container']}", "gpu": gpu.name, "seq": s, "model": f"{shape.name} e{e}",
            "gpus": n, "t": t, "p": p, "d": d, "global_batch": r["global_batch"], "micro_batch": r["micro_batch"],
            "assumed": note + how + ", dropless, even load" + (", all-to-all overlapped" if r.get("ep_overlap") else ""),
            "measured_step_s": measured, "predicted_step_s": pred,
            "error_pct": 100 * (pred / measured - 1), "fits": fits, "flat_error_pct": 100 * (flat / measured - 1),
        })  # fmt: skip
    return out


LLAMA3_SCHEDULE = ("interleaved-1f1b",)
"""The Llama 3 report's schedule (arXiv 2407.21783 §3.3.2, Figure 6: V stages on each pipeline rank, Narayanan
et al.'s interleaving with a tunable number of contiguous micro-batches); its context parallelism gathers K/V
in one all-gather exposed in the critical path (same section): ``cp_comm="allgather"``."""


LLAMA3_FSDP = {"zero": (2,), "pipeline_grad_reduce": "each", "grad_dtype": "fp32"}
"""The report's FSDP (§3.3.2): optimizer states and gradients sharded, the weights not resharded after the
forward (ZeRO-2), under its pipeline: every micro-batch's gradients reduce-scattered, in FP32, and a shard
accumulated in FP32 ("FP32 gradient accumulation ... over multiple micro-batches and also reduce-scatter
gradients in FP32")."""


def llama3_rows(data: dict, cp_comm: str = "allgather") -> list[dict]:
    """Llama 3 Table 4: step = model FLOPs / (TFLOP/s per GPU · GPUs), b_m = 1, the rest the planner's fastest;
    ``cp_comm`` the report's all-gather unless asked otherwise."""
    sec = data["llama3_2024_table4"]
    gpu = get_accelerator(sec["gpu"])
    out = []
    for r in sec["rows"]:
        s, n, t, p, c, B = r["seq"], r["gpus"], r["tp"], r["pp"], r["cp"], r["global_batch"]
        shape = _llama("", s, sec["shape"])
        d = n // (t * p * c)
        split = embedding_split(shape.layers, p)
        stated = (r["recompute"],) if "recompute" in r else None  # §3.3.2: none at 8K; else the planner's
        cfg = PlanConfig(
            shape=shape, gpu=gpu, global_batch=B, data_parallel=d, pipeline_parallel=p, tensor_parallel=t,
            sequence_parallel=True, context_parallel=c, micro_batches=(1,), flash_attention=True,
            memory_headroom=0.0, choose="fastest", efficiency=FUSED, layers_per_stage=split,
            schedules=LLAMA3_SCHEDULE, cp_comm=cp_comm, recompute=stated, **LLAMA3_FSDP,
        )  # fmt: skip
        pred, fits, how, flat = _fastest(cfg)
        measured = model_flops_per_step(shape, B, s) / (r["tflops_per_gpu"] * 1e12 * n)
        out.append({
            "source": "Llama 3 Table 4", "gpu": gpu.name, "seq": s, "model": f"{shape.name} c{c}", "gpus": n,
            "t": t, "p": p, "d": d, "global_batch": B, "micro_batch": 1, "assumed": how,
            "measured_step_s": measured, "predicted_step_s": pred, "error_pct": 100 * (pred / measured - 1),
            "fits": fits, "flat_error_pct": 100 * (flat / measured - 1),
        })  # fmt: skip
    return out


LONG_SEQUENCE_TABLES = {
    "nemo_long_sequence_2024": ("NeMo 24.03 long sequence", "apex"),
    "nemo_long_sequence_b200_2025": ("NeMo 25.04 long sequence", "mcore"),
}
"""NeMo's long-sequence tables: (the rows' source label, their optimizer state's settings). NeMo 24.03 ran apex's
distributed Adam (:func:`nemo_optimizer_state`); NeMo 25.04 (NeMo 2.0) Megatron-core's distributed optimizer, fp32
master and moments, the gradient buffer in bf16 (``grad_reduce_in_fp32`` False in its performance recipe)."""


def nemo_long_rows(
    data: dict, table: str = "nemo_long_sequence_2024", recompute: str | None = None
) -> list[dict]:
    """A NeMo long-sequence table (:data:`LONG_SEQUENCE_TABLES`: LLAMA2-7B FP8 on DGX-H100 with NeMo 24.03, LLAMA3-8B
    FP8 on DGX-B200 with NeMo 25.04; 4K to 1M tokens with context parallelism): step = model FLOPs (NeMo's
    full-attention count of the time) / (TFLOP/s per GPU · GPUs); TE's cuDNN attention (on Hopper the mid-2024
    kernel's, on the B200 its row's), the p2p ring, b_m 1, ZeRO-1, TP collectives exposed, the planner's fastest
    recompute (``_not_published``); ``recompute``: that one instead (``--long-recompute``: what-if, not a fit)."""
    sec = data[table]
    label, optimizer = LONG_SEQUENCE_TABLES[table]
    state = nemo_optimizer_state() if optimizer == "apex" else {"grad_dtype": "half"}
    hopper = {"attention_fraction": CUDNN_HOPPER_CEILING} if sec["gpu"].startswith("h100") else {}
    gpu = get_accelerator(sec["gpu"], **hopper)
    out = []
    for r in sec["rows"]:
        s, n, t, p, d, c = r["seq_k"] * 1024, r["gpus"], r["tp"], r["pp"], r["dp"], r["cp"]
        shape = get_model(sec["model"]).with_seq(s)
        cfg = PlanConfig(
            shape=shape, gpu=gpu, global_batch=r["global_batch"], data_parallel=d, pipeline_parallel=p,
            tensor_parallel=t, sequence_parallel=t > 1, context_parallel=c, cp_comm="ring", micro_batches=(1,),
            zero=(1,), flash_attention=True, precision=sec["precision"], fp8_recipe=sec["fp8_recipe"],
            schedules=("1f1b",), memory_headroom=0.0, choose="fastest", efficiency=FUSED, **state,
            **({"recompute": (recompute,)} if recompute else {}),
        )  # fmt: skip
        pred, fits, how, flat = _fastest(cfg)
        measured = model_flops_per_step(shape, r["global_batch"], s) / (r["tflops_per_gpu"] * 1e12 * n)
        out.append({
            "source": label, "gpu": gpu.name, "seq": s, "model": f"{shape.name} c{c}",
            "gpus": n, "t": t, "p": p, "d": d, "global_batch": r["global_batch"], "micro_batch": 1,
            "assumed": how + ", bf16 gradient buffer assumed",
            "measured_step_s": measured, "predicted_step_s": pred, "error_pct": 100 * (pred / measured - 1),
            "fits": fits, "flat_error_pct": 100 * (flat / measured - 1),
        })  # fmt: skip
    return out


def cudnn_llama_rows(data: dict) -> list[dict]:
    """cudnn-frontend's Llama-3.2-1B training benchmark (Hugging Face's eager model on one H200 and one B200, SDPA on
    cuDNN, the model in bf16, SGD): the measured step is the published time per iteration. Predicted at the clock the
    benchmark locked (the row's ``sustained_clock_fraction``: the locked clock's share of the burst clock the kernel
    terms were measured at, the rate following :data:`~microbatch.hardware_clocks.RATE_PER_CLOCK` of its fall), with
    PyTorch's eager kernels (no fusion), cuDNN's attention figures (on the H200 cuDNN 9.19's, measured after the run's
    9.9 where ``cudnn-2024`` was measured before it: BENCHMARKS.md gives both; on the B200 the row's, cuDNN 9.13's), bf16 weights and gradients without a master copy, SGD without momentum, no gradient
    clipping."""
    from microbatch.predict.attention import kernel_figures

    sec = data["cudnn_frontend_llama32_1b_2025"]
    out = []
    for r in sec["rows"]:
        row = get_accelerator(r["gpu"])
        ceiling, ramp = kernel_figures("cudnn", row.name, row.attention_fraction, row.attention_ramp)
        # the locked clock against the burst clock the kernel terms stand at, the rate following 0.75 of its fall
        clock = 1 - RATE_PER_CLOCK * (1 - sec["clock_mhz"][r["gpu"]] / sec["burst_clock_mhz"][r["gpu"]])
        gpu = row.with_overrides(
            attention_fraction=ceiling, attention_ramp=ramp, sustained_clock_fraction=clock
        )
        b, s = r["batch"], r["seq"]
        cfg = PlanConfig(
            shape=get_model(sec["model"]).with_seq(s), gpu=gpu, global_batch=b, micro_batches=(b,), recompute=("none",),
            master_weights="none", optimizer="sgd-plain", loss_dtype="half", grad_clip=False, flash_attention=True,
            memory_headroom=0.0,
            choose="fastest",
        )  # fmt: skip
        pred, fits, how, flat = _fastest(cfg)
        out.append({
            "source": "cudnn-frontend Llama-3.2-1B", "gpu": gpu.name, "seq": s, "model": f"llama-3.2-1b {r['gpu']}",
            "gpus": 1, "t": 1, "p": 1, "d": 1, "global_batch": b, "micro_batch": b,
            "assumed": how + f", clock locked at {sec['clock_mhz'][r['gpu']]} MHz", "measured_step_s": r["step_s"],
            "predicted_step_s": pred, "error_pct": 100 * (pred / r["step_s"] - 1), "fits": fits,
            "flat_error_pct": 100 * (flat / r["step_s"] - 1),
        })  # fmt: skip
    return out


BRIDGE_CUDNN = CUDNN_919_HOPPER
"""The Megatron-Bridge rows' attention on Hopper: cuDNN as of 9.19 (``--attention-kernel cudnn``), the nearest measured
version to their containers' (NGC 25.09–26.02 ship cuDNN 9.13–9.19); the 2024 rows (NeMo 24.03/24.07, the
Megatron-LM README's Megatron-Core r0.8.0) keep the mid-2024 kernel's (``cudnn-2024``)."""

MEGATRON_FP8_RECIPES = {"tensorwise": "te-current", "delayed": "te-delayed"}
"""The planner's recipe for Megatron's ``fp8_recipe`` names: Megatron's ``tensorwise`` is Transformer Engine's
current scaling (``Float8CurrentScaling``, what Megatron-Bridge's tables call FP8-CS), ``delayed`` TE's delayed
scaling — not torchao's recipes of the same names."""


def nemo_shape(name: str, seq: int, tp: int, table: dict) -> ModelShape:
    """A NeMo 24.07 table's model from its launcher config's widths (``shapes`` in the data): GPT3 at NeMo's GPT
    defaults (GeLU, LayerNorm, learned positions, biases, tied embeddings; GPT2 BPE padded to 128·t as NeMo pads
    it), Llama as Llama, Nemotron with its two-matrix squared-ReLU MLP."""
    m = table[name]
    common = dict(name=name, layers=m["layers"], hidden=m["hidden"], heads=m["heads"], kv_heads=m["kv"],
                  ffn_hidden=m["ffn"], seq=seq, dropout=m["dropout"])  # fmt: skip
    if m["family"] == "gpt3":
        pad = 128 * tp
        return ModelShape(vocab=-(-m["vocab_unpadded"] // pad) * pad, tied_embeddings=True, **common)
    return ModelShape(vocab=m["vocab_unpadded"], gated_mlp=m["family"] == "llama", bias=False,
                      norm="rmsnorm" if m["family"] == "llama" else "layernorm", learned_positions=False,
                      **common)  # fmt: skip


NEMO_FP8_GRAD_SYNC = "bf16"
"""The gradient buffer of NeMo's FP8 table runs: bf16, as the launcher's one FP8 training config sets it
(``gpt3/175b_fp8.yaml`` at 24.07: ``grad_sync_dtype: bf16``; the per-model configs are BF16, ``fp8: False``, so
the tables' FP8 runs are not them) and as Megatron-Bridge's performance configs later do (``grad_reduce_in_fp32 =
False``); apex's own default (= ``dtype``, fp32) would put GPT3-20B's 64-GPU row, which ran, at 93.5 GiB. Assumed, not
stated by the per-model configs: each NeMo row's ``assumed`` says so."""


def nemo_optimizer_state(
    optim_dtype: str = "fp32", grad_sync_dtype: str = NEMO_FP8_GRAD_SYNC
) -> dict[str, str]:
    """PlanConfig's state settings for NeMo's distributed Adam (apex ``DistributedFusedAdam`` as NeMo's
    ``megatron_base_model.setup_optimization`` sets it up for a bf16 model, v2.0.0rc0): the moments in the config's
    ``optim.dtype``, the gradient buffer in ``grad_sync_dtype``, the fp32 master kept as its 16-bit remainders when
    the state is fp32 (``store_param_remainders``), none when the state is bf16 (``store_params`` False: the bf16
    weights updated in place)."""
    grad = grad_sync_dtype
    return {"grad_dtype": "fp32" if grad == "fp32" else "half", "moments_dtype": optim_dtype,
            "master_weights": "remainder" if optim_dtype == "fp32" else "none"}  # fmt: skip


def nemo_2407_rows(data: dict) -> list[dict]:
    """NeMo 24.07's DGX-H100 FP8 pre-training table: step = GBS·s / (tokens/s/GPU · GPUs), each model's
    settings from its launcher config at the 24.07 tag (``_stated``), ZeRO-1, cuDNN attention; nothing fitted."""
    sec = data["nemo_2407_dgx_h100_fp8"]
    gpu = get_accelerator(sec["gpu"], attention_fraction=CUDNN_HOPPER_CEILING)
    out = []
    for r in sec["rows"]:
        s, n, t, p, c, v = r["seq"], r["gpus"], r["tp"], r["pp"], r["cp"], r["vp"]
        m = sec["shapes"][r["model"]]
        shape = nemo_shape(r["model"], s, t, sec["shapes"])
        d = n // (t * p * c)
        sp = m["sp"] and t > 1
        cfg = PlanConfig(
            shape=shape, gpu=gpu, global_batch=r["global_batch"], data_parallel=d, pipeline_parallel=p,
            tensor_parallel=t, sequence_parallel=sp, async_tp=sp and r.get("tp_overlap", m["tp_overlap"]),
            context_parallel=c, cp_comm="ring", micro_batches=(r["micro_batch"],), zero=(1,), flash_attention=True,
            precision=sec["precision"], fp8_recipe=sec["fp8_recipe"],
            schedules=("interleaved-1f1b",) if v > 1 else ("1f1b",), virtuals=(v,) if v > 1 else None,
            recompute=(m["recompute"],) if m["recompute"] else ("none",), memory_headroom=0.0, choose="fastest",
            efficiency=FUSED, **nemo_optimizer_state(m.get("optim_dtype", "fp32")),
        )  # fmt: skip
        pred, fits, how, flat = _fastest(cfg)
        measured = r["global_batch"] * s / (r["tokens_per_s_per_gpu"] * n)
        out.append({
            "source": "NeMo 24.07", "gpu": gpu.name, "seq": s, "model": shape.name, "gpus": n, "t": t, "p": p,
            "d": d, "global_batch": r["global_batch"], "micro_batch": r["micro_batch"],
            "assumed": how + ", bf16 gradient buffer assumed",
            "measured_step_s": measured, "predicted_step_s": pred, "error_pct": 100 * (pred / measured - 1),
            "fits": fits, "flat_error_pct": 100 * (flat / measured - 1),
        })  # fmt: skip
    return out


def _band(seq: int) -> str:
    return "s <= 2k" if seq <= 2048 else ("2k < s <= 8k" if seq <= 8192 else "s > 8k")


def _summary(label: str, part: list[dict]) -> str:
    errs = [abs(r["error_pct"]) for r in part]
    flat = [abs(r["flat_error_pct"]) for r in part]
    fast = sum(1 for r in part if r["error_pct"] < 0)
    return (
        f"  {label:<26} {len(part):>3} rows  mean |error| {sum(errs) / len(errs):5.1f}%  max {max(errs):5.1f}%  "
        f"mean signed {sum(r['error_pct'] for r in part) / len(part):+6.1f}%  too fast {100 * fast / len(part):3.0f}%  "
        f"flat 50% rule {sum(flat) / len(flat):5.1f}%"
    )


def print_breakdown(rows: list[dict], worst: int = 5) -> None:
    """Error by source, accelerator and sequence band; the share too fast; the worst rows."""
    for title, key in (("by source", "source"), ("by accelerator", "gpu"), ("by sequence band", "band")):
        print(title)
        groups: dict[str, list[dict]] = {}
        for r in rows:
            groups.setdefault(_band(r["seq"]) if key == "band" else r[key], []).append(r)
        for label, part in groups.items():
            print(_summary(label, part))
    print("worst rows")
    for r in sorted(rows, key=lambda r: -abs(r["error_pct"]))[:worst]:
        print(
            f"  {r['source']:<24} {r['model']:<18} {r['gpus']:>6} GPUs  s {r['seq']:>6}  {r['error_pct']:+6.1f}%"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument(
        "--long-recompute", choices=("none", "selective", "full"), default=None,
        help="what-if: the NeMo long-sequence rows at this recompute instead of the planner's fastest (not published)",
    )  # fmt: skip
    args = ap.parse_args()
    data = json.loads(DATA.read_text())
    base = narayanan_rows(data) + korthikanti_rows(data)
    moe = moe_bridge_rows(data)
    readme = megatron_readme_rows(data)
    longseq = nemo_long_rows(data, recompute=args.long_recompute) + nemo_long_rows(
        data, "nemo_long_sequence_b200_2025", recompute=args.long_recompute
    )
    nemo = nemo_2407_rows(data)
    zero3 = deepspeed_azure_rows(data)
    eager = cudnn_llama_rows(data)
    rows = base + bridge_rows(data) + nemo + readme + llama3_rows(data) + longseq + zero3 + eager + moe
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"{'source':<24} {'model':<14} {'GPUs':>5} {'t':>2} {'p':>3} {'d':>4} {'B':>5} {'b_m':>3} "
          f"{'measured':>9} {'predicted':>9} {'error':>7}")  # fmt: skip
    for r in rows:
        print(f"{r['source']:<24} {r['model']:<14} {r['gpus']:>5} {r['t']:>2} {r['p']:>3} {r['d']:>4} "
              f"{r['global_batch']:>5} {r['micro_batch']:>3} {r['measured_step_s']:>8.2f}s "
              f"{r['predicted_step_s']:>8.2f}s {r['error_pct']:>+6.1f}%{'' if r['fits'] else '  !'}")  # fmt: skip
    unfit = [r for r in rows if not r["fits"]]
    print(f"! predicted not to fit, though the run ran: {len(unfit)} of {len(rows)} rows")
    for r in unfit:
        print(f"  {r['source']} {r['model']} {r['gpus']} GPUs: {r['assumed']}")
    print()
    for label, part in (
        ("Narayanan 2021", base[:10]),
        ("Korthikanti 2022", base[10:18]),
        ("issue-17 rows", base),
        ("Megatron-LM README", readme),
        ("NeMo 24.07", nemo),
        ("NeMo long sequence", longseq),
        ("DeepSpeed ZeRO-3", zero3),
        ("HF eager, 1 GPU", eager),
        ("MoE rows (i. 29)", moe),
    ):
        errs = [abs(r["error_pct"]) for r in part]
        signs = sum(1 for r in part if r["error_pct"] < 0)
        print(
            f"{label:<17} mean |error| {sum(errs) / len(errs):.1f}%, max {max(errs):.1f}%, "
            f"mean signed {sum(r['error_pct'] for r in part) / len(part):+.1f}%, {signs} of {len(part)} too fast"
        )
    print()
    print_breakdown(rows)
    print(
        "Narayanan rows, assumed where the source is silent: b_m = 1, 1F1B (no interleaving), full recompute, no ZeRO"
    )
    print(
        "from the runs' software (2021 Megatron-LM): no flash attention; gradient all-reduce after the backward"
    )
    print(
        "Megatron-Bridge rows: recompute the planner's fastest that fits. Llama 3 rows as its report ran (§3.3.2):"
        " interleaved 1F1B, no recompute at 8K, FSDP (ZeRO-2, FP32 gradients reduce-scattered after each"
        " micro-batch), all-gather context parallelism; v and the 128K row's recompute the planner's fastest"
    )
    print(
        "405B rows: 7, 8 x 14, 7 (Llama 3) or 15, 16 x 6, 15 (Megatron-Bridge, vp 8) layers per stage: the first"
    )
    print(
        "and last stages also hold the embedding and the loss; Llama 3's v, not published, the planner's fastest"
    )
    print(
        "from the runs' software (Megatron-Bridge recipes, llama3_70b_pretrain_config: CommOverlapConfig(tp_comm_overlap="
    )
    print(
        "True), Transformer Engine userbuffers): dense rows with t > 1 overlap TP communication with the GEMMs (async_tp)"
    )
    print(
        "Megatron-Bridge rows: context parallelism as Megatron's p2p ring (its default cp_comm_type). "
        "Megatron-Bridge MoE rows (MB MoE): dropless with even expert load (the tables' forced balance), no"
    )
    print(
        "Megatron-LM README rows (H100, Megatron-Core r0.8.0): GPT blocks (4h GeLU MLP, untied embeddings, learned"
        " positions, dropout 0.1: Megatron's defaults), BF16 with fp32 gradients, SP and overlapped TP communication"
    )
    print(
        "when t > 1, the distributed optimizer, TE fused attention; b_m, 1F1B or interleaved, v and recompute the"
        " planner's fastest (not published)"
    )
    print("all-to-all overlap, ZeRO-1; Qwen3 and GPT-OSS at their own head widths (32 x 128 on 2048, 64 x 64")
    print(
        "on 2880), GPT-OSS's 18 sliding-window layers at 128 keys; the 25.09 DeepSeek-V3 row's FP8 "
        "recipe assumed (no precision column); nothing fitted"
    )
    print(
        "TE rows (Megatron-Bridge, Megatron-LM README, NeMo): cuDNN attention (TE prefers it on Hopper: cuDNN 9.19's curve"
        " for the Bridge rows' 2025-26 containers, mid-2024's for the NeMo and README rows), FP8 as TE casts"
        " (te-current for Bridge's FP8-CS, te-delayed for NeMo). NeMo 24.07 rows: each model's launcher config at the"
        " 24.07 tag (dropout, SP, TP overlap, recompute, optim.dtype), ZeRO-1 as NeMo's distributed Adam keeps it (bf16"
        " gradient buffer, fp32 master as 16-bit remainders, or none under a bf16 state); DeepSeek-V3 with its recipe's"
        " bf16 moments; NeMo long-sequence rows (24.03 on H100, 25.04 on B200): b_m 1, ZeRO-1, TP"
        " collectives exposed, Megatron's p2p ring, the planner's fastest recompute; on the B200 TE's cuDNN at the"
        " row's curve (cuDNN 9.13's figures: the 25.04 container's is older), Megatron-core's optimizer"
    )
    print(
        "DeepSpeed Azure row (2022): ZeRO-3 (DeepSpeed's, from its gathered buffers) data parallelism alone, fp16,"
        " full recompute, no flash attention, Megatron-DeepSpeed's fused kernels and GPT defaults (the post's recipe)"
    )
    for k in ("nemo_dgx_h100_bf16",):
        print(f"{k}: {data[k]['_status']}")


if __name__ == "__main__":
    main()
