"""Splitting a batch into micro-batches: by rows (:func:`split`) or by a token budget (:func:`split_by_tokens`).

A batch is a tensor, a tuple/list of tensors or a mapping of name -> tensor, nested as a collate function
makes them, with the rows in dim 0, and lists of plain values with one per row (the texts of the rows), and,
inside the batch, lists or tuples of mappings with one record per row where their tensors do not hold the rows
(torchvision's detection targets: a dict of boxes and labels per image, each with its own number of boxes; where
they do, they are fields, as ``default_collate`` makes them: :func:`_layout`), and, in a mapping, flags that are not
rows (a bool or None: CLIP's collator's ``return_loss=True``), carried whole to every micro-batch;
micro-batches are views (no copy; a token split's cut sequences are copied contiguous). :func:`batch_rows` checks that every tensor agrees on
the number of rows. Used by :mod:`microbatch.run.accumulate` and by loops written by hand.

torch is imported at module level; ``import microbatch`` stays light because this module loads
only on first use.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from microbatch.errors import ConfigError, check_positive_int, whole_number

__all__ = ["Batch", "split", "split_by_tokens", "batch_rows", "take_rows"]

Batch = Any  # a tensor, tuples/lists/mappings of tensors (nested) and per-row lists, all sharing dim 0


def _holds_tensors(value: Any) -> bool:
    """A tensor or a mapping, or a list/tuple with one somewhere inside."""
    if isinstance(value, (torch.Tensor, Mapping)):
        return True
    return isinstance(value, (tuple, list)) and any(_holds_tensors(v) for v in value)


def _flag(value: Any) -> bool:
    """A value that holds no rows and goes whole to every micro-batch, in a mapping or in place in a tuple or list: a
    bool or None (``return_loss=True``, ``past_key_values=None``, a collate's ``(x, y, None)`` for a mask it did not
    make). A number or a string is not taken so: it may count the batch (an item count)."""
    return value is None or isinstance(value, bool)


def _records(value: Any) -> bool:
    """A list or tuple of two or more mappings: fields (``default_collate`` of samples holding such a list) or one
    record per row (torchvision's detection targets), as :func:`_layout` decides."""
    return isinstance(value, (tuple, list)) and len(value) > 1 and all(isinstance(v, Mapping) for v in value)


def _tensor_records(value: Any) -> bool:
    """A list or tuple (inside the batch) of two or more tensors: fields, each with the rows in dim 0, or one tensor per
    row (torchvision's detection images, each (3, H_i, W_i)), the last reading :func:`_layout` tries."""
    return (
        isinstance(value, (tuple, list))
        and len(value) > 1
        and all(isinstance(v, torch.Tensor) and v.dim() > 0 for v in value)
    )


def _array(value: Any) -> bool:
    """An array that is not a tensor (a NumPy array, anything with a shape and ``__array__``): rows of data, never
    one row's value; :func:`_leaves` refuses it with the conversion to make."""
    return hasattr(value, "__array__") and hasattr(value, "shape") and not isinstance(value, torch.Tensor)


def _per_row(value: Any, records: int = 0) -> bool:
    """A list or tuple with no tensor or mapping inside: one value per row (a string, a number, a row's own list
    of choices), sliced with the rows; with ``records`` 1, also a list or tuple of mappings, one a row (:func:`_records`),
    with 2 of mappings or of tensors (:func:`_tensor_records`). Not one that holds an array (``(x_np, y_np)`` is two arrays of rows,
    not two rows)."""
    if not isinstance(value, (tuple, list)) or any(_array(v) for v in value):
        return False
    if (records >= 1 and _records(value)) or (records >= 2 and _tensor_records(value)):
        return True
    return not _holds_tensors(value)


def _leaves(batch: Batch, name: str = "batch", records: int = 0) -> list[tuple[str, Any]]:
    """(name, tensor or per-row list) for every leaf of ``batch``, through nested tuples, lists and mappings
    (``default_collate`` of ``(dict, tensor)`` samples gives ``[dict, tensor]``); ConfigError for any other
    structure."""
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0:
            raise ConfigError(
                f"{name} is a 0-dim tensor; every entry needs the rows in dim 0: a value with no rows (a scale, a "
                "count of the whole batch) belongs in loss_fn's closure, not in the batch that is split"
            )
        if batch.is_nested or batch.layout != torch.strided:  # torch cannot slice their rows as views
            kind = (
                "nested (jagged)"
                if batch.is_nested
                else f"{str(batch.layout).removeprefix('torch.')} (sparse)"
            )
            fix = (
                "pad it (t.to_padded_tensor(0)) or give a list with one tensor per row"
                if batch.is_nested
                else "make it dense (t.to_dense()) before the step, or build it inside loss_fn from dense rows"
            )
            raise ConfigError(
                f"{name} is a {kind} tensor, whose rows cannot be cut into micro-batches; {fix}"
            )
        return [(name, batch)]
    if isinstance(batch, Mapping):
        items = [(f"{name}[{k!r}]", v) for k, v in batch.items() if not _flag(v)]
    elif isinstance(batch, (tuple, list)):
        if batch and _per_row(batch, records if name != "batch" else 0):
            return [(name, batch)]
        items = [(f"{name}[{i}]", v) for i, v in enumerate(batch) if not _flag(v)]
    elif name == "batch":
        raise ConfigError(
            f"batch of type {type(batch).__name__} is not supported; a batch is a tensor, a tuple/list of "
            "tensors or a dict of tensors (nested as a collate function makes them), all with the rows in dim 0: "
            + _as_dict_fix(batch)
        )
    elif _array(batch):
        raise ConfigError(
            f"{name} is a {type(batch).__name__}, not a tensor; convert it with torch.as_tensor (torch.from_numpy for "
            "a NumPy array) before the step: every entry of the batch is a tensor with the rows in dim 0"
        )
    else:
        raise ConfigError(
            f"{name} is a {type(batch).__name__}, not a tensor; every entry of the batch must be a tensor "
            "with the rows in dim 0, a list with one value per row, or in a dict a flag (a bool or None); keep "
            "other values in loss_fn's closure"
        )
    if not items:
        raise ConfigError(f"{name} is empty (no tensors); give at least one tensor with the rows in dim 0")
    return [leaf for n, v in items for leaf in _leaves(v, n, records)]


def _sizes(batch: Batch, records: int) -> dict[str, int]:
    return {
        n: (t.shape[0] if isinstance(t, torch.Tensor) else len(t)) for n, t in _leaves(batch, records=records)
    }


def _layout(batch: Batch) -> tuple[int, int]:
    """(rows, records): the rows of ``batch`` (dim 0), after checking that every tensor and per-row list agrees, and
    how its lists are read (0: fields; 1: lists of mappings one record a row; 2: lists of tensors one a row too). They
    are fields (each mapping's and tensor's rows in dim 0) where that agrees; one record per row where only that agrees
    (torchvision's detection targets: each image's own number of boxes), lists of tensors kept as fields where the
    records alone agree (``(ids, mask)`` beside the targets), one tensor a row only where nothing else does
    (torchvision's images beside their targets); where fields agree too (as many rows as records, and each record's
    tensors as long), fields, with a warning."""
    sizes = _sizes(batch, records=0)
    if len(set(sizes.values())) <= 1:
        rows = next(iter(sizes.values()))
        _warn_if_ambiguous(batch, rows)
        return rows, 0
    found = {}
    for level in (1, 2):  # lists of mappings one a row; then lists of tensors too (torchvision's images)
        per_row = _sizes(batch, records=level)
        if len(set(per_row.values())) <= 1 and per_row != sizes:
            found[level] = next(iter(per_row.values()))
    if 2 in found and (1 not in found or _uneven_tensors(batch)):  # images of their own sizes: one a row
        return found[2], 2
    if 1 in found:
        if 2 in found:  # a list of as many tensors as rows, each of as many rows: either reading fits
            import warnings

            warnings.warn(
                f"the batch holds a list of {found[1]} tensors, as many as its rows, each with {found[1]} rows: split as "
                "fields (each tensor cut by rows); if they are one a row (torchvision's images), stack them "
                "(torch.stack) into one tensor of rows, or split the batch yourself",
                RuntimeWarning,
                stacklevel=3,
            )
        return found[1], 1
    if _samples(batch):
        raise ConfigError(
            f"batch is a {type(batch).__name__} of {len(batch)} samples ({type(batch[0]).__name__}s whose tensors hold "
            "one sample each), not collated; collate them first (torch.utils.data.default_collate(samples), what a "
            "DataLoader does) so that each tensor holds the rows in dim 0"
        )
    shown = ", ".join(f"{n} has {s}" for n, s in list(sizes.items())[:6])
    more = f" and {len(sizes) - 6} more" if len(sizes) > 6 else ""
    raise ConfigError(
        f"tensors of the batch have different first dimensions ({shown}{more}); every tensor needs the same "
        "number of rows in dim 0 (a list of dicts with one per row, torchvision's targets, is split with the rows)"
    )


def _uneven_tensors(batch: Batch) -> bool:
    """Whether a list or tuple inside ``batch`` holds two or more tensors of one rank and different shapes (images of
    their own sizes): read one a row where both readings agree with the records."""
    values = (
        batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (tuple, list)) else ()
    )
    for v in values:
        if _tensor_records(v) and len({t.dim() for t in v}) == 1 and len({tuple(t.shape) for t in v}) > 1:
            return True
        if isinstance(v, (Mapping, tuple, list)) and _uneven_tensors(v):
            return True
    return False


