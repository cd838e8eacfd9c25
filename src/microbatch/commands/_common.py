"""Options and output helpers shared by the commands."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import click

from microbatch.batch import MAX_BATCH
from microbatch.commands._answer import emit
from microbatch.commands._outputs import (
    check_out_dir,
    check_output_file,
    command_name,
    force_option,
    keep_beside,
    keep_result,
    same_file,
    write_result,
)
from microbatch.errors import ConfigError
from microbatch.precision import FP8_RECIPES
from microbatch.schedules.registry import schedule_names

if TYPE_CHECKING:
    from microbatch.choose.config import ChoiceConfig
    from microbatch.model import ModelShape

__all__ = [
    "json_option",
    "stages_option",
    "command_name",
    "emit",
    "write_result",
    "check_out_dir",
    "keep_result",
    "keep_beside",
    "check_output_file",
    "MAX_BATCH",
    "check_batch_bound",
    "force_option",
    "same_file",
    "flags_for",
    "progress",
    "option_group",
    "model_options",
    "resolve_model",
    "choice_options",
    "choice_config",
    "parse_split",
    "zero_choice",
    "parse_zero",
    "SCHEDULE_HELP",
    "microbatches_option",
    "virtual_option",
    "width_option",
    "use_color",
]

F = TypeVar("F", bound=Callable[..., Any])

json_option = click.option("--json", "as_json", is_flag=True, help="Print one JSON object for scripts.")


def check_batch_bound(ctx: click.Context, param: click.Parameter, value: int | None) -> int | None:
    """Click callback of a batch flag: refuse a value over :data:`MAX_BATCH` (usage error, exit 2,
    one line with the value, the rule and the fix)."""
    if value is not None and value > MAX_BATCH:
        raise click.BadParameter(
            f"{value:,} is over the limit of {MAX_BATCH:,} sequences (the choices enumerate divisors, so time "
            f"grows with the batch; published global batches are below 100,000); give {MAX_BATCH:,} or less",
            ctx=ctx,
            param=param,
        )
    return value


def stages_option(required: bool = True, default: int | None = None) -> Callable[[F], F]:
    """``--stages`` with ``--pipeline-parallel`` as another name (every command accepts both). No ``default`` given:
    none is passed to click, whose 8.2 takes an explicit ``default=None`` as a value and let a missing required
    ``--stages`` through to a check that said "got None" (a fuzzer's run)."""
    given: dict[str, Any] = {} if default is None else {"default": default}
    return click.option(
        "--stages",
        "--pipeline-parallel",
        "-p",
        "stages",
        type=int,
        required=required and default is None,
        help="Pipeline stages p (ranks). --pipeline-parallel is the same option.",
        **given,
    )


class flags_for:  # noqa: N801 - used as a context manager, named like one
    """Context manager: a ConfigError that carries no parameter names but whose message starts with a
    config field's name (``threads must be ...``) is raised again carrying that name, so the CLI writes
    it as the flag (``--threads must be ...``, :func:`microbatch.commands._flags.cli_message`)."""

    def __init__(self, *fields: str) -> None:
        self.fields = fields

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        if isinstance(exc, ConfigError) and type(exc) is ConfigError and not exc.params:
            text = str(exc)
            for field in sorted(self.fields, key=len, reverse=True):
                if text.startswith(field + " ") or text.startswith(field.replace("_", " ") + " "):
                    plain = field if text.startswith(field + " ") else field.replace("_", " ")
                    raise ConfigError(field + text[len(plain) :], params=(field,)) from None


def progress(text: str) -> None:
    """One line of progress on stderr (a terminal or not: scripted and CI runs are not silent); a stderr that cannot
    take it (a full disk behind ``2>log``) costs the line, not the work."""
    try:
        click.echo(text, err=True)
    except (OSError, ValueError):
        pass


def option_group(
    f: Callable[..., Any], key: str, names: Sequence[str], opts: Sequence[Callable[..., Any]]
) -> Callable[..., Any]:
    """Add the click options ``opts`` to the command ``f``, which receives the values of the
    parameters ``names`` as one keyword argument ``key`` (a dict) instead of one each."""
    import functools

    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        kwargs[key] = {k: kwargs.pop(k, None) for k in names}
        return f(*args, **kwargs)

    for opt in reversed(opts):
        wrapper = opt(wrapper)
    return wrapper


MODEL_FLAGS = ("model", "hf_config", "layers", "hidden", "heads", "head_size", "kv_heads", "ffn_hidden", "vocab", "seq")  # fmt: skip
"""Parameters :func:`model_options` adds; the command receives them as one dict, ``model_spec``."""


def model_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """Add the model options: ``--model NAME``, ``--hf-config PATH`` and the shape flags.

    The command receives one keyword argument ``model_spec`` (a dict of the ten values) and calls
    :func:`resolve_model` on it::

        @click.command("tune")
        @model_options
        def cmd(model_spec, ...):
            shape = resolve_model(model_spec, default="small")
    """
    opts = [
        click.option(
            "--model", "model", help="A registry model name (gpt2, llama-2-7b, megatron-530b, tiny, ...)."
        ),
        click.option(
            "--hf-config", "hf_config", type=click.Path(dir_okay=True), help="A Hugging Face config.json."
        ),
        click.option("--layers", type=int, help="L: transformer layers (shape flag)."),
        click.option("--hidden", type=int, help="h: hidden size (shape flag)."),
        click.option("--heads", type=int, help="a: attention heads (shape flag)."),
        click.option("--head-size", "head_size", type=int, help="d_h: one head's width (default h/a)."),
        click.option("--kv-heads", "kv_heads", type=int, help="Key/value heads (grouped-query attention)."),
        click.option("--ffn-hidden", "ffn_hidden", type=int, help="MLP inner width (default 4h)."),
        click.option("--vocab", type=int, help="V: vocabulary size (shape flag)."),
        click.option("--seq", type=int, help="s: sequence length (overrides the model's)."),
    ]
    return option_group(f, "model_spec", MODEL_FLAGS, opts)


MOE_FLAGS = (
    "experts", "top_k", "expert_ffn_hidden", "shared_experts", "expert_parallel", "capacity_factor", "context_parallel",
    "fp8_recipe", "recompute_every", "shard_degree",
)  # fmt: skip
"""Parameters :func:`moe_options` adds (``plan`` and ``memory``); the command receives them as ``moe_spec``."""


def moe_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """The mixture-of-experts flags of ``plan`` and ``memory``: the expert shape (E, K, F, S: set or override
    the model's experts, :func:`microbatch.moe.with_expert_flags`), expert parallelism EP (``-e``, inside the
    data-parallel group) and the capacity factor (default dropless). Split the dict with :func:`moe_split`."""
    opts = [
        click.option(
            "--experts", type=int, help="E: routed experts per MoE layer (with --top-k on a dense model)."
        ),
        click.option("--top-k", "top_k", type=int, help="K: routed experts each token visits."),
        click.option("--expert-ffn-hidden", "expert_ffn_hidden", type=int, help="F: one expert's MLP width."),
        click.option("--shared-experts", "shared_experts", type=int, help="S: experts every token visits."),
        click.option(
            "--expert-parallel",
            "-e",
            "expert_parallel",
            type=int,
            default=1,
            show_default=True,
            help="EP: GPUs the experts are spread over, inside the data-parallel group (divides d and E).",
        ),  # fmt: skip
        click.option(
            "--capacity-factor",
            "capacity_factor",
            type=float,
            help="Expert buffers padded to this × the balanced share (tokens over it dropped); default dropless.",
        ),  # fmt: skip
        click.option(
            "--context-parallel",
            "-c",
            "context_parallel",
            type=int,
            default=1,
            show_default=True,
            help="c: GPUs each sequence is split over (K/V exchanged, see plan --cp-comm); GPUs = t·p·d·c, 2c divides s.",
        ),  # fmt: skip
        click.option(
            "--fp8-recipe",
            "fp8_recipe",
            type=click.Choice(list(FP8_RECIPES)),
            default=None,
            help="With --precision fp8: torchao's one scale per tensor or per row, or Transformer Engine's delayed "
            "or current scaling (weights cast once a step, the linear layers' saved inputs kept in FP8).  "
            "[default: tensorwise]",
        ),  # fmt: skip
        click.option(
            "--shard-degree",
            "shard_degree",
            type=int,
            metavar="N",
            help="Hybrid sharding (HSDP) with ZeRO >= 1: state sharded inside groups of N of the d ranks (with "
            "their -c ranks), the d/N groups all-reduce their gradient shards (FSDP HYBRID_SHARD; torchtitan "
            "data_parallel_shard_degree); N divides d; not with -e.",
        ),  # fmt: skip
        click.option(
            "--recompute-every",
            "recompute_every",
            type=int,
            default=1,
            show_default=True,
            help="K: full recompute of one layer in K (with --recompute full; torchtitan's selective_ac_option).",
        ),  # fmt: skip
    ]
    return option_group(f, "moe_spec", MOE_FLAGS, opts)


def moe_split(moe_spec: Mapping[str, Any], precision: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(shape flags for :func:`resolve_model`, layout keywords for MemoryConfig / PlanConfig); an FP8 recipe
    given without ``--precision fp8`` is refused (it would be ignored)."""
    if moe_spec.get("fp8_recipe") and precision != "fp8":
        raise ConfigError(f"--fp8-recipe {moe_spec['fp8_recipe']} scales FP8 GEMMs, and --precision {precision} "
                          "runs none; give --precision fp8 with it, or drop --fp8-recipe")  # fmt: skip
    shape = {k: moe_spec.get(k) for k in MOE_FLAGS[:4]}

    def given(key: str) -> Any:  # 0 is refused by the configs' checks (it read as 1 through ``or``)
        value = moe_spec.get(key)
        return 1 if value is None else value

    return shape, {
        "expert_parallel": given("expert_parallel"),
        "capacity_factor": moe_spec.get("capacity_factor"),
        "context_parallel": given("context_parallel"),
        "fp8_recipe": moe_spec.get("fp8_recipe") or "tensorwise",
        "recompute_every": given("recompute_every"),
        "shard_degree": moe_spec.get("shard_degree"),
    }


def resolve_model(spec: Mapping[str, Any], default: str | None = None) -> ModelShape:
    """The :class:`~microbatch.model.ModelShape` that ``model_spec`` names.

    ``--model`` or ``--hf-config`` (shape flags given with them override fields), or the shape
    flags alone; with none of them, the ``default`` registry model (a ConfigError if None).
    """
    from microbatch.model import resolve_model as _resolve

    rest = dict(spec)
    model, hf = rest.pop("model", None), rest.pop("hf_config", None)
    if model is None and hf is None and default is not None and all(v is None for v in rest.values()):
        model = default
    elif model is None and hf is None and default is not None and rest.get("layers") is None:
        model = default  # only --seq (or similar) given: override the default model's field
    return _resolve(model, hf, **rest)


CHOICE_FLAGS = (
    "memory_budget",
    "memory_headroom",
    "max_latency_ms",
    "rule",
    "tolerance",
    "reference",
    "global_batch",
    "data_parallel",
)
"""Parameters :func:`choice_options` adds; the command receives them as one dict, ``choice_spec``.
Each is the :class:`~microbatch.choose.config.ChoiceConfig` field of the same name, except
``--memory-budget`` (a size such as ``12GiB``), which becomes ``memory_budget_bytes``."""


def choice_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """The options that turn a curve into a choice (shared by ``tune`` and ``recommend``).

    The command receives one keyword argument ``choice_spec`` (a dict of the eight values) and
    passes it to :func:`choice_config`.
    """
    from microbatch.choose.bound import BOUND_MARGIN, BOUND_SLACK, BOUND_WINDOW
    from microbatch.choose.config import DEFAULT_TOLERANCE

    opts = [
        click.option(
            "--memory-budget",
            help="Memory per device the choice must fit, e.g. 12GiB, 500MB (default: none; tune uses the device's total memory on CUDA, 80% of the available memory on the CPU).",
        ),
        click.option(
            "--memory-headroom",
            type=float,
            default=None,
            help="Share of the budget kept free when predicting the largest fitting b_m (default 0.10).",
        ),
        click.option(
            "--max-latency-ms",
            type=float,
            help="Drop points whose step (decode: per-token) time exceeds this.",
        ),
        click.option(
            "--rule",
            type=click.Choice(["fraction", "gain"]),
            default="fraction",
            show_default=True,
            help="fraction: smallest b_m within the tolerance of the best; gain: stop when a doubling gains < tolerance.",
        ),
        click.option(
            "--tolerance",
            type=float,
            default=DEFAULT_TOLERANCE,
            show_default=True,
            help="Tolerance τ of the rule.",
        ),
        click.option(
            "--reference",
            type=click.Choice(["measured", "bound"]),
            default=None,
            help="What 'best' is for rule fraction. measured: the best measured throughput. bound: also "
            f"the most any larger b_m can reach, 1/slope of a line fitted to step time over the {BOUND_WINDOW} "
            "largest b_m (the roofline makes step time convex in b_m, so no larger b_m beats it), when "
            f"every point is within {100 * BOUND_SLACK:g}% of that line; a point is then within τ of the "
            "bound only with a margin for the fit's error (two standard errors of its slope; "
            f"{100 * BOUND_MARGIN:g}% when no line fits). "
            "Default: bound for tune (it stops early, so it must answer for what it did not measure), "
            "measured for recommend (a curve given whole is taken as the truth).",
        ),
        click.option(
            "--global-batch",
            "-B",
            type=int,
            callback=check_batch_bound,
            help="B_global: the knee is chosen among the b_m with b_m × d dividing it, and g = B / (b_m × d) "
            "reported; tune probes only those b_m.",
        ),
        click.option(
            "--data-parallel",
            "-d",
            type=int,
            default=1,
            show_default=True,
            callback=check_batch_bound,
            help="d: data-parallel replicas.",
        ),
    ]
    return option_group(f, "choice_spec", CHOICE_FLAGS, opts)


def choice_config(choice_spec: Mapping[str, Any]) -> ChoiceConfig:
    """The :class:`~microbatch.choose.config.ChoiceConfig` of the shared options (``choice_spec``):
    flags not given keep the config's defaults (``--reference``: the command's own default)."""
    from microbatch.choose.config import ChoiceConfig
    from microbatch.units import parse_bytes

    values = {k: v for k, v in choice_spec.items() if v is not None and k != "memory_budget"}
    budget = choice_spec.get("memory_budget")
    if budget is not None:
        values["memory_budget_bytes"] = parse_bytes(budget)
    return ChoiceConfig(**values)


def parse_split(text: str | None) -> tuple[int, ...] | None:
    """``--layers-per-stage 5,6,6,5`` as a tuple; None when not given."""
    if text is None:
        return None
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ConfigError(
            f"--layers-per-stage {text!r} must be whole numbers separated by commas, e.g. 5,6,6,5"
        ) from None


def zero_choice() -> click.Choice[str]:
    """The ``--zero`` choices: 0–3, or dist-opt (Megatron's distributed optimizer, = 1)."""
    return click.Choice(["0", "1", "2", "3", "dist-opt"])


def parse_zero(text: str) -> int:
    """``dist-opt`` (Megatron's distributed optimizer) shards what ZeRO-1 shards."""
    return 1 if text == "dist-opt" else int(text)


SCHEDULE_HELP = (
    "Schedule: "
    + ", ".join(schedule_names())
    + " (aliases: "
    + ", ".join(a for a in schedule_names(aliases=True) if a not in schedule_names())
    + "; the registry of microbatch.schedules.registry)."
)
"""The ``--schedule`` help of ``bubble`` and ``simulate``: every registered name, read from the registry."""


def microbatches_option(f: F) -> F:
    """``--microbatches`` / ``-m``, required."""
    return click.option(
        "--microbatches", "-m", type=int, required=True, help="m: micro-batches per pipeline flush."
    )(f)


def virtual_option(f: F) -> F:
    """``--virtual`` / ``-v``: v stages per rank, default 1 (``-v`` as plan, memory and pipeline spell it)."""
    return click.option("--virtual", "-v", type=int, default=1, show_default=True, help=VIRTUAL_HELP)(f)


VIRTUAL_HELP = "v: virtual stages (model chunks) per rank."


MIN_DIAGRAM_WIDTH = 10
"""Fewest columns a terminal diagram's time axis can use (:func:`microbatch.show.text.render_timeline_text`
widens anything narrower to 10)."""


def check_width(ctx: click.Context, param: click.Parameter, value: int) -> int:
    """``--width`` callback: at least :data:`MIN_DIAGRAM_WIDTH` columns, else click's usage error
    (exit 2, one line) with the value, the rule and the fix. Any command's ``--width`` can take it
    (``callback=check_width``)."""
    if value < MIN_DIAGRAM_WIDTH:
        raise click.BadParameter(
            f"{value} columns is below the diagram's minimum of {MIN_DIAGRAM_WIDTH}; give --width "
            f"{MIN_DIAGRAM_WIDTH} or more (default 100)",
            ctx=ctx,
            param=param,
        )
    return value


def width_option(f: F) -> F:
    """``--width``: columns of the diagram's time axis, checked by :func:`check_width`."""
    return click.option(
        "--width",
        type=int,
        default=100,
        show_default=True,
        callback=check_width,
        help=f"Most columns the diagram's time axis may use (at least {MIN_DIAGRAM_WIDTH}).",
    )(f)


def use_color() -> bool:
    """Colour only on a terminal, and never when NO_COLOR is set (https://no-color.org)."""
    if os.environ.get("NO_COLOR"):
        return False
    return bool(getattr(sys.stdout, "isatty", lambda: False)())
