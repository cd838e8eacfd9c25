"""The command line of the benches that print a table of rows: ``--json`` for the rows, else the rendering."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable


def run_table(doc: str, rows: Callable[[], list[dict]], render: Callable[[list[dict]], None]) -> None:
    """Parse ``--json`` (the description: ``doc``'s first line), build ``rows()`` and print them as JSON or
    through ``render``."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    table = rows()
    if args.json:
        print(json.dumps(table, indent=1))
        return
    render(table)
