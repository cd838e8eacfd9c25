"""Measurements from the machine: timing, host and device memory, probes, the built-in GPT.

Layer 3 (above ``schedules``; beside ``predict``). A measured figure comes from the allocator,
the clock or the process, never from the arithmetic of a prediction.
"""
