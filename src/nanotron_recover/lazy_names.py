"""A package's public names, imported on first use.

Several packages re-export names from modules that import torch or start MPI (``checkpoint``,
``data_parallel``, ``ft``). A process that needs only a light part of such a package -- the
``snapshots clean`` step on every node at a job's end, a unit test of the policy code -- must not
pay for the heavy parts by importing the package. :func:`lazy_names` gives the package a module
``__getattr__`` (PEP 562): ``from package import Name`` imports ``Name``'s module the first time
it is asked for.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_names(package: str, modules: dict[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package`` that imports each name in ``modules`` (name ->
    relative module, e.g. ``".save"``) from its module when first asked for."""

    def __getattr__(name: str) -> Any:
        if name in modules:
            return getattr(importlib.import_module(modules[name], package), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
