"""The environment a Python child process of the tool starts with (a ``tune`` probe, a pipeline rank started as a
new interpreter): :func:`with_package_on_path`."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

__all__ = ["package_root", "with_package_on_path"]


def package_root() -> str:
    """The folder that holds this ``microbatch`` package (``src`` in a checkout, ``site-packages`` installed)."""
    return str(Path(__file__).resolve().parent.parent)


def with_package_on_path(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with :func:`package_root` first on ``PYTHONPATH`` (and not again later), so a child interpreter
    imports the copy of microbatch its parent runs from a checkout (``src``); unchanged where the package is
    installed, in a folder the interpreter searches anyway (a site-packages folder ahead of the standard library
    would let any module there shadow it, and a system site ahead of the virtual environment's).

    The folder that holds the package, not the package's own folder: on the path, that one made the package's
    modules top-level names in every child (its ``_json.py`` took the place of the standard library's C JSON
    accelerator, ``errors`` and ``model`` shadowed any installed module of those names)."""
    root = package_root()
    if root in _site_folders():
        return dict(env)
    rest = [x for x in env.get("PYTHONPATH", "").split(os.pathsep) if x and x != root]
    return {**env, "PYTHONPATH": os.pathsep.join([root, *rest])}


def _site_folders() -> set[str]:
    """The site-packages folders this interpreter searches without being told (resolved)."""
    import site

    found = [*site.getsitepackages(), site.getusersitepackages()]
    return {str(Path(f).resolve()) for f in found}
