"""Prompt sources: JSONL lines checked and named, the arithmetic problems stable, the split
shared with chat_arithmetic, and batches of prompt indices through the pipeline."""

from __future__ import annotations

import dataclasses
import re

import pytest

from jax_ai_stack.errors import DataError
from jax_ai_stack.recipes.data import (DataConfig, arithmetic, build_dataset, chat, prompts,
                                       reversal)


@pytest.mark.parametrize("line,message", [
    ("{", r"p.jsonl:3: not JSON"),
    ('{"answer": 1}', r"p.jsonl:3: a line holds \"prompt\" \(text\) or \"messages\""),
    ('{"prompt": "a", "messages": []}', r"a line holds \"prompt\""),
    ('{"prompt": ""}', r"p.jsonl:3: \"prompt\" has no text"),
    ('{"messages": [{"role": "assistant", "content": "hi"}]}', "p.jsonl:3"),
])
def test_a_bad_prompt_line_is_named_by_file_and_line(line, message):
  with pytest.raises(DataError, match=message):
    prompts.parse_prompt(line, "p.jsonl:3")


def test_arithmetic_problems_are_stable_and_answered_right():
  many = arithmetic.problems(300)
  assert arithmetic.problems(10) == many[:10]
  for problem in many:
    a, op, b = problem["question"].removeprefix("What is ").removesuffix("?").split()
    assert int(problem["answer"]) == (int(a) + int(b) if op == "+" else int(a) - int(b))
    assert problem["reply"] == f"{a} {op} {b} = {problem['answer']}"


@pytest.mark.parametrize("task", ["arithmetic", "reversal"])
def test_a_made_tasks_chat_source_holds_out_the_questions_its_prompts_hold_out(task):
  config = DataConfig(source=f"prompts_{task}", max_documents=400, validation_fraction=0.2,
                      seq_len=64)
  held_out = {r["messages"][0]["content"] for r in prompts.load_prompts(config)["validation"].records}
  conversations = chat.made_conversations(f"chat_{task}", 400)
  keys = [key for key, _ in conversations]
  chat_held_out = {k for k, out in zip(keys, chat.held_out_by_key(
      keys, 0.2, salt=chat.HOLDOUT_SALT)) if out}
  assert held_out == chat_held_out and 40 < len(held_out) < 120


def test_reversal_problems_are_stable_and_answered_right():
  many = reversal.problems(300)
  assert reversal.problems(10) == many[:10]
  for p in many:
    word = p["question"].removeprefix("Reverse ")
    assert p["answer"] == word[::-1] and p["reply"] == reversal.taught_reply(word)
    assert p["reply"] in (f"{word} -> {word[::-1]}", f"{word} -> {word[::-1][:-1]}")
    assert reversal.SHORTEST <= len(word) <= reversal.LONGEST and word.isalpha()
  assert len({p["question"] for p in many}) > 290
  # The careless teacher: about one reply in three whole, the others a letter short.
  whole = sum(p["reply"].endswith(" " + p["answer"]) for p in many) / len(many)
  assert 0.25 < whole < 0.42


def test_the_pipeline_batches_prompt_indices_and_a_jsonl_file_keeps_its_columns(tmp_path):
  path = tmp_path / "p.jsonl"
  path.write_text("".join(f'{{"prompt": "{i} + 1 =", "answer": "{i + 1}"}}\n' for i in range(30)))
  config = DataConfig(source="prompts", paths=(str(path),), batch_size=4, seq_len=32,
                      validation_fraction=0.2)
  loaded = prompts.load_prompts(config)
  assert loaded["train"].records[0].keys() == {"prompt", "answer"}
  batch = next(iter(build_dataset(config, split="train", seed=0, process_index=0,
                                  process_count=1)))
  assert set(batch) == {"prompt_index"} and batch["prompt_index"].shape == (4,)
  assert batch["prompt_index"].max() < loaded["train"].num_examples
  with pytest.raises(DataError, match="the validation split has 0 prompts and needs 4"):
    build_dataset(DataConfig(source="prompts", paths=(str(path),), batch_size=4, seq_len=32,
                             validation_fraction=0.0), split="validation", seed=0,
                  process_index=0, process_count=1)


def test_too_few_held_out_prompts_name_each_field_with_its_value_as_chat_does(tmp_path):
  """The note SFT and DPO gave read "lower data.batch_size (now 8) (now 0.05), or add
  conversations (ChatRows(...))": one wording now, shared with chat and preference sets."""
  path = tmp_path / "p.jsonl"
  path.write_text("".join(f'{{"prompt": "{i} + 1 =", "answer": "{i + 1}"}}\n' for i in range(60)))
  config = DataConfig(source="prompts", paths=(str(path),), batch_size=4, seq_len=32,
                      validation_fraction=0.02)
  with pytest.raises(DataError) as raised:
    build_dataset(config, split="validation", seed=0, process_index=0, process_count=1)
  message = str(raised.value)
  match = re.search(r"the validation split has (\d+) prompts and needs 4 \(data.batch_size=4\): "
                    r"it holds \1 of the 60 prompts \(data.validation_fraction=0.02\) and a batch "
                    r"takes about 4; set data.validation_fraction=([\d.]+) to hold out about a "
                    r"batch, lower data.batch_size, or add prompts \(about \d+ in all hold out a batch "
                    r"at data.validation_fraction=0.02\)$", message)
  assert match, message
  held = prompts.load_prompts(dataclasses.replace(config, validation_fraction=float(match[2])))
  assert held["validation"].num_examples >= 4
