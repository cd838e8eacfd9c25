"""The layer rule of ../shared/DESIGN.md, read from the source with ``ast`` so it cannot erode.

Layers, bottom up: core → schedules → predict, measure → choose, run → integrations → show →
commands / cli. A module imports only from its own layer and the layers below; ``predict`` and
``measure`` are peers that do not import each other, and so are ``choose`` and ``run``; nothing in the library imports
``commands`` or ``cli``; ``schedules`` and ``predict`` import no torch at module level; no
import circle between modules; no module over 500 lines and no function over 80 (an explicit,
named allow-list for predict/ while issue 28 works there).
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

PKG = pathlib.Path(__file__).resolve().parents[1] / "src" / "microbatch"

RANK = {
    "core": 0,
    "schedules": 1,
    "predict": 2,
    "measure": 2,
    "choose": 3,
    "run": 3,  # choose's peer: neither imports the other (what both need lives below: model.check_seq)
    "integrations": 5,
    "show": 6,
    "commands": 7,
    "cli": 8,  # the entry point over the commands: it dispatches to them and writes their errors' flags
    "__main__": 9,
}
HEAVY = ("torch", "numpy", "matplotlib", "transformers")


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(p for p in parts if p != "__init__")


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in RANK else "core"


def imports(path: pathlib.Path, *, top_level_only: bool = False) -> list[tuple[str, int]]:
    """(imported module, line) for every import in ``path``; with top_level_only, module scope only."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    out: list[tuple[str, int]] = []
    for node in nodes:
        if (
            isinstance(node, ast.If) and top_level_only
        ):  # `if TYPE_CHECKING:` blocks import nothing at run time
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "microbatch":
                out += [(f"microbatch.{a.name}", node.lineno) for a in node.names]
            else:
                out.append((node.module, node.lineno))
        elif isinstance(node, ast.ImportFrom) and node.level:
            out.append(("<relative>", node.lineno))
        elif isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
    return out


MODULES = sorted(PKG.rglob("*.py"))


def test_the_package_has_the_layers():
    found = {p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert {"schedules", "predict", "measure", "choose", "run", "integrations", "show", "commands"} <= found


@pytest.mark.parametrize("path", MODULES, ids=lambda p: module_name(p))
def test_imports_go_down_the_layers(path):
    me = module_name(path)
    mine = layer(me)
    bad = []
    # the package's facade names every layer's public API for type checkers (``if TYPE_CHECKING:``, py.typed) and
    # loads each lazily: only what it imports at run time is held to the layers
    for target, line in imports(path, top_level_only=me == "microbatch"):
        if target == "<relative>":
            bad.append(f"line {line}: relative import (write microbatch.<layer>.<module>)")
            continue
        if not target.startswith("microbatch"):
            continue
        theirs = layer(target)
        if RANK[theirs] > RANK[mine] or (RANK[theirs] == RANK[mine] and theirs != mine):
            bad.append(f"line {line}: {me} ({mine}) imports {target} ({theirs})")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(
    "path",
    [p for p in MODULES if layer(module_name(p)) in ("core", "schedules", "predict")],
    ids=lambda p: module_name(p),
)
def test_calculators_import_no_heavy_module_at_module_level(path):
    heavy = [
        f"line {line}: {t}" for t, line in imports(path, top_level_only=True) if t.split(".")[0] in HEAVY
    ]
    assert not heavy, f"{module_name(path)} imports at module level: " + ", ".join(heavy)


def test_no_import_circle():
    graph: dict[str, set[str]] = {}
    names = {module_name(p) for p in MODULES}
    for p in MODULES:
        me = module_name(p)
        graph[me] = {t for t, _ in imports(p) if t in names and t != me and not me.startswith(t + ".")}
        graph[me] -= {"microbatch"}
    # Tarjan-free check: depth-first search for a back edge.
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(n: str) -> None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                cycles.append(stack[stack.index(m) :] + [m])
            elif m not in state:
                visit(m)
        stack.pop()
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n)
    assert not cycles, "import circles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_rule_catches_an_upward_import(tmp_path):
    """The checker itself can fail: an upward import in a fake module is reported."""
    fake = tmp_path / "m.py"
    fake.write_text("from microbatch.show.text import render_timeline_text\n")
    found = [t for t, _ in imports(fake)]
    assert found == ["microbatch.show.text"]
    assert RANK[layer(found[0])] > RANK[layer("microbatch.predict.memory")]


def test_choose_and_run_are_peers():
    """choose and run share a rank, so test_imports_go_down_the_layers refuses an import either way
    between them (the rule for two layers of one rank: only a layer's own modules)."""
    for me, other in (
        ("microbatch.run.pipeline.launch", "microbatch.choose.tune.preflight"),
        ("microbatch.choose.tune.entry", "microbatch.run.accumulate.exact"),
    ):
        mine, theirs = layer(me), layer(other)
        assert RANK[theirs] == RANK[mine] and theirs != mine, (me, other)