def _samples(batch: Batch) -> bool:
    """A list or tuple of more than two samples alike (mappings, or tuples, of tensors of one shape each): a batch a
    collate function has not made."""
    if (
        not isinstance(batch, (tuple, list))
        or len(batch) <= 2
        or not isinstance(batch[0], (Mapping, tuple, list))
    ):
        return False

    def shapes(sample: Any) -> Any:
        values = sample.values() if isinstance(sample, Mapping) else sample
        return tuple(tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__ for v in values)

    first = shapes(batch[0])
    return all(type(s) is type(batch[0]) and shapes(s) == first for s in batch)


def _as_dict_fix(batch: Any) -> str:
    """The conversion that makes ``batch`` a dict: a dataclass's fields, an object's attributes."""
    import dataclasses

    if dataclasses.is_dataclass(batch):
        return "pass dataclasses.asdict(batch) (or {f.name: getattr(batch, f.name) ...}) and read the dict in loss_fn"
    return "pass its tensors as a dict (vars(batch) for an object of attributes) and read the dict in loss_fn"


def _warn_if_ambiguous(batch: Batch, rows: int, name: str = "batch") -> None:
    """A warning for a list or tuple of ``rows`` mappings, or of ``rows`` tensors, inside the batch whose tensors also
    all hold ``rows``: read as fields, though it may be one record per row (each image with as many boxes as the batch
    has images; three RGB images of three channels)."""
    items = (
        batch.items()
        if isinstance(batch, Mapping)
        else enumerate(batch)
        if isinstance(batch, (tuple, list))
        else ()
    )
    for key, value in items:
        where = f"{name}[{key!r}]"
        if _records(value) and len(value) == rows:
            import warnings

            warnings.warn(
                f"{where} holds {rows} dicts, as many as the batch's rows, and each dict's tensors hold {rows} rows "
                "too: split as fields (each dict's tensors cut by rows); if they are one record per row "
                "(torchvision's detection targets), give rows whose records differ in length, or split the "
                "records yourself in loss_fn",
                RuntimeWarning,
                stacklevel=4,
            )
            return
        images = _tensor_records(value) and all(
            t.dim() >= 3 for t in value
        )  # (C, H, W) each, not (ids, mask)
        if images and len(value) == rows:  # three RGB images beside three labels
            import warnings

            warnings.warn(
                f"{where} holds {rows} tensors, as many as the batch's rows, and each holds {rows} rows in dim 0 "
                "too: split as fields (each tensor cut along dim 0); if they are one a row (torchvision's images, "
                "(3, H, W) each), stack them (torch.stack) into one tensor of rows, or split the batch yourself",
                RuntimeWarning,
                stacklevel=4,
            )
            return
        if isinstance(value, (Mapping, tuple, list)):
            _warn_if_ambiguous(value, rows, where)


