"""What the pipeline runs against what the user's model does: the chain of its units, checked before any rank starts.

The ranks run a factory's model as the chain its units make (:func:`~microbatch.run.pipeline.split.model_units`:
``embed``, each of ``layers``, ``head``), never the model's own ``forward``. Where that ``forward`` does more than
chain them (a skip connection, a scaled embedding, a dropout or a norm between units) the pipeline would train another
model, exit 0, and leave the gradient check to fail with no cause (a review's U-Net and √H-scaled embedding: losses
equal to the plain chain's). :func:`check_forward_is_chain` runs ``forward`` once on the micro-batch the units were
checked on (the meta device: shapes, no memory) with a hook on each unit and refuses a ``forward`` that calls the
units in another order, feeds one something other than the previous one's output, or returns something other than the
last one's. :func:`check_position_tables` refuses a ``seq`` longer than a learned position table in the first unit,
which an index on the meta device does not catch (a rank then died with a bare ``IndexError``).
"""

from __future__ import annotations

from typing import Any

from microbatch.errors import ConfigError
from microbatch.run.pipeline.resolved import ResolvedRun

__all__ = ["check_forward_is_chain", "check_position_tables", "check_splittable"]


def _runs_forward(model: Any) -> bool:
    """Whether ``model`` has a ``forward`` of its own to compare (an ``nn.Sequential``'s is the chain itself)."""
    from torch import nn

    return not isinstance(model, (nn.Sequential, nn.ModuleList, list, tuple)) or (
        isinstance(model, nn.Sequential) and type(model).forward is not nn.Sequential.forward
    )


def check_forward_is_chain(spec: str, model: Any, units: list[Any], tokens: Any) -> None:
    """ConfigError when ``model(tokens)`` is not ``units`` chained on ``tokens`` (module docstring). A ``forward`` that
    cannot run here (it needs other arguments, data on the meta device) is not judged: the ranks never call it.

    Judged: the units called once each, in turn; each given the previous one's output (the first the token ids, or a
    view of them: ``input_ids.view(-1, s)``), positionally or by keyword, and no other tensor (a mask, positions: a
    layer index or None is no tensor); the last one's output somewhere in what ``forward`` returns (a tuple, a dict, a
    dataclass or ``ModelOutput``), or that output cast to another dtype (``head(h).float()``)."""
    import torch

    if not _runs_forward(model):
        return
    calls: list[
        tuple[int, Any, Any, int]
    ] = []  # (unit, its input, its output, other tensors given), in order

    def hook(i: int) -> Any:
        def record(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
            given = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            calls.append((i, given[0] if given else None, out, max(0, len(given) - 1)))

        return record

    handles = [u.register_forward_hook(hook(i), with_kwargs=True) for i, u in enumerate(units)]
    try:
        with torch.no_grad():
            out = model(tokens)
    except Exception:  # noqa: BLE001 - not runnable with token ids alone: nothing to compare
        return
    finally:
        for h in handles:
            h.remove()
    order = [c[0] for c in calls]
    if order != list(range(len(units))):
        _refuse(
            spec, f"calls its layers in the order {order[:12]}, not once each in turn (0 to {len(units) - 1})"
        )
    for i, given, _, others in calls:
        if others:
            _refuse(spec, f"gives layer {i} ({type(units[i]).__name__}) a second tensor (a mask, positions)")
        expected = tokens if i == 0 else calls[i - 1][2]
        fed = given is expected or (
            i == 0 and isinstance(given, torch.Tensor) and given.numel() == tokens.numel()
        )  # the ids reshaped
        if not fed:
            what = "the token ids" if i == 0 else f"layer {i - 1}'s output"
            _refuse(spec, f"gives layer {i} ({type(units[i]).__name__}) something other than {what}")
    if not _holds(out, calls[-1][2]):
        _refuse(spec, f"returns something other than its last layer's ({type(units[-1]).__name__}) output")


def _holds(out: Any, last: Any, depth: int = 0) -> bool:
    """Whether ``out`` is ``last``, a cast of it to another dtype (same shape), or holds one in a tuple, list, dict,
    dataclass or ``ModelOutput`` (two levels down)."""
    import dataclasses
    from collections.abc import Mapping

    import torch

    if out is last:
        return True
    if isinstance(out, torch.Tensor) and isinstance(last, torch.Tensor):
        return out.shape == last.shape and out.dtype != last.dtype
    if depth >= 2:
        return False
    if isinstance(out, Mapping):
        values: list[Any] = list(out.values())
    elif isinstance(out, (tuple, list)):
        values = list(out)
    elif dataclasses.is_dataclass(out) and not isinstance(out, type):
        values = [getattr(out, f.name) for f in dataclasses.fields(out)]
    else:
        return False
    return any(_holds(v, last, depth + 1) for v in values)


def _refuse(spec: str, what: str) -> None:
    raise ConfigError(
        f"model factory {spec}: the model's forward {what}; the pipeline runs the chain of its layers (embed, each "
        "of layers, head), not forward, so it would train another model; move what forward does between them "
        "(a skip connection, a scale, a dropout or a norm) into a layer"
    )


POSITION_TABLE_MIN = 64
"""The fewest rows an ``nn.Embedding`` beside the token table must have to be taken for a position table: a model's
context is longer (GPT-2's 1,024, BERT's 512); a token-type, segment or language table is a handful (BERT's 2)."""


def check_position_tables(spec: str, units: list[Any], seq: int, token_table: Any) -> None:
    """ConfigError when the first unit holds an ``nn.Embedding`` other than the token table with fewer rows than
    ``seq`` and at least :data:`POSITION_TABLE_MIN`: a learned position table, which ``seq`` positions would index
    past."""
    from torch import nn

    tables = [m for m in units[0].modules() if isinstance(m, nn.Embedding) and m is not token_table]
    short = [t for t in tables if POSITION_TABLE_MIN <= t.num_embeddings < seq]
    if short:
        n = short[0].num_embeddings
        raise ConfigError(
            f"model factory {spec}: seq {seq} is longer than the first layer's position table ({n} positions, an "
            f"nn.Embedding beside the token table); give seq no longer than {n}",
            params=("seq",),
        )


def check_splittable(run: ResolvedRun) -> None:
    """Refuse, before any process starts, a model the ranks could not build or split.

    A ``module:function`` model is imported and built here
    (:func:`microbatch.run.pipeline.split.inspect_factory`): a module that cannot be imported, a name
    that cannot be called, a call that fails or returns something other than a stack of layers with a
    token embedding is a :class:`ConfigError` naming the factory. Any model needs at least p·v layers
    (units: for a built-in model the embedding, every block, the head); a built-in model with learned
    positions takes at most its position table's length as ``seq``."""
    from microbatch.run.pipeline.config import check_enough_layers

    cfg, shape = run.cfg, run.shape
    if shape is None:
        from microbatch.run.pipeline.split import inspect_factory
        from microbatch.run.pipeline.stage_profile import in_launcher

        with in_launcher(run, f"calling the model factory {cfg.model}", fix="fix the factory"):
            units = inspect_factory(cfg.model).units  # bounded as the ranks are: a factory that blocks ends
        check_enough_layers(cfg, units, f"model factory {cfg.model} returns")
        return
    from microbatch.model import check_seq

    check_seq(shape, shape.seq)  # a model with learned positions takes at most its table's length
    check_enough_layers(
        cfg, shape.layers + 2, f"model {cfg.model} has", f"(embedding, {shape.layers} blocks, head)"
    )