def test_modules_stay_under_500_lines():
    big = {module_name(p): n for p in MODULES if (n := len(p.read_text().splitlines())) > 500}
    assert not big, f"modules over 500 lines (split along the real seam): {big}"


MAX_FUNCTION_LINES = 80
"""The most lines a function (its signature, docstring and body; a method or a nested function
counts on its own) may span; past it, split along its real seam (a command parses, calls, renders)."""

LONG_FUNCTIONS_ALLOWED: dict[str, str] = {}
"""The functions allowed past MAX_FUNCTION_LINES, each with its reason: only predict/'s, while
another engineer works there (issue 28); remove an entry once its function is split."""


def function_lines(path: pathlib.Path, module: str | None = None) -> dict[str, int]:
    """Qualified name (``module.Class.method``, ``module.outer.inner``) -> lines of every function in ``path``."""
    out: dict[str, int] = {}

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}.{child.name}"
                if not isinstance(child, ast.ClassDef):
                    out[name] = (child.end_lineno or child.lineno) - child.lineno + 1
                walk(child, name)
            else:
                walk(child, prefix)

    walk(ast.parse(path.read_text()), module or module_name(path))
    return out


def test_functions_stay_under_80_lines():
    long = {
        name: n
        for p in MODULES
        for name, n in function_lines(p).items()
        if n > MAX_FUNCTION_LINES and name not in LONG_FUNCTIONS_ALLOWED
    }
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split along the real seam): {long}"


def test_the_long_function_allow_list_is_predicts_and_current():
    """Each allowed function is in predict/, has a reason, and is still long (else its entry goes)."""
    lines = {name: n for p in MODULES for name, n in function_lines(p).items()}
    for name, why in LONG_FUNCTIONS_ALLOWED.items():
        assert name.startswith("microbatch.predict.") and why, name
        assert name in lines, f"{name} is allowed to be long but no longer exists: remove its entry"
        assert lines[name] > MAX_FUNCTION_LINES, f"{name} is {lines[name]} lines now: remove its entry"


def test_the_size_rule_catches_a_long_function(tmp_path):
    """The checker itself can fail: a method of 81 lines in a fake module is measured as such."""
    fake = tmp_path / "m.py"
    body = "".join(f"        x{i} = {i}\n" for i in range(79))
    fake.write_text(
        f"class C:\n    def f(self):\n{body}        return 0\n\n    def g(self):\n        return 1\n"
    )
    found = function_lines(fake, "m")
    assert found == {"m.C.f": 81, "m.C.g": 2}
    assert [n for n, k in found.items() if k > MAX_FUNCTION_LINES] == ["m.C.f"]


FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9]*(?:-[a-z0-9]+)*")
"""A command-line flag in a string: ``--micro-batch``, ``--json`` (not ``a--b``, not ``---``)."""

FLAG_STRINGS_ALLOWED = {
    "microbatch.measure.childprobe": (3, "the child process's own argv (--worker), not a microbatch flag"),
    "microbatch.measure.board": (
        3,
        "nvidia-smi's own argv (--query-gpu, --format, --id), not a microbatch flag",
    ),
    # issue 31 item 4: modules other engineers were restructuring; convert, then lower or drop the entry
    "microbatch.run.pipeline.launch": (
        1,
        "torchrun's own flag (--master-port) in a retry hint, not a microbatch flag",
    ),
    "microbatch.integrations.": (
        1,
        "torchrun's own flag (--nproc_per_node) in integrations/hf, not a microbatch flag",
    ),
    "microbatch.show.export": (1, "torchrun's own flag (--nproc_per_node) in the hf note, not ours"),
}
"""Module (or package prefix ending in ``.``) below ``commands/`` -> (most strings naming a flag, why).
The library speaks in parameter names (``micro_batch``) and carries them in ``ConfigError.params``;
``commands/_flags.py`` writes them as flags. show/ is held to the same rule: a sentence it writes names
a parameter, and a command passes its flag in where the text is for the command line
(``render_tune(again="--no-cache")``). Each entry may only shrink; a module not listed has none."""


def _docstring_nodes(tree: ast.AST) -> set[int]:
    """ids of the string statements that are docstrings (a module's, class's, function's, attribute's)."""
    out: set[int] = set()
    for node in ast.walk(tree):
        for st in getattr(node, "body", []) if isinstance(getattr(node, "body", None), list) else []:
            if (
                isinstance(st, ast.Expr)
                and isinstance(st.value, ast.Constant)
                and isinstance(st.value.value, str)
            ):
                out.add(id(st.value))
    return out


