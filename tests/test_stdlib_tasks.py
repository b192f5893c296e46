"""`evaluation.stdlib_tasks`: harness tasks made from the standard library, offline."""

from __future__ import annotations

import json

import yaml

from jax_ai_stack.recipes.data import chat
from jax_ai_stack.recipes.evaluation import stdlib_tasks

FUNCTIONS = list(chat.stdlib_functions())


def test_each_docstring_row_holds_its_own_summary_where_the_answer_says():
  rows = stdlib_tasks.docstring_rows(FUNCTIONS[:50])
  for function, row in zip(FUNCTIONS, rows):
    assert row["call"] == function.call and len(row["choices"]) == stdlib_tasks.CHOICES
    assert row["choices"][row["answer"]] == function.summary
    assert row["choices"].count(function.summary) == 1
  assert len({row["answer"] for row in rows}) == stdlib_tasks.CHOICES  # Not always first.
  assert stdlib_tasks.docstring_rows(FUNCTIONS[:50]) == rows  # Seeded: the same every run.


def test_a_definition_row_hides_the_real_line_among_three_swapped_copies():
  for function, row in zip(FUNCTIONS, stdlib_tasks.definition_rows(FUNCTIONS[:30])):
    real = row["choices"][row["answer"]]
    assert real.startswith(f"def {function.key.rpartition('.')[2]}(") and real.endswith(":")
    others = [c for i, c in enumerate(row["choices"]) if i != row["answer"]]
    assert len(set(others)) == 3 and real not in others
    assert all(sorted(c) == sorted(real) and len(c) == len(real) for c in others)


def test_the_held_out_functions_are_the_ones_chat_stdlib_holds_out():
  unseen = {f.key for f in stdlib_tasks.held_out(FUNCTIONS)}
  conversations = list(chat.stdlib_conversations())
  keys = [key for key, _ in conversations]
  mask = chat.held_out_by_key(keys, stdlib_tasks.HELD_OUT_FRACTION, salt=chat.HOLDOUT_SALT)
  assert unseen == {key for key, held in zip(keys, mask) if held} and unseen


def test_the_written_task_files_are_harness_yaml_pointing_at_their_data(tmp_path):
  stdlib_tasks.write(tmp_path / "tasks")
  for task in stdlib_tasks.TASKS:
    spec = yaml.safe_load((tmp_path / "tasks" / f"{task}.yaml").read_text())
    assert spec["task"] == task and spec["dataset_path"] == "json"
    data = spec["dataset_kwargs"]["data_files"]["test"]
    assert data == str((tmp_path / "tasks" / f"{task}.jsonl").resolve())
    rows = [json.loads(line) for line in open(data, encoding="utf-8")]
    assert len(rows) == (len(stdlib_tasks.held_out(FUNCTIONS)) if "held_out" in task
                         else len(FUNCTIONS))
