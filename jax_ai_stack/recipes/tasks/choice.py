"""Which Task a run opens with: the one given, or the one its config's model registers.

Apart from `base` (the Task class) and `registry` (the table a config reads
without jax): the registry names its Tasks by "module:Class", and a Task's
module imports `base`, so `base` itself names no Task.

Example:
  >>> from jax_ai_stack.recipes import config
  >>> type(resolve(None, config.load("digits-cnn"))).__name__
  'ImageClassification'
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jax_ai_stack.recipes.tasks.base import Task
from jax_ai_stack.recipes.tasks.registry import registered


def resolve(task: Task | Callable[[Any], Task] | None, config: Any) -> Task:
  """The Task a run opens with: `task` itself, `task(config)` when it is a function or
  a Task subclass, else the one `config` names (its registered Task's `for_config`)."""
  if isinstance(task, Task):
    return task
  if task is not None:
    return task(config)
  return registered(config.model).task_class().for_config(config)
