"""The compatibility matrix: tested version sets, and how this install compares.

`compat_matrix.yaml` is the single source of truth for every pin. This module
reads it, finds the row that fits the running Python and accelerator, compares
that row with what is installed, and renders the matrix as pip constraints or as
pyproject.toml pins. It never imports jax, so `jax-ai-stack doctor` can report on
a broken install.

Example:
  >>> from jax_ai_stack import compat
  >>> row = compat.find_row(compat.load_matrix(), python="3.12", accelerator="cpu")
  >>> row.packages["jax"]
  '0.12.0.1'
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.resources
import pathlib
import sys
from typing import Literal

from packaging.specifiers import InvalidSpecifier, Specifier
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from jax_ai_stack import yamlio

MATRIX_FILENAME = "compat_matrix.yaml"
ACCELERATORS = ("cpu", "cuda12", "cuda13", "tpu")

# A package whose presence marks an accelerator install, in detection order.
_ACCELERATOR_MARKERS = {
    "cuda13": "jax-cuda13-plugin",
    "cuda12": "jax-cuda12-plugin",
    "tpu": "libtpu",
}

Status = Literal["ok", "different", "missing", "absent"]


class MatrixError(ValueError):
  """The matrix file is missing or malformed; the message names the file."""


class RowNotFoundError(LookupError):
  """No row for the asked Python / accelerator; the message lists the rows."""


@dataclasses.dataclass(frozen=True)
class Row:
  """One tested combination of Python version and accelerator."""

  name: str
  python: str
  accelerator: str
  ci: bool
  packages: dict[str, str]
  reason: str = ""
  limitations: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Upstream:
  """Upstream's jax-ai-stack release that the rows pin a superset of: its core pins and
  its extras' pins (`tfds`)."""

  version: str
  packages: dict[str, str]
  extras: dict[str, dict[str, str]]

  @property
  def pins(self) -> dict[str, str]:
    """Every package it pins, its extras' included."""
    return {**self.packages, **{n: v for extra in self.extras.values() for n, v in extra.items()}}


@dataclasses.dataclass(frozen=True)
class Matrix:
  """All rows, plus which packages belong to which optional extra."""

  rows: tuple[Row, ...]
  extras: dict[str, tuple[str, ...]]
  source: str
  upstream: Upstream | None = None

  @property
  def optional_packages(self) -> frozenset[str]:
    """Packages that only some extra installs: not required at run time."""
    return frozenset(p for names in self.extras.values() for p in names)


@dataclasses.dataclass(frozen=True)
class PackageStatus:
  """One package of a row against the environment."""

  name: str
  pinned: str
  installed: str | None
  optional: bool

  @property
  def status(self) -> Status:
    if self.installed is None:
      return "absent" if self.optional else "missing"
    try:  # PEP 440's ==, as pip reads the pin: 2.13.0 accepts the local build 2.13.0+cpu.
      same = Specifier(f"=={self.pinned}").contains(self.installed, prereleases=True)
    except (InvalidSpecifier, InvalidVersion):  # Not PEP 440: only the very same string.
      same = self.installed == self.pinned
    return "ok" if same else "different"


def canonical_name(name: str) -> str:
  """PEP 503 normalised project name (`Orbax_Checkpoint` -> `orbax-checkpoint`)."""
  return canonicalize_name(name)


def default_matrix_path() -> pathlib.Path:
  """The matrix shipped in the package, else the one at the source checkout's root."""
  shipped = importlib.resources.files("jax_ai_stack") / MATRIX_FILENAME
  if shipped.is_file():
    return pathlib.Path(str(shipped))
  return pathlib.Path(__file__).resolve().parent.parent / MATRIX_FILENAME


