"""The configuration of one pipeline-parallel run, validated before any process starts.

:class:`PipelineConfig` names the schedule (through the one registry,
:mod:`microbatch.schedules.registry`, whose torch class and (p, m, v) rules it applies), the sizes,
the model, the numerics and the deadline; :func:`config_from_dict` reads it back from JSON.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any

from microbatch.batch import check_batch_quantity
from microbatch.errors import ConfigError, check_positive, check_positive_int, plain_numbers, whole_number
from microbatch.schedules.registry import (
    MAX_STAGES,
    check_servable,
    get_spec,
    is_builtin,
    schedule_names,
    torch_spec,
)

if TYPE_CHECKING:
    from microbatch.model import ModelShape

__all__ = [
    "FACTORY_SEQ",
    "STARTUP_S",
    "PipelineConfig",
    "builtin_shape",
    "check_enough_layers",
    "config_from_dict",
]

STARTUP_S = 60.0
"""Allowance for starting Python and importing torch in every worker, added to ``timeout_s`` for the
launcher's deadline of a local run (:func:`microbatch.run.pipeline.launch.run_pipeline`)."""

FACTORY_SEQ = 16
"""Tokens per sequence of a ``module:function`` model when ``seq`` is not given (what
:func:`microbatch.run.pipeline.rank.build_full_model` uses)."""


_DEFAULT_TIMEOUT_S = 120.0
""":attr:`PipelineConfig.timeout_s`'s default, named by the error of a bad one."""


