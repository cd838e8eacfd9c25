"""The one measuring driver: every entry point that measures a curve runs it.

:func:`tune` (the user's own step), :func:`tune_model` (a described model) and the integrations
(Lightning, the Hugging Face Trainer, Accelerate's decorator) resolve their settings, open a prober
and hand it to :func:`~microbatch.choose.tune.driver.run_search`, which searches, confirms the knee
and chooses with the pure rules of :mod:`microbatch.choose`. Modules, bottom up:

- ``config``: the settings of the measuring, ``SearchConfig`` and ``ProbeConfig``;
- ``preflight``: the checks made before any model is built;
- ``cache``: the tune cache (keys, points on disk);
- ``probing``: the prober protocol, default timings, the memory budget, opening a prober;
- ``search``: the doubling search and its stop rules;
- ``confirm``: the knee measured again before answering;
- ``user_step``: what probing the user's own step needs (threads, timing, batch structure);
- ``driver``: :func:`~microbatch.choose.tune.driver.run_search`, the one search loop;
- ``entry``: :func:`tune` and :func:`tune_model`.

The entry points load on first use (``from microbatch.choose.tune import tune``), so importing a
module of this package does not import them all.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the names as the type checker sees them; loaded on first use at run time
    from microbatch.choose.tune.entry import (
        NOTHING_MEASURED,
        NonFiniteLoss,
        TuneInterrupted,
        configs_from_options,
        tune,
        tune_model,
    )

__all__ = [
    "NOTHING_MEASURED",
    "NonFiniteLoss",
    "TuneInterrupted",
    "configs_from_options",
    "tune",
    "tune_model",
]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.entry"), name)


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
