"""The import graph of `jax_ai_stack`: a DAG, and no module imports one of a layer above it.

The graph is read statically (`ast`, nothing imported): every `import` and
`from ... import` of every module, at module level and inside functions,
relative ones resolved, `from package import name` counted as the submodule
when `name` is one. Imports under `if TYPE_CHECKING:` never run (annotations
only) and are left out. A package's `__init__` runs before any of its
modules, so it may sit no higher than they do.

A cycle is fixed by moving the shared piece down into a module both sides may
import, not by hiding an import inside a function or in a string: those count here
too (a "module:Name" that `pkgutil.resolve_name` imports, a lazy export table).
"""

from __future__ import annotations

import ast
import fnmatch
import pathlib
import re

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "jax_ai_stack"

LAYERS: list[tuple[str, str, tuple[str, ...]]] = [
    ("foundations", "the standard library and each other only; a package facade loads its "
     "modules on first use, so importing it costs nothing", (
         "jax_ai_stack", "errors", "lazy", "atomic", "yamlio", "logs", "native_logs", "absl_flags",
         "determinism", "kernels", "recipes", "recipes.data", "recipes.models",
         "recipes.models.hf", "recipes.inference", "recipes.serve", "recipes.evaluation",
         "recipes.finetune", "recipes.rl")),
    ("environment and kernels", "what is installed, the chips it can compile for, and which "
     "attention kernel runs where: they know nothing of recipes",
     ("compat", "doctor", "topology", "kernels.*")),
    ("recipe configs", "the config tree (and the Task registry it names) loads, validates and "
     "prints without jax", (
         "recipes.configlib", "recipes.mesh_axes", "recipes.byte_sizes", "recipes.*_config", "recipes.config",
         "recipes.compile_cache", "recipes.data.config", "recipes.finetune.config",
         "recipes.rl.config",
         "recipes.models.configs", "recipes.models.cnn_config", "recipes.models.custom_config",
         "recipes.models.moe_config", "recipes.models.rope_config",
         "recipes.models.latent_config", "recipes.models.linear_config",
         "recipes.models.param_count",
         "recipes.models.hf.families",
         "recipes.models.hf.families.*",
         "recipes.tasks", "recipes.tasks.registry", "recipes.phases")),
    ("builders", "each builds one library object (model, dataset, mesh, optimizer, step, "
     "checkpoint manager, Task) from a config; none opens a workdir as a run", (
         "recipes.data.*", "recipes.models.*", "recipes.inference.*", "recipes.serve.*",
         "recipes.evaluation.*", "recipes.rl.*",
         "recipes.tasks.*",
         "recipes.sharding",
         "recipes.optim", "recipes.step", "recipes.metrics", "recipes.progress", "recipes.profile",
         "recipes.checkpoint",
         "recipes.checkpoint.*", "recipes.distributed", "recipes.memory", "recipes.host_memory",
         "recipes.measured_activations", "recipes.sample_memory",
         "recipes.aot",
         "recipes.transforms", "recipes.stop_signal", "recipes.finetune.lora",
         "recipes.finetune.adapters", "recipes.finetune.base_run", "recipes.finetune.quant",
         "recipes.finetune.reference", "recipes.finetune.transforms",
         "recipes.finetune.teacher")),
    ("the run", "`build_run` opens a workdir into a Run; what trains one or works on a "
     "finished one (quantize, merge) builds on it", (
         "recipes.preflight", "recipes.workdir", "recipes.opening", "recipes.held_out", "recipes.run",
         "recipes.trainer", "recipes.train",
         "recipes.record",
         "recipes.finetune.ptq",
         "recipes.finetune.lora_merge")),
    ("command lines", "parse flags, read the environment once, call one function below, "
     "print; nothing but another command line imports them", ("cli", "*.cli", "*_cli")),
]
"""(name, why, module patterns without the `jax_ai_stack.` prefix), bottom up.

A module belongs to the first layer that names it exactly, else to the first
whose pattern matches it, looking from the top down (so `kernels.cli` is a
command line, `recipes.data.config` a config).
"""


def modules() -> dict[str, tuple[pathlib.Path, bool]]:
  """{'jax_ai_stack.recipes.run': (path, is_package)} of every module of the package."""
  found = {}
  for path in PACKAGE.rglob("*.py"):
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
  return found


def _type_checking_only(tree: ast.AST) -> set[int]:
  """ids of the import nodes under `if TYPE_CHECKING:` (never executed)."""
  skipped = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING",
                                                               "typing.TYPE_CHECKING"):
      for child in node.body:
        skipped.update(id(n) for n in ast.walk(child))
  return skipped


