"""What a run checks before anything is built or written: the code and tasks its config names.

A config names Python as 'module:function' or 'module:Class' (`model.task`,
`rl.rewards`) and lm-evaluation-harness tasks by name or path
(`train.eval_tasks`). Each is imported or resolved here, before the workdir is
created and before the model is built and compiled, so a misspelled module
costs seconds, is named in one line with its field, and leaves no workdir
behind (no config.yaml, record.json, metrics.jsonl or checkpoints/).

`references(config)` lists what a config names; `check_references` imports each
(`train.run` and `opening.open_to_train` call it, so a notebook's `Trainer.open`
is checked too); `check` adds the harness tasks, resolved once and handed to
the Trainer.

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

from typing import Any

from jax_ai_stack.errors import ConfigError
from jax_ai_stack.recipes import configlib, tasks


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


def check(config: Any):
  """`check_references`, then `train.eval_tasks` resolved (`evaluation.in_training.
  TrainingTasks`, or None without them): ConfigError for a bad name, before the run opens."""
  check_references(config)
  if not getattr(config.train, "eval_tasks", ()):
    return None
  model = getattr(config, "model", None)
  if model is not None and not hasattr(model, "task"):  # Built in (a custom Task: at opening).
    task_class = tasks.registered(model).task_class()
    if not hasattr(task_class, "tokenizer"):  # Before the harness indexes its tasks.
      raise ConfigError(f"train.eval_tasks: {task_class.__name__} has no language model to run "
                        "lm-evaluation-harness tasks on")
  from jax_ai_stack.recipes.evaluation import in_training  # pylint: disable=g-import-not-at-top

  return in_training.TrainingTasks(config.train)
