"""A child interpreter of the tool imports the parent's microbatch, and only as a package (microbatch.child_env)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import microbatch
from microbatch.child_env import package_root, with_package_on_path


def test_the_folder_holding_the_package_goes_first_once():
    root = package_root()
    assert (Path(root) / "microbatch" / "__init__.py").resolve() == Path(microbatch.__file__).resolve()
    env = with_package_on_path({"PYTHONPATH": os.pathsep.join(["/a", root, "/b"]), "X": "1"})
    assert env["PYTHONPATH"].split(os.pathsep) == [root, "/a", "/b"] and env["X"] == "1"
    assert with_package_on_path({})["PYTHONPATH"] == root


def test_a_child_sees_the_standard_librarys_json_accelerator_not_the_packages_module():
    """The probes put the package's own folder on PYTHONPATH: in every child its ``_json.py`` replaced the C JSON
    scanner (``json.decoder.c_scanstring`` None) and ``errors`` was a top-level module."""
    code = (
        "import json.decoder, importlib.util, microbatch; "
        "print(json.decoder.c_scanstring is not None, importlib.util.find_spec('errors') is None, microbatch.__file__)"
    )
    env = with_package_on_path({k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd="/", capture_output=True, text=True, timeout=60
    )
    c_scanner, no_errors_module, where = out.stdout.split()
    assert (c_scanner, no_errors_module) == ("True", "True"), out
    assert Path(where).resolve() == Path(microbatch.__file__).resolve()


def test_an_installed_package_leaves_the_path_as_it_is(monkeypatch):
    """Installed, the package's folder is a site-packages folder the child searches anyway; put first, it came before
    the standard library (a ``fractions.py`` there shadowed the standard one in every probe: a helper's run)."""
    from microbatch import child_env

    monkeypatch.setattr(child_env, "_site_folders", lambda: {package_root()})
    assert with_package_on_path({"PYTHONPATH": "/a"}) == {"PYTHONPATH": "/a"}
    assert "PYTHONPATH" not in with_package_on_path({})
