"""The tasks made on the fly whose answers a program checks: `arithmetic` and `reversal`.

Each has a chat source that teaches its replies (`chat_<task>`) and a prompt
source that asks its questions for reinforcement learning (`prompts_<task>`),
with the columns the built-in rewards read (`answer`, `pattern`). Both sources
of a task hold out the same questions.

Example:
  >>> [p["reply"] for p in problems("prompts_reversal", 2)]
  ['qnhibb -> bbihn', 'evq -> qv']
  >>> task_of("chat_stdlib") is None
  True
"""

from __future__ import annotations

from types import ModuleType

from jax_ai_stack.recipes.data import arithmetic, reversal

TASKS: dict[str, ModuleType] = {"arithmetic": arithmetic, "reversal": reversal}


def task_of(source: str) -> ModuleType | None:
  """The module of the task `source` (`chat_<task>`, `prompts_<task>`) makes; None for a
  source that reads data."""
  kind, _, name = source.partition("_")
  return TASKS.get(name) if kind in ("chat", "prompts") else None


def problems(source: str, count: int | None) -> list[dict[str, str]]:
  """The first `count` problems of `source`'s task (its `DEFAULT_COUNT` when None)."""
  task = task_of(source)
  return task.problems(count or task.DEFAULT_COUNT)
