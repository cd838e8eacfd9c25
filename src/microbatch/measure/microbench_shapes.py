"""The shapes the kernel microbenchmark times (:mod:`microbatch.measure.microbench`): a layer's GEMMs at b_m·s rows,
an M × (K = N) grid, and the attention key lengths. Pure: no torch."""

from __future__ import annotations

from microbatch.model import ModelShape

__all__ = ["layer_gemm_shapes", "grid_gemm_shapes", "attention_seqs"]


def layer_gemm_shapes(shape: ModelShape, rows: int) -> list[tuple[str, int, int, int]]:
    """(label, rows, k, n) of one layer's GEMMs and the output layer, as :func:`~microbatch.predict.roofline.layer_forward`
    charges them at t = 1: QKV ``h → a·d + 2·kv·d``, projection ``a·d → h`` (a·d = h unless the model sets its
    head width apart), MLP ``h → f`` (2f gated) and ``f → h``, logits ``h → V``."""
    h, f, qw = shape.hidden, shape.ffn, shape.q_width
    kvd = shape.kv * shape.head_dim
    return [
        ("qkv", rows, h, qw + 2 * kvd),
        ("proj", rows, qw, h),
        ("fc1", rows, h, (2 if shape.gated_mlp else 1) * f),
        ("fc2", rows, f, h),
        ("logits", rows, h, shape.vocab),
    ]


def grid_gemm_shapes(quick: bool) -> list[tuple[str, int, int, int]]:
    """The M × (K = N) grid: rows 128 … 8,192 and widths 1,024 … 8,192 (quick: rows 16 … 256, widths 64, 256)."""
    rows, widths = ((16, 64, 256), (64, 256)) if quick else ((128, 512, 2048, 8192), (1024, 4096, 8192))
    return [("grid", m, w, w) for w in widths for m in rows]


def attention_seqs(seq: int, quick: bool) -> tuple[int, ...]:
    """Key lengths for attention: s/4, s/2, s (and 2s unless quick), at least 16."""
    out = {max(16, seq // 4), max(16, seq // 2), seq} | (set() if quick else {2 * seq})
    return tuple(sorted(out))
