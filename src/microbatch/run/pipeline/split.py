"""Splitting a model into pipeline stages: its layers, a balanced contiguous split, the stage modules.

:func:`load_factory` imports a ``module:function`` model factory and :func:`inspect_factory` builds
its model once in the launching process (on the meta device where it can), so that a factory that
cannot be imported, called or split is refused before any rank starts. :func:`model_units` lists the layers pipelining may cut between; :func:`balanced_split` cuts a
list of weights (parameter counts from :func:`unit_param_counts`, or measured seconds from
:func:`unit_times_s`) into contiguous groups minimising the heaviest; :func:`split_units` builds the
stage modules. torch is imported inside the functions that need it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import reprlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from microbatch.errors import ConfigError, PipelineError

if TYPE_CHECKING:
    from microbatch.shape import ModelShape

__all__ = [
    "FactoryModel",
    "balanced_split",
    "dropout_modules",
    "inspect_factory",
    "load_factory",
    "model_units",
    "shape_unit_params",
    "split_units",
    "unit_param_counts",
    "unit_times_s",
]

_BUILT_IN = "a built-in model (tiny, small or another preset of microbatch.model)"


def _one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"


@contextlib.contextmanager
def working_folder_first() -> Iterator[None]:
    """The working folder first on ``sys.path`` inside the block, as the ranks have it (they run
    ``python -c``): a factory's module, and what the factory imports when called, resolve as there. What the
    factory's module or the factory prints goes to stderr: stdout is the command's result (one JSON object)."""
    import sys

    here = os.getcwd()
    sys.path.insert(0, here)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.path.remove(here)  # the first occurrence: the one put in above


def load_factory(spec: str) -> Callable[[], Any]:
    """The function ``module:function`` names, imported here, as every rank imports it.

    Raises :class:`ConfigError` naming the module and the fix when the module cannot be imported (or
    raises while importing), has no such attribute, or the attribute cannot be called.
    """
    mod_name, _, fn_name = spec.partition(":")
    if not mod_name or not fn_name:
        raise ConfigError(
            f"model {spec!r} is not module:function; a model factory is named as module:function (for "
            f"example mypkg.models:build); give that, or {_BUILT_IN}"
        )
    try:
        with working_folder_first():
            module = importlib.import_module(mod_name)
    except ImportError as e:
        raise ConfigError(
            f"model factory {spec}: module {mod_name!r} cannot be imported ({_one_line(e)}); install it or put "
            f"its folder on PYTHONPATH (every rank imports it too), or give {_BUILT_IN}"
        ) from None
    except Exception as e:  # the module itself fails while importing
        raise ConfigError(
            f"model factory {spec}: importing module {mod_name!r} raised {_one_line(e)}; fix the module, or "
            f"give {_BUILT_IN}"
        ) from None
    try:
        factory = getattr(module, fn_name)
    except AttributeError:
        raise ConfigError(
            f"model factory {spec}: module {mod_name!r} has no attribute {fn_name!r}; give module:function "
            f"naming a function of {mod_name} that returns a torch.nn.Module"
        ) from None
    if not callable(factory):
        raise ConfigError(
            f"model factory {spec} names {reprlib.repr(factory)} (of type {type(factory).__name__}), which "
            "cannot be called; give module:function naming a function that takes no arguments and returns a "
            "torch.nn.Module"
        )
    return cast("Callable[[], Any]", factory)


@dataclass(frozen=True, kw_only=True)
class FactoryModel:
    """What building a ``module:function`` model in the launching process showed."""

    spec: str
    """The factory, as ``module:function``."""
    params: int
    """Distinct parameters of the model (a tied weight counted once)."""
    units: int
    """Layers pipelining may cut between (:func:`model_units`)."""
    vocab: int
    """Vocabulary: ``num_embeddings`` of the model's first ``nn.Embedding`` (token ids are drawn below it)."""
    meta: bool
    """True when it was built on the meta device (no memory, no weights initialised)."""
    largest: int = 0
    """Elements of its largest parameter tensor (the host check's optimizer temporaries on the CPU)."""


def inspect_factory(spec: str) -> FactoryModel:
    """Import the factory ``spec`` names, call it once here and check what it returns.

    It is called on the meta device (shapes without memory); a factory that cannot build there (it
    loads weights, moves tensors to a device) is called again for real. The rules each rank relies on:
    it takes no arguments, returns a ``torch.nn.Module`` that :func:`model_units` can split, holding an
    ``nn.Embedding`` for the token ids. Raises :class:`ConfigError` naming the factory, what it did or
    returned, and the fix. Cached per ``spec``: the launcher checks it more than once per run, and every
    rank must build the same model from it anyway. The cache is keyed by the function object as well,
    so a module reloaded in a long-lived process (a notebook) is inspected again.
    """
    return _inspect(spec, load_factory(spec))


