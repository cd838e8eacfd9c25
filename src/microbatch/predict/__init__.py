"""Predictions: memory per stage, the roofline step time, candidates, plans, calibration.

Layer 3 (above ``schedules``; beside ``measure``). No torch at module level.
"""
