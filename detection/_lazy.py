"""Names a package hands on, imported when first asked for (PEP 562).

A package whose modules differ in what they need (the argument spec of ``sdcguard train`` is
stdlib only, the launcher imports torch) re-exports its names this way, so that importing the
package — which Python does before any of its modules — costs nothing its caller did not ask
for. Invariant: this module imports only the stdlib.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str, where: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``: ``where`` maps each name to the module
    that defines it (relative to ``package``). A name, once looked up, is bound in the package."""
    namespace = importlib.import_module(package).__dict__

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        namespace[name] = value  # later look-ups skip this hook
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(where))

    return __getattr__, __dir__