@functools.lru_cache(maxsize=16)
def _inspect(spec: str, factory: Callable[[], Any]) -> FactoryModel:
    import torch
    from torch import nn

    def build() -> Any:
        # this process's random stream left as it was; imports inside the factory resolve as in a rank
        with torch.random.fork_rng(devices=[]), working_folder_first():
            return factory()

    try:
        with torch.device("meta"):
            model, meta = build(), True
    except PipelineError:  # the launcher's deadline (in_launcher): not the factory's failure to build on meta
        raise
    except Exception:  # cannot build on the meta device: build it for real, as the ranks do
        try:
            model, meta = build(), False
        except PipelineError:
            raise
        except Exception as e:
            raise ConfigError(
                f"model factory {spec} failed when called with no arguments ({_one_line(e)}); a model "
                "factory takes no arguments and returns a torch.nn.Module; fix it, or give "
                f"{_BUILT_IN}"
            ) from None
    if not isinstance(model, nn.Module):
        shown = " ".join(reprlib.repr(model).split())  # one line: a module's repr spans several
        raise ConfigError(
            f"model factory {spec} returned an object of type {type(model).__name__} ({shown}), not a "
            "torch.nn.Module; it must return the model: an nn.Sequential of layers, or a module with .embed, "
            f".layers and .head; or give {_BUILT_IN}"
        )
    try:
        units = model_units(model)
    except ConfigError as e:
        raise ConfigError(f"model factory {spec}: {e}") from None
    _check_outside(spec, model, units)
    emb = token_embedding(model)
    if emb is None:
        raise ConfigError(
            f"model factory {spec} returned a {type(model).__name__} without an nn.Embedding; the pipeline "
            "feeds token ids (b, s) and draws them below the first nn.Embedding's num_embeddings; make the "
            "first layer an nn.Embedding"
        )
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError(
            f"model factory {spec} returned a {type(model).__name__} with no parameter that requires grad (every one "
            "frozen): a pipeline's training step has no gradient to compute; unfreeze the parameters to train "
            "(p.requires_grad_(True)) in the factory"
        )
    params = sum(p.numel() for p in model.parameters())
    largest = max((p.numel() for p in model.parameters()), default=0)
    return FactoryModel(
        spec=spec, params=params, units=len(units), vocab=int(emb.num_embeddings), meta=meta, largest=largest
    )


def token_embedding(model: Any) -> Any:
    """The table the token ids index: among the ``nn.Embedding`` s of the model's first unit (:func:`model_units`),
    else of the whole model, the one as wide as the last ``nn.Linear``'s outputs (the logits), else the first (a
    position table may be registered before the token table); None without one."""
    from torch import nn

    try:
        units = model_units(model)
    except ConfigError:
        units = []
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    vocab = linears[-1].out_features if linears else None
    for scope in (units[0] if units else None, model):
        if isinstance(scope, nn.Module):
            tables = [m for m in scope.modules() if isinstance(m, nn.Embedding)]
            if tables:
                return next((t for t in tables if t.num_embeddings == vocab), tables[0])
    return None


def _check_outside(spec: str, model: Any, units: Sequence[Any]) -> None:
    """ConfigError when some of ``model``'s parameters lie in none of its ``units``: the pipeline runs the chain of
    units, not the model's own ``forward``, so a position table added there or a final norm outside ``head`` would
    never run nor train (the gradient check then fails with no reason given)."""
    inside = {id(p) for u in units if hasattr(u, "parameters") for p in u.parameters()}
    outside = [name for name, p in model.named_parameters() if id(p) not in inside]
    if outside:
        shown = ", ".join(outside[:4]) + (f" and {len(outside) - 4} more" if len(outside) > 4 else "")
        raise ConfigError(
            f"model factory {spec}: parameters {shown} are in none of the layers the pipeline runs (embed, the "
            "layers and head, or the nn.Sequential's children; the model's own forward is not run), so they would "
            "never run nor train; move them into a layer (a position table into embed, a final norm into head)"
        )


def model_units(model: Any) -> list[Any]:
    """The ordered layers of a model that pipelining may cut between.

    A GPT-like module (``embed``, ``layers``, ``head``) gives ``[embed, *layers, head]``; an
    ``nn.Sequential`` (or any list of modules) gives its children. Each unit maps the previous
    unit's output to its own, the first takes token ids and the last returns logits.
    """
    from torch import nn

    if all(hasattr(model, a) for a in ("embed", "layers", "head")):
        return [model.embed, *model.layers, model.head]
    if isinstance(model, (nn.Sequential, nn.ModuleList, list, tuple)):
        units = list(model)
        if units:
            return units
    raise ConfigError(
        f"cannot split a {type(model).__name__} into stages; pipelining needs a stack of layers: an "
        "nn.Sequential, or a module with .embed, .layers (nn.ModuleList) and .head"
    )


