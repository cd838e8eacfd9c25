"""README's architecture table names every module of the package, and no module that is gone.

The table is the map a new contributor reads first; a helper found six modules missing from it (2026-12-07), so
this test reads the table's backticked names per row and compares them with the files under ``src/microbatch``.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "microbatch"


def _table_rows() -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Architecture", 1)[1].split("\n## ", 1)[0]
    return [line for line in section.splitlines() if line.startswith("| ") and "---" not in line][1:]


def _named(cell: str) -> set[str]:
    return set(re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", cell))


def _modules(folder: Path) -> set[str]:
    return {p.stem for p in folder.glob("*.py") if p.stem != "__init__"}


def _folder_of(first_cell: str) -> str | None:
    """The top-level folder a row describes ('' for core, the package's own modules), from its first cell."""
    found = re.search(r"`([a-z_]+)/`", first_cell)
    return found.group(1) if found else ("" if "core" in first_cell else None)


def test_every_module_is_in_its_layers_row():
    missing: list[str] = []
    rows = _table_rows()
    first_cells = set().union(*(_named(row.strip("| ").split(" | ")[0].replace(".py", "")) for row in rows))
    for row in rows:
        cells = row.strip("| ").split(" | ")
        folder = _folder_of(cells[0])
        assert folder is not None, f"a row of README's architecture table names no layer: {cells[0]!r}"
        named = _named(cells[1]) | (first_cells if not folder else set())  # `cli.py` heads the commands' row
        base = PACKAGE / folder if folder else PACKAGE
        files = base.rglob("*.py") if folder else base.glob("*.py")
        for path in files:
            if path.stem in ("__init__", "__main__") or "__pycache__" in path.parts:
                continue
            command = folder == "commands" and not path.stem.startswith("_")  # "one module per command"
            if path.stem not in named and not command:
                missing.append(str(path.relative_to(PACKAGE)))
    assert not missing, f"README's architecture table does not name, in its layer's row: {sorted(missing)}"


def test_the_table_names_no_module_that_is_gone():
    rows = _table_rows()
    every = {p.stem for p in PACKAGE.rglob("*.py")} | {p.name for p in PACKAGE.rglob("*") if p.is_dir()}
    ghosts = sorted(name for row in rows for name in _named(row.split(" | ")[1]) if name not in every)
    assert not ghosts, f"README's architecture table names modules that do not exist: {ghosts}"


def test_the_reader_sees_the_rows():
    # the parse itself: every layer row read, and a module known to be listed found in its row
    rows = _table_rows()
    assert len(rows) >= 9
    assert any("steptime" in _named(row.split(" | ")[1]) for row in rows)
    assert _modules(PACKAGE / "predict") >= {"steptime", "roofline"}
