"""Running the choice: exact gradient accumulation, the gradient noise scale, pipeline training.

Layer 5, beside ``choose`` (the two do not import each other); returns data, never draws
(``show`` draws).

- :mod:`~microbatch.run.accumulate`: exact accumulation, out-of-memory splitting, the controller;
- :mod:`~microbatch.run.pipeline`: one resolved pipeline run, its ranks and its report;
- :mod:`~microbatch.run.noise`, :mod:`~microbatch.run.noise_measure`: the gradient noise scale.
"""

__all__: list[str] = []