def balanced_split(weights: Sequence[float], parts: int) -> list[int]:
    """Contiguous split of ``weights`` into ``parts`` non-empty groups minimising the heaviest.

    Returns the group sizes. Exact dynamic programme (linear partition, O(parts·n²)); among
    equally good splits the earliest cut wins (lighter leading stages).
    """
    n = len(weights)
    if parts > n:
        raise ConfigError(
            f"{parts} stages but the model has only {n} layers to split (embedding, blocks, head); each "
            f"stage needs at least one; use fewer stages (p·v <= {n}) or a deeper model"
        )
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))
    inf = float("inf")
    # best[k][i]: minimal heaviest group splitting the first i units into k groups
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i] - 1e-12:
                    best[k][i], cut[k][i] = cost, j
    sizes: list[int] = []
    i = n
    for k in range(parts, 0, -1):
        j = cut[k][i]
        sizes.append(i - j)
        i = j
    return sizes[::-1]


def split_units(units: Sequence[Any], sizes: Sequence[int]) -> list[Any]:
    """Stage modules (``nn.Sequential``, :func:`_stage_class`) holding ``sizes[k]`` consecutive units each."""
    stage = _stage_class()
    out: list[Any] = []
    i = 0
    for k in sizes:
        out.append(stage(*units[i : i + k]))
        i += k
    return out


@functools.cache
def _stage_class() -> Any:
    """``nn.Sequential`` whose output is never a view: a stage ending in ``nn.Linear`` on a (b, s, h) input
    returns a view of its matmul's result, and torch's split backward (``stage_backward_input``, the
    zero-bubble schedules and DualPipeV) detaches its stage outputs in place, which a view refuses ("Can't
    detach views in-place", pytorch/pytorch issue 142229, open in torch 2.13). Such an output is copied
    once (one pass over it: b·s·h between stages, b·s·V for a head returning logits), on every schedule, so
    that the profile, the memory calibration and the run see the same stage; any other output is returned
    as it is."""
    import torch
    from torch import nn

    class Stage(nn.Sequential):
        def forward(self, x: Any) -> Any:
            y = x
            for unit in self:  # nn.Sequential's own loop
                y = unit(y)
            return y.clone() if isinstance(y, torch.Tensor) and y._is_view() else y

    return Stage


def unit_param_counts(units: Sequence[Any]) -> list[int]:
    """Parameters of every unit (a weight shared by two units counts in both: both compute with it)."""
    return [sum(p.numel() for p in u.parameters()) for u in units]


def shape_unit_params(shape: ModelShape) -> list[int]:
    """:func:`unit_param_counts` of the built-in model of ``shape``
    (:class:`microbatch.measure.gpt.GPT`: embedding, every block, head) without building it: token
    (and learned position) embeddings; per block two norms, the q/k/v and output projections and the
    dense MLP (the GPT builds every block dense, with standard attention); the head's norm and its
    output projection (counted again where it is tied to the embedding, as in
    :func:`unit_param_counts`)."""
    h, qw, kvd, f = shape.hidden, shape.q_width, shape.kv * shape.head_dim, shape.ffn
    norm = 2 * h if shape.norm == "layernorm" else h
    attn = h * (qw + 2 * kvd) + qw * h + ((qw + 2 * kvd) + h if shape.bias else 0)
    mlp = (3 if shape.gated_mlp else 2) * h * f + (
        ((2 if shape.gated_mlp else 1) * f + h) if shape.bias else 0
    )
    embed = shape.vocab * h + (shape.positions * h if shape.learned_positions else 0)
    return [embed, *[2 * norm + attn + mlp] * shape.layers, norm + shape.vocab * h]


def unit_times_s(units: Sequence[Any], tokens: Any, repeats: int = 3) -> list[float]:
    """Measured forward + backward seconds of every unit on ``tokens`` (best of ``repeats``)."""
    import torch

    times: list[float] = []
    x = tokens
    for u in units:
        best = float("inf")
        for _ in range(repeats):
            inp = x.detach().requires_grad_(x.is_floating_point())
            t0 = time.perf_counter()
            y = u(inp)
            y.float().square().mean().backward()
            best = min(best, time.perf_counter() - t0)
        u.zero_grad(set_to_none=True)
        with torch.no_grad():
            x = u(x)
        times.append(best)
    return times


def dropout_modules(module: Any, where: str = "") -> list[str]:
    """Names of ``module``'s layers whose output in training mode the gradient check cannot reproduce: dropout that
    drops anything (``nn.Dropout`` and its kin with p > 0: other random masks than the unsplit reference's) and
    batch-statistic norms (BatchNorm in training mode, named with "batch statistics": each micro-batch normalised by
    its own rows, the reference by the whole batch's). Either makes the gradients differ."""
    import torch

    drops = [
        f"{where} {name or type(m).__name__}".strip()
        for name, m in module.named_modules()
        if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.training and float(m.p) > 0
    ]
    norms = [
        f"{where} {name or type(m).__name__} ({type(m).__name__}: batch statistics)".strip()
        for name, m in module.named_modules()
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.training
    ]
    return drops + norms
