"""The schedule as a value: actions, the registry of schedules, generators, validation, simulation.

Layer 2 (above the core). Pure Python: no torch at module level, so calculators start fast.

- :mod:`~microbatch.schedules.action` — :class:`Action`, :class:`Schedule`, placements;
- :mod:`~microbatch.schedules.registry` — the one table of schedules (names, aliases, placement,
  in-flight rule, torch class, (p, m, v) rules) that every layer and every ``--schedule`` reads;
- :mod:`~microbatch.schedules.generators` — the built-in action orders;
- :mod:`~microbatch.schedules.rules` — their servability checks and in-flight rules;
- :mod:`~microbatch.schedules.validate` — the dependency and deadlock check;
- :mod:`~microbatch.schedules.simulate` — the event simulation (re-exporting the closed forms);
- :mod:`~microbatch.schedules.closed_forms` — the bubble's closed forms, each with its source and rule.
"""

__all__: list[str] = []
