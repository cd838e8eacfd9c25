"""The public API, pinned: what ``microbatch`` exports, where each name lives, what importing costs.

A change to any of these is a change to the API and should show up here as a failing test: the
top-level ``__all__`` (exact list), the module each lazy export comes from, ``import microbatch``
loading neither torch nor matplotlib, and ``__all__`` in every public module of the library (every
name it lists exists). ``commands`` (click commands, loaded by the CLI) and ``__main__`` are not
library API and are not walked; modules whose name starts with one underscore are private.
"""

from __future__ import annotations

import importlib
import json
import pathlib
import pkgutil
import subprocess
import sys
import types
import typing

import pytest

import microbatch

ROOT = pathlib.Path(__file__).resolve().parents[1]

EXPECTED_ALL = [
    "__version__",
    "BatchConfig",
    "solve",
    "accumulate",
    "MicroBatchController",
    "tune",
    "recommend",
    "plan",
    "estimate_memory",
    "simulate",
    "run_pipeline",
    "ModelShape",
    "Accelerator",
    "TimingConfig",
    "ProbeConfig",
    "SearchConfig",
    "ChoiceConfig",
    "Measurement",
    "TuneResult",
    "CurvePoint",
    "Recommendation",
    "PlanConfig",
    "Plan",
    "MemoryConfig",
    "MemoryCalibration",
    "MemoryEstimate",
    "Schedule",
    "SimResult",
    "PipelineConfig",
    "PipelineReport",
    "GradientNoiseScale",
]
"""The top-level ``microbatch.__all__``, in order: the functions, then the config and result types
they take and return."""

EXPECTED_HOME = {
    # public name: (defining module, name there)
    "BatchConfig": ("microbatch.batch", "BatchConfig"),
    "solve": ("microbatch.batch", "solve"),
    "accumulate": ("microbatch.run.accumulate.exact", "accumulate"),
    "MicroBatchController": ("microbatch.run.accumulate.controller", "MicroBatchController"),
    "tune": ("microbatch.choose.tune.entry", "tune"),
    "recommend": ("microbatch.choose.knee", "recommend"),
    "plan": ("microbatch.predict.plan", "make_plan"),
    "estimate_memory": ("microbatch.predict.memory", "estimate_memory"),
    "simulate": ("microbatch.schedules.simulate", "simulate"),
    "run_pipeline": ("microbatch.run.pipeline.launch", "run_pipeline"),
    "ModelShape": ("microbatch.shape", "ModelShape"),
    "Accelerator": ("microbatch.hardware", "Accelerator"),
    "TimingConfig": ("microbatch.measure.timing", "TimingConfig"),
    "ProbeConfig": ("microbatch.choose.tune.config", "ProbeConfig"),
    "SearchConfig": ("microbatch.choose.tune.config", "SearchConfig"),
    "ChoiceConfig": ("microbatch.choose.config", "ChoiceConfig"),
    "Measurement": ("microbatch.measure.probes", "Measurement"),
    "TuneResult": ("microbatch.choose.result", "TuneResult"),
    "CurvePoint": ("microbatch.choose.curve", "CurvePoint"),
    "Recommendation": ("microbatch.choose.knee", "Recommendation"),
    "PlanConfig": ("microbatch.predict.plan_config", "PlanConfig"),
    "Plan": ("microbatch.predict.plan", "Plan"),
    "MemoryConfig": ("microbatch.predict.memory_config", "MemoryConfig"),
    "MemoryCalibration": ("microbatch.predict.memory_config", "MemoryCalibration"),
    "MemoryEstimate": ("microbatch.predict.memory_estimate", "MemoryEstimate"),
    "Schedule": ("microbatch.schedules.action", "Schedule"),
    "SimResult": ("microbatch.schedules.simulate", "SimResult"),
    "PipelineConfig": ("microbatch.run.pipeline.config", "PipelineConfig"),
    "PipelineReport": ("microbatch.run.pipeline.report", "PipelineReport"),
    "GradientNoiseScale": ("microbatch.run.noise", "GradientNoiseScale"),
}
"""Where each lazily exported entry point is defined (``obj.__module__``, ``obj.__name__``)."""


