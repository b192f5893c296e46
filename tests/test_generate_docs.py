"""The generated reference pages in docs/ say what the code says."""

from __future__ import annotations

import importlib.util
import inspect
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def generate_docs():
  spec = importlib.util.spec_from_file_location("generate_docs", ROOT / "scripts" / "generate_docs.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_committed_pages_are_up_to_date(generate_docs, capsys):
  assert generate_docs.main(["--check"]) == 0, (
      f"{capsys.readouterr().out} (the pages are the same on Python 3.11-3.13)")


def test_each_page_says_how_to_regenerate_it(generate_docs):
  for text in generate_docs.pages().values():
    assert text.splitlines()[0].endswith("by `python scripts/generate_docs.py`: do not edit by hand. -->")


def test_config_page_has_every_field_as_an_override(generate_docs):
  text = generate_docs.config_page()
  assert "| `steps` | `int` | `500` | Optimizer steps to train for. |" in text
  assert "## `model` (kind: cnn)" in text
  assert "`DType` is `Literal[\"float32\", \"bfloat16\", \"float16\"]`." in text
  for title, _, cls in generate_docs.recipe_sections():
    for name, (_, doc) in generate_docs.field_docs(cls)[1].items():
      assert doc, f"{title} field {name} has no docstring"


def test_check_fails_when_a_field_docstring_changes(generate_docs, tmp_path, monkeypatch, capsys):
  from jax_ai_stack.recipes import config

  assert generate_docs.main(["--docs", str(tmp_path)]) == 0
  assert generate_docs.main(["--check", "--docs", str(tmp_path)]) == 0
  # The same TrainConfig, one docstring edited, in a real module (inspect reads its source).
  source = inspect.getsource(config.TrainConfig)
  edited = source.replace('"""Optimizer steps to train for."""', '"""Edited."""')
  assert edited != source
  module_file = tmp_path / "edited_config.py"
  module_file.write_text(
      "from __future__ import annotations\nfrom typing import Literal\n"
      "from jax_ai_stack.recipes.configlib import config_dataclass\n\n" + edited,
      encoding="utf-8")
  spec = importlib.util.spec_from_file_location("edited_config", module_file)
  module = importlib.util.module_from_spec(spec)
  monkeypatch.setitem(sys.modules, "edited_config", module)
  spec.loader.exec_module(module)
  sections = generate_docs.recipe_sections()
  monkeypatch.setattr(generate_docs, "recipe_sections", lambda: [
      (title, doc, module.TrainConfig if cls is config.TrainConfig else cls)
      for title, doc, cls in sections])
  capsys.readouterr()
  assert generate_docs.main(["--check", "--docs", str(tmp_path)]) == 1
  out = capsys.readouterr().out
  assert "config.md" in out and "cli.md" not in out and "matrix.md" not in out
  assert "| Edited. |" in generate_docs.config_page()
