"""Running the choice: exact gradient accumulation, the gradient noise scale, pipeline training.

Layer 5: uses the layers below; returns data, never draws (``show`` draws).
"""

__all__: list[str] = []