def load_matrix(path: str | pathlib.Path | None = None) -> Matrix:
  """Reads and validates the matrix; raises `MatrixError` naming the file."""
  path = pathlib.Path(path) if path is not None else default_matrix_path()
  try:
    data = yamlio.read_yaml(path)
  except yamlio.YamlFileError as e:
    raise MatrixError(f"compatibility matrix {e}") from None
  if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
    raise MatrixError(f"compatibility matrix {path} has no list under 'rows'")
  extras = data.get("extras") or {}
  if not isinstance(extras, dict):
    raise MatrixError(f"compatibility matrix {path}: 'extras' must be a mapping")
  rows = tuple(_parse_row(path, i, raw) for i, raw in enumerate(data["rows"]))
  names = [r.name for r in rows]
  duplicates = sorted({n for n in names if names.count(n) > 1})
  if duplicates:
    raise MatrixError(f"compatibility matrix {path}: duplicate row names {duplicates}")
  return Matrix(
      rows=rows,
      extras={k: tuple(canonical_name(p) for p in v) for k, v in extras.items()},
      source=str(path),
      upstream=_parse_upstream(path, data.get("upstream")),
  )


def _parse_upstream(path: pathlib.Path, raw: object) -> Upstream | None:
  if raw is None:
    return None
  where = f"compatibility matrix {path}, upstream"
  if not isinstance(raw, dict) or not isinstance(raw.get("packages"), dict) or "version" not in raw:
    raise MatrixError(f"{where}: needs 'version' and a 'packages' mapping")
  extras = raw.get("extras") or {}
  if not isinstance(extras, dict) or not all(isinstance(v, dict) for v in extras.values()):
    raise MatrixError(f"{where}: 'extras' maps each extra to its packages' versions")
  pins = lambda packages: {canonical_name(n): str(v) for n, v in packages.items()}  # noqa: E731
  return Upstream(version=str(raw["version"]), packages=pins(raw["packages"]),
                  extras={extra: pins(packages) for extra, packages in extras.items()})


def _parse_row(path: pathlib.Path, index: int, raw: object) -> Row:
  where = f"compatibility matrix {path}, rows[{index}]"
  if not isinstance(raw, dict):
    raise MatrixError(f"{where}: a row must be a mapping")
  missing = [k for k in ("name", "python", "accelerator", "ci", "packages") if k not in raw]
  if missing:
    raise MatrixError(f"{where}: missing field(s) {missing}")
  if raw["accelerator"] not in ACCELERATORS:
    raise MatrixError(
        f"{where}: accelerator {raw['accelerator']!r} is not one of {list(ACCELERATORS)}"
    )
  if not isinstance(raw["packages"], dict) or not raw["packages"]:
    raise MatrixError(f"{where}: 'packages' must map package names to versions")
  packages = {}
  for name, version in raw["packages"].items():
    if not isinstance(version, str) or not _is_version(version):
      raise MatrixError(
          f"{where}: package {name!r} needs an exact version as a quoted string, got {version!r}"
      )
    packages[canonical_name(name)] = version
  if not raw["ci"] and not raw.get("reason"):
    raise MatrixError(f"{where}: a row with ci: false must say why in 'reason'")
  return Row(
      name=str(raw["name"]),
      python=str(raw["python"]),
      accelerator=raw["accelerator"],
      ci=bool(raw["ci"]),
      packages=packages,
      reason=str(raw.get("reason", "")),
      limitations=tuple(raw.get("limitations") or ()),
  )


def _is_version(text: str) -> bool:
  """A PEP 440 version, as `name==text` needs: no wildcard, no range."""
  try:
    Version(text)
  except InvalidVersion:
    return False
  return True


def running_python() -> str:
  return f"{sys.version_info.major}.{sys.version_info.minor}"


def detect_accelerator() -> str:
  """The accelerator this install targets, read from installed plugins (no jax import)."""
  for accelerator, marker in _ACCELERATOR_MARKERS.items():
    if installed_version(marker) is not None:
      return accelerator
  return "cpu"


def find_row(matrix: Matrix, python: str | None = None, accelerator: str | None = None) -> Row:
  """The row for a Python version and accelerator (defaults: what is running)."""
  python = python or running_python()
  accelerator = accelerator or detect_accelerator()
  for row in matrix.rows:
    if row.python == python and row.accelerator == accelerator:
      return row
  listed = ", ".join(f"{r.python}/{r.accelerator}" for r in matrix.rows)
  raise RowNotFoundError(
      f"no row for Python {python} with accelerator {accelerator!r} in {matrix.source}; "
      f"rows (python/accelerator): {listed}"
  )