def batch_rows(batch: Batch) -> int:
    """Rows (dim 0) of ``batch``, after checking that every tensor (and per-row list) in it has the same number."""
    return _layout(batch)[0]


def take_rows(
    batch: Batch,
    start: int,
    stop: int,
    width: int | None = None,
    cut: frozenset[int] = frozenset(),
    *,
    records: int = 0,
    top: bool = True,
) -> Batch:
    """Rows ``start:stop`` of every tensor (views) and per-row list, through nested containers; the tensors in
    ``cut`` (by ``id``: :func:`_cut`) also cut to ``width`` columns in dim 1. ``records``: how the batch's lists are
    read (:func:`_layout`); ``top``: ``batch`` is the whole batch (never a list of
    records)."""
    inner: dict[str, Any] = {"records": records, "top": False}
    if isinstance(batch, torch.Tensor):
        t = batch[start:stop]
        if width is not None and id(batch) in cut:
            t = t[
                :, :width
            ].contiguous()  # a view of several rows would not be contiguous: Hugging Face's .view()
        return t
    if isinstance(batch, Mapping):
        return {
            k: v if _flag(v) else take_rows(v, start, stop, width, cut, **inner) for k, v in batch.items()
        }
    if _per_row(batch, 0 if top else records):
        return batch[start:stop]
    parts = [v if _flag(v) else take_rows(v, start, stop, width, cut, **inner) for v in batch]
    if isinstance(batch, tuple):
        make = getattr(type(batch), "_make", None)  # a namedtuple (default_collate keeps them) takes fields
        return make(parts) if callable(make) else type(batch)(parts)
    return parts


