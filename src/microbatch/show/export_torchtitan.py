"""The torchtitan export: a plan as torchtitan's TOML tables (:mod:`microbatch.show.export` writes them).

For torchtitan 0.2.x (0.2.0–0.2.2), the releases that read this TOML job config: 0.3 reads none (its configs are
Python), and 0.1 spells FP8 and the pipeline's and experts' keys otherwise (it drops unknown keys silently).
``training.local_batch_size`` (b_m, or b_m·m with pipelining, which torchtitan splits into micro-batches of
``parallelism.pipeline_parallel_microbatch_size``), ``training.global_batch_size`` = B,
``training.mixed_precision_param`` (float32 for an fp32 plan; torchtitan has no fp16),
``parallelism.pipeline_parallel_schedule`` (the torch class's name), the plan's stages, FSDP for ZeRO (torchtitan
has no ZeRO-1), expert parallelism (with expert tensor parallelism t) and context parallelism (with its K/V rotate
method), FP8 linears, per-op and every-K-th recompute and async TP. What torchtitan would refuse or run otherwise
is refused here: DDP (ZeRO 0) beside tensor or pipeline parallelism, a multi-stage torch schedule with one stage
per rank, fp16, and the planner's selective recompute (the attention core only) without flash attention. Split
from :mod:`microbatch.show.export`; the helpers both use are in :mod:`microbatch.show.export_common`.
"""

from __future__ import annotations

from microbatch.errors import ConfigError
from microbatch.predict.stages import split_layers, virtual_stage_layers
from microbatch.predict.state import zero_groups
from microbatch.schedules.registry import DEFAULT_SCHEDULE, get_spec, schedule_names, torch_spec
from microbatch.show.export_common import Json, clip_norm, precision_of, schedule_spec

__all__ = ["TORCHTITAN_HEADER", "torchtitan_config"]

TORCHTITAN_VERSIONS = "torchtitan 0.2.x (0.2.0–0.2.2, TOML job config)"
"""The torchtitan releases the TOML is for: 0.3.0 reads no TOML (its configs come from a Python registry), and 0.1.0
registers FP8 as ``float8`` and has no keys for the first and last stages' layers or for expert parallelism."""

TORCHTITAN_HEADER = (
    f"# microbatch export for {TORCHTITAN_VERSIONS}; torchtitan 0.3 reads no TOML, 0.1 other keys"
)
"""The comment line the TOML text starts with."""


def _torchtitan_schedule(name: str) -> str:
    """torchtitan's ``pipeline_parallel_schedule``: the name of the torch class that runs ``name``
    without its ``Schedule`` prefix (``Interleaved1F1B``); 1F1B for a schedule torch cannot run."""
    try:
        torch_name = torch_spec(name).torch_name
    except ConfigError:
        return "1F1B"
    return (torch_name or "Schedule1F1B").removeprefix("Schedule")


