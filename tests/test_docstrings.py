"""Every module's docstrings show an example, and every example runs and prints what it shows."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import jax_ai_stack

MODULES = sorted(
    info.name for info in pkgutil.walk_packages(jax_ai_stack.__path__, "jax_ai_stack.")
)

NO_EXAMPLE: dict[str, str] = {}
"""Modules allowed to have no example, each with the reason; keep it short."""


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)  # Examples that write files write them here.
  module = importlib.import_module(name)
  result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
  assert result.failed == 0, f"{result.failed} failing example(s) in {name}"
  if name in NO_EXAMPLE:
    assert result.attempted == 0, f"{name} has examples now: remove it from NO_EXAMPLE"
  else:
    assert result.attempted > 0, (
        f"{name} has no example: add one to its module docstring (or its main function's),"
        " or list it in NO_EXAMPLE with the reason")


def test_no_example_lists_only_modules():
  assert set(NO_EXAMPLE) <= set(MODULES), set(NO_EXAMPLE) - set(MODULES)
