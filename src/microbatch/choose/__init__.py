"""Choosing: the knee rules and the search that measures as little as it can (``tune``).

Layer 4: uses ``predict`` and ``measure``. Modules, bottom up:

- ``curve``: a measured point of the throughput curve, the gain per doubling;
- ``bound``: the bound on what a larger b_m can reach (a line fitted to step time);
- ``memory_fit``: peak memory M(b) = M_0 + k·b and the largest b_m that fits;
- ``config``: the settings — ``ChoiceConfig``, ``SearchConfig``, ``ProbeConfig``;
- ``knee``: the knee rules and ``recommend`` (the choice under budget, latency and B_global);
- ``search``: the doubling search and its stop rules;
- ``cache``, ``probing``, ``result``: the tune cache, driving the probes, the answer;
- ``tune``: the entry points ``tune_model`` (a described model) and ``tune`` (the user's step).

Why the rules are what they are: ``docs/knee.md``.
"""

__all__: list[str] = []
