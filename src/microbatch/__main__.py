"""``python -m microbatch``: the command line (:func:`microbatch.cli.main`)."""

import sys

from microbatch.cli import main

__all__: list[str] = []

if __name__ == "__main__":
    sys.exit(main())
