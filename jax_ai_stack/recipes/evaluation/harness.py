"""lm-evaluation-harness tasks run on a model: names and task directories resolved, the
harness's results returned, and each way it can go wrong said in one line.

`evaluate(harness_model, resolve(["arc_easy", "path/to/my_tasks"]), limit=...)`:
`resolve` reads each entry: a directory is scanned for task YAML files (all its tasks run), a
task YAML file runs its one task, a name must be one the harness knows (else the close ones
are listed, the local task files first). The data
must be on disk: a registered task whose dataset lives on the Hugging Face Hub
needs a download, which this project never makes at run time, so it says so;
a task YAML whose `dataset_path` is a local format (`json`, `csv`, `parquet`)
with `dataset_kwargs.data_files` runs offline (`HF_DATASETS_OFFLINE=1`, which
the command line sets).

Example: an unknown name lists the close ones.
  >>> resolve(["hellaswg"])
  Traceback (most recent call last):
  ...
  jax_ai_stack.errors.ConfigError: --tasks: no task 'hellaswg' in lm-eval; close: hellaswag, ...
"""

from __future__ import annotations

import dataclasses
import difflib
import pathlib
from typing import Any

import yaml

from jax_ai_stack.errors import ConfigError, DataError

__all__ = ["Tasks", "evaluate", "nearby_tasks", "prepare", "resolve", "task_files"]


def task_files(directory: pathlib.Path) -> dict[str, pathlib.Path]:
  """{task name: its YAML} of the task files in `directory` (recursively); ConfigError
  when none is valid."""
  found, problems = {}, []
  for path in sorted(directory.rglob("*.yaml")):
    name, problem = _task_name(path)
    if name is None:
      problems.append(problem)
    else:
      found[name] = path
  if not found:
    raise ConfigError(f"--tasks {directory}: no task YAML file (one with a 'task:' name)"
                      + (f"; {'; '.join(problems)}" if problems else ""))
  return found


def _task_name(path: pathlib.Path) -> tuple[str | None, str | None]:
  """(the 'task:' name of a task YAML file, None) or (None, what is wrong with it)."""
  try:
    spec = yaml.safe_load(path.read_text(encoding="utf-8"))
  except (OSError, yaml.YAMLError, UnicodeDecodeError) as e:
    return None, f"{path.name}: not YAML ({str(e).splitlines()[0]})"
  if isinstance(spec, dict) and isinstance(spec.get("task"), str):
    return spec["task"], None
  return None, f"{path.name}: no 'task:' name"


def _is_path(entry: str) -> bool:
  """Whether a --tasks entry is meant as a file or folder rather than a task name."""
  return "/" in entry or entry.startswith(".") or entry.endswith((".yaml", ".yml"))


def _missing(entry: str, what: str) -> ConfigError:
  """A path that is not there, with the close names in its folder (`parity.yml` for
  `parity.yaml`)."""
  path = pathlib.Path(entry)
  names = sorted(p.name for p in path.parent.iterdir()) if path.parent.is_dir() else []
  close = difflib.get_close_matches(path.name, names, n=3, cutoff=0.6)
  hint = f"; close: {', '.join(str(path.parent / n) for n in close)}" if close else ""
  return ConfigError(f"{what} {entry}: no such file or directory{hint}")


def nearby_tasks(directory: pathlib.Path, *, most: int = 200) -> dict[str, pathlib.Path]:
  """{task name: its YAML} of the task files in `directory` and its folders one level down
  (not hidden ones; at most `most` files read): the local tasks a misspelled name may mean."""
  found: dict[str, pathlib.Path] = {}
  candidates = [*sorted(directory.glob("*.yaml")), *sorted(directory.glob("[!.]*/*.yaml"))]
  for path in candidates[:most]:
    name, _ = _task_name(path)
    if name is not None:
      found.setdefault(name, path)
  return found


@dataclasses.dataclass(frozen=True)
class Tasks:
  """Harness tasks resolved: their names and the TaskManager that knows them all."""

  names: tuple[str, ...]
  manager: Any


def prepare(entries: list[str], scratch: pathlib.Path, *, what: str = "--tasks"
            ) -> tuple[Tasks, Any]:
  """(`resolve` of `entries`, the embedded tasks made or None): 'stdlib' is made and written
  into `scratch` first (`stdlib_tasks`); ConfigError, named as `what`, for a path that is not
  a directory or an unknown name."""
  from jax_ai_stack.recipes.evaluation import stdlib_tasks  # pylint: disable=g-import-not-at-top

  for entry in entries:
    if _is_path(entry) and not pathlib.Path(entry).exists():
      raise _missing(entry, what)
  made = stdlib_tasks.make() if stdlib_tasks.NAME in entries else None
  embedded = str(stdlib_tasks.write(scratch, made)) if made else None
  return resolve([embedded if e == stdlib_tasks.NAME else e for e in entries], what=what), made