def torchtitan_config(c: Json) -> tuple[Json, list[str]]:
    p, t, d, z = (
        c.get("pipeline_parallel", 1),
        c.get("tensor_parallel", 1),
        c["data_parallel"],
        c.get("zero", 0),
    )
    _check_torchtitan(c)
    b, g, B = c["micro_batch"], c["grad_accum"], c["global_batch"]
    training: Json = {"global_batch_size": B}
    notes = [
        f"written for {TORCHTITAN_VERSIONS}: torchtitan 0.3 reads no TOML (Python configs), 0.1 other keys"
    ]
    ep, cp = c.get("expert_parallel", 1), c.get("context_parallel", 1)
    if ep > 1 and cp > 1 and ep % cp:  # 0.2.0's ParallelDims: assert ep % cp == 0 (0.2.1 dropped it)
        notes.append(
            f"torchtitan 0.2.0 refuses expert_parallel {ep} beside context_parallel {cp} (its ParallelDims asserts "
            "ep % cp == 0); 0.2.1 and 0.2.2 take it: run one of those"
        )
    if (clip := clip_norm(c)) is not None:  # torchtitan clips at 1.0 unless told
        training["max_norm"] = clip or float("inf")  # it always clips: a limit of 0 would zero every gradient
        if not clip:
            notes.append(
                "no clipping: max_norm = inf (torchtitan clips every step; at 0 it zeroes the gradients)"
            )
    shard = zero_groups(d, 1, c.get("shard_degree"))[0]  # refuses a degree that does not divide d
    parallelism: Json = {
        "data_parallel_replicate_degree": d if z == 0 else d // shard,
        "data_parallel_shard_degree": 1 if z == 0 else shard,  # hybrid sharding (HSDP) when shard < d
        "tensor_parallel_degree": t,
        "pipeline_parallel_degree": p,
    }
    if p > 1:
        # one flush per step: the local batch is the m micro-batches of one flush
        training["local_batch_size"] = b * g
        parallelism["pipeline_parallel_microbatch_size"] = b
        name = c.get("schedule", DEFAULT_SCHEDULE)
        parallelism["pipeline_parallel_schedule"] = _torchtitan_schedule(name)
        notes += _torchtitan_stages(c, parallelism, p) + _receive_buffers(c, g)
        spec = schedule_spec(c.get("schedule"))
        if spec is not None and spec.run_as is not None:
            notes.append(
                f"{name} is torch's {torch_spec(name).torch_name} with one stage per rank "
                f"({_torchtitan_schedule(name)})"
            )
    else:
        training["local_batch_size"] = b  # torchtitan accumulates global / (local × dp) micro-batches
    if "seq" in c:
        training["seq_len"] = c["seq"]
    notes += _torchtitan_precision(c, training, parallelism)
    if z in (1, 2):
        parallelism["fsdp_reshard_after_forward"] = "never"
        notes.append(
            f"ZeRO {z} maps to FSDP without resharding after forward (ZeRO-2-like); torchtitan has no ZeRO-1"
            + (
                f": it gathers each layer and reduce-scatters its gradients in every one of the {g} micro-batches, "
                f"where the plan timed ZeRO {z} as one reduce-scatter and one gather a step; plan it at zero 3 "
                "with zero3_impl fsdp2 for the time torchtitan's FSDP takes"
                if p == 1 and g > 1
                else ""
            )
        )
    if z >= 1 and p > 1:  # torch's pipelining turns off FSDP's gradient sync until the last micro-batch
        notes.append(
            "under pipeline stages FSDP keeps the stage's weights and gradients whole until the last backward "
            "(ZeRO 1's memory) and reduce-scatters them once after it"
            + (" (the plan timed ZeRO 1 as a reduction overlapped with the last backward)" if z == 1 else "")
        )
    if t > 1 and not c.get("sequence_parallel", False):
        notes.append(
            "torchtitan's tensor parallelism always shards norms and dropout along the sequence (SP)"
        )
    checkpoint, more = _torchtitan_recompute(c)
    cfg = {"training": training, "parallelism": parallelism, "activation_checkpoint": checkpoint}
    return cfg, notes + more + _torchtitan_new(c, cfg)