# -- the top-level package ---------------------------------------------------------------------


def test_top_level_all_is_pinned() -> None:
    assert microbatch.__all__ == EXPECTED_ALL


def test_every_export_has_a_pinned_home() -> None:
    assert set(EXPECTED_HOME) == set(EXPECTED_ALL) - {"__version__"}


@pytest.mark.parametrize("name", sorted(EXPECTED_HOME))
def test_lazy_export_resolves_to_its_definition(name: str) -> None:
    module, qualname = EXPECTED_HOME[name]
    obj = getattr(microbatch, name)
    assert callable(obj), f"microbatch.{name} is a {type(obj).__name__}, not callable"
    assert (obj.__module__, obj.__name__) == (module, qualname)
    assert obj is getattr(importlib.import_module(module), qualname)
    ns: dict[str, object] = {}
    exec(f"from microbatch import {name} as imported", ns)
    assert ns["imported"] is obj


PUBLIC_FUNCTIONS = (
    "tune",
    "recommend",
    "plan",
    "estimate_memory",
    "simulate",
    "run_pipeline",
    "accumulate",
    "solve",
)
"""The top-level functions whose signatures the exported types must cover."""


def _classes_in(hint: object) -> set[type]:
    """The classes a type hint names, through unions, generics and callables (whose parameters
    come as a list)."""
    if isinstance(hint, list):
        return set().union(*(_classes_in(h) for h in hint))
    found = {hint} if isinstance(hint, type) else set()
    return found.union(*(_classes_in(a) for a in typing.get_args(hint)))


def test_the_types_the_functions_take_and_return_are_exported() -> None:
    """Every microbatch class named in a public function's signature (parameters and return) is in
    ``microbatch.__all__``, as the very class the function names."""
    named: set[type] = set()
    for name in PUBLIC_FUNCTIONS:
        fn = getattr(microbatch, name)
        hints = typing.get_type_hints(getattr(fn, "__wrapped__", fn))
        named |= {c for h in hints.values() for c in _classes_in(h) if c.__module__.startswith("microbatch.")}
    exported = {getattr(microbatch, n) for n in EXPECTED_HOME}
    assert {c.__name__ for c in named} >= {
        "TuneResult",
        "PlanConfig",
        "Plan",
        "SimResult",
        "PipelineConfig",
        "PipelineReport",
    }
    assert not named - exported, sorted(c.__name__ for c in named - exported)


def test_dir_lists_the_exports_and_unknown_names_raise() -> None:
    assert set(EXPECTED_ALL) <= set(dir(microbatch))
    with pytest.raises(AttributeError, match=r"module 'microbatch' has no attribute 'no_such_name'"):
        _ = microbatch.no_such_name


def test_version_matches_pyproject() -> None:
    import tomllib  # stdlib from 3.11, the floor in pyproject.toml

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert microbatch.__version__ == project["version"]
    assert project["requires-python"].startswith(">=3.11")  # tomllib: no test may skip for want of it


def _loaded_after(statement: str) -> dict[str, bool]:
    """Which heavy modules a fresh interpreter has loaded after running ``statement``."""
    code = (
        f"import sys, json; {statement}; "
        "print(json.dumps({m: m in sys.modules for m in ('torch', 'matplotlib', 'numpy')}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT, timeout=300
    )
    loaded: dict[str, bool] = json.loads(out.stdout.strip().splitlines()[-1])
    return loaded


def test_import_microbatch_loads_neither_torch_nor_matplotlib() -> None:
    loaded = _loaded_after("import microbatch")
    assert not loaded["torch"] and not loaded["matplotlib"], loaded


def test_the_import_probe_can_see_torch() -> None:
    """The probe above can fail: the first use of a torch-backed export does load torch."""
    assert _loaded_after("import microbatch; microbatch.accumulate")["torch"]


# -- __all__ in every public module --------------------------------------------------------------


def public_module_names() -> list[str]:
    """Every module of the library API: walked with pkgutil, less commands, __main__ and _private ones."""
    names = []
    for info in pkgutil.walk_packages(microbatch.__path__, "microbatch."):
        parts = info.name.split(".")
        if parts[1] in ("commands", "__main__"):
            continue
        if any(p.startswith("_") and not p.startswith("__") for p in parts):
            continue
        names.append(info.name)
    return sorted(names)


