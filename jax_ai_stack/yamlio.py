"""Reading YAML files with errors that name the file and line.

Numbers are read as YAML 1.2 reads them: `10:15` (a range of steps) stays the
string it looks like, where PyYAML's YAML 1.1 rules read it as 615 (base 60).

Example:
  >>> _ = open("run.yaml", "w").write("model: {num_layers: 2}")
  >>> read_yaml("run.yaml")
  {'model': {'num_layers': 2}}
  >>> loads("10:15"), loads("12"), loads("0.5")
  ('10:15', 12, 0.5)
  >>> _ = open("bad.yaml", "w").write("model: [1, 2")
  >>> read_yaml("bad.yaml")
  Traceback (most recent call last):
  ...
  jax_ai_stack.yamlio.YamlFileError: bad.yaml:1:13: not valid YAML: expected ',' or ']', but
  got '<stream end>'
"""

from __future__ import annotations

import pathlib
import re

import yaml


_INT = "tag:yaml.org,2002:int"
_FLOAT = "tag:yaml.org,2002:float"


class Loader(yaml.SafeLoader):
  """PyYAML's safe loader without YAML 1.1's base-60 numbers (YAML 1.2 has none)."""


Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in (_INT, _FLOAT)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
Loader.add_implicit_resolver(_INT, re.compile(
    r"^(?:[-+]?0b[0-1_]+|[-+]?0[0-7_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+)$"),
    list("-+0123456789"))
Loader.add_implicit_resolver(_FLOAT, re.compile(
    r"^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+][0-9]+)?|\.[0-9][0-9_]*(?:[eE][-+][0-9]+)?"
    r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"), list("-+0123456789."))


def loads(text: str) -> object:
  """`text` parsed (`Loader`'s numbers); raises `yaml.YAMLError`."""
  return yaml.load(text, Loader=Loader)  # noqa: S506 - a SafeLoader.


class YamlFileError(ValueError):
  """A YAML file that is missing or does not parse; the message says where."""


def read_yaml(path: str | pathlib.Path) -> object:
  """The parsed content of `path`; raises `YamlFileError` naming file and line."""
  path = pathlib.Path(path)
  try:
    return loads(path.read_text(encoding="utf-8"))
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
