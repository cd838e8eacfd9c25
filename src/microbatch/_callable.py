"""Make a submodule callable as its main function of the same name.

``microbatch.accumulate`` and ``microbatch.tune`` are both a submodule and the main function it
defines. Once the submodule is imported, Python binds the package attribute to the module,
hiding the function; making the module callable keeps ``microbatch.accumulate(...)`` and
``microbatch.tune(...)`` working either way.
"""

from __future__ import annotations

import sys
from typing import Any


def make_module_callable(module_name: str, func_name: str) -> None:
    """Make ``sys.modules[module_name]`` forward calls to its attribute ``func_name``.

    The function is looked up on each call, so a later rebinding of the name is honoured.
    """
    module = sys.modules[module_name]

    class _CallableModule(type(module)):  # a ModuleType subclass
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return getattr(self, func_name)(*args, **kwargs)

    _CallableModule.__doc__ = f"The module {module_name}, callable as its function {func_name}()."
    module.__class__ = _CallableModule
