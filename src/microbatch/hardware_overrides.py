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
        try:
            out[k] = int(value) if whole else float(value)
        except ValueError:
            if k in _NOT_FIGURES:  # "name=foo" is no figure at all: its refusal names the figures
                ACCELERATORS["h100-sxm"].with_overrides(**{k: value})
            raise ConfigError(
                f"gpu_set {item!r}: {value!r} is not a {'whole ' * whole}number", params=("gpu_set",)
            ) from None
    return out
