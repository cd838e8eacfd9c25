"""Showing results: text tables and diagrams, figures, the HTML report, config exports.

Layer 7: formats data that the layers below return. The library below ``show`` never prints.
"""

__all__: list[str] = []
