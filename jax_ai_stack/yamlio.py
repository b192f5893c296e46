"""Reading YAML files with errors that name the file and line.

Example:
  >>> _ = open("run.yaml", "w").write("model: {num_layers: 2}")
  >>> read_yaml("run.yaml")
  {'model': {'num_layers': 2}}
  >>> _ = open("bad.yaml", "w").write("model: [1, 2")
  >>> read_yaml("bad.yaml")
  Traceback (most recent call last):
  ...
  jax_ai_stack.yamlio.YamlFileError: bad.yaml:1:13: not valid YAML: expected ',' or ']', but
  got '<stream end>'
"""

from __future__ import annotations

import pathlib

import yaml


class YamlFileError(ValueError):
  """A YAML file that is missing or does not parse; the message says where."""


def read_yaml(path: str | pathlib.Path) -> object:
  """The parsed content of `path`; raises `YamlFileError` naming file and line."""
  path = pathlib.Path(path)
  try:
    return yaml.safe_load(path.read_text(encoding="utf-8"))
  except FileNotFoundError:
    raise YamlFileError(f"{path}: file not found") from None
  except IsADirectoryError:
    raise YamlFileError(f"{path}: is a directory, not a YAML file") from None
  except UnicodeDecodeError as e:
    raise YamlFileError(f"{path}: not a text file ({e.reason} at byte {e.start})") from None
  except yaml.YAMLError as e:
    mark = getattr(e, "problem_mark", None)
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    raise YamlFileError(f"{where}: not valid YAML: {problem}") from None
