"""Generates the reference pages in docs/ from the code, so they cannot drift.

`docs/config.md` (every recipe config field: type, default, docstring),
`docs/cli.md` (every command's `--help`) and `docs/matrix.md` (the tested
version sets). Run after changing any of them: `python scripts/generate_docs.py`.
With `--check` it only names the stale pages (exit 1 if any).

The CLI page pins what differs between Python versions (the width, colour, how an
option with a value is listed and how subcommands align: as Python 3.13 does it),
so 3.11, 3.12 and 3.13 generate the same bytes.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import inspect
import pathlib
import sys
import typing

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from jax_ai_stack import cli, compat  # noqa: E402
from jax_ai_stack.recipes import config  # noqa: E402
from jax_ai_stack.recipes.tasks import registry  # noqa: E402

DOCS = ROOT / "docs"
COMMAND = "python scripts/generate_docs.py"
WIDTH = 88
# The matrix page's leading columns (README's "Tested sets"); other packages follow, sorted.
MAIN_PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "grain", "tensorstore",
                 "qwix", "tokamax", "numpy")


def _header(title: str, source: str) -> str:
  return (f"<!-- Generated from {source} by `{COMMAND}`: do not edit by hand. -->\n\n"
          f"# {title}\n\n")


def _cell(text: str) -> str:
  return " ".join(text.split()).replace("|", "\\|")


# --- config.md ---------------------------------------------------------------


def field_docs(cls: type) -> tuple[str, dict[str, tuple[str, str]]]:
  """The class docstring and {field: (annotation as written, docstring)}, from its source.

  From the source, not `__annotations__` or `__doc__`: those are what Python (and its
  version) makes of it; the source is what the author wrote.
  """
  source = inspect.cleandoc("\n" + inspect.getsource(cls))
  node = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef))
  fields = {}
  for stmt, after in zip(node.body, node.body[1:] + [None]):
    if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
      doc = ""
      if (isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
          and isinstance(after.value.value, str)):
        doc = inspect.cleandoc(after.value.value)
      fields[stmt.target.id] = (ast.get_source_segment(source, stmt.annotation), doc)
  return ast.get_docstring(node) or "", fields


def _default(field: dataclasses.Field) -> str:
  if field.default is not dataclasses.MISSING:
    return f"`{field.default!r}`"
  if field.default_factory is not dataclasses.MISSING:
    return f"`{field.default_factory()!r}`"
  return "required"


def type_aliases(cls: type) -> dict[str, str]:
  """{name: definition as written} of the module-level aliases of `cls`'s module, and of
  those it imports from another module of the package (`from ...configs import DType`)."""
  return _module_aliases(inspect.getmodule(cls).__name__)


def _module_aliases(module: str) -> dict[str, str]:
  source = inspect.getsource(importlib.import_module(module))
  aliases = {}
  for stmt in ast.parse(source).body:
    if isinstance(stmt, ast.ImportFrom) and (stmt.module or "").startswith("jax_ai_stack."):
      imported = _module_aliases(stmt.module)
      aliases.update({name.name: imported[name.name] for name in stmt.names
                      if name.name in imported})
    elif (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1
          and isinstance(stmt.targets[0], ast.Name)):
      aliases[stmt.targets[0].id] = ast.get_source_segment(source, stmt.value)
  return aliases


def field_table(cls: type) -> str:
  """One markdown table: field, type, default, docstring; then the aliases it names."""
  _, docs = field_docs(cls)
  aliases = type_aliases(cls)
  lines = ["| field | type | default | description |", "|---|---|---|---|"]
  used = {}
  for field in dataclasses.fields(cls):
    annotation, doc = docs[field.name]
    if annotation in aliases:
      used[annotation] = aliases[annotation]
    lines.append(f"| `{field.name}` | `{_cell(annotation)}` | {_cell(_default(field))} "
                 f"| {_cell(doc)} |")
  notes = "".join(f"\n`{name}` is `{_cell(value)}`.\n" for name, value in used.items())
  return "\n".join(lines) + "\n" + notes


def recipe_sections() -> list[tuple[str, str, type]]:
  """(title, description, config class) of each section of `RecipeConfig`, in order."""
  _, docs = field_docs(config.RecipeConfig)
  sections = []
  for field in dataclasses.fields(config.RecipeConfig):
    doc = docs[field.name][1]
    if field.name == "model":
      for entry in registry.REGISTRY:
        kind = dataclasses.fields(entry.model_config)[0].default
        sections.append((f"`model` (kind: {kind})", doc, entry.model_config))
        sections += optional_subsections("model", entry.model_config)
    elif field.default_factory is not dataclasses.MISSING:
      sections.append((f"`{field.name}`", doc, field.default_factory))
      sections += optional_subsections(field.name, field.default_factory)
  return sections


def optional_subsections(prefix: str, cls: type) -> list[tuple[str, str, type]]:
  """`S.f` sections for the fields of type `SomeConfig | None` (off unless set: `finetune.lora`)."""
  _, docs = field_docs(cls)
  hints = typing.get_type_hints(cls)
  out = []
  for field in dataclasses.fields(cls):
    members = [t for t in typing.get_args(hints[field.name]) if dataclasses.is_dataclass(t)]
    if len(members) == 1:
      out.append((f"`{prefix}.{field.name}`", docs[field.name][1], members[0]))
  return out


def config_page() -> str:
  top = [f for f in dataclasses.fields(config.RecipeConfig) if f.default is not dataclasses.MISSING]
  text = _header("Recipe config reference", "jax_ai_stack/recipes/config.py")
  text += ("Every field of `RecipeConfig`. A row of section `S` is set with the override\n"
           "`S.field=value` (`jax-ai-stack train lm-tiny train.steps=10`) or in a YAML file\n"
           "under `S:`. `model.kind` picks the model family and with it the model table.\n\n")
  _, docs = field_docs(config.RecipeConfig)
  text += "## Top level\n\n" + "\n".join(
      f"- `{f.name}` (`{docs[f.name][0]}`, default `{f.default!r}`): {_cell(docs[f.name][1])}"
      for f in top) + "\n"
  for title, doc, cls in recipe_sections():
    text += f"\n## {title}\n\n{_cell(doc)}\n\n{field_table(cls)}"
  return text


# --- cli.md ------------------------------------------------------------------


class _PinnedHelp:
  """Formatter mixin: help text that does not depend on the Python version."""

  def __init__(self, prog, **kwargs):
    super().__init__(prog, **{**kwargs, "width": WIDTH})

  def add_argument(self, action):
    # As Python 3.13: a subcommand's own indent counts when aligning the help column.
    if action.help is not argparse.SUPPRESS:
      lengths = [len(self._format_action_invocation(action)) + self._current_indent]
      for sub in self._iter_indented_subactions(action):
        lengths.append(len(self._format_action_invocation(sub)) + self._current_indent)
      self._action_max_length = max(self._action_max_length, *lengths)
      self._add_item(self._format_action, [action])

  def _format_action_invocation(self, action):
    # As Python 3.13: `-o, --out OUT`, not `-o OUT, --out OUT`.
    if not action.option_strings or action.nargs == 0:
      return super()._format_action_invocation(action)
    metavar = self._format_args(action, self._get_default_metavar_for_optional(action))
    return ", ".join(action.option_strings) + " " + metavar


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
  """(command words, parser) of `parser` and every subcommand below it, in help order."""
  yield path, parser
  seen = set()
  for action in parser._actions:
    if isinstance(action, argparse._SubParsersAction):
      for name, sub in action.choices.items():
        if id(sub) not in seen:  # aliases name the same parser
          seen.add(id(sub))
          yield from _commands(sub, path + (name,))


def help_text(parser: argparse.ArgumentParser) -> str:
  """`parser.format_help()` at a fixed width, without colour, in the pinned style."""
  parser.formatter_class = type("Pinned", (_PinnedHelp, parser.formatter_class), {})
  if hasattr(parser, "color"):  # Python 3.14 colours help on a terminal
    parser.color = False
  return parser.format_help()


def cli_page() -> str:
  text = _header("Command-line reference", "jax_ai_stack/cli.py")
  text += "Every `jax-ai-stack` command's `--help`.\n"
  for path, parser in _commands(cli.build_parser()):
    title = " ".join(("jax-ai-stack",) + path)
    text += f"\n## `{title}`\n\n```text\n{help_text(parser).rstrip()}\n```\n"
  return text


# --- matrix.md ---------------------------------------------------------------


def matrix_page() -> str:
  matrix = compat.load_matrix(ROOT / compat.MATRIX_FILENAME)
  names = {p for row in matrix.rows for p in row.packages}
  columns = [p for p in MAIN_PACKAGES if p in names] + sorted(names - set(MAIN_PACKAGES))
  text = _header("Compatibility matrix", compat.MATRIX_FILENAME)
  text += ("The tested version sets, one row per Python and accelerator. `pyproject.toml`'s\n"
           "pins are generated from the same file (`python scripts/sync_pins.py`);\n"
           "`jax-ai-stack doctor` compares an install with its row.\n\n"
           "## Rows\n\n| row | Python | accelerator | tested in CI |\n|---|---|---|---|\n")
  for row in matrix.rows:
    ci = "yes" if row.ci else f"no: {_cell(row.reason)}" if row.reason else "no"
    text += f"| `{row.name}` | {row.python} | {row.accelerator} | {ci} |\n"
  text += "\n## Versions\n\n| row | " + " | ".join(columns) + " |\n"
  text += "|---" * (len(columns) + 1) + "|\n"
  for row in matrix.rows:
    text += f"| `{row.name}` | " + " | ".join(row.packages.get(p, "") for p in columns) + " |\n"
  text += "\n## Extras\n\n" + "".join(
      f"- `{extra}`: {', '.join(packages)}\n" for extra, packages in matrix.extras.items())
  limited = [row for row in matrix.rows if row.limitations]
  if limited:
    text += "\n## Known limitations\n"
    for row in limited:
      text += f"\n`{row.name}`:\n\n" + "".join(f"- {_cell(l)}\n" for l in row.limitations)
  return text


# --- main --------------------------------------------------------------------


def pages() -> dict[str, str]:
  """{file name in docs/: its text}."""
  return {"config.md": config_page(), "cli.md": cli_page(), "matrix.md": matrix_page()}


def stale(docs: pathlib.Path, generated: dict[str, str]) -> list[str]:
  """The pages whose file in `docs` is missing or differs from `generated`."""
  return [name for name, text in generated.items()
          if not (docs / name).is_file() or (docs / name).read_text(encoding="utf-8") != text]


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--check", action="store_true", help="report only; exit 1 if stale")
  parser.add_argument("--docs", type=pathlib.Path, default=DOCS, help="where the pages live")
  args = parser.parse_args(argv)
  generated = pages()
  names = stale(args.docs, generated)
  if args.check:
    if names:
      print(f"stale in {args.docs}: {', '.join(names)}: run `{COMMAND}`")
      return 1
    print(f"{', '.join(generated)} are up to date")
    return 0
  args.docs.mkdir(parents=True, exist_ok=True)
  for name in names:
    (args.docs / name).write_text(generated[name], encoding="utf-8")
  print(f"regenerated: {', '.join(names)}" if names else "all pages were up to date")
  return 0


if __name__ == "__main__":
  sys.exit(main())
