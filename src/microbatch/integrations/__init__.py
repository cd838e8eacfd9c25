"""Integrations with the loops people already train in (Lightning, Hugging Face, Accelerate).

Layer 6. The frameworks are optional dependencies, imported inside functions.
"""

__all__: list[str] = []
