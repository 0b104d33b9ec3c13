"""Package attributes that load their module on first use (PEP 562), so that a package's torch-free
modules (settings, pins) can be imported before torch."""

import importlib


def lazy_getattr(package: str, where: dict[str, str]):
    """A module ``__getattr__`` for ``package`` that imports ``where[name]`` and returns its ``name``."""

    def __getattr__(name: str):
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(where[name]), name)

    return __getattr__