def resolve(entries: list[str], *, what: str = "--tasks") -> Tasks:
  """`entries` (names, task YAML files, directories of them) as Tasks; ConfigError naming an
  unknown one, with the close names: local tasks first (those `entries` bring, those in the
  current directory), then lm-eval's (`what`: the flag or field that gave them)."""
  from lm_eval.tasks import TaskManager

  directories, names, local = [], [], {}
  for entry in entries:
    path = pathlib.Path(entry)
    if path.is_dir():
      found = task_files(path)
    elif path.is_file():
      name, problem = _task_name(path)
      if name is None:
        raise ConfigError(f"{what} {entry}: not a task file ({problem})")
      found, path = {name: path}, path.parent  # The harness indexes folders.
    elif _is_path(entry):
      raise _missing(entry, what)
    else:
      names.append(entry)
      continue
    directories.append(path)
    names += list(found)
    local.update(found)
  manager = TaskManager(include_path=[str(d) for d in dict.fromkeys(directories)] or None)
  known = set(manager.all_tasks)
  for name in names:
    if name not in known:
      raise ConfigError(f"{what}: no task {name!r} in lm-eval{_close(name, local, known)} (or "
                        "give a task YAML file or a directory of them)")
  return Tasks(tuple(names), manager)


def _close(name: str, local: dict[str, pathlib.Path], known: set[str]) -> str:
  """'; close: ...' naming the tasks near `name`: local ones first, with their files (the
  run's own, then the current directory's), then lm-eval's; '' when none is near."""
  from jax_ai_stack.recipes.evaluation import stdlib_tasks  # pylint: disable=g-import-not-at-top

  nearby = {**nearby_tasks(pathlib.Path()), **local}  # Relative: as the user would type it.
  mine = difflib.get_close_matches(name, [stdlib_tasks.NAME, *nearby], n=5, cutoff=0.6)
  theirs = [t for t in difflib.get_close_matches(name, sorted(known), n=5, cutoff=0.6)
            if t not in mine and t not in local]
  shown = [n if n == stdlib_tasks.NAME or n in local else f"{n} ({nearby[n]})" for n in mine]
  shown += theirs[:max(0, 5 - len(shown))]
  return f"; close: {', '.join(shown)}" if shown else ""


BOOTSTRAP_ITERS = 1000
"""Resamples of lm-eval's bootstrap standard error (its own default is 100,000): metrics
without a closed form (perplexity, f1, bleu, ...) get one in about a second, to two
digits. A mean (acc, exact_match) has a closed form, computed whenever this is above 0."""


def evaluate(harness_model, tasks: Tasks, *, limit: int | float | None = None,
             num_fewshot: int | None = None, apply_chat_template: bool = False,
             seed: int = 0, bootstrap_iters: int = BOOTSTRAP_ITERS) -> dict[str, Any]:
  """The harness's results dict for `tasks` (`resolve`) on `harness_model` (a
  `HarnessModel`), with its standard errors (`BOOTSTRAP_ITERS`; 0: none, each "N/A")."""
  names, manager = list(tasks.names), tasks.manager
  if apply_chat_template and not harness_model.chat_template(True):
    raise ConfigError("--apply-chat-template: this run has no chat template (train with "
                      "data.chat_template, or leave the flag out)")
  from lm_eval import evaluator

  try:
    return evaluator.simple_evaluate(
        model=harness_model, tasks=names, num_fewshot=num_fewshot, limit=limit,
        task_manager=manager, apply_chat_template=apply_chat_template, log_samples=False,
        random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
        fewshot_random_seed=seed, bootstrap_iters=bootstrap_iters)
  except (ConnectionError, FileNotFoundError, OSError) as e:
    if not _offline(e):
      raise
    raise DataError(f"--tasks {','.join(names)}: the data is not on disk and this project "
                    f"downloads nothing at run time ({type(e).__name__}: "
                    f"{str(e).splitlines()[0][:200]}); point the task's dataset_path/"
                    "dataset_kwargs.data_files at local files") from None


def stderr_note(results: dict[str, Any]) -> str | None:
  """A line on the table's Stderr column where some of it is "N/A"; None where none is."""
  missing = sorted({key.split("_stderr,")[0] for task in results.get("results", {}).values()
                    for key, value in task.items() if "_stderr," in key and value == "N/A"})
  if not missing:
    return None
  return (f"Stderr N/A ({', '.join(missing)}): lm-eval has no standard error for that metric, "
          "or the task had a single example")


def _offline(error: BaseException) -> bool:
  """Whether `error` is the Hub refusing a download (offline mode, no network)."""
  text = f"{type(error).__name__} {error}".lower()
  return any(word in text for word in ("offline", "couldn't reach", "connection",
                                       "doesn't exist on the hub", "unable to find",
                                       "no such file", "not found"))
