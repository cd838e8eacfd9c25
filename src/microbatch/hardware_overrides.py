"""``KEY=VALUE`` overrides of an accelerator row's figures (``--gpu-set``), read and checked: split from
:mod:`microbatch.hardware`, which is at its size limit."""

from __future__ import annotations

from dataclasses import replace

from microbatch.errors import ConfigError
from microbatch.hardware import _NOT_FIGURES, ACCELERATORS, Accelerator

__all__ = ["mig_slice", "parse_overrides"]


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
        if k in out:  # the last would win silently, as a repeated option does nowhere else
            raise ConfigError(
                f"gpu_set gives {k} twice ({item!r} after {k}={out[k]:g}); give each figure once",
                params=("gpu_set",),
            )
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
        _check_rate(item, k, out[k])
    return out


RATE_RANGES = {"flops": (1e9, 1e17, "FLOP/s"), "bytes": (1e6, 1e14, "bytes/s")}
"""The figures ``--gpu-set`` takes for a peak (``bf16=``, ``fp8=``...) and a bandwidth (``*_bytes_per_s=``), as
given (before the sustained clock scales them): 1 GFLOP/s to 100 PFLOP/s, twenty times the fastest row's (B200 fp8,
4.5 PFLOP/s dense); 1 MB/s to 100 TB/s, twelve times the fastest memory's (B200's 8 TB/s). Plausibility bounds that
refuse a slip of units (bf16=1e30 planned at an MFU of 3e-16), not fits."""

RATE_EXAMPLES = {
    "bf16": "989e12", "fp16": "989e12", "fp32": "67e12", "fp8": "1979e12", "memory_bandwidth_bytes_per_s": "3.35e12",
    "intra_node_bytes_per_s": "450e9", "inter_node_bytes_per_s": "50e9",
}  # fmt: skip
"""The example each refusal names: the H100 SXM row's own figure for that setting (dense peaks; NVLink 4 at 450 GB/s a
direction; one 400 Gb/s NIC a GPU), so the fix shows the unit and the size together."""


def _check_rate(item: str, key: str, value: float) -> None:
    """ConfigError when a peak or bandwidth override lies outside :data:`RATE_RANGES`, naming the value given."""
    if key not in RATE_EXAMPLES:  # not a peak or a bandwidth: checked by the row itself
        return
    kind = "bytes" if key.endswith("_bytes_per_s") else "flops"
    lo, hi, unit = RATE_RANGES[kind]
    if not lo <= value <= hi:  # NaN fails too
        raise ConfigError(
            f"gpu_set {item!r}: {value:g} {unit} is outside [{lo:g}, {hi:g}] {unit}; give the figure in {unit}, "
            f"e.g. {key}={RATE_EXAMPLES[key]} (the H100 SXM's)",
            params=("gpu_set",),
        )


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
        bare = value.strip().replace("_", "").replace(".", "", 1).isdigit()  # a number without its unit
        example = f"{value.strip()}GiB" if bare and 1 <= float(value) <= 4096 else "80GiB"
        raise ConfigError(
            f"gpu_set {item!r} is {n:,} bytes, under 1 GiB: no accelerator that trains; give a size with its unit, "
            f"e.g. memory_bytes={example}",
            params=("gpu_set",),
        )
    return n


def mig_slice(acc: Accelerator, compute_units: int | None, memory_bytes: float | None) -> Accelerator:
    """``acc`` as a Multi-Instance GPU slice of it runs (``NVIDIA H100 80GB HBM3 MIG 3g.40gb``: torch names the whole
    GPU's row and reports the slice's SMs and memory): the peaks scaled by its share of the row's SMs, the memory
    bandwidth by its share of the memory. NVIDIA's MIG User Guide ("Terminology"): a GPU SM slice is "roughly one
    seventh of the total number of SMs", a memory slice "roughly one eighth of the total GPU memory resources,
    including both capacity and bandwidth". ``acc`` itself where the device holds all of the row's SMs."""
    if not compute_units or not acc.compute_units or compute_units >= acc.compute_units:
        return acc
    sms = compute_units / acc.compute_units
    whole = ACCELERATORS.get(
        acc.name, acc
    ).memory_bytes  # the row's, not the slice's (from_device_name sets that)
    memory = min(1.0, memory_bytes / whole) if memory_bytes and whole else sms
    sliced = acc.with_overrides(
        **{dtype: peak * sms for dtype, peak in acc.peak_flops.items()},
        compute_units=compute_units,
        memory_bandwidth_bytes_per_s=acc.memory_bandwidth_bytes_per_s * memory,
    )
    note = f"; a MIG slice here: {compute_units} of its {acc.compute_units} SMs, {memory:.0%} of its memory bandwidth"
    return replace(sliced, source=acc.source + note)
