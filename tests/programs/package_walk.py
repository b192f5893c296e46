"""Each package imported and asked for its modules: only a fresh interpreter has imported nothing.

Notes what each package's own `__init__` defined before any of its children loaded (a child
import sets the child as an attribute of its parent, which would hide a missing lazy name).

argv: the heavy libraries (JSON), which importing the packages must not load."""

import importlib
import json
import pkgutil
import sys

packages, found = {}, []


def walk(name):
  package = importlib.import_module(name)
  packages[name] = (package, set(vars(package)), set(dir(package)))
  for info in pkgutil.iter_modules(package.__path__):
    if not info.name.startswith("_"):
      found.append((name, info.name))
      if info.ispkg:
        walk(f"{name}.{info.name}")


walk("jax_ai_stack")
heavy = sorted({m.split(".")[0] for m in sys.modules} & set(json.loads(sys.argv[1])))

unreachable = []
for parent, child in found:
  package, eager, listed = packages[parent]
  module = importlib.import_module(f"{parent}.{child}")
  try:
    value = getattr(package, child) if child in eager else package.__getattr__(child)
  except AttributeError:
    value = None
  # `kernels.attention` is the function that its module of the same name defines.
  if child not in listed or (value is not module and getattr(value, "__module__", None)
                             != module.__name__):
    unreachable.append(f"{parent}.{child}")
print(json.dumps({"heavy": heavy, "modules": len(found), "unreachable": unreachable}))
