"""Preference pairs: a prompt with a chosen and a rejected reply, for DPO.

Sources (`data.source`):

* `preference`: JSONL files (`data.paths`), one pair per line: `{"prompt",
  "chosen", "rejected"}` (strings: one user turn, two replies) or `{"chosen":
  [messages], "rejected": [messages]}` (two conversations that differ only in
  their last turn, the assistant's).
* `preference_stdlib`: pairs made from `chat_stdlib`'s questions about the
  standard library, offline: chosen, the right answer; rejected, the same
  answer with its words in reverse order.

Each side is the prompt and its reply rendered with the run's chat template
(`chat.tokenize`): the reply's tokens, its end-of-turn token included, are the
ones whose log-probability counts. A pair is one row per side, not packed: its
first `data.seq_len + 1` tokens, the rest cut (counted); a pair with a side
left without a reply token is dropped (counted). The split is by a hash of the
prompt, so both replies to one prompt fall on the same side.

A batch is `chosen_<key>` and `rejected_<key>` for each LM key (`inputs`,
`targets`, `segment_ids`, `positions`, `loss_mask`), [B, T] each.

Example: a pair (byte tokenizer); the sides share the prompt.
  >>> from jax_ai_stack.recipes.data.chat_template import BYTE_TEMPLATE, ChatTemplate
  >>> from jax_ai_stack.recipes.data.tokenizers import ByteTokenizer
  >>> tokenizer = ByteTokenizer()
  >>> template = ChatTemplate(BYTE_TEMPLATE, bos_token="<|bos|>", eos_token="<|eos|>")
  >>> pair = parse_pair('{"prompt": "2+2?", "chosen": "4", "rejected": "5"}', "p.jsonl:1")
  >>> rows = PreferenceRows([pair], template, tokenizer, seq_len=32, description="one")
  >>> batch = rows(np.arange(1))
  >>> [tokenizer.decode(batch[f"{side}_targets"][0][batch[f"{side}_loss_mask"][0] > 0])
  ...  for side in SIDES]
  ['4\\n', '5\\n']
"""

from __future__ import annotations

import functools
import json
import pathlib
from collections.abc import Sequence

import numpy as np

from jax_ai_stack.errors import DataError
from jax_ai_stack.recipes.data import chat, chat_template, examples, sources
from jax_ai_stack.recipes.data.config import DataConfig
from jax_ai_stack.recipes.data.tokenizers import Tokenizer, build_tokenizer

SIDES = ("chosen", "rejected")
KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_mask")

Pair = tuple[list[dict], str, str]
"""(prompt messages, ending with a user turn; chosen reply; rejected reply)."""


def parse_pair(line: str, where: str) -> Pair:
  """One JSONL line as a preference pair; DataError naming `where` (file:line)."""
  record = chat.load_json_line(line, where)
  if not isinstance(record, dict) or not {"chosen", "rejected"} <= record.keys():
    raise DataError(f"{where}: a line holds \"chosen\" and \"rejected\" (replies, with a "
                    "\"prompt\"; or two conversations)")
  if "prompt" in record:
    prompt = chat.parse_line(json.dumps({"prompt": record["prompt"]}), where, to_answer=True)
    chosen, rejected = record["chosen"], record["rejected"]
  else:
    sides = [chat.parse_line(json.dumps({"messages": record[side]}), f"{where} ({side})")
             for side in SIDES]
    if sides[0][:-1] != sides[1][:-1] or any(s[-1]["role"] != "assistant" for s in sides):
      raise DataError(f"{where}: \"chosen\" and \"rejected\" must be the same conversation up "
                      "to their last turn, the assistant's")
    prompt, chosen, rejected = sides[0][:-1], sides[0][-1]["content"], sides[1][-1]["content"]
  for side, reply in zip(SIDES, (chosen, rejected)):
    if not isinstance(reply, str) or not reply:
      raise DataError(f"{where}: \"{side}\" has no text")
  if chosen == rejected:
    raise DataError(f"{where}: \"chosen\" and \"rejected\" are the same reply: nothing to prefer")
  return prompt, chosen, rejected


