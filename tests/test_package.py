"""The package's lazy namespaces: every submodule is reachable from its parent, on first use."""

import importlib
import json
import subprocess
import sys

import pytest

import jax_ai_stack
from jax_ai_stack import recipes
from multidevice import run_program


@pytest.mark.parametrize("package", [jax_ai_stack, recipes], ids=lambda p: p.__name__)
def test_every_advertised_submodule_loads(package):
  for name in package.__all__:
    if name == "__version__":
      continue
    module = getattr(package, name)
    assert module is importlib.import_module(f"{package.__name__}.{name}")


def test_unknown_attribute_is_an_attribute_error():
  with pytest.raises(AttributeError, match="no attribute 'nope'"):
    recipes.nope  # noqa: B018


def test_kernels_attention_is_the_function_even_after_its_module_loads():
  """`kernels` loads lazily; importing the submodule of the same name must not
  replace the function (as a plain lazy `__getattr__` would let it)."""
  code = ("import jax_ai_stack.kernels.attention\n"
          "from jax_ai_stack import kernels\n"
          "print(type(kernels.attention).__name__, type(kernels.Request).__name__)")
  result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert result.stdout.split() == ["function", "type"]


HEAVY_MODULES = ("jax", "jaxlib", "flax", "optax", "grain", "orbax", "tensorstore", "tokamax",
                 "qwix")

def test_every_public_module_is_an_attribute_of_its_package_and_packages_import_cheaply():
  """`recipes.finetune.lora`, `kernels.table`, ...: each module that `pkgutil` finds
  in a package (a name without a leading underscore) is in the package's `dir()`
  and loads when asked for as an attribute, with no `import` of its own; and
  importing the packages themselves loads no jax or other heavy library."""
  result = run_program("package_walk", HEAVY_MODULES, check=True)
  walk = json.loads(result.stdout.splitlines()[-1])
  assert walk["heavy"] == [], f"importing the packages imported {walk['heavy']}"
  assert walk["modules"] > 50
  assert walk["unreachable"] == [], "not attributes of their package: add them to _SUBMODULES"


def test_import_recipes_imports_no_heavy_library():
  code = ("import sys\nimport jax_ai_stack.recipes\nfrom jax_ai_stack.recipes import finetune\n"
          "print(' '.join({name.split('.')[0] for name in sys.modules}))")
  result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  imported = set(result.stdout.split()) & set(HEAVY_MODULES)
  assert not imported, f"import jax_ai_stack.recipes imported {sorted(imported)}"


def test_a_moved_module_still_loads_from_its_old_name_with_a_warning():
  with pytest.warns(DeprecationWarning, match="moved to jax_ai_stack.recipes.finetune.lora"):
    from jax_ai_stack.recipes import lora
  assert lora is importlib.import_module("jax_ai_stack.recipes.finetune.lora")
  assert "lora" not in dir(recipes)