def _padded_by_lengths(t: torch.Tensor, lens: Sequence[int]) -> bool:
    """Whether ``t`` is padded as ``lens`` say: in every row shorter than its width, each position from the row's
    length on holds one value, the same in every row (a pad id, -100, a mask's 0, a pad embedding), so a cut at a
    micro-batch's longest row loses nothing. An encoder-decoder's labels longer than the inputs the lengths describe,
    or left-padded ids, are not padded so, and are not cut."""
    pads = [t[i, n:] for i, n in enumerate(lens) if n < t.shape[1]]
    if not pads:
        return True  # no row shorter than the width: nothing will be cut
    pad = pads[0][:1]  # the first padded position of the first padded row: the pad value (or vector)
    return all(bool((tail == pad).all()) for tail in pads)


def _cut(batch: Batch, records: int, lens: Sequence[int], width: int) -> frozenset[int]:
    """The tensors (by ``id``) a token split cuts: two or more dims, ``width`` wide, padded as ``lens`` say
    (:func:`_padded_by_lengths`). ConfigError where the batch's ``input_ids`` are not while another tensor is (its
    mask's tail all ones: left padding), which would cut the two to different widths."""
    leaves = [
        (n, t) for n, t in _leaves(batch, records=records) if isinstance(t, torch.Tensor) and t.dim() >= 2
    ]
    padded = {n: _padded_by_lengths(t, lens) for n, t in leaves if t.shape[1] == width}
    ids = [n for n in padded if n.endswith("['input_ids']")]
    if any(not padded[n] for n in ids) and any(padded.values()):
        raise ConfigError(
            f"{ids[0]}'s columns past each row's length are not padding (left-padded rows?), while another tensor's "
            "are: cutting would leave them at different widths; pass trim_padding=False for left padding, or give "
            "lengths that match the right-padded rows"
        )
    return frozenset(id(t) for n, t in leaves if padded.get(n))


