"""Predictions: memory per stage, the roofline step time, candidates, plans, calibration.

- ``state`` (bytes of weights, gradients, optimizer state per parameter; ZeRO) and ``activations``
  (bytes one layer keeps per micro-batch) → ``memory`` (per pipeline stage, with the in-flight rule);
- ``roofline`` (a layer's forward time, collectives) → ``steptime`` (the one step-time rule);
- ``plan_config`` (what to plan) → ``candidate`` (one candidate's memory and time) → ``plan``
  (enumerate, simulate the leaders and the contenders, recommend, lint, advise);
- ``calibrate`` (fit corrections to measured points) → ``apply_calibration`` (use them in a plan)
  and ``validation`` (the planner's error, stated).

Layer 3 (above ``schedules``; beside ``measure``). No torch at module level.
"""

__all__: list[str] = []
