"""`data.made_tasks`: which sources make their data, and the problems each makes."""

from __future__ import annotations

import pytest

from jax_ai_stack.recipes.data import arithmetic, made_tasks, reversal


@pytest.mark.parametrize("source, task", [
    ("chat_arithmetic", arithmetic), ("prompts_arithmetic", arithmetic),
    ("chat_reversal", reversal), ("prompts_reversal", reversal),
    ("chat_stdlib", None), ("prompts", None), ("stdlib", None), ("preference_stdlib", None),
])
def test_each_source_names_its_task_or_none(source, task):
  assert made_tasks.task_of(source) is task


def test_the_problems_of_both_sources_of_a_task_are_the_same_with_their_columns():
  assert made_tasks.problems("chat_reversal", 5) == made_tasks.problems("prompts_reversal", 5)
  assert len(made_tasks.problems("prompts_arithmetic", None)) == arithmetic.DEFAULT_COUNT
  for source in ("prompts_arithmetic", "prompts_reversal"):
    [problem] = made_tasks.problems(source, 1)
    assert set(problem) == {"question", "answer", "reply", "pattern"}
