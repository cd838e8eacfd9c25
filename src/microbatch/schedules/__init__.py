"""The schedule as a value: actions, the registry of schedules, generators, validation, simulation.

Layer 2 (above the core). Pure Python: no torch at module level, so calculators start fast.
"""
