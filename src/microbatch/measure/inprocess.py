"""Probes in this process: the probe type the tuner takes, its fixed bytes, and the prober that runs it where
out-of-memory is an exception (CUDA, or a user's own model). Split from :mod:`microbatch.measure.probes`."""

from __future__ import annotations

from microbatch.errors import ConfigError
from microbatch.measure.device import oom_types
from microbatch.measure.probes import DecodeProbe, Measurement, TrainProbe

__all__ = ["Probe", "static_bytes", "InProcessProber"]

Probe = TrainProbe | DecodeProbe
"""A probe in this process: what :func:`microbatch.measure.spec.build_probe` returns."""


def static_bytes(probe: Probe) -> int:
    """Bytes a training probe holds before any activation: weights + gradients + Adam's two moments."""
    n = sum(p.numel() * p.element_size() for p in probe.model.parameters())
    return int(n) * (4 if isinstance(probe, TrainProbe) else 1)


class InProcessProber:
    """Probes in this process (CUDA, where OOM is an exception, or a user's own model): what tune calls."""

    def __init__(self, probe: Probe, *, setup_size: int = 1) -> None:
        self.probe = probe
        """The probe run for each micro-batch size."""
        self.peak_before_bytes: int | None = None
        """Peak memory before the first probe: not measured in process (None)."""
        self.setup_size = setup_size
        """Rows of the set-up step (the search's first micro-batch: a model whose step needs two rows, BatchNorm in
        training or an in-batch contrastive loss, is tuned from ``start`` 2)."""

    def start(self) -> None:
        if getattr(self.probe, "ready", True):
            return
        try:
            self.probe.setup(self.setup_size)
        except Exception as e:  # the user's own error, its traceback kept: say where it came from
            if not isinstance(e, oom_types()):
                hint = (
                    "; a model whose training step needs more rows (BatchNorm, an in-batch contrastive loss) is tuned "
                    "from start=2 or more"
                    if self.setup_size == 1
                    and not isinstance(e, ConfigError)  # our own message names its fix
                    else ""
                )
                e.add_note(
                    f"microbatch: raised by tune's set-up step at micro-batch {self.setup_size} (one forward, backward "
                    f"and optimizer step, so the optimizer's state exists before the probes){hint}"
                )
            raise

    def measure(self, micro_batch: int, *, checkpointing: bool = False) -> Measurement:
        self.probe.set_checkpointing(checkpointing)
        return self.probe.measure(micro_batch)

    def close(self) -> None:
        pass
