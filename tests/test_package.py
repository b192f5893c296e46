"""The package's lazy namespaces: every advertised submodule loads on first use."""

import importlib
import subprocess
import sys

import pytest

import jax_ai_stack
from jax_ai_stack import recipes


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
