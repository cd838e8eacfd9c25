"""Choosing: the knee rules and the search that measures as little as it can (``tune``).

Layer 4: uses ``predict`` and ``measure``.
"""
