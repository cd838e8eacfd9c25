"""Choosing: the knee rules (pure) and, in :mod:`microbatch.choose.tune`, the one measuring driver.

Layer 4, beside ``run`` (the two do not import each other): uses ``predict`` and ``measure``.
The rules, bottom up (no clock, no probe, no device: a curve in, a choice out):

- ``curve``: a measured point of the throughput curve, the gain per doubling;
- ``bound``: the bound on what a larger b_m can reach (a line fitted to step time);
- ``memory_fit``: peak memory M(b) = M_0 + k·b and the largest b_m that fits;
- ``confirm_rules``: which points confirm the knee, which measurement of each to keep, the noise;
- ``noise``: the standard errors that say when two points cannot be told apart;
- ``config``: the settings of a choice, ``ChoiceConfig`` (and ``apply_options``: keywords into a config);
- ``knee``: the knee rules and ``recommend`` (the choice under budget, latency and B_global);
- ``result``: :class:`~microbatch.choose.result.TuneResult`, the answer of a tune.

``tune/``: the search, the confirmation, probing, the cache and the entry points ``tune`` and
``tune_model``; every integration runs the same driver. Why the rules are what they are:
``docs/knee.md``.
"""

__all__: list[str] = []
