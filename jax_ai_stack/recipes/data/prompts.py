"""Prompts for reinforcement learning: what a policy answers, and what its rewards read.

Sources (`data.source`):

* `prompts`: JSONL files (`data.paths`), one prompt per line: `{"prompt": text}`
  (continued as it is) or `{"messages": [...]}` (a conversation ending with a
  user turn, answered through the run's chat template), plus any other columns
  (an answer, unit tests) that the rewards read.
* `prompts_arithmetic`: `data.arithmetic`'s problems, `{"messages": [user:
  "What is 85 - 63?"], "answer": "22", "reply": "85 - 63 = 22", "pattern": ...}`:
  a task whose answers a program checks, offline; `prompts_reversal` the same of
  `data.reversal`'s words ("Reverse evq": "qve").

The split is by a hash of the prompt's text (its last turn's, for a
conversation), as chat sources split theirs: `chat_arithmetic` holds out the
questions `prompts_arithmetic` holds out. A batch holds `prompt_index` [B], each
row's place in its split's list (`load_prompts(config)[split].records`): the
rollout reads the prompts and columns there, so the data pipeline carries
integers only and its position is checkpointed like any other.

Example: a line of a prompts file, and a batch of indices.
  >>> parse_prompt('{"prompt": "2 + 2 =", "answer": "4"}', "p.jsonl:1")
  {'prompt': '2 + 2 =', 'answer': '4'}
  >>> PromptRows([{"prompt": "a"}, {"prompt": "b"}], description="two")(np.arange(2))
  {'prompt_index': array([0, 1], dtype=int32)}
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence

import numpy as np

from jax_ai_stack.errors import DataError
from jax_ai_stack.recipes.data import chat, made_tasks, sources
from jax_ai_stack.recipes.data.config import DataConfig


def parse_prompt(line: str, where: str) -> dict:
  """One JSONL line as a prompt record; DataError naming `where` (file:line)."""
  record = chat.load_json_line(line, where)
  if not isinstance(record, dict) or ("prompt" in record) == ("messages" in record):
    raise DataError(f"{where}: a line holds \"prompt\" (text) or \"messages\" (a conversation "
                    "ending with a user turn), and any columns the rewards read")
  if "messages" in record:
    record["messages"] = chat.parse_line(json.dumps({"messages": record["messages"]}), where,
                                         to_answer=True)
  elif not isinstance(record["prompt"], str) or not record["prompt"]:
    raise DataError(f"{where}: \"prompt\" has no text")
  return record


class PromptRows:
  """A split's prompt records; called with row ids, the batch `{"prompt_index": ids}`."""

  def __init__(self, records: Sequence[dict], *, description: str):
    self.records = list(records)
    self.num_examples = len(self.records)
    self.description = description
    self.stats = {"prompts": self.num_examples}

  def __call__(self, ids: np.ndarray) -> dict[str, np.ndarray]:
    return {"prompt_index": np.asarray(ids, np.int32)}

  def __repr__(self) -> str:
    return f"PromptRows({self.description}, prompts={self.num_examples})"


def load_prompts(config: DataConfig) -> dict[str, PromptRows]:
  """`{"train": PromptRows, "validation": PromptRows}` of a prompt source (read once per
  config and files)."""
  made = made_tasks.task_of(config.source) is not None  # Reads no file.
  return _load(config, () if made else chat.file_stamps(config))


@functools.lru_cache(maxsize=2)
def _load(config: DataConfig, stamps: tuple) -> dict[str, PromptRows]:
  del stamps  # Part of the cache key: a changed file is read again.
  if made_tasks.task_of(config.source):
    records = [{"messages": [{"role": "user", "content": p.pop("question")}], **p}
               for p in made_tasks.problems(config.source, config.max_documents)]
    what = f"{config.source.partition('_')[2]} problems"
  else:
    lines, _ = chat.read_lines(sources.source_files(config), config.max_bad_lines, parse_prompt)
    records, what = [record for _, record in lines], ", ".join(config.paths)
    if config.max_documents is not None:
      records = records[:config.max_documents]
  if not records:
    raise DataError(f"data: no prompt in {what}")
  keys = [r["messages"][-1]["content"] if "messages" in r else r["prompt"] for r in records]
  held_out = chat.held_out_by_key(keys, config.holdout_fraction, salt=chat.HOLDOUT_SALT)
  return {split: PromptRows([r for r, k in zip(records, keep) if k],
                            description=f"{config.source} {what}, split={split!r}")
          for split, keep in (("train", ~held_out), ("validation", held_out))}
