"""Every example in a docstring of the package runs and prints what it shows."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import jax_ai_stack

MODULES = sorted(
    info.name for info in pkgutil.walk_packages(jax_ai_stack.__path__, "jax_ai_stack.")
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)  # Examples that write files write them here.
  module = importlib.import_module(name)
  result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
  assert result.failed == 0, f"{result.failed} failing example(s) in {name}"