def flag_strings(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, text) of every string in ``path`` that names a flag, docstrings and comments aside
    (an f-string counts each literal part)."""
    tree = ast.parse(path.read_text())
    docs = _docstring_nodes(tree)
    return [
        (n.lineno, n.value)
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant)
        and isinstance(n.value, str)
        and id(n) not in docs
        and FLAG.search(n.value)
    ]


def _flag_key(module: str) -> str | None:
    return next(
        (k for k in FLAG_STRINGS_ALLOWED if module == k or (k.endswith(".") and module.startswith(k))), None
    )


def test_the_library_speaks_in_parameters_not_flags():
    """Below commands/ a string names a flag only where FLAG_STRINGS_ALLOWED still allows it."""
    counts: dict[str, int] = {}
    stray: dict[str, list[tuple[int, str]]] = {}
    for p in MODULES:
        mod = module_name(p)
        if layer(mod) in ("commands", "cli") or not (found := flag_strings(p)):
            continue
        key = _flag_key(mod)
        if key is None:
            stray[mod] = found
        else:
            counts[key] = counts.get(key, 0) + len(found)
    assert not stray, f"flags below commands/ (name the parameter, add it to ConfigError.params): {stray}"
    over = {k: (n, FLAG_STRINGS_ALLOWED[k][0]) for k, n in counts.items() if n > FLAG_STRINGS_ALLOWED[k][0]}
    assert not over, f"more flag strings than allowed (found, allowed): {over}"


def test_the_flag_rule_catches_a_flag(tmp_path):
    """The checker itself can fail: a flag in a message counts, one in a docstring does not."""
    fake = tmp_path / "m.py"
    fake.write_text(
        '"""Use ``--seq``."""\n\ndef f(seq):\n    """--seq too."""\n'
        '    raise ValueError(f"give a shorter --seq than {seq}; or-- not --")\n'
    )
    assert [line for line, _ in flag_strings(fake)] == [5]
    assert not FLAG.search("no a--b, no --, no ---x")


def _schedule_words() -> set[str]:
    """Every registered schedule name and alias (the registry is the one table of them)."""
    from microbatch.schedules.registry import SCHEDULES

    return {n for spec in SCHEDULES.values() for n in (spec.name, *spec.aliases)}


def schedule_name_comparisons(path: pathlib.Path, words: set[str]) -> list[tuple[int, str]]:
    """(line, name) of every comparison in ``path`` against a schedule name or alias written as a string:
    ``name == "dualpipev"``, ``name in ("gpipe", "1f1b")``, ``case "zb-h1":``. A name as data (a default,
    a list to loop over, a message) is not a comparison."""
    tree = ast.parse(path.read_text())
    found: list[tuple[int, str]] = []

    def check(node: ast.AST, line: int) -> None:
        items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
        for item in items:
            if isinstance(item, ast.Constant) and isinstance(item.value, str) and item.value.lower() in words:
                found.append((line, item.value))

    for n in ast.walk(tree):
        if isinstance(n, ast.Compare):
            for operand in (n.left, *n.comparators):
                check(operand, n.lineno)
        elif isinstance(n, ast.MatchValue):
            check(n.value, n.value.lineno)
    return sorted(found)


def test_schedule_behaviour_comes_from_the_registry():
    """Outside schedules/ no code compares a schedule's name to decide what to do: behaviour that differs
    by schedule is a field or function of its registry entry (DESIGN), so a new schedule touches only
    schedules/ and its tests."""
    words = _schedule_words()
    stray = {
        module_name(p): found
        for p in MODULES
        if layer(module_name(p)) != "schedules" and (found := schedule_name_comparisons(p, words))
    }
    assert not stray, f"schedule names compared outside schedules/ (make it a field of ScheduleSpec): {stray}"


def test_the_schedule_name_rule_catches_a_comparison(tmp_path):
    """The checker itself can fail: ==, in a tuple and a match case count; a default, a list of data and
    a message do not."""
    fake = tmp_path / "m.py"
    fake.write_text(
        'def f(name="1f1b"):\n'
        '    for n in ("gpipe", "1f1b"):\n'
        '        print(f"{n} is not dualpipev")\n'
        '    if name == "DualPipeV" or "zb-h1" != name:\n'
        "        return 1\n"
        '    if name in ("gpipe", "other"):\n'
        "        return 2\n"
        "    match name:\n"
        '        case "interleaved":\n'
        "            return 3\n"
        "    return 0\n"
    )
    words = _schedule_words()
    assert schedule_name_comparisons(fake, words) == [
        (4, "DualPipeV"), (4, "zb-h1"), (6, "gpipe"), (9, "interleaved")
    ]  # fmt: skip


def import_graph() -> dict[str, list[str]]:
    """Module -> the microbatch modules it imports (anywhere in the file), sorted."""
    names = {module_name(p) for p in MODULES}
    graph: dict[str, list[str]] = {}
    for p in MODULES:
        me = module_name(p)
        graph[me] = sorted({t for t, _ in imports(p) if t in names and t != me and t != "microbatch"})
    return graph


if __name__ == "__main__":  # `make graph`: the import graph, layer by layer, with line counts
    lines = {module_name(p): len(p.read_text().splitlines()) for p in MODULES}
    g = import_graph()
    for mod in sorted(g, key=lambda m: (RANK[layer(m)], m)):
        print(f"[{layer(mod)}] {mod} ({lines[mod]} lines)")
        for t in g[mod]:
            print(f"    -> {t} [{layer(t)}]")