def _owner(name: str, known: dict) -> str | None:
  """`name` or its nearest enclosing module of the package (None: another library)."""
  while name and name not in known:
    name = name.rpartition(".")[0]
  return name or None


def imports(name: str, path: pathlib.Path, is_package: bool, known: dict) -> set[str]:
  """The package's modules `name` imports (module level and inside functions)."""
  tree = ast.parse(path.read_text(encoding="utf-8"))
  skipped = _type_checking_only(tree)
  found = set()
  for node in ast.walk(tree):
    if id(node) in skipped:
      continue
    if isinstance(node, ast.Import):
      found.update(_owner(alias.name, known) for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        here = name.split(".") if is_package else name.split(".")[:-1]
        here = here[:len(here) - (node.level - 1)]
        base = ".".join(here + ([base] if base else []))
      for alias in node.names:
        submodule = f"{base}.{alias.name}"
        found.add(submodule if submodule in known else _owner(base, known))
  return {m for m in found if m is not None and m != name}


def lazy_tables(known: dict) -> dict[str, dict[str, str]]:
  """{package: {attribute: the module it loads}} of each package whose `__init__` builds its
  attributes lazily (`lazy.lazy_attributes(__name__, _SUBMODULES, _EXPORTS)`)."""
  tables = {}
  for name, (path, is_package) in known.items():
    if not is_package:
      continue
    table = {}
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
      if isinstance(node, ast.Assign) and [ast.unparse(x) for x in node.targets] in (
          ["_SUBMODULES"], ["_EXPORTS"]):
        value = ast.literal_eval(node.value)
        pairs = value.items() if isinstance(value, dict) else ((v, v) for v in value)
        table.update({attribute: f"{name}.{module}" for attribute, module in pairs})
    if table:
      tables[name] = table
  return tables


def late_imports(name: str, path: pathlib.Path, known: dict,
                 tables: dict[str, dict[str, str]]) -> set[str]:
  """The package's modules `name` loads later than its imports: those it names in strings
  (a "module:attribute" for `pkgutil.resolve_name`, a dotted path for `importlib`), and
  those a lazy package loads for it (`from package import Name`, `package.Name`)."""
  tree = ast.parse(path.read_text(encoding="utf-8"))
  found, bound = set(), {}
  for node in ast.walk(tree):
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
      module = node.value.partition(":")[0]
      if module in known and "." in module:  # Not the package's bare name (a logger's).
        found.add(module)
    elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
      for alias in node.names:
        if node.module in tables and alias.name in tables[node.module]:
          found.add(tables[node.module][alias.name])
        if f"{node.module}.{alias.name}" in tables:
          bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    elif isinstance(node, ast.Import):
      bound.update({alias.asname: alias.name for alias in node.names
                    if alias.asname and alias.name in tables})
  for node in ast.walk(tree):
    if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
        and node.value.id in bound):
      found.add(tables[bound[node.value.id]].get(node.attr))
  return {m for m in found if m is not None and m != name}


def graph(*, late: bool = False) -> dict[str, set[str]]:
  """{module: the package's modules it imports}; `late`: and those it loads later
  (`late_imports`: by a string, through a lazy package)."""
  known = modules()
  edges = {name: imports(name, path, is_package, known)
           for name, (path, is_package) in known.items()}
  if late:
    tables = lazy_tables(known)
    for name, (path, _) in known.items():
      edges[name] |= late_imports(name, path, known, tables)
  return edges


def layer_of(name: str) -> int:
  short = name.removeprefix("jax_ai_stack.") if name != "jax_ai_stack" else name
  for index, (_, _, patterns) in enumerate(LAYERS):
    if short in patterns:
      return index
  for index in reversed(range(len(LAYERS))):
    if any(fnmatch.fnmatchcase(short, p) for p in LAYERS[index][2] if "*" in p):
      return index
  raise LookupError(f"{name} is in no layer: add it to LAYERS in {__file__}")


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
  """One cycle of `edges` as [a, b, ..., a], or None."""
  state: dict[str, int] = {}  # 1: on the path, 2: done.
  path: list[str] = []

  def visit(node: str) -> list[str] | None:
    state[node] = 1
    path.append(node)
    for target in sorted(edges.get(node, ())):
      if state.get(target) == 1:
        return path[path.index(target):] + [target]
      if target not in state and (cycle := visit(target)):
        return cycle
    path.pop()
    state[node] = 2
    return None

  for node in sorted(edges):
    if node not in state and (cycle := visit(node)):
      return cycle
  return None


