"""The package's lazy namespaces: every advertised submodule loads on first use."""

import importlib

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
