"""Integrations with the loops people already train in: the knee on their real step, B_global held exactly.

Layer 6. The frameworks are optional dependencies, imported inside functions (Lightning's
``Callback`` base class excepted: :mod:`~microbatch.integrations.lightning_oom` imports it when
Lightning is installed).

- :mod:`~microbatch.integrations.lightning`: ``KneeBatchSize``, a callback like ``BatchSizeFinder``.
- :mod:`~microbatch.integrations.lightning_oom`: ``SplitOnOOM``, a callback that redoes a step that ran
  out of memory in smaller pieces, with the same gradient (re-exported by ``lightning``).
- :mod:`~microbatch.integrations.hf`: ``tune_trainer``, the replacement for ``auto_find_batch_size``.
- :mod:`~microbatch.integrations.accelerate`: ``knee_batch_size``, the replacement for
  ``find_executable_batch_size``.
- :mod:`~microbatch.integrations.common`: the B_global checks they share.

Each probes with :func:`microbatch.tune`, which leaves the model, optimizer and random generators
as it found them (:mod:`microbatch.measure.snapshot`).
"""

__all__: list[str] = []
