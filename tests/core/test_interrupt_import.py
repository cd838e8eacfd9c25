"""A Ctrl-C during an import that swallows it (torch's C start-up imports numpy and clears the error) is raised
once the import is done: ``tune`` measured every point and exited 0 after one landed there (a review, 5 times)."""

from __future__ import annotations

import signal
import sys

import pytest

from microbatch.interrupts import imported_keeping_interrupts

SWALLOWS = """import os, signal, time
try:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.05)
except BaseException:
    pass
LOADED = True
"""


def test_an_interrupt_the_import_swallowed_is_raised_after_it(tmp_path, monkeypatch):
    (tmp_path / "swallowing_start_up.py").write_text(SWALLOWS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "swallowing_start_up", raising=False)
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        imported_keeping_interrupts("swallowing_start_up")
    assert sys.modules["swallowing_start_up"].LOADED  # the import itself finished
    assert signal.getsignal(signal.SIGINT) is before  # the handler put back


def test_without_an_interrupt_the_module_comes_back(tmp_path, monkeypatch):
    (tmp_path / "quiet_start_up.py").write_text("VALUE = 7\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "quiet_start_up", raising=False)
    assert imported_keeping_interrupts("quiet_start_up").VALUE == 7
    assert imported_keeping_interrupts("json") is sys.modules["json"]  # imported already: no handler swapped


def test_the_handler_that_was_there_gets_the_interrupt(tmp_path, monkeypatch):
    """A program's own SIGINT handler (one that sets a flag) is called after the import, not replaced by an
    exception (a review)."""
    (tmp_path / "swallowing_again.py").write_text(SWALLOWS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "swallowing_again", raising=False)
    seen: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: seen.append(signum))
    try:
        module = imported_keeping_interrupts("swallowing_again")
    finally:
        signal.signal(signal.SIGINT, previous)
    assert module.LOADED and seen == [signal.SIGINT]


def test_the_first_import_anywhere_keeps_the_interrupt(tmp_path, monkeypatch):
    """The finder the command line installs: a plain ``import`` of the named module, from any code, raises the
    Ctrl-C its start-up swallowed once it is done (validate's torch import lost one: exit 0, a review); the module
    keeps its own loader; a second import passes."""
    from microbatch.interrupts import _FirstImportFinder, interrupts_kept_in_first_import

    (tmp_path / "swallowing_anywhere.py").write_text(SWALLOWS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "swallowing_anywhere", raising=False)
    before = list(sys.meta_path)
    monkeypatch.setattr(sys, "meta_path", [f for f in before if not isinstance(f, _FirstImportFinder)])
    (tmp_path / "quiet_anywhere.py").write_text("VALUE = 3\n")
    monkeypatch.delitem(sys.modules, "quiet_anywhere", raising=False)
    interrupts_kept_in_first_import("swallowing_anywhere", "quiet_anywhere")
    interrupts_kept_in_first_import("swallowing_anywhere")  # once per process
    assert sum(isinstance(f, _FirstImportFinder) for f in sys.meta_path) == 1
    with pytest.raises(KeyboardInterrupt):
        import swallowing_anywhere  # noqa: F401
    monkeypatch.delitem(sys.modules, "swallowing_anywhere", raising=False)
    import quiet_anywhere  # through the finder: run under the held signals, its own loader kept

    assert quiet_anywhere.VALUE == 3 and type(quiet_anywhere.__loader__).__name__ == "SourceFileLoader"


def test_the_command_line_installs_it_before_torch_is_imported():
    import subprocess

    code = (
        "import sys; from microbatch.cli import main; main(['batch', '-B', '8', '-b', '2']); "
        "print('torch' in sys.modules, [type(f).__name__ for f in sys.meta_path][0])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
    assert out.strip().splitlines()[-1] == "False _FirstImportFinder"


def _fresh_finder(monkeypatch, tmp_path, **modules):
    from microbatch.interrupts import _FirstImportFinder, interrupts_kept_in_first_import

    for name, text in modules.items():
        (tmp_path / f"{name}.py").write_text(text)
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "meta_path", [f for f in sys.meta_path if not isinstance(f, _FirstImportFinder)])
    interrupts_kept_in_first_import(*modules)


def test_a_find_spec_check_before_the_import_does_not_use_the_hold_up(tmp_path, monkeypatch):
    """transformers checks importlib.util.find_spec("torch") before importing it: that lookup took the name off the
    finder, and the import after it was not held (a review)."""
    import importlib.util

    _fresh_finder(monkeypatch, tmp_path, swallowing_probed=SWALLOWS)
    assert (
        importlib.util.find_spec("swallowing_probed").loader.get_filename("swallowing_probed").endswith(".py")
    )
    with pytest.raises(KeyboardInterrupt):
        import swallowing_probed  # noqa: F401


def test_the_interrupted_module_stays_imported_whole(tmp_path, monkeypatch):
    """Raised inside the loader, the import machinery took the module out of sys.modules (torch's C extension stayed
    loaded, and torch could not be imported again in that process); delivered once the import returns, it stays."""
    _fresh_finder(monkeypatch, tmp_path, swallowing_kept=SWALLOWS)
    with pytest.raises(KeyboardInterrupt):
        import swallowing_kept  # noqa: F401
    assert sys.modules["swallowing_kept"].LOADED and sys.getprofile() is None
    import swallowing_kept  # noqa: F401, F811  (from sys.modules: no second run)


SLOW_TWICE = """import os, signal, time
os.kill(os.getpid(), signal.SIGINT)
time.sleep(0.05)
os.kill(os.getpid(), signal.SIGINT)  # a second Ctrl-C: acted on at once
time.sleep(0.05)
REACHED = True
"""

FAILING = """import os, signal, time
os.kill(os.getpid(), signal.SIGINT)
time.sleep(0.05)
raise ImportError("optional backend missing")
"""


def test_a_second_signal_acts_at_once_and_one_held_over_a_failed_import_is_not_lost(tmp_path, monkeypatch):
    _fresh_finder(monkeypatch, tmp_path, slow_twice=SLOW_TWICE, failing_opt=FAILING)
    with pytest.raises(KeyboardInterrupt):
        import slow_twice  # noqa: F401
    assert "slow_twice" not in sys.modules  # stopped inside its body: REACHED never ran
    with pytest.raises(KeyboardInterrupt):  # not the ImportError a caller of an optional import would catch
        import failing_opt  # noqa: F401