def read_pairs(paths: Sequence[pathlib.Path], max_bad_lines: int) -> tuple[list[Pair], int]:
  """(every pair in `paths`, in order; bad lines skipped), as `chat.read_jsonl` reads."""
  lines, skipped = chat.read_lines(paths, max_bad_lines, parse_pair)
  return [pair for _, pair in lines], skipped


def stdlib_pairs(patterns: tuple[str, ...] = ()) -> list[Pair]:
  """`chat_stdlib`'s questions, each with its answer chosen and the same answer damaged (its
  words in reverse order) rejected: a preference a model can learn for questions it never
  saw, unlike the facts in the answers."""
  pairs = []
  for _, (question, answer) in chat.stdlib_conversations(patterns):
    damaged = " ".join(reversed(answer["content"].split()))
    if damaged != answer["content"]:
      pairs.append(([question], answer["content"], damaged))
  return pairs


class PreferenceRows:
  """Pairs as rows: `chosen_*` and `rejected_*` [N, seq_len] (see the module). `stats`
  counts the pairs kept, cut and dropped."""

  prompt: list[dict] | None = None
  """The split's first pair's prompt (ending with a user turn): a prompt of the run's own
  data for the end-of-run sample; None: no pair."""

  def __init__(self, pairs: Sequence[Pair], template: chat_template.ChatTemplate,
               tokenizer: Tokenizer, *, seq_len: int, description: str):
    self.seq_len, self.description = seq_len, description
    kept, truncated, dropped = [], 0, 0
    for prompt, *replies in pairs:
      sides = []
      for reply in replies:
        ids, mask = chat.tokenize(template, tokenizer,
                                  [*prompt, {"role": "assistant", "content": reply}])
        truncated += len(ids) > seq_len + 1
        sides.append((ids[:seq_len + 1], mask[:seq_len + 1]))
      if all(mask[1:].any() for _, mask in sides):
        kept.append(sides)
      else:
        dropped += 1
    self.stats = {"pairs": len(kept), "truncated": truncated, "dropped": dropped}
    self.num_examples = len(kept)
    self._arrays = {}
    for s, side in enumerate(SIDES):
      arrays = examples.one_per_row([pair[s] for pair in kept], seq_len=seq_len,
                                    pad_id=tokenizer.pad_id)
      self._arrays.update({f"{side}_{key}": value for key, value in arrays.items()})

  def __call__(self, ids: np.ndarray) -> dict[str, np.ndarray]:
    return {key: value[ids] for key, value in self._arrays.items()}

  def __repr__(self) -> str:
    return (f"PreferenceRows({self.description}, pairs={self.num_examples}, "
            f"seq_len={self.seq_len})")


def load_preferences(config: DataConfig) -> dict[str, PreferenceRows]:
  """`{"train": PreferenceRows, "validation": PreferenceRows}` of a preference source (built
  once per config and files); prints a note when pairs were cut or dropped."""
  return _load(config, chat.file_stamps(config))


@functools.lru_cache(maxsize=2)
def _load(config: DataConfig, stamps: tuple) -> dict[str, PreferenceRows]:
  del stamps  # Part of the cache key: a changed file is read again.
  tokenizer = build_tokenizer(config)
  template = chat_template.for_data(config, tokenizer)
  if config.source == "preference_stdlib":
    pairs, skipped, what = stdlib_pairs(config.paths), 0, "the standard library's functions"
  else:
    pairs, skipped = read_pairs(sources.source_files(config), config.max_bad_lines)
    what = ", ".join(config.paths)
  if config.max_documents is not None:
    pairs = pairs[:config.max_documents]
  if not pairs:
    raise DataError(f"data: no preference pair in {what}")
  held_out = chat.held_out_by_key([json.dumps(prompt) for prompt, _, _ in pairs],
                                  config.holdout_fraction, salt=2)
  out = {}
  for split, keep in (("train", ~held_out), ("validation", held_out)):
    chosen = [pair for pair, k in zip(pairs, keep) if k]
    out[split] = PreferenceRows(chosen, template, tokenizer, seq_len=config.seq_len,
                                description=f"{config.source} {what}, split={split!r}")
    out[split].prompt = list(chosen[0][0]) if chosen else None
    chat.report(split, out[split].stats, "pairs", config.seq_len, skipped, template)
  return out