def _number(name: str, value: object, example: str) -> float:
    """``value`` if it is a real number (not a bool, not a string of one), else a ConfigError naming ``name`` and
    ``example``."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(
            f"{name} must be a number, got {value!r}; give e.g. {name} {example}", params=(name,)
        )
    return value


@dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    """One pipeline-parallel run: what to split, how to schedule it, for how long."""

    schedule: str = "1f1b"
    """Schedule name or alias from :mod:`microbatch.schedules.registry` that torch can run: gpipe,
    1f1b, interleaved-1f1b, zb-h1, zb-interleaved (torch's ZB1P), zbv or dualpipev. Stored as the
    registry's name of the schedule asked (``zb-h1``, never the name of the class's entry it runs as:
    :attr:`microbatch.run.pipeline.resolved.ResolvedRun.spec` is that one)."""
    stages: int = 2
    """p: pipeline ranks (processes)."""
    microbatches: int = 4
    """m: micro-batches per global batch (per optimizer step)."""
    virtual: int = 1
    """v: stages per rank (interleaved schedules; zbv needs 2). Total stages = p·v."""
    model: str = "tiny"
    """A preset of :mod:`microbatch.model` built by :mod:`microbatch.measure.gpt`, or ``module:function``
    returning a stack of layers (``nn.Sequential`` or embed/layers/head) that maps token ids
    ``(b, s)`` to logits ``(b, s, V)``."""
    global_batch: int | None = None
    """B: sequences per optimizer step; None means one sequence per micro-batch (B = m)."""
    seq: int | None = None
    """s: tokens per sequence; None means the model's default."""
    steps: int = 3
    """N: optimizer steps. Measurements average the steps after the first (warm-up)."""
    backend: str = "gloo"
    """torch.distributed backend: gloo (CPU) or nccl (one GPU per rank)."""
    balance: str = "params"
    """How layers are split into stages: ``params`` (equal parameter counts) or ``time``
    (equal measured forward+backward time per layer, timed on rank 0 and broadcast)."""
    check_gradients: bool = False
    """Compare the gradients after the first step with the unsplit model on the same batch."""
    trace: bool = False
    """Return every compute interval (for ``--trace`` and the timeline drawing)."""
    lr: float = 1e-3
    """Adam learning rate."""
    seed: int = 0
    """Seed of the weights (same on every rank) and of the synthetic token batches."""
    dtype: str = "float32"
    """Parameter dtype: float32, bfloat16 or float16."""
    timeout_s: float = _DEFAULT_TIMEOUT_S
    """Collective timeout of the process group and the launcher's deadline for the whole run."""

    def __post_init__(self) -> None:
        plain_numbers(self)
        if not isinstance(
            self.model, str
        ):  # each rank builds it afresh from its name: an object cannot travel
            raise ConfigError(
                f"model must be a built-in model's name ('small') or 'module:function' (a factory each rank imports), "
                f"got {type(self.model).__name__}; name the model, or write a factory that builds it",
                params=("model",),
            )
        object.__setattr__(self, "schedule", get_spec(self.schedule).name)
        if not is_builtin(self.schedule):  # each rank imports microbatch afresh: it knows the built-ins only
            raise ConfigError(
                f"schedule {self.schedule!r} is registered in this process only; the pipeline's ranks are new processes "
                f"that import microbatch afresh and do not see it; run one of {', '.join(schedule_names(torch=True))}",
                params=("schedule",),
            )
        runner = torch_spec(self.schedule)  # refuses a schedule torch has no class for
        check_positive_int("microbatches", self.microbatches, fix="give microbatches 1 or more")
        check_positive_int("virtual", self.virtual, fix="give virtual 1 or more stages per rank")
        check_positive_int("steps", self.steps, fix="give steps 1 or more")
        if whole_number(self.stages) is None or self.stages < 2:
            raise ConfigError(
                f"stages {self.stages!r} is not a pipeline; pipelining needs p >= 2 (a whole number); give stages 2",
                params=("stages",),
            )
        if self.global_batch is not None:
            check_batch_quantity(
                "global_batch",
                self.global_batch,
                fix=f"give global_batch a multiple of m = {self.microbatches} sequences, or leave it out "
                "for B = m",
            )
            if self.global_batch % self.microbatches:
                m = self.microbatches
                lo, hi = (self.global_batch // m) * m, (self.global_batch // m + 1) * m
                near = ", ".join(str(x) for x in (lo, hi) if x > 0)
                raise ConfigError(
                    f"global batch {self.global_batch} is not divisible by {m} micro-batches; every "
                    f"micro-batch holds B/m whole sequences; nearest valid global batches: {near}"
                )
        if self.seq is not None:
            check_positive_int(
                "seq", self.seq, fix="give seq 1 or more tokens, or leave it out for the model's length"
            )
        if self.backend not in ("gloo", "nccl"):
            raise ConfigError(f"backend {self.backend!r} is not supported; use gloo (CPU) or nccl (GPU)")
        if self.balance not in ("params", "time"):
            raise ConfigError(f"balance {self.balance!r} is not known; use 'params' or 'time'")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype {self.dtype!r} is not supported; use float32, bfloat16 or float16")
        check_positive(
            "timeout_s", _number("timeout_s", self.timeout_s, "120"),
            fix="give timeout_s 10 s or more (the command's default is 300, the library's "
            f"{_DEFAULT_TIMEOUT_S:g}), and a long run's whole length",
        )  # fmt: skip
        check_positive("lr", _number("lr", self.lr, "1e-3"), fix="give Adam's learning rate, e.g. lr 1e-3")
        if whole_number(self.seed) is None:
            raise ConfigError(
                f"seed must be a whole number, got {self.seed!r}; e.g. seed 0", params=("seed",)
            )
        if ":" not in self.model and self.stages <= MAX_STAGES:  # a built-in model: layers before m's rule
            shape = builtin_shape(self.model, self.seq)
            check_enough_layers(
                self, shape.layers + 2, f"model {self.model} has", f"(embedding, {shape.layers} blocks, head)"
            )
        # the schedule's own rule, the one `bubble` applies too (zb-h1's is torch's class's rule at v = 1),
        # then the rule of the class that runs it where that is another entry's
        check_servable(self.schedule, self.stages, self.microbatches, self.virtual)
        if runner.name != self.schedule:
            check_servable(runner.name, self.stages, self.microbatches, self.virtual)

    @property
    def batch(self) -> int:
        """B: sequences per optimizer step."""
        return self.global_batch if self.global_batch is not None else self.microbatches

    @property
    def micro_batch(self) -> int:
        """b_m = B / m sequences per micro-batch."""
        return self.batch // self.microbatches

    @property
    def total_stages(self) -> int:
        """p·v stages in all."""
        return self.stages * self.virtual

    def deadline(self, given_s: float | None = None) -> tuple[float, str]:
        """Seconds the launcher allows a local run, and what they are made of: ``given_s`` (and ``""``),
        or ``timeout_s`` plus :data:`STARTUP_S`."""
        if given_s is not None:
            return given_s, ""
        return (
            self.timeout_s + STARTUP_S,
            f"{self.timeout_s:g} s of timeout_s + {STARTUP_S:.0f} s allowed for start-up",
        )

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict (the form :func:`config_from_dict` reads back)."""
        return asdict(self)


def check_run_args(cfg: object, deadline_s: object) -> None:
    """ConfigError unless ``run_pipeline`` was given a :class:`PipelineConfig` and a deadline of seconds > 0 (or
    None): a dict failed on hashing, a negative deadline in the interval timer."""
    from microbatch.errors import check_instance

    check_instance("cfg", cfg, PipelineConfig, "run_pipeline(PipelineConfig(model='small', stages=2, ...))")
    if deadline_s is not None and (
        isinstance(deadline_s, bool) or not isinstance(deadline_s, int | float) or not 0 < deadline_s < 1e9
    ):
        raise ConfigError(
            f"deadline_s {deadline_s!r} must be seconds > 0 (and below 1e9); give e.g. deadline_s=600, or None for "
            "the config's timeout plus start-up",
            params=("deadline_s",),
        )


def builtin_shape(model: str, seq: int | None) -> ModelShape:
    """The built-in model ``model`` at ``seq`` tokens (None: its own); an unknown name is refused with
    what a pipeline run takes: a preset it builds, or a ``module:function`` factory (it builds the model
    it trains, so a shape or a Hugging Face config.json alone is not enough)."""
    from microbatch.model import PRESETS, get_model

    try:
        return get_model(model, seq=seq)
    except ConfigError:
        pass
    from pathlib import Path

    file = Path(model).is_file()
    raise ConfigError(
        f"model {model!r} is "
        + ("a file, not a preset or a factory" if file else "neither a built-in preset nor module:function")
        + "; the run builds and trains the network itself, so give a built-in preset ("
        + ", ".join(PRESETS)
        + ") or module:function, a function of your module that takes no arguments and returns the network "
        "as a stack of layers (nn.Sequential, or embed/layers/head) mapping token ids (b, s) to logits "
        "(b, s, V); a Hugging Face config.json or a shape alone cannot be trained here",
        params=("model",),
    )


def check_enough_layers(cfg: PipelineConfig, units: int, what: str, detail: str = "") -> None:
    """Refuse p·v stages for a model of ``units`` layers to split (each stage needs at least one);
    ``what``: the model and its verb (``model tiny has``), ``detail``: what the layers are."""
    if cfg.total_stages > units:
        raise ConfigError(
            f"{cfg.total_stages} stages (p·v = {cfg.stages}·{cfg.virtual}) but {what} only {units} layers "
            f"to split{' ' + detail if detail else ''}; each stage needs at least one; use p·v <= {units} or "
            "a deeper model"
        )


def config_from_dict(d: dict[str, Any]) -> PipelineConfig:
    """A :class:`PipelineConfig` from its :meth:`~PipelineConfig.to_dict` form (unknown keys ignored)."""
    names = {f.name for f in fields(PipelineConfig)}
    return PipelineConfig(**{k: v for k, v in d.items() if k in names})
