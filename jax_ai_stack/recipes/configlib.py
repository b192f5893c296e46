"""Typed, frozen configs: load from YAML, override with dotted names, dump back.

Every recipe config is a frozen dataclass validated by pydantic, declared with
`@config_dataclass`. A field's docstring (the string literal under it) becomes
its description. Validation errors name the dotted field, the bad value and,
for an unknown key, the closest known one.

Example:
  >>> @config_dataclass
  ... class Demo:
  ...   width: int = 8
  ...   '''Hidden width.'''
  >>> from_dict(Demo, apply_overrides({}, ["width=16"])).width
  16
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import pathlib
import pkgutil
import sys
import typing
from typing import Any, TypeVar

import pydantic
import yaml
from pydantic.dataclasses import dataclass as _pydantic_dataclass

from jax_ai_stack import yamlio
from jax_ai_stack.errors import ConfigError
from jax_ai_stack.recipes.mesh_axes import prefer_explicit_rest

T = TypeVar("T")

_CONFIG = pydantic.ConfigDict(extra="forbid", use_attribute_docstrings=True)


def config_dataclass(cls: type[T]) -> type[T]:
  """Makes `cls` a frozen, validated dataclass that rejects unknown fields."""
  return _pydantic_dataclass(frozen=True, config=_CONFIG)(cls)




def kinds(cls: type) -> tuple[str, ...]:
  """Every `kind` that tags the config dataclass `cls`: one, or a Literal of several (the
  decoder's architectures); () for a dataclass without a `kind` field."""
  for field in dataclasses.fields(cls):
    if field.name == "kind":
      hint = typing.get_type_hints(cls)["kind"]
      return tuple(str(tag) for tag in typing.get_args(hint) or (field.default,))
  return ()


def _union_members(tp: Any) -> dict[str, type]:
  """For a tagged union of config dataclasses: {tag value: dataclass}."""
  while typing.get_origin(tp) is typing.Annotated:
    tp = typing.get_args(tp)[0]
  return {tag: member for member in typing.get_args(tp) if dataclasses.is_dataclass(member)
          for tag in kinds(member)}


def _walk(cls: Any, loc: tuple[str, ...]) -> tuple[list[str], Any]:
  """The field path a user would write for a pydantic error location, and the
  type it ends in. Tags pydantic adds for tagged unions (`model.llama.x`) are
  not fields, so they are dropped (`model.x`)."""
  shown = []
  for part in loc:
    members = _union_members(cls)
    if part in members:
      cls = members[part]
      continue
    shown.append(part)
    cls = typing.get_type_hints(cls).get(part) if dataclasses.is_dataclass(cls) else None
    members = [m for m in typing.get_args(cls) if m is not type(None)]
    if len(members) == 1 and type(None) in typing.get_args(cls):
      cls = members[0]  # An optional section (`X | None`) has X's fields.
  return shown, cls


def _describe(error: dict, cls: type) -> str:
  loc = tuple(str(p) for p in error["loc"])
  if error["type"] in ("unexpected_keyword_argument", "extra_forbidden"):
    parent, owner = _walk(cls, loc[:-1])
    field = ".".join(parent + [loc[-1]])
    known = [f.name for f in dataclasses.fields(owner)] if dataclasses.is_dataclass(owner) else []
    close = difflib.get_close_matches(loc[-1], known, n=1)
    if close:
      return f"unknown field {field!r}; did you mean {'.'.join(parent + close)!r}?"
    return f"unknown field {field!r}" + (f" (known: {', '.join(known)})" if known else "")
  shown, _ = _walk(cls, loc)
  value = error.get("input")
  got = "" if isinstance(value, dict) else f" (got {value!r})"
  where = f"field {'.'.join(shown)!r}: " if shown else ""
  return f"{where}{error['msg']}{got}"


def from_dict(cls: type[T], data: dict, source: str = "config") -> T:
  """Validates `data` into `cls`; raises `ConfigError` naming every bad field."""
  try:
    return pydantic.TypeAdapter(cls).validate_python(data)
  except pydantic.ValidationError as e:
    problems = "; ".join(_describe(err, cls) for err in e.errors())
    raise ConfigError(f"{source}: {problems}") from None


def to_dict(config: Any) -> dict:
  """A plain dict (YAML/JSON ready) of a config dataclass."""
  return pydantic.TypeAdapter(type(config)).dump_python(config, mode="json")


def to_yaml(config: Any) -> str:
  return yaml.safe_dump(to_dict(config), sort_keys=False)


def load_yaml(path: str | pathlib.Path) -> dict:
  """Reads a YAML mapping; raises `ConfigError` naming the file and line."""
  try:
    data = yamlio.read_yaml(path)
  except yamlio.YamlFileError as e:
    raise ConfigError(f"config {e}") from None
  if data is None:
    return {}
  if not isinstance(data, dict):
    raise ConfigError(f"{path}: the top level must be a mapping of fields")
  return data


def parse_overrides(args: list[str]) -> list[str]:
  """Turns `--a.b 1` and `a.b=1` forms into a list of `a.b=1` strings."""
  out, i = [], 0
  while i < len(args):
    arg = args[i]
    if arg.startswith("--"):
      key = arg[2:]
      if "=" in key:
        out.append(key)
      elif i + 1 < len(args):
        out.append(f"{key}={args[i + 1]}")
        i += 1
      else:
        raise ConfigError(f"override {arg!r} has no value")
    elif "=" in arg:
      out.append(arg)
    else:
      raise ConfigError(f"override {arg!r} is not of the form field.name=value")
    i += 1
  return out


def apply_overrides(data: dict, overrides: list[str]) -> dict:
  """A copy of `data` with each `dotted.name=value` set; values parse as YAML.

  Overrides are the last layer of a config: a mesh axis they set to -1 (the
  rest) wins over another axis's -1 from `data` (`mesh_axes.prefer_explicit_rest`).
  """
  import copy

  data = copy.deepcopy(data)
  mesh_set: set[str] = set()
  for item in overrides:
    key, sep, raw = item.partition("=")
    if not sep or not key:
      raise ConfigError(f"override {item!r} is not of the form field.name=value")
    try:
      value = yamlio.loads(raw)
    except yaml.YAMLError:
      value = raw
    node = data
    parts = key.split(".")
    for part in parts[:-1]:
      if node.get(part) is None:  # Missing, or an optional group left unset (`lora: null`).
        node[part] = {}
      child = node[part]
      if not isinstance(child, dict):
        raise ConfigError(f"override {item!r}: {part!r} is not a group of fields")
      node = child
    node[parts[-1]] = value
    if len(parts) == 2 and parts[0] == "mesh":
      mesh_set.add(parts[1])
  if mesh_set and isinstance(data.get("mesh"), dict):
    data["mesh"] = prefer_explicit_rest(data["mesh"], mesh_set)
  return data


def import_named(path: str, field: str) -> Any:
  """What a config field names as 'module:function' (`model.task`, `rl.rewards`), imported
  from the current directory or PYTHONPATH; ConfigError naming `field` when it does not
  import."""
  if os.getcwd() not in sys.path:
    sys.path.append(os.getcwd())
  try:
    return pkgutil.resolve_name(path)
  except (ImportError, AttributeError, ValueError) as e:
    raise ConfigError(f"{field}={path!r} does not import ({type(e).__name__}: {e}); it "
                      "must be 'module:function' importable from the current directory or "
                      "PYTHONPATH") from e
