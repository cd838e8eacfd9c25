"""A probe described as plain data (:class:`ProbeSpec`) and built from it (:func:`build_probe`).

The description names the model (a registry name, a shape, or a Hugging Face ``config.json``),
the sequence length, the mode (training or decoding), the device, the precision and the timing;
it travels as JSON, so the child process of :mod:`microbatch.measure.childprobe` rebuilds the
same probe. Models are built with random weights: the built-in GPT
(:mod:`microbatch.measure.gpt`) or a transformers model (:mod:`microbatch.measure.hf`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from microbatch.batch import grad_accum_for
from microbatch.errors import ConfigError, plain_numbers
from microbatch.measure.hf import hf_config_from_shape, hf_model, load_hf_config
from microbatch.measure.inprocess import Probe
from microbatch.measure.probes import DecodeProbe, Measurement, TrainProbe
from microbatch.measure.timing import TimingConfig
from microbatch.model import ModelShape, get_model
from microbatch.precision import get_precision

if TYPE_CHECKING:
    import torch

__all__ = ["MODES", "BACKENDS", "ProbeSpec", "build_probe", "measure_once"]

MODES = ("train", "decode")
"""What a probe runs: forward + backward (``train``) or KV-cache decoding (``decode``)."""

BACKENDS = ("builtin", "hf")
"""What builds a registry shape: the built-in GPT or a transformers model."""


@dataclass(frozen=True, kw_only=True)
class ProbeSpec:
    """What to probe, as plain data (so a child process can rebuild it)."""

    model: str | None = None
    """A registry name (``tiny``, ``small``, ``gpt2``…); None with ``hf_config`` or ``shape``."""
    shape: dict[str, Any] | None = None
    """A :class:`~microbatch.model.ModelShape` as a dict (its ``to_dict()``), instead of a name."""
    hf_config: str | None = None
    """Path to a Hugging Face ``config.json`` (or its folder): built with random weights, nothing downloaded."""
    backend: str = "builtin"
    """``builtin`` (microbatch.measure.gpt) or ``hf`` (a transformers model of the registry shape) for ``model``."""
    seq: int
    """Sequence length: the longest the data holds (memory is set by the longest sequence)."""
    mode: str = "train"
    """``train`` (forward + backward) or ``decode`` (KV-cache decoding)."""
    device: str = "cpu"
    """``cpu`` or ``cuda`` (or ``cuda:N``)."""
    precision: str = "fp32"
    """A measurable precision of :mod:`microbatch.precision` (``fp32``, ``bf16-mixed``: autocast, fp32 weights)."""
    timing: TimingConfig = field(default_factory=TimingConfig)
    """Warm-up and repeat limits."""
    new_tokens: int = 32
    """Decoding: tokens decoded after the prefill (at least warm-up + max repeats)."""
    global_batch: int | None = None
    """B_global, to amortise the optimizer step over g = B / (b_m·d)."""
    data_parallel: int = 1
    """d."""
    seed: int = 0
    """Weights and data seed."""
    threads: int | None = None
    """torch intra-op threads in the probe process (None: torch's default). One thread gives
    steadier timings on a CPU shared with other jobs."""

    def __post_init__(self) -> None:
        plain_numbers(self)
        if sum(x is not None for x in (self.model, self.hf_config, self.shape)) != 1:
            raise ConfigError("give exactly one of model or hf_config", params=("model", "hf_config"))
        if isinstance(self.seq, bool) or not isinstance(self.seq, int) or self.seq < 1:
            raise ConfigError(
                f"seq {self.seq!r} must be a whole number >= 1: the longest sequence the data holds"
            )
        if self.mode not in MODES:
            raise ConfigError(f"mode {self.mode!r} is not known; use train or decode")
        get_precision(self.precision, measurable=True)
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend {self.backend!r} is not known; use builtin or hf")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ConfigError(f"device {self.device!r} is not known; use cpu or cuda")
        if self.mode == "decode" and self.seq <= 2:
            raise ConfigError(f"decoding needs seq > 2, got {self.seq}")

    def grad_accum(self, micro_batch: int) -> int | None:
        """g = B_global / (b_m·d) (at least 1), or None without a global batch."""
        if self.global_batch is None:
            return None
        return max(1, grad_accum_for(self.global_batch, micro_batch, self.data_parallel))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ProbeSpec:
        d = dict(d)
        d["timing"] = TimingConfig(**d.get("timing", {}))
        return cls(**d)


def _registry_model(spec: ProbeSpec, device: torch.device) -> tuple[Any, int]:
    """The model of a registry name or shape, and its vocabulary size."""
    import torch

    if spec.shape is not None:
        fields = {k: v for k, v in spec.shape.items() if k in ModelShape.__dataclass_fields__}
        shape = ModelShape(**fields).with_seq(spec.seq)
    else:
        assert spec.model is not None  # narrowed: ProbeSpec holds exactly one of model, shape, hf_config
        shape = get_model(spec.model, seq=spec.seq)
    if shape.learned_positions and spec.seq > shape.positions:
        raise ConfigError(
            f"seq {spec.seq} is longer than {shape.name}'s {shape.positions} learned positions; "
            f"use seq <= {shape.positions}",
            params=("seq",),
        )
    if spec.backend == "hf":
        return hf_model(hf_config_from_shape(shape), torch.float32, device, spec.seed), shape.vocab
    from microbatch.measure.gpt import build_model

    return build_model(shape, seed=spec.seed, device=device), shape.vocab


def build_probe(spec: ProbeSpec) -> Probe:
    """The in-process probe (TrainProbe or DecodeProbe) of ``spec``: model built with random weights."""
    import torch

    device = torch.device(spec.device)
    if spec.model is not None or spec.shape is not None:
        model, vocab = _registry_model(spec, device)
    else:
        assert spec.hf_config is not None  # narrowed: ProbeSpec holds exactly one of model, shape, hf_config
        config = load_hf_config(spec.hf_config)
        vocab = int(getattr(config, "vocab_size", 0) or 0)
        if vocab < 1:
            raise ConfigError(f"hf_config {spec.hf_config!r} has no vocab_size", params=("hf_config",))
        model = hf_model(config, torch.float32, device, spec.seed)
    gen = torch.Generator().manual_seed(spec.seed + 1)
    if spec.mode == "decode":
        return DecodeProbe(
            model,
            vocab=vocab,
            seq=spec.seq,
            new_tokens=spec.new_tokens,
            device=device,
            precision=spec.precision,
            timing=spec.timing,
        )
    hf = not hasattr(model, "decode_step")

    def make_batch(b: int) -> Any:
        t = torch.randint(0, vocab, (b, spec.seq), generator=gen).to(device)
        return {"input_ids": t, "labels": t} if hf else t

    return TrainProbe(
        model,
        make_batch,
        device=device,
        precision=spec.precision,
        timing=spec.timing,
        grad_accum_for=spec.grad_accum,
    )


def measure_once(spec: ProbeSpec, micro_batch: int, *, checkpointing: bool = False) -> Measurement:
    """One probe of ``spec`` in this process (for scripts and tests)."""
    probe = build_probe(spec)
    probe.set_checkpointing(checkpointing)
    return probe.measure(micro_batch)