def test_the_reader_resolves_relative_and_submodule_imports(tmp_path):
  known = {"p": None, "p.a": None, "p.b": None, "p.b.c": None}
  source = tmp_path / "a.py"
  source.write_text("from . import b\nfrom .b import c, thing\nimport os\n"
                    "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n  import p.b.c\n"
                    "def f():\n  from p.b import c\n")
  assert imports("p.a", source, False, known) == {"p.b", "p.b.c"}
  init = tmp_path / "__init__.py"
  init.write_text('_SUBMODULES = ("c",)\n_EXPORTS = {"Thing": "c"}\n')
  tables = lazy_tables({"p.b": (init, True)})
  assert tables == {"p.b": {"c": "p.b.c", "Thing": "p.b.c"}}
  source.write_text('TASK = "p.a:Thing"\nfrom p import b\nfrom p.b import Thing\n'
                    'def f():\n  return b.c\nlogger = "p"\n')
  assert late_imports("p.x", source, known, tables) == {"p.a", "p.b.c"}
  assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
  assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_import_graph_has_no_cycle():
  """Imports that run later count: a string resolved into a module, a lazy package's
  attribute."""
  cycle = find_cycle(graph(late=True))
  assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_every_module_is_in_a_layer():
  for name in modules():
    layer_of(name)  # Raises, naming the module, if none.


def test_no_module_imports_a_layer_above_its_own():
  edges = graph()
  for name in modules():  # A package's __init__ runs before each of its modules.
    parent = name.rpartition(".")[0]
    if parent:
      edges[name] = edges[name] | {parent}
  wrong = []
  for source, targets in sorted(edges.items()):
    for target in sorted(targets):
      if layer_of(target) > layer_of(source):
        wrong.append(f"{source} ({LAYERS[layer_of(source)][0]}) imports {target} "
                     f"({LAYERS[layer_of(target)][0]})")
  assert not wrong, "imports up the layers (move the shared piece down):\n" + "\n".join(wrong)


@pytest.mark.parametrize("name, layer", [
    ("jax_ai_stack.kernels.cli", "command lines"),
    ("jax_ai_stack.recipes.data.config", "recipe configs"),
    ("jax_ai_stack.recipes.data.pipeline", "builders"),
    ("jax_ai_stack.recipes.finetune.lora_cli", "command lines"),
    ("jax_ai_stack.recipes.run", "the run"),
])
def test_layers_are_assigned_most_specific_first(name, layer):
  assert LAYERS[layer_of(name)][0] == layer


@pytest.mark.parametrize("name", ["jax_ai_stack.recipes.run", "jax_ai_stack.recipes.trainer",
                                  "jax_ai_stack.recipes.train"])
def test_the_trainer_names_no_fine_tuning(name):
  """LoRA, QLoRA, QAT and a base to start from reach a run as a model transform (the
  Task's `model_transforms`) and DPO as an objective: the run and its loop import neither."""
  named = graph()[name]
  assert not [t for t in named if t.startswith("jax_ai_stack.recipes.finetune")], named


def test_the_architecture_page_names_only_modules_that_exist_in_their_layer():
  """docs/architecture.md: every `jax_ai_stack.x` it names is a module or package here, and
  each module of its layer table belongs to the layer it is listed under."""
  page = (PACKAGE.parent / "docs" / "architecture.md").read_text()
  named = set(re.findall(r"`(jax_ai_stack(?:\.\w+)*)`", page))
  assert len(named) > 20 and not named - modules().keys(), sorted(named - modules().keys())
  names = [layer for layer, _, _ in LAYERS]
  rows = re.findall(r"^\| ([a-z][^|]*?) \|[^|]*\|([^|]*)\|$", page, re.M)[1:]  # Not the head.
  assert [name for name, _ in rows] == names
  for row in rows:
    layer = names.index(row[0])
    for module in re.findall(r"`(jax_ai_stack[\w.]*)`", row[1]):
      assert layer_of(module) <= layer, (module, row[0])


MAX_LINES = 450
"""A module longer than this is split by concept (the trainer's loop from the train command's
course, the engine's scheduling from its steps), not trimmed."""


def test_every_module_is_at_most_max_lines():
  long = {name: n for name, (path, _) in modules().items()
          if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
  assert not long, f"modules over {MAX_LINES} lines: {long}"
