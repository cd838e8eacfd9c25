"""Which accelerator row a device is: from the name torch reports, or the name a saved file records.

Pure string rules naming a row of :data:`microbatch.hardware.ACCELERATORS` (whose ``from_device_name`` and
``match_accelerator`` wrap these with the table). An A100 is told apart by its memory (40 or 80 GB); an H100 with HBM2e only by a name that
says so (a 94 GiB H100 may also be the HBM3 part of a GH200, which has another bandwidth).
"""

from __future__ import annotations

import re
from collections.abc import Container

from microbatch.errors import ConfigError
from microbatch.units import GIB

__all__ = ["device_key", "name_key"]

# Substrings of torch.cuda.get_device_name() -> registry key, most specific first.
_DEVICE_NAMES = (
    ("h100 pcie", "h100-pcie"),
    ("h100 nvl", "h100-nvl"),
    ("h800", "h800"),
    ("h100", "h100-sxm"),
    ("h200", "h200"),
    ("b200", "b200"),
    ("a100", "a100-80gb"),
    ("l4", "l4"),
    ("mi300x", "mi300x"),
)

_NOT_A_ROW = re.compile(r"gh200|\bl40")
"""Names that hold a row's needle but are another part: a GH200 (an H100-class die with 96 GB of HBM3 or 144 GB of
HBM3e, neither the H200's nor the HBM2e H100's bandwidth) and an L40 or L40S (Ada workstation parts, not the L4)."""


def device_key(device_name: str, total_memory_bytes: float | None = None) -> str | None:
    """The table key of a device name as torch reports it; None if unknown.

    An A100 is told apart by its memory (40 or 80 GB); an H100 with HBM2e by its name only.
    """
    low = device_name.lower()
    if _NOT_A_ROW.search(low):
        return None
    for needle, key in _DEVICE_NAMES:
        # the part's number whole: not the start of a longer one ("RTX A1000", an 8 GB card, is no A100)
        if re.search(re.escape(needle) + r"(?!\d)", low):
            if key == "a100-80gb" and total_memory_bytes is not None and total_memory_bytes < 60 * GIB:
                key = "a100-40gb"
            if key == "h100-sxm" and "hbm2e" in low:
                key = "h100-96gb"  # an SXM H100 whose name gives its HBM2e
            return key
    return None


_PART_WORDS = re.compile(
    r"(?:nvidia|amd|instinct|tesla|hgx|dgx|sxm\d?|pcie|nvl|hbm\d?e?|\d{2,3}gb?|gpu|tensor|core|oam|vf|mig|\d+g\.\d+gb)"
)
"""Words a device's full name carries beside its part (``NVIDIA A100-SXM4-80GB``, ``NVIDIA H100 80GB HBM3``, ``AMD
Instinct MI300X``, ``NVIDIA HGX H100``, ``NVIDIA A100 (80 GB)``, a MIG slice's ``MIG 1g.10gb``, ROCm's ``MI300X VF``)."""


def typed_key(name: str, known: Container[str]) -> str | None:
    """:func:`name_key` for a name a user typed: only where every word beside the part is one a device's full name
    carries (:data:`_PART_WORDS`), so ``a100-4``, ``h100-pci``, ``mi300a`` or ``h200x`` are no row (a review,
    2026-12-08: they planned the A100 80GB, the H100 SXM, the MI300X and the H200 without a word)."""
    key = name_key(name, known)
    if key is None:
        return None
    n = re.sub(r"(\d)\s+(gb?)\b", r"\1\2", name.lower().replace("(", " ").replace(")", " "))  # 80 GB, (80GB)
    part = re.search(r"(a100|h100|h200|h800|b200|mi300x?|\bl4\b)", n)
    rest = (n[: part.start()] + " " + n[part.end() :]) if part else n
    words = [w for w in re.split(r"[\s\-_/]+", rest) if w]
    return key if all(_PART_WORDS.fullmatch(w) for w in words) else None


def name_key(name: str, known: Container[str]) -> str | None:
    """The table key of a device name such as ``NVIDIA H200`` or ``NVIDIA A100-SXM4-80GB`` (a key in ``known``
    is itself); None if unknown.

    From the name alone (a saved file's ``device_name``): an A100's size comes from the name, where
    :func:`device_key` uses the memory torch reports.
    """
    n = name.lower().replace("nvidia", "").replace("amd instinct", "").strip()
    if not n or n in ("cpu", "cuda", "gpu") or n.startswith("cuda:"):
        return None
    if n in known:
        return n
    if _NOT_A_ROW.search(n):
        return None
    for key, pattern in (
        ("h200", r"h200(?!\d)"),
        ("h100-pcie", r"h100(?!\d).*pcie"),
        ("h100-nvl", r"h100(?!\d).*nvl"),
        ("h800", r"h800(?!\d)"),
        ("h100-96gb", r"h100(?!\d).*hbm2e"),
        ("h100-sxm", r"h100(?!\d)"),
        ("a100-40gb", r"a100(?!\d).*40"),
        ("a100-80gb", r"a100(?!\d)"),
        ("b200", r"b200(?!\d)"),
        ("l4", r"\bl4\b"),
        ("mi300x", r"mi300"),
    ):
        if re.search(pattern, n):
            return key
    return None


def unknown_name(name: str, key: str, known: list[str], aliases: list[str]) -> ConfigError:
    """The error for an accelerator ``name`` no row answers, with the nearest known name or alias."""
    import difflib

    near = difflib.get_close_matches(key, [*known, *aliases], n=1, cutoff=0.6)
    return ConfigError(
        f"unknown accelerator {name!r}" + (f" (did you mean {near[0]}?)" if near else "")
        + f"; known: {', '.join(known)} (aliases: {', '.join(aliases)}); for another card plan the nearest row with the "
        "card's own figures (plan's gpu_set, e.g. memory_bytes=48GiB bf16=362e12)",
        params=("gpu_set",),
    )  # fmt: skip
