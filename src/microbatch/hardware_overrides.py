"""``KEY=VALUE`` overrides of an accelerator row's figures (``--gpu-set``), read and checked: split from
:mod:`microbatch.hardware`, which is at its size limit."""

from __future__ import annotations

from microbatch.errors import ConfigError
from microbatch.hardware import _NOT_FIGURES, ACCELERATORS

__all__ = ["parse_overrides"]


def parse_overrides(items: list[str] | tuple[str, ...]) -> dict[str, float]:
    """``KEY=VALUE`` strings (``--gpu-set inter_node_bytes_per_s=25e9``) as overrides for :func:`get_accelerator`."""
    out: dict[str, float] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(
                f"gpu_set {item!r} must be KEY=VALUE, for example inter_node_bytes_per_s=25e9",
                params=("gpu_set",),
            )
        k, whole = key.strip(), key.strip() in ("gpus_per_node", "compute_units")
        if k == "memory_bytes":  # a size as people write one: 48GiB, 80GB, 8e10
            out[k] = _memory_bytes(item, value)
            continue
        try:
            out[k] = int(value) if whole else float(value)
        except ValueError:
            if k in _NOT_FIGURES:  # "name=foo" is no figure at all: its refusal names the figures
                ACCELERATORS["h100-sxm"].with_overrides(**{k: value})
            raise ConfigError(
                f"gpu_set {item!r}: {value!r} is not a {'whole ' * whole}number", params=("gpu_set",)
            ) from None
    return out


MIN_DEVICE_BYTES = 2**30
"""The smallest ``memory_bytes`` taken: 1 GiB, below any accelerator that trains; a bare 80 is 80 bytes."""


def _memory_bytes(item: str, value: str) -> int:
    """``memory_bytes`` of ``--gpu-set``: a size (:func:`~microbatch.units.parse_bytes`), at least a GiB."""
    from microbatch.units import parse_bytes

    try:
        n = parse_bytes(value, name=f"gpu_set {item!r}:")
    except ConfigError as e:
        raise ConfigError(str(e), params=("gpu_set",)) from None
    if n < MIN_DEVICE_BYTES:
        raise ConfigError(
            f"gpu_set {item!r} is {n:,} bytes, under 1 GiB: no accelerator that trains; give a size with its unit, "
            f"e.g. memory_bytes={value.strip()}GiB",
            params=("gpu_set",),
        )
    return n
