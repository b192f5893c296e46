"""lm-evaluation-harness tasks run on a model: names and task directories resolved, the
harness's results returned, and each way it can go wrong said in one line.

`evaluate(harness_model, resolve(["arc_easy", "path/to/my_tasks"]), limit=...)`:
`resolve` reads each entry: a directory is scanned for task YAML files (all its tasks run), a
name must be one the harness knows (else the close ones are listed). The data
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

__all__ = ["Tasks", "evaluate", "prepare", "resolve", "task_files"]


def task_files(directory: pathlib.Path) -> dict[str, pathlib.Path]:
  """{task name: its YAML} of the task files in `directory` (recursively); ConfigError
  when none is valid."""
  found, problems = {}, []
  for path in sorted(directory.rglob("*.yaml")):
    try:
      spec = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as e:
      problems.append(f"{path.name}: not YAML ({str(e).splitlines()[0]})")
      continue
    if isinstance(spec, dict) and isinstance(spec.get("task"), str):
      found[spec["task"]] = path
    else:
      problems.append(f"{path.name}: no 'task:' name")
  if not found:
    raise ConfigError(f"--tasks {directory}: no task YAML file (one with a 'task:' name)"
                      + (f"; {'; '.join(problems)}" if problems else ""))
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
    if ("/" in entry or entry.startswith(".")) and not pathlib.Path(entry).is_dir():
      raise ConfigError(f"{what} {entry}: no such directory")
  made = stdlib_tasks.make() if stdlib_tasks.NAME in entries else None
  embedded = str(stdlib_tasks.write(scratch, made)) if made else None
  return resolve([embedded if e == stdlib_tasks.NAME else e for e in entries], what=what), made


def resolve(entries: list[str], *, what: str = "--tasks") -> Tasks:
  """`entries` (names, directories of task YAML files) as Tasks; ConfigError naming an
  unknown one, with the close names (`what`: the flag or field that gave them)."""
  from lm_eval.tasks import TaskManager

  directories = [pathlib.Path(e) for e in entries if pathlib.Path(e).is_dir()]
  names = []
  for entry in entries:
    path = pathlib.Path(entry)
    names += list(task_files(path)) if path.is_dir() else [entry]
  manager = TaskManager(include_path=[str(d) for d in directories] or None)
  known = set(manager.all_tasks)
  for name in names:
    if name not in known:
      close = difflib.get_close_matches(name, sorted(known), n=5, cutoff=0.6)
      hint = f"; close: {', '.join(close)}" if close else ""
      raise ConfigError(f"{what}: no task {name!r} in lm-eval{hint} (or give a directory "
                        "of task YAML files)")
  return Tasks(tuple(names), manager)


def evaluate(harness_model, tasks: Tasks, *, limit: int | float | None = None,
             num_fewshot: int | None = None, apply_chat_template: bool = False,
             seed: int = 0) -> dict[str, Any]:
  """The harness's results dict for `tasks` (`resolve`) on `harness_model` (a
  `HarnessModel`)."""
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
        fewshot_random_seed=seed, bootstrap_iters=0)
  except (ConnectionError, FileNotFoundError, OSError) as e:
    if not _offline(e):
      raise
    raise DataError(f"--tasks {','.join(names)}: the data is not on disk and this project "
                    f"downloads nothing at run time ({type(e).__name__}: "
                    f"{str(e).splitlines()[0][:200]}); point the task's dataset_path/"
                    "dataset_kwargs.data_files at local files") from None


def _offline(error: BaseException) -> bool:
  """Whether `error` is the Hub refusing a download (offline mode, no network)."""
  text = f"{type(error).__name__} {error}".lower()
  return any(word in text for word in ("offline", "couldn't reach", "connection",
                                       "doesn't exist on the hub", "unable to find",
                                       "no such file", "not found"))