def _padded_width(batch: Batch, records: int) -> int:
    """The padded width of a token split: the widest dim 1 of the batch's integer or bool tensors of two or more dims
    (ids, masks, labels), else of any such tensor; a row's features (a float ``(b, 16)`` beside ``(b, 8)`` ids, a
    spectrogram's mel bins) are not tokens."""
    tensors = [t for _, t in _leaves(batch, records=records) if isinstance(t, torch.Tensor) and t.dim() >= 2]
    tokens = [t.shape[1] for t in tensors if not (t.is_floating_point() or t.is_complex())]
    widths = tokens or [t.shape[1] for t in tensors]
    return max(widths) if widths else 1


def split(batch: Batch, micro_batch_size: int) -> list[Batch]:
    """Split ``batch`` into consecutive micro-batches of ``micro_batch_size`` rows (views, no copy).

    The last micro-batch holds the remainder and may be smaller; a micro-batch size at least the
    number of rows gives one micro-batch. Tuples stay tuples, lists lists, mappings become dicts.
    """
    size = whole_number(micro_batch_size)
    if size is None or size < 1:
        kind = (
            f" (a {type(micro_batch_size).__name__}: give an int)"
            if isinstance(micro_batch_size, float)
            else ""
        )
        raise ConfigError(
            f"micro_batch_size must be a whole number >= 1, got {micro_batch_size!r}{kind}; give the rows per "
            "forward/backward (b_m)"
        )
    rows, records = _layout(batch)
    if rows == 0:
        raise ConfigError("batch has 0 rows; give at least one row")
    return [take_rows(batch, i, min(i + size, rows), records=records) for i in range(0, rows, size)]


def split_by_tokens(
    batch: Batch,
    max_tokens: int,
    *,
    lengths: Sequence[int] | torch.Tensor,
    trim_padding: bool = True,
) -> list[Batch]:
    """Split ``batch`` into consecutive micro-batches of at most ``max_tokens`` padded tokens each.

    For variable-length data. ``lengths[i]`` is the number of real tokens of row ``i`` (for example
    ``attention_mask.sum(1)``). A micro-batch of ``r`` rows whose longest row has ``l`` tokens costs
    ``r × l`` tokens when ``trim_padding`` is true (every tensor of two or more dims whose dim 1 is
    the batch's padded width, :func:`_padded_width`, is cut to ``l`` where it is padded as the lengths say,
    :func:`_cut`: right padding assumed, as in training; the cut tensors copied contiguous), ``r × width``
    otherwise. Rows keep their order (sort the batch by length first to waste less padding); the
    micro-batch gradient sum does not depend on the grouping. A row longer than ``max_tokens`` on its
    own is an error.
    """
    check_positive_int("max_tokens", max_tokens, fix="give the padded tokens one forward/backward may hold")
    rows, records = _layout(batch)
    if rows == 0:
        raise ConfigError("batch has 0 rows; give at least one row")
    lens = [int(x) for x in (lengths.tolist() if isinstance(lengths, torch.Tensor) else lengths)]
    if len(lens) != rows:
        raise ConfigError(
            f"lengths has {len(lens)} entries but the batch has {rows} rows; give one length per row"
        )
    width = _padded_width(batch, records)
    if any(n < 0 or n > width for n in lens):
        bad = next(n for n in lens if n < 0 or n > width)
        raise ConfigError(f"a row length of {bad} is outside 0..{width} (the padded width); check lengths")
    cut = _cut(batch, records, lens, width) if trim_padding else frozenset()
    out: list[Batch] = []
    start, longest = 0, 0
    for i, n in enumerate(lens):
        cost_one = n if trim_padding else width
        if max(cost_one, 1) > max_tokens:
            raise ConfigError(
                f"row {i} alone costs {cost_one} tokens, over max_tokens={max_tokens}; raise max_tokens to at "
                f"least {cost_one} or truncate the row"
            )
        new_longest = max(longest, n)
        cost = (i + 1 - start) * (max(new_longest, 1) if trim_padding else width)
        if cost > max_tokens:
            out.append(
                take_rows(batch, start, i, max(longest, 1) if trim_padding else None, cut, records=records)
            )
            start, new_longest = i, n
        longest = new_longest
    out.append(take_rows(batch, start, rows, max(longest, 1) if trim_padding else None, cut, records=records))
    return out
