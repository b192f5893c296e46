"""Package attributes loaded on first use, so importing a package stays cheap.

`import jax_ai_stack.recipes.config` must not pay for jax, Flax or Orbax; a
package `__init__` therefore names its submodules and the names it exports
from them, and Python calls the module-level `__getattr__` this builds the
first time one is asked for (PEP 562).

Example:
  >>> __getattr__, __dir__ = lazy_attributes("json", ["decoder"], {"JSONEncoder": "encoder"})
  >>> __getattr__("decoder").__name__, __getattr__("JSONEncoder")().encode({"a": 1})
  ('json.decoder', '{"a": 1}')
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any


def lazy_attributes(
    package: str, submodules: Iterable[str], exports: Mapping[str, str] | None = None,
    moved: Mapping[str, str] | None = None, renamed: Mapping[str, str] | None = None,
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
  """`__getattr__` and `__dir__` for `package`.

  Args:
    package: the package's `__name__`.
    submodules: names that import `package.<name>`.
    exports: name -> the submodule that defines it.
    moved: old name -> the dotted path, below `package`, of the submodule that
      took its place. The old name still loads that module, with a
      `DeprecationWarning` naming the new path; `__dir__` leaves it out.
    renamed: old name -> the full dotted name of what took its place (a module's
      attribute). The old name still gives it, with a `DeprecationWarning` naming
      the new one; `__dir__` leaves it out.
  """
  submodules, exports, moved = frozenset(submodules), dict(exports or {}), dict(moved or {})
  renamed = dict(renamed or {})

  def __getattr__(name: str) -> Any:
    if name in submodules:
      return importlib.import_module(f"{package}.{name}")
    if name in exports:
      return getattr(importlib.import_module(f"{package}.{exports[name]}"), name)
    if name in moved:
      new = f"{package}.{moved[name]}"
      warnings.warn(f"{package}.{name} moved to {new}; import it from there",
                    DeprecationWarning, stacklevel=2)
      return importlib.import_module(new)
    if name in renamed:
      warnings.warn(f"{package}.{name} is deprecated: use {renamed[name]}", DeprecationWarning,
                    stacklevel=2)
      module, _, attribute = renamed[name].rpartition(".")
      return getattr(importlib.import_module(module), attribute)
    raise AttributeError(f"module {package!r} has no attribute {name!r}")

  def __dir__() -> list[str]:
    return sorted(submodules | exports.keys())

  return __getattr__, __dir__
