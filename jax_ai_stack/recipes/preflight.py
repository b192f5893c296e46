"""What a run checks before anything is built or written: the code and tasks its config names.

A config names Python as 'module:function' or 'module:Class' (`model.task`,
`rl.rewards`) and lm-evaluation-harness tasks by name or path
(`train.eval_tasks`). Each is imported or resolved here, before the workdir is
created and before the model is built and compiled, so a misspelled module
costs seconds, is named in one line with its field, and leaves no workdir
behind (no config.yaml, record.json, metrics.jsonl or checkpoints/).

`references(config)` lists what a config names; `check_references` imports each
(`train.run` and `opening.open_to_train` call it, so a notebook's `Trainer.open`
is checked too); `check` adds a fresh run's `finetune.base`, a distillation teacher and the
harness tasks, resolved once and handed to the Trainer.

Example:
  >>> from jax_ai_stack.recipes import config
  >>> references(config.load("lm-tiny-grpo"))  # doctest: +ELLIPSIS
  [('rl.rewards', 'jax_ai_stack.recipes.rl.rewards:exact_answer'), ...]
  >>> check_references(config.load("lm-tiny-grpo", overrides=["rl.rewards=[my_rewardz:parity]", "rl.reward_weights=null"]))
  Traceback (most recent call last):
  ...
  jax_ai_stack.errors.ConfigError: rl.rewards='my_rewardz:parity' does not import (ModuleNotFoundError: No module named 'my_rewardz'); it must be 'module:function' importable from the current directory or PYTHONPATH
"""

from __future__ import annotations

import pathlib
from typing import Any

from jax_ai_stack.errors import ConfigError
from jax_ai_stack.recipes import configlib, tasks
from jax_ai_stack.recipes.workdir import CHECKPOINT_DIR


def references(config: Any) -> list[tuple[str, str]]:
  """(field, 'module:name') of every piece of Python `config` names that a run imports."""
  found = []
  task = getattr(getattr(config, "model", None), "task", None)
  if isinstance(task, str):  # A model of one's own (model.kind=custom).
    found.append(("model.task", task))
  data, rl = getattr(config, "data", None), getattr(config, "rl", None)
  if rl is not None and getattr(data, "is_prompts", False):  # Only a run on prompts scores.
    found.extend(("rl.rewards", ref) for ref in rl.rewards)
  return found


def check_references(config: Any) -> None:
  """Imports each of `references(config)`; ConfigError naming the field and the module
  for one that does not import (or a reward that is not a function)."""
  for field, ref in references(config):
    if field == "rl.rewards":
      from jax_ai_stack.recipes.rl import rewards  # pylint: disable=g-import-not-at-top

      rewards.load((ref,), (1.0,))  # The callable check too.
    else:
      configlib.import_named(ref, field)


def check_base(config: Any, workdir: pathlib.Path | None) -> None:
  """A fresh run's `finetune.base` is a trained run (`base_run.resolve_base`'s error names
  it). A resumed one reads the base its checkpoint points to, so its config's is not asked."""
  base = getattr(getattr(config, "finetune", None), "base", None)
  checkpoints = None if workdir is None else pathlib.Path(workdir) / CHECKPOINT_DIR
  if base is None or (checkpoints is not None and checkpoints.is_dir() and any(
      p.name.isdigit() for p in checkpoints.iterdir())):
    return
  from jax_ai_stack.recipes.finetune import base_run  # pylint: disable=g-import-not-at-top

  base_run.resolve_base(base)


def check_teacher(config: Any) -> None:
  """A distillation run's teacher is a trained run that speaks the student's tokens
  (`teacher.read_teacher`'s one line otherwise)."""
  distill = getattr(getattr(config, "finetune", None), "distill", None)
  if getattr(distill, "teacher", None) is not None:
    from jax_ai_stack.recipes.finetune import teacher  # pylint: disable=g-import-not-at-top

    teacher.read_teacher(distill.teacher, config)


def check(config: Any, workdir: pathlib.Path | None = None):
  """`check_references` and `check_base`, then `train.eval_tasks` resolved
  (`evaluation.in_training.TrainingTasks`, or None without them): ConfigError for a bad
  name, before the run opens."""
  check_references(config)
  check_base(config, workdir)
  check_teacher(config)
  if not getattr(config.train, "eval_tasks", ()):
    return None
  try:  # A built-in Task; a custom one (model.task, or given in Python) is asked at opening.
    task_class = None if getattr(config.model, "task", None) else tasks.registered(
        config.model).task_class()
  except (AttributeError, TypeError):  # A config of one's own the registry does not know.
    task_class = None
  if task_class is not None and not hasattr(task_class, "tokenizer"):  # Before indexing.
    raise ConfigError(f"train.eval_tasks: {task_class.__name__} has no language model to run "
                      "lm-evaluation-harness tasks on")
  from jax_ai_stack.recipes.evaluation import in_training  # pylint: disable=g-import-not-at-top

  return in_training.TrainingTasks(config.train)