PUBLIC_MODULES = public_module_names()


def lacking_all(modules: list[types.ModuleType]) -> list[str]:
    """Names of the modules without ``__all__``."""
    return [m.__name__ for m in modules if not hasattr(m, "__all__")]


def problems_with_all(module: types.ModuleType) -> list[str]:
    """What is wrong with ``module.__all__``: a non-string, a duplicate, a listed name that is missing."""
    listed = list(module.__all__)
    problems = [f"{n!r} is not a string" for n in listed if not isinstance(n, str)]
    problems += [
        f"{n!r} is listed twice" for n in sorted({n for n in listed if listed.count(n) > 1}, key=str)
    ]
    problems += [f"{n!r} is listed but not defined" for n in listed if not hasattr(module, str(n))]
    return problems


def test_the_walk_finds_the_layers() -> None:
    """The walk is not vacuous: it reaches every layer's modules, and skips commands and __main__."""
    assert {
        "microbatch.run.accumulate",
        "microbatch.run.noise",
        "microbatch.batch",
        "microbatch.units",
    } <= set(PUBLIC_MODULES)
    layers = {n.split(".")[1] for n in PUBLIC_MODULES if n.count(".") >= 1}
    assert {"schedules", "predict", "measure", "choose", "run", "show"} <= layers
    assert not [n for n in PUBLIC_MODULES if n.startswith("microbatch.commands") or n.endswith("__main__")]


def test_every_public_module_has_all() -> None:
    modules, broken = [], []
    for name in PUBLIC_MODULES:
        try:
            modules.append(importlib.import_module(name))
        except ImportError as e:
            broken.append(f"{name} (cannot be imported: {e})")
    missing = lacking_all(modules)
    assert not missing + broken, (
        f"{len(missing)} public modules have no __all__, {len(broken)} cannot be checked:\n"
        + "\n".join(missing + broken)
    )


@pytest.mark.parametrize("name", PUBLIC_MODULES)
def test_every_name_in_all_exists(name: str) -> None:
    module = importlib.import_module(name)
    if not hasattr(module, "__all__"):
        pytest.skip(f"{name} has no __all__ (reported by test_every_public_module_has_all)")
    problems = problems_with_all(module)
    assert not problems, f"{name}.__all__: " + "; ".join(problems)


def test_the_checks_can_fail() -> None:
    """The checkers report a module without __all__ and an __all__ naming what is not there."""
    bare = types.ModuleType("fake_bare")
    good = types.ModuleType("fake_good")
    good.__all__ = ["f"]  # type: ignore[attr-defined]
    good.f = len  # type: ignore[attr-defined]
    bad = types.ModuleType("fake_bad")
    bad.__all__ = ["f", "gone", "f", 3]  # type: ignore[attr-defined]
    bad.f = len  # type: ignore[attr-defined]
    assert lacking_all([bare, good, bad]) == ["fake_bare"]
    assert problems_with_all(good) == []
    assert problems_with_all(bad) == [
        "3 is not a string",
        "'f' is listed twice",
        "'gone' is listed but not defined",
        "3 is listed but not defined",
    ]


def test_type_checkers_see_every_lazy_export_from_its_module():
    """``__getattr__`` returns Any, so a type checker saw ``microbatch.tune`` as Any (and ``from microbatch import
    tunee`` passed mypy --strict) though the package ships py.typed: the ``if TYPE_CHECKING:`` imports name every
    export, from the module ``_LAZY`` loads it from, under its public name."""
    import ast

    tree = ast.parse((ROOT / "src" / "microbatch" / "__init__.py").read_text())
    block = next(
        n
        for n in tree.body
        if isinstance(n, ast.If) and isinstance(n.test, ast.Name) and n.test.id == "TYPE_CHECKING"
    )
    seen = {
        (alias.asname or alias.name): (node.module, alias.name)
        for node in block.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    want = {
        name: (f"microbatch.{mod}", microbatch._RENAMED.get(name, name))
        for name, mod in microbatch._LAZY.items()
    }
    assert seen == want
