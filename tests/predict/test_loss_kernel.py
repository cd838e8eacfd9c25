"""How the loss runs (``loss_kernel``): fused, in place (Megatron's vocabulary-parallel cross-entropy), or eager
(PyTorch's ``F.cross_entropy``), whose backward holds two more copies of the kept logits at the step's peak."""

from __future__ import annotations

import json
import weakref
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from microbatch.cli import main
from microbatch.errors import ConfigError
from microbatch.hardware import get_accelerator
from microbatch.model import get_model
from microbatch.predict.activations import loss_backward_bytes, output_activation_bytes
from microbatch.predict.calibrate import Calibration
from microbatch.predict.memory import MemoryConfig, estimate_memory
from microbatch.predict.plan import PlanConfig, make_plan
from microbatch.show.export import export_plan

SHAPE = get_model("llama-3.2-1b").with_seq(1024)
H200 = get_accelerator("h200")


class _LiveStorages(TorchDispatchMode):
    """Bytes of every tensor storage an op creates, alive until its last reference goes (weak references): the
    memory a step holds, taken from the tensors' lifetimes, not from any formula."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.now = 0
        self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                key = st.data_ptr()
                if key and key not in self.live:
                    self.live[key] = st.nbytes()
                    self.now += st.nbytes()
                    self.peak = max(self.peak, self.now)
                    weakref.finalize(st, self._free, key)
        return out

    def _free(self, key: int) -> None:
        self.now -= self.live.pop(key, 0)


@pytest.mark.parametrize("upcast", [True, False])
def test_eager_cross_entropy_holds_two_more_copies_in_its_backward(upcast: bool) -> None:
    """Measured: the logits F.cross_entropy keeps after the forward, and what its backward adds over them, equal the
    output term's logits and :func:`loss_backward_bytes` (fp32 after an upcast, bf16 taken as they are)."""
    rows, h, vocab = 2048, 32, 3000
    x = torch.randn(rows, h, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(vocab, h, dtype=torch.bfloat16, requires_grad=True)
    y = torch.randint(0, vocab, (rows,))
    track = _LiveStorages()
    with track:
        logits = F.linear(x, w)
        before = track.now - logits.untyped_storage().nbytes()  # what the projection keeps (its inputs)
        loss = F.cross_entropy(logits.float() if upcast else logits, y)
        del logits
        kept = track.now - before
        loss.backward()
    shape = get_model("tiny").with_seq(rows)
    shape = replace(shape, vocab=vocab)
    lb = 4 if upcast else 2
    logit_term = output_activation_bytes(shape, 1, logits_bytes=lb) - output_activation_bytes(
        shape, 1, logits_bytes=0
    )
    assert kept == pytest.approx(logit_term, rel=0.01)  # + the scalar loss and the 1-D statistics
    assert track.peak - kept == pytest.approx(
        loss_backward_bytes(shape, 1, logits_bytes=lb, loss_kernel="eager"), rel=0.01
    )
    assert loss_backward_bytes(shape, 1, logits_bytes=lb, loss_kernel="fused") == 0.0


def test_memory_adds_the_transient_once_on_the_stage_with_the_loss() -> None:
    """By hand: 2 · 4 B · s · b · V / t on the last stage only, not once per micro-batch in flight; under full
    recompute the larger of it and the recompute working set counts (they come at different moments)."""
    kw = dict(micro_batch=2, pipeline_parallel=2, microbatches=8, tensor_parallel=2, schedule="gpipe")
    fused = estimate_memory(SHAPE, MemoryConfig(**kw))
    eager = estimate_memory(SHAPE, MemoryConfig(**kw, loss_kernel="eager"))
    by_hand = 2 * 4 * 1024 * 2 * SHAPE.vocab / 2
    assert eager.stages[0].activations_bytes == fused.stages[0].activations_bytes
    assert eager.stages[1].activations_bytes - fused.stages[1].activations_bytes == pytest.approx(by_hand)
    assert eager.stages[1].activation_terms["loss_backward"] == pytest.approx(by_hand)
    assert (
        eager.stages[1].in_flight == 8
    )  # GPipe's held micro-batches keep logits; one backward runs at a time
    full = estimate_memory(SHAPE, MemoryConfig(**kw, recompute="full"))
    full_eager = estimate_memory(SHAPE, MemoryConfig(**kw, recompute="full", loss_kernel="eager"))
    working = full.stages[1].activation_terms["recompute_working"]
    gap = full_eager.stages[1].activations_bytes - full.stages[1].activations_bytes
    assert gap == pytest.approx(max(0.0, by_hand - working))


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_the_planner_prices_the_loss_as_estimate_memory_does(recompute: str) -> None:
    base = dict(
        shape=SHAPE, gpu=H200, global_batch=16, pipeline_parallel=2, micro_batches=(2,), recompute=(recompute,),
        schedules=("1f1b",), zero=(0,), choose="fastest", memory_headroom=0.0,
    )  # fmt: skip
    for kernel in ("fused", "eager"):
        cand = make_plan(PlanConfig(**base, loss_kernel=kernel)).fastest
        assert cand is not None
        est = estimate_memory(
            SHAPE,
            MemoryConfig(
                micro_batch=2, pipeline_parallel=2, microbatches=cand.microbatches, schedule="1f1b",
                recompute=recompute, loss_kernel=kernel,
            ),
        )  # fmt: skip
        assert cand.peak_memory_bytes == pytest.approx(est.peak_bytes, rel=1e-9)
    assert PlanConfig(**base, loss_kernel="eager").to_dict()["loss_kernel"] == "eager"


def test_an_unknown_kernel_is_refused_with_the_choices(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError, match="loss_kernel 'liger' is not known; use fused .*; or eager"):
        MemoryConfig(micro_batch=1, loss_kernel="liger")
    with pytest.raises(ConfigError, match="loss_kernel 'liger'"):
        PlanConfig(shape=SHAPE, gpu=H200, global_batch=8, loss_kernel="liger")
    assert main(["memory", "--model", "llama-3.2-1b", "-b", "1", "--loss-kernel", "liger"]) == 2
    assert "'liger' is not one of 'fused', 'eager'" in capsys.readouterr().err


def _calibration_file(tmp_path: Path, **extra: Any) -> Path:
    """A saved calibration of llama-3.2-1b (activations × 1.5, 1 GiB fixed), with ``extra`` fields."""
    cal = Calibration.from_dict({
        "kind": "calibration", "memory": {"activation_scale": 1.5, "fixed_bytes": 2.0**30}, "efficiency": None,
        "accelerator": "", "peak_flops": 0.0, "model": "llama-3.2-1b",
        "shape": {k: v for k, v in SHAPE.to_dict().items() if k != "param_count"}, "seq": 1024,
        "precision": "bf16-mixed", "checkpointing": False, "device": "cuda", "micro_batches": [1, 2, 4],
    })  # fmt: skip
    d = cal.to_dict()
    assert d["loss_kernel"] == "fused"  # a file saved before the field was fitted on the fused line
    d.update(extra)
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(d))
    return path


