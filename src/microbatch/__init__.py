"""microbatch: choose and run micro-batching for PyTorch.

``B_global = b_m × g × d``. The global batch is a statistical choice; the micro-batch is a
physical one. This package predicts memory and step time, measures the real throughput and
memory curve, chooses the knee and the number of pipeline micro-batches, runs the choice
(exact gradient accumulation, pipeline-parallel training) and shows it.

Layers, bottom up (each imports only from itself and the layers below; see CONTRIBUTING.md):
core (``errors``, ``batch``, ``model``, ``hardware``, ``units``, ``records``) →
``schedules`` → ``predict`` / ``measure`` → ``choose`` → ``run`` → ``integrations`` →
``show`` → ``commands`` / ``cli``.

Importing the package is cheap: torch, numpy and matplotlib are imported only by the modules
that need them, and the public functions and types below load their module on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Public name -> module that defines it (loaded lazily, so `import microbatch` stays fast).
_LAZY = {
    "BatchConfig": "batch",
    "solve": "batch",
    "accumulate": "run.accumulate.exact",
    "MicroBatchController": "run.accumulate.controller",
    "tune": "choose.tune.entry",
    "recommend": "choose.knee",
    "plan": "predict.plan",
    "estimate_memory": "predict.memory",
    "simulate": "schedules.simulate",
    "run_pipeline": "run.pipeline.launch",
    # the config and result types the functions above take and return
    "ModelShape": "shape",
    "Accelerator": "hardware",
    "TimingConfig": "measure.timing",
    "ProbeConfig": "choose.tune.config",
    "SearchConfig": "choose.tune.config",
    "ChoiceConfig": "choose.config",
    "Measurement": "measure.probes",
    "TuneResult": "choose.result",
    "CurvePoint": "choose.curve",
    "Recommendation": "choose.knee",
    "PlanConfig": "predict.plan_config",
    "Plan": "predict.plan",
    "MemoryConfig": "predict.memory_config",
    "MemoryCalibration": "predict.memory_config",
    "MemoryEstimate": "predict.memory_estimate",
    "Schedule": "schedules.action",
    "SimResult": "schedules.simulate",
    "PipelineConfig": "run.pipeline.config",
    "PipelineReport": "run.pipeline.report",
    "GradientNoiseScale": "run.noise",
}
# The public name when it differs from the name in its module.
_RENAMED = {"plan": "make_plan"}

if TYPE_CHECKING:  # the same names, for type checkers (py.typed): __getattr__ below returns Any
    from microbatch.batch import BatchConfig as BatchConfig
    from microbatch.batch import solve as solve
    from microbatch.choose.config import ChoiceConfig as ChoiceConfig
    from microbatch.choose.curve import CurvePoint as CurvePoint
    from microbatch.choose.knee import Recommendation as Recommendation
    from microbatch.choose.knee import recommend as recommend
    from microbatch.choose.result import TuneResult as TuneResult
    from microbatch.choose.tune.config import ProbeConfig as ProbeConfig
    from microbatch.choose.tune.config import SearchConfig as SearchConfig
    from microbatch.choose.tune.entry import tune as tune
    from microbatch.hardware import Accelerator as Accelerator
    from microbatch.measure.probes import Measurement as Measurement
    from microbatch.measure.timing import TimingConfig as TimingConfig
    from microbatch.predict.memory import estimate_memory as estimate_memory
    from microbatch.predict.memory_config import MemoryCalibration as MemoryCalibration
    from microbatch.predict.memory_config import MemoryConfig as MemoryConfig
    from microbatch.predict.memory_estimate import MemoryEstimate as MemoryEstimate
    from microbatch.predict.plan import Plan as Plan
    from microbatch.predict.plan import make_plan as plan  # noqa: F401 (public as plan; __all__ is built from _LAZY)
    from microbatch.predict.plan_config import PlanConfig as PlanConfig
    from microbatch.run.accumulate.controller import MicroBatchController as MicroBatchController
    from microbatch.run.accumulate.exact import accumulate as accumulate
    from microbatch.run.noise import GradientNoiseScale as GradientNoiseScale
    from microbatch.run.pipeline.config import PipelineConfig as PipelineConfig
    from microbatch.run.pipeline.launch import run_pipeline as run_pipeline
    from microbatch.run.pipeline.report import PipelineReport as PipelineReport
    from microbatch.schedules.action import Schedule as Schedule
    from microbatch.schedules.simulate import SimResult as SimResult
    from microbatch.schedules.simulate import simulate as simulate
    from microbatch.shape import ModelShape as ModelShape

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'microbatch' has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{mod}"), _RENAMED.get(name, name))


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_LAZY))
