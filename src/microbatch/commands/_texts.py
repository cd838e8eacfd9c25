"""Help and hint texts that several commands share: the command line's words, kept out of the library
(which names parameters, ``docs/errors.md``)."""

from __future__ import annotations

__all__ = ["CALIBRATION_HELP", "CLOSED_FORM", "PP_GRAD_REDUCE_HELP"]

CALIBRATION_HELP = (
    "Measured points: a `tune --out DIR` result.json (or DIR), or JSON with micro_batch, throughput, "
    "peak_memory_bytes, step_time_s plus model, seq, precision, checkpointing, device. Fits, for that "
    "implementation, the activation scale and fixed bytes of the memory model and the GEMM efficiency "
    "against rows b_m·s. Assumes activations linear in b_m (2+ points needed) and backward = 2× forward; "
    "the analytic terms are scaled, not replaced, so another s, layout or b_m range is an extrapolation "
    "(the output says which). The efficiency applies only on the GPU it was measured on; another model is "
    "an error, another precision a warning. Or a `bench-gpu` kernel microbenchmark: its measured GEMM, "
    "attention, streaming and collective terms replace the analytic ones on the accelerator it ran on."
)
"""Help text of ``--calibration`` on ``memory`` and ``plan``."""

CLOSED_FORM = "microbatch bubble --no-diagram"
"""Where the command line finds a bubble too large to simulate (``check_simulable``'s ``closed_form``)."""

PP_GRAD_REDUCE_HELP = (
    "ZeRO 2/3 with -p > 1: gradients reduce-scattered once after the last micro-batch, held whole until then "
    "(torch's pipelining, torchtitan), or after each micro-batch behind its backward, only a shard kept (FSDP "
    "without no_sync; Llama 3's FSDP)."
)
"""Help text of ``--pp-grad-reduce`` on ``memory`` and ``plan``."""