def test_a_calibrated_memory_prices_the_loss_its_calibration_measured(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "old").mkdir()
    (tmp_path / "new").mkdir()
    old = _calibration_file(tmp_path / "old")
    new = _calibration_file(tmp_path / "new", loss_kernel="eager")
    args = ["memory", "--model", "llama-3.2-1b", "--seq", "1024", "-b", "2", "--json"]

    def peak(*more: str) -> float:
        assert main([*args, *more]) == 0
        return float(json.loads(capsys.readouterr().out)["peak_memory_bytes"])

    by_hand = 1.5 * 2 * 4 * 1024 * 2 * SHAPE.vocab  # scaled like every activation term
    assert peak("--calibration", str(new)) - peak("--calibration", str(old)) == pytest.approx(
        by_hand, rel=1e-9
    )
    assert peak("--calibration", str(new), "--loss-kernel", "fused") == peak("--calibration", str(old))
    assert peak("--loss-kernel", "eager") - peak() == pytest.approx(by_hand / 1.5, rel=1e-9)


def test_a_fit_from_measurements_is_on_the_eager_line() -> None:
    from microbatch.predict.calibrate import calibrate
    from microbatch.predict.memory_fit import analytic_memory_line
    from microbatch.records import MeasuredPoint, Measurements

    static, a = analytic_memory_line(SHAPE, seq=1024)
    pts = [
        MeasuredPoint(micro_batch=b, step_time_s=None, peak_memory_bytes=static + 2.0 * a * b)
        for b in (1, 2, 4)
    ]
    meas = Measurements(
        model="llama-3.2-1b",
        shape=SHAPE,
        precision="bf16-mixed",
        checkpointing=False,
        device="cuda",
        points=tuple(pts),
    )
    cal = calibrate(meas, None)
    assert cal.loss_kernel == "eager" and cal.memory.activation_scale == pytest.approx(2.0)
    assert Calibration.from_dict(cal.to_dict()).loss_kernel == "eager"


def test_the_hugging_face_export_names_the_eager_loss_a_fused_plan_left_out() -> None:
    plan = make_plan(
        PlanConfig(shape=SHAPE, gpu=H200, global_batch=16, micro_batches=(4,), recompute=("none",), zero=(0,))
    ).to_dict()
    hf = export_plan(plan, "hf")
    assert any("loss_kernel eager" in n for n in hf.notes)
    eager = make_plan(
        PlanConfig(
            shape=SHAPE, gpu=H200, global_batch=16, micro_batches=(4,), recompute=("none",), zero=(0,),
            loss_kernel="eager",
        )
    ).to_dict()  # fmt: skip
    assert not any("loss_kernel" in n for n in export_plan(eager, "hf").notes)
    assert not any("loss_kernel" in n for n in export_plan(plan, "deepspeed").notes)


def test_torchtitan_without_compile_runs_an_eager_loss_and_the_texts_name_the_kernel(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from microbatch.predict.gemm import COMPILED_NORM_MEMORY, DEFAULT_EFFICIENCY

    base = dict(shape=SHAPE, gpu=H200, global_batch=16, data_parallel=2, micro_batches=(4,), zero=(3,))
    eager_loop = make_plan(PlanConfig(**base)).to_dict()
    assert any("torchtitan's loss without compile" in n for n in export_plan(eager_loop, "torchtitan").notes)
    compiled = replace(DEFAULT_EFFICIENCY, fused_elementwise=True, fused_norm_memory=COMPILED_NORM_MEMORY)
    titan = export_plan(make_plan(PlanConfig(**base, efficiency=compiled)).to_dict(), "torchtitan")
    assert not any("loss_kernel" in n for n in titan.notes)  # its loss compiled with the model
    assert main(["memory", "--model", "llama-3.2-1b", "-b", "1", "--loss-kernel", "eager"]) == 0
    assert "eager loss" in capsys.readouterr().out
