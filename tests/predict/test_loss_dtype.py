"""The logits the loss reads and keeps (``loss_dtype``): fp32 (upcast, the frameworks' default) or half (Megatron's
fp16_lm_cross_entropy; a bf16 model's loss without autocast)."""

from __future__ import annotations

import pytest

from microbatch.cli import main
from microbatch.errors import ConfigError
from microbatch.hardware import get_accelerator
from microbatch.model import get_model
from microbatch.precision import LOSS_DTYPES, loss_bytes
from microbatch.predict.activations import output_activation_bytes
from microbatch.predict.gemm import DEFAULT_EFFICIENCY
from microbatch.predict.memory import MemoryConfig, estimate_memory
from microbatch.predict.plan import PlanConfig, make_plan
from microbatch.predict.roofline import logits_forward

SHAPE = get_model("llama-3.2-1b")
H200 = get_accelerator("h200")


def test_half_logits_halve_the_losss_bytes_and_keep_the_gemm() -> None:
    """By hand: b_m 12 at s 1,024 (12,288 rows) over a 128,256 vocabulary: the loss streams 3 passes of the logits
    (written at ``memory``, read twice at the eager softmax rate), 4 B each in fp32, 2 in half; the GEMM is the
    same."""
    rows, v = 12 * 1024, SHAPE.vocab
    run = H200.at_sustained_clock()
    passes = 1 / DEFAULT_EFFICIENCY.memory + 2 / DEFAULT_EFFICIENCY.score_fractions(True)[0]
    full, _ = logits_forward(SHAPE, 12, H200, seq=1024)
    half, _ = logits_forward(SHAPE, 12, H200, seq=1024, logits_bytes=2)
    assert full - half == pytest.approx(2 * rows * v * passes / run.memory_bandwidth_bytes_per_s, rel=1e-9)
    out = {k: output_activation_bytes(SHAPE, 12, seq=1024, logits_bytes=b) for k, b in LOSS_DTYPES.items()}
    assert out["fp32"] - out["half"] == 2 * rows * v


def test_plan_and_memory_follow_the_loss_dtype() -> None:
    base = dict(shape=SHAPE.with_seq(1024), gpu=H200, global_batch=12, micro_batches=(12,), recompute=("none",),
                choose="fastest", memory_headroom=0.0)  # fmt: skip
    fp32 = make_plan(PlanConfig(**base)).fastest
    half = make_plan(PlanConfig(**base, loss_dtype="half")).fastest
    assert fp32 is not None and half is not None
    assert half.step_time_s < fp32.step_time_s
    assert fp32.memory["activations"] - half.memory["activations"] == pytest.approx(
        2 * 12 * 1024 * SHAPE.vocab
    )
    mem = {k: estimate_memory(SHAPE, MemoryConfig(micro_batch=4, loss_dtype=k)) for k in LOSS_DTYPES}
    assert mem["fp32"].stages[-1].activation_terms["output"] - mem["half"].stages[-1].activation_terms[
        "output"
    ] == pytest.approx(2 * 4 * SHAPE.seq * SHAPE.vocab)


@pytest.mark.parametrize(("loss", "precision", "words"), [
    ("bf16", "bf16-mixed", "is not known; use fp32"),
    ("half", "fp32", "fp32 training's logits are fp32"),
])  # fmt: skip
def test_a_loss_dtype_that_cannot_be_is_refused(loss: str, precision: str, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        loss_bytes(loss, precision)
    with pytest.raises(ConfigError, match=words):
        PlanConfig(shape=SHAPE, gpu=H200, global_batch=8, loss_dtype=loss, precision=precision)


def test_the_cli_names_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["memory", "--model", "llama-3.2-1b", "-b", "1", "--precision", "fp32", "--loss-dtype", "half"])
        == 2
    )
    err = capsys.readouterr().err
    assert "--loss-dtype half with --precision fp32" in err
    assert main(["memory", "--model", "llama-3.2-1b", "-b", "1", "--loss-dtype", "half", "--json"]) == 0
    assert '"loss_dtype": "half"' in capsys.readouterr().out
