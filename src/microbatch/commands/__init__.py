"""One module per CLI command; each defines ``cmd``, a click command. See ``microbatch.cli``."""

__all__: list[str] = []