def _receive_buffers(c: Json, m: int) -> list[str]:
    """torch.distributed.pipelining allocates a receive buffer for every micro-batch of a flush on each stage fed by
    another (``_prepare_forward_infra``; ``microbatch pipeline`` measures them held through the step: m inputs a fed
    stage, to the byte on every schedule), where Megatron frees each input after its backward, as the plan prices it.
    The note gives their bytes: m × b_m·s·h·e (/ t under sequence parallelism)."""
    h, s, b = c.get("hidden"), c.get("seq"), c["micro_batch"]
    if not isinstance(h, int) or not isinstance(s, int):
        return []
    e = 4 if precision_of(c) == "fp32" else 2
    t = c.get("tensor_parallel", 1) if c.get("sequence_parallel") else 1
    c_ = c.get("context_parallel", 1) or 1
    each = b * (s // c_) * h * e / t
    v = c.get("virtual", 1) or 1  # every stage but the first is fed: v a rank, v − 1 on the first rank
    first = f"; {(v - 1) * m * each / 2**30:,.2f} GiB on the first" if v > 1 else " but the first"
    return [
        f"torch's pipelining keeps a receive buffer for each of the {m} micro-batches of every stage fed by another "
        f"({m} × {each / 2**20:,.1f} MiB): {v * m * each / 2**30:,.2f} GiB on each rank{first}, beyond the plan's "
        "peak, which frees each input after its backward as Megatron does"
    ]


def _float8_experts(c: Json, cfg: Json) -> str:
    """torchtitan's routed experts are ``GroupedExperts`` parameters, not ``nn.Linear``: the float8 linear converter
    leaves them in bf16 and its grouped-GEMM converter (``quantize.grouped_mm.float8``, ``fqns``) runs them in FP8,
    refused beside pipeline or context parallelism (``components/quantization/float8.py``); written where it runs,
    said where it cannot. The linear converter also takes the router's gate and the output projection, which the
    plan prices in the compute dtype."""
    also = (
        "; torchtitan's float8 linear converter also converts the router's gate and the output projection, priced "
        "in bf16 here: list them in quantize.linear.float8.filter_fqns to keep them so"
    )
    if c.get("pipeline_parallel", 1) > 1 or c.get("context_parallel", 1) > 1:
        return (
            "the plan priced the routed experts' GEMMs in FP8; torchtitan's grouped-GEMM float8 converter refuses "
            "pipeline and context parallelism, so here its experts run in bf16 (slower than planned)" + also
        )
    cfg["model"]["converters"].append("quantize.grouped_mm.float8")
    cfg["quantize.grouped_mm.float8"] = {"fqns": ["experts"]}
    return (
        "the routed experts (GroupedExperts, not nn.Linear) in FP8 through quantize.grouped_mm.float8, written"
        + also
    )


def _check_torchtitan(c: Json) -> None:
    """ConfigError for a layout torchtitan 0.2 refuses or would run otherwise than the plan (module docstring)."""
    p, t, d, z = (
        c.get("pipeline_parallel", 1),
        c.get("tensor_parallel", 1),
        c["data_parallel"],
        c.get("zero", 0),
    )
    cp, ep = c.get("context_parallel", 1), c.get("expert_parallel", 1)
    # ZeRO 0, or ZeRO >= 1 sharded over groups of one (shard degree 1: every rank a replica), is DDP there
    replicated = z == 0 or zero_groups(d, 1, c.get("shard_degree"))[0] == 1
    if replicated and d > 1 and cp == 1 and (t > 1 or p > 1):
        how = "ZeRO 0" if z == 0 else f"ZeRO {z} with shard degree 1"
        raise ConfigError(
            f"torchtitan runs {how} over d = {d} ranks as DDP (data_parallel_replicate_degree = {d}), and its DDP "
            f'takes no other parallelism ("DDP has not supported > 1D parallelism"), here t = {t}, p = {p}; plan '
            "again with zero 3 (or 1 or 2: torchtitan runs each as FSDP) and a shard degree above 1, or with "
            "tensor_parallel 1 and pipeline_parallel 1",
            params=("zero", "shard_degree", "tensor_parallel", "pipeline_parallel"),
        )
    sharded = (1 if z == 0 else zero_groups(d, 1, c.get("shard_degree"))[0]) * cp
    if ep > 1 and sharded % ep:
        raise ConfigError(
            f"torchtitan carves expert parallelism out of the FSDP-sharded ranks (data-parallel shard × context "
            f"parallel = {sharded} here, with ZeRO {z}), which expert_parallel {ep} does not divide; plan again with "
            "zero 3 (torchtitan's FSDP)",
            params=("zero", "expert_parallel"),
        )
    seq = c.get("seq")
    if isinstance(seq, int) and seq % (2 * t * cp):
        raise ConfigError(
            f"torchtitan asserts seq_len divisible by 2·t·c = {2 * t * cp} (sequence parallelism splits it over t, "
            f"load-balanced context parallelism into 2c chunks: parallel_dims.seq_len_divisor), and {seq} is not; "
            f"plan again with seq a multiple of {2 * t * cp}",
            params=("seq",),
        )
    if precision_of(c) == "fp16-mixed":
        raise ConfigError(
            "torchtitan has no fp16-mixed (its training.mixed_precision_param takes bfloat16 or float32); plan "
            "again with precision bf16-mixed (or fp32), or export this plan to deepspeed, hf or lightning",
            params=("precision",),
        )
    if p > 1:
        _check_stages_per_rank(str(c.get("schedule", DEFAULT_SCHEDULE)), int(c.get("virtual", 1) or 1))
    spec = schedule_spec(c.get("schedule"))  # DualPipeV: a forward overlapped with a backward
    overlapped = spec is not None and spec.overlapped is not None
    if p > 1 and ep > 1 and overlapped and c.get("recompute", "none") != "none":
        raise ConfigError(
            "torchtitan refuses DualPipeV with expert parallelism and activation checkpointing together (from 0.2.1 "
            "get_dual_pipe_v_flag raises NotImplementedError while pipeline_parallel_expert_parallel_overlap, its "
            f"default, is on), here recompute {c.get('recompute')} with expert_parallel {ep}; plan again with recompute "
            "none or another schedule",
            params=("recompute", "schedule"),
        )


def _check_stages_per_rank(name: str, v: int) -> None:
    """ConfigError when torch runs ``name`` with a multi-stage class (one whose registry entry has no fixed
    single stage per rank) and the plan has v < 2: torchtitan refuses it ("Multi-stage schedule requires at
    least 2 stages per rank"). ZB-H1 is torch's InterleavedZeroBubble with one stage per rank."""
    try:
        runner = torch_spec(name)
    except ConfigError:
        return  # torch has no class: written as 1F1B (_torchtitan_schedule)
    if runner.stages_per_rank == 1 or v >= 2:
        return
    ok = []
    for other in schedule_names():  # the ones the planner times and torchtitan runs
        spec = get_spec(other)
        try:
            single = torch_spec(other).stages_per_rank == 1
        except ConfigError:
            continue
        if spec.step_time is None or (spec.stages_per_rank == 1 and not single):
            continue
        ok.append(f"{other} with virtual 2 or more" if spec.stages_per_rank is None else other)
    raise ConfigError(
        f"torchtitan runs {name} as torch's {runner.torch_name}, a multi-stage schedule, and refuses it "
        f'with {v} stage per rank ("Multi-stage schedule requires at least 2 stages per rank"); plan again with '
        f"schedules {', '.join(ok)}",
        params=("virtual", "schedules"),
    )


def _torchtitan_precision(c: Json, training: Json, parallelism: Json) -> list[str]:
    """``training.mixed_precision_param``: float32 for an fp32 plan (torchtitan's default is bfloat16); a note
    where torchtitan turns mixed precision off (tensor or pipeline parallelism without FSDP or CP)."""
    prec = precision_of(c)
    if prec == "fp32":
        training["mixed_precision_param"] = "float32"
        return []
    if (
        c.get("reduce_dtype") == "half" and c.get("zero", 0) >= 2
    ):  # torchtitan reduces in float32, nothing else
        raise ConfigError(
            "the plan reduce-scatters its gradients in 16 bits, and torchtitan 0.2.x reduces in float32 only "
            "(training.mixed_precision_reduce is Literal['float32']); plan with reduce_dtype auto (fp32), or change "
            "torchtitan's MixedPrecisionPolicy(reduce_dtype=...) in code",
            params=("reduce_dtype",),
        )
    no_fsdp = parallelism["data_parallel_shard_degree"] == 1 and c.get("context_parallel", 1) == 1
    if no_fsdp and (parallelism["tensor_parallel_degree"] > 1 or parallelism["pipeline_parallel_degree"] > 1):
        return [
            f"the plan is {prec}, but torchtitan casts to bfloat16 only under FSDP, HSDP or context parallelism, or "
            "under DDP or on one device with no other parallelism: with tensor or pipeline parallelism and no FSDP "
            '(d = 1) it trains in float32 ("Mixed precision training is disabled"), with more memory and time than '
            "the plan counted"
        ]
    return []


def _torchtitan_recompute(c: Json) -> tuple[Json, list[str]]:
    """The ``[activation_checkpoint]`` table. The planner's ``selective`` recomputes only the attention core
    (Korthikanti et al. 2022), which flash attention does not store: ``mode = "none"`` (torchtitan's own selective
    is per-op or every-K-th-layer recompute; its default, option "2", recomputes every second block in full).
    Without flash attention torchtitan has nothing that matches: ConfigError."""
    mode = c.get("recompute", "none")
    if mode != "selective":
        return {"mode": mode}, []  # op and every-K are set by _torchtitan_new
    flash = c.get("flash_attention")
    if flash is False:
        raise ConfigError(
            "torchtitan has no recompute selective in the planner's sense without flash attention (only the "
            "attention core's scores recomputed, Korthikanti et al. 2022): its selective mode recomputes per op or "
            "every K-th block; plan again with recompute op (torchtitan's per-op selective) or full, or with flash "
            "attention",
            params=("recompute",),
        )
    assumed = "" if flash else " (flash attention assumed: the plan does not record it)"
    return {"mode": "none"}, [
        "recompute selective recomputes only the attention core (Korthikanti et al. 2022), which flash "
        f'attention does not store{assumed}: written as mode = "none"; torchtitan\'s "selective" is per-op or '
        'every-K-th-block recompute (its default, option "2", recomputes every second block in full)'
    ]


def _torchtitan_stages(c: Json, parallelism: Json, p: int) -> list[str]:
    """torchtitan's layers per (virtual) stage for the plan's even split: L/(p·v), with its first and last
    stages not shortened (its default takes a layer off each for the embedding and the output layer, which
    would not be the split the plan timed, and with v > 1 would set another number of stages per rank)."""
    v, layers, split = c.get("virtual", 1) or 1, c.get("layers"), c.get("layers_per_stage")
    if not isinstance(split, list) and isinstance(layers, int) and layers % (p * v) and layers >= p:
        split = list(split_layers(layers, p))  # the plan's even split: the remainder on the last stages
    if isinstance(split, list) and len(split) == p and all(isinstance(n, int) and n > 0 for n in split):
        # an uneven split (the planner's layers_per_stage): each virtual stage's modules by name, in the model's
        # order as the planner places them (stage s on rank s mod p; DualPipeV's V), the embedding on the first
        # and the final norm and output on the last, as torchtitan's own split places them
        spec = schedule_spec(c.get("schedule"))
        chunks = virtual_stage_layers(tuple(split), v, spec.placement if spec is not None else "loop")
        first = [sum(chunks[:i]) for i in range(len(chunks))]
        parts = [[f"layers.{j}" for j in range(a, a + n)] for a, n in zip(first, chunks, strict=True)]
        parts[0].insert(0, "tok_embeddings")
        parts[-1] += ["norm", "output"]
        parallelism["module_fqns_per_model_part"] = parts
        return [
            f"the plan's split {split}"
            + (f" ({v} stages per rank: {list(chunks)} layers per stage)" if v > 1 else "")
            + " written as parallelism.module_fqns_per_model_part, in the module names of torchtitan's Llama models "
            "(tok_embeddings, layers.N, norm, output): rename them for another model"
        ]
    if not isinstance(layers, int) or layers % (p * v):
        what = f"the plan's split {split} over {v} stages per rank" if split else "the plan's split"
        return [
            f"{what} is not written (torchtitan's pipeline_parallel_layers_per_stage holds one count for every "
            f"stage): set parallelism.module_fqns_per_model_part so each of the {p} ranks holds {v} stage(s)"
        ]
    parallelism["pipeline_parallel_layers_per_stage"] = layers // (p * v)
    parallelism["pipeline_parallel_first_stage_less_layers"] = 0
    parallelism["pipeline_parallel_last_stage_less_layers"] = 0
    return []


def _torchtitan_new(c: Json, cfg: Json) -> list[str]:
    """The torchtitan keys of expert and context parallelism, FP8, per-op or every-K recompute and async TP."""
    par, notes = cfg["parallelism"], []
    if (ep := c.get("expert_parallel", 1)) > 1:
        par["expert_parallel_degree"] = ep
        if (t := c.get("tensor_parallel", 1)) > 1:  # the planner shards each expert's F over the t ranks
            par["expert_tensor_parallel_degree"] = t
        notes.append(f"expert parallelism {ep} is carved out of the data-parallel × context-parallel ranks")
    if (cp := c.get("context_parallel", 1)) > 1:
        exchange = c.get("cp_comm", "allgather")
        if exchange not in ("allgather", "ring"):
            raise ConfigError(
                f"torchtitan has no {exchange} context parallelism (its rotate methods are an all-gather and a ring "
                "of sends); plan with cp_comm allgather or ring"
            )
        par["context_parallel_degree"] = cp  # torch's all-to-all rotater is the ring of sends
        par["context_parallel_rotate_method"] = "allgather" if exchange == "allgather" else "alltoall"
        if c.get("zero", 0) == 0:
            notes.append(
                f"torchtitan shards the weights over the context-parallel ranks (its FSDP mesh is data-shard × cp = "
                f"{cp}) where the plan priced ZeRO 0: less memory than planned, and FSDP's gathers"
            )
    spec = schedule_spec(c.get("schedule"))  # one that overlaps a forward with a backward: DualPipeV
    if c.get("ep_overlap") and (
        c.get("pipeline_parallel", 1) == 1 or spec is None or spec.overlapped is None
    ):
        notes.append(
            "the plan hid the expert all-to-alls behind other micro-batches' work (ep_overlap); torchtitan overlaps "
            "them only under DualPipeV (pipeline_parallel_expert_parallel_overlap): here they run exposed"
        )
    if c.get("async_tp"):
        par["enable_async_tensor_parallel"] = True
        cfg.setdefault("compile", {})["enable"] = True
        notes.append("async tensor parallelism needs torch.compile (compile.enable = true, written)")
    if precision_of(c) == "fp8":
        cfg.setdefault("model", {})["converters"] = ["quantize.linear.float8"]
        cfg["quantize.linear.float8"] = {"recipe_name": c.get("fp8_recipe", "tensorwise")}
        cfg.setdefault("compile", {})["enable"] = True
        notes.append("float8 linears need torch.compile to fuse the casts (compile.enable = true, written)")
        if c.get("moe"):
            notes.append(_float8_experts(c, cfg))
    if c.get("elementwise") == "compiled":  # the plan priced torch.compile's fused elementwise kernels
        cfg.setdefault("compile", {})["enable"] = True
    ac = cfg["activation_checkpoint"]
    if ac["mode"] == "op":
        ac.update(mode="selective", selective_ac_option="op")
    elif ac["mode"] == "full" and c.get("recompute_every", 1) > 1:
        ac.update(mode="selective", selective_ac_option=str(c["recompute_every"]))
    return notes