def installed_version(name: str) -> str | None:
  try:
    return importlib.metadata.version(name)
  except importlib.metadata.PackageNotFoundError:
    return None


def compare(matrix: Matrix, row: Row) -> list[PackageStatus]:
  """Each package of `row` against the installed environment, sorted by name."""
  return [
      PackageStatus(
          name=name,
          pinned=pinned,
          installed=installed_version(name),
          optional=name in matrix.optional_packages,
      )
      for name, pinned in sorted(row.packages.items())
  ]


def constraints_text(row: Row) -> str:
  """A pip constraints file pinning every package of the row."""
  from jax_ai_stack import __version__

  lines = [
      f"# jax-ai-stack {__version__}: tested set {row.name}"
      f" (Python {row.python}, {row.accelerator})",
      "# Use: pip install -c constraints.txt <your packages>",
  ]
  lines += [f"{name}=={version}" for name, version in sorted(row.packages.items())]
  return "\n".join(lines) + "\n"


# Rendering pyproject.toml pins ------------------------------------------------

PYPROJECT_BEGIN = "# BEGIN pins generated from compat_matrix.yaml by scripts/sync_pins.py"
PYPROJECT_END = "# END generated pins"


def _marker(pythons: list[str]) -> str:
  return " or ".join(f"python_version == '{p}'" for p in sorted(pythons))


def _pins(rows: list[Row], names: set[str] | None = None, extra: str = "") -> list[str]:
  """`name==version[; marker]` lines, one per distinct version across rows.

  A version shared by every row's Python needs no marker; requires-python in
  pyproject.toml already bounds the Pythons to those the matrix has rows for.
  """
  by_version: dict[tuple[str, str], list[str]] = {}
  for row in rows:
    for name, version in row.packages.items():
      if names is None or name in names:
        by_version.setdefault((name, version), []).append(row.python)
  every_python = {row.python for row in rows}
  return [
      f"{name}{extra}=={version}"
      + ("" if set(pythons) == every_python else f"; {_marker(pythons)}")
      for (name, version), pythons in sorted(by_version.items())
  ]


def pyproject_block(matrix: Matrix) -> str:
  """The generated part of pyproject.toml: dependencies and optional extras."""
  cpu_rows = [r for r in matrix.rows if r.accelerator == "cpu"]
  core = {n for r in cpu_rows for n in r.packages} - matrix.optional_packages
  out = [PYPROJECT_BEGIN, "dependencies = ["]
  out += [f'  "{pin}",' for pin in _pins(cpu_rows, core)]
  out += ["]", "", "[project.optional-dependencies]"]
  for extra, names in sorted(matrix.extras.items()):
    out.append(f"{extra} = [")
    out += [f'  "{pin}",' for pin in _pins(cpu_rows, set(names))]
    out.append("]")
  for accelerator in ACCELERATORS[1:]:
    rows = [r for r in matrix.rows if r.accelerator == accelerator]
    out.append(f"{accelerator} = [")
    out += [f'  "{pin}",' for pin in _pins(rows, {"jax"}, extra=f"[{accelerator}]")]
    added = {n for r in rows for n in r.packages} - {n for r in cpu_rows for n in r.packages}
    out += [f'  "{pin}",' for pin in _pins(rows, added)]
    out.append("]")
  out.append(PYPROJECT_END)
  return "\n".join(out)


def replace_pyproject_block(text: str, block: str) -> str:
  """`text` (a pyproject.toml) with its generated block replaced by `block`."""
  start, end = text.find(PYPROJECT_BEGIN), text.find(PYPROJECT_END)
  if start < 0 or end < 0:
    raise MatrixError("pyproject.toml lacks the generated-pins markers")
  return text[:start] + block + text[end + len(PYPROJECT_END):]
