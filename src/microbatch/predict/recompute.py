"""The recompute policies beyond Megatron's two: torchtitan's per-op selective, and full every K-th layer.

**Per-op selective** (``op``; torchtitan ``activation_checkpoint.mode = "selective"`` with
``selective_ac_option = "op"``, ``torchtitan/models/llama3/infra/parallelize.py``'s save list): inside each
checkpointed block the outputs of matmuls, of the attention kernel and of reductions are saved, except
every second matmul (counted in execution order, the first saved); everything else (norms, rotary,
activation function, products) is recomputed in the backward from what was saved. For a Llama block the
matmuls run q, k, v, o, w1, w3, w2: q, v, w1, w2 are saved, k, o, w3 recomputed.

**Full every K-th layer** (``recompute_every = K``; torchtitan ``selective_ac_option = "K"``, Megatron
``--recompute-granularity full --recompute-method uniform``'s effect on memory): one layer in K keeps
only its input and reruns its forward in the backward; the others keep everything. Averaged over a
stage's layers (the remainder of L_stage/K ignored).
"""

from __future__ import annotations

from microbatch.errors import ConfigError
from microbatch.model import ModelShape

__all__ = [
    "matmul_widths", "op_saved_terms", "op_recompute_gemm_share", "every_kth", "check_every_kth", "recompute_working",
]  # fmt: skip


def matmul_widths(shape: ModelShape) -> list[tuple[int, int, bool]]:
    """The block's matmuls in execution order as (k, n, column-parallel): q, k, v, o, then w1, (w3,) w2."""
    h, qw, kvd, f = shape.hidden, shape.q_width, shape.kv * shape.head_dim, shape.ffn
    mlp = [(h, f, True), (h, f, True), (f, h, False)] if shape.gated_mlp else [(h, f, True), (f, h, False)]
    return [(h, qw, True), (h, kvd, True), (h, kvd, True), (qw, h, False), *mlp]


def op_saved_terms(shape: ModelShape, tokens: float, *, tensor_parallel: int, sp: int, dtype_bytes: int,
                   none_bytes: float, flash_stats: float) -> dict[str, float]:  # fmt: skip
    """Bytes a block keeps under per-op selective recompute, for ``tokens`` = b·s tokens of one micro-batch:

    ``layer_input`` e·sbh/sp (the checkpoint's input); ``saved_matmuls`` the outputs of the odd-numbered
    matmuls (e·sb·n, /t for column-parallel ones); ``attention_output`` e·sb·a·d_h/t (e·sbh/t at d_h = h/a) and its ``attention_stats``
    (the flash kernel's outputs are saved). A mixture-of-experts or latent-attention block, whose matmul
    order this does not spell out, keeps half of its no-recompute bytes ``none_bytes`` besides its input
    (an assumption).
    """
    e, t = dtype_bytes, tensor_parallel
    terms = {"layer_input": e * tokens * shape.hidden / sp}
    if shape.moe is not None or shape.mla is not None:
        terms["saved_half"] = none_bytes / 2
        return terms
    saved = matmul_widths(shape)[0::2]
    terms["saved_matmuls"] = sum(e * tokens * n / (t if col else 1) for _, n, col in saved)
    terms["attention_output"] = e * tokens * shape.q_width / t
    terms["attention_stats"] = flash_stats
    return terms


def op_recompute_gemm_share(shape: ModelShape) -> float:
    """Share of the block's matmul FLOPs rerun in the backward under per-op selective recompute: the
    even-numbered matmuls' k·n over all (Llama-3-8B: k, o, w3 = 36.5%); ½ for MoE and MLA blocks (assumed)."""
    if shape.moe is not None or shape.mla is not None:
        return 0.5
    widths = matmul_widths(shape)
    return sum(k * n for k, n, _ in widths[1::2]) / sum(k * n for k, n, _ in widths)


def every_kth(full_bytes: float, none_bytes: float, every: int) -> float:
    """Mean bytes per layer when one layer in K is fully recomputed: (full + (K − 1)·none) / K."""
    return (full_bytes + (every - 1) * none_bytes) / every


def check_every_kth(
    every: int, layers: int, stages: int = 1, layers_per_stage: tuple[int, ...] | None = None
) -> None:
    """ConfigError when one layer in ``every`` is more than the largest pipeline stage's layers (``layers_per_stage``,
    or the even split of ``layers`` over ``stages``: the remainder's stage): torchtitan recomputes layers K, 2K, …
    of each stage's model part, so no layer would be recomputed, where the average of :func:`every_kth` would still
    count 1/K of one."""
    most = max(layers_per_stage) if layers_per_stage else -(-layers // max(1, stages))
    if every > most:
        where = (
            f"the model's {layers} layers" if most == layers else f"the {most} layers of the largest stage"
        )
        raise ConfigError(
            f"recompute_every {every} is more than {where} (every K-th layer of a stage is recomputed): no layer "
            f"would be recomputed; give recompute_every between 1 and {most}, or recompute none",
            params=("recompute_every", "recompute"),
        )


def recompute_working(none_bytes: float, kept_bytes: float) -> float:
    """Bytes the layer being recomputed adds while its backward runs: its activations without recompute
    (``none_bytes``) less what it keeps under recompute (``kept_bytes``: the checkpointed input under full
    recomputation, the saved outputs under per-op recomputation), which the recomputed forward refers to
    rather than copies (autograd saves references). A stage of one layer and one micro-batch in flight then
    holds what it holds without recompute, not more."""
    return max(0.0, none_bytes - kept_bytes)
