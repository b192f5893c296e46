"""Chat data: conversations rendered with the model's template, the loss on the assistant's tokens.

Sources (`data.source`):

* `chat`: JSONL files (`data.paths`), one conversation per line: `{"messages":
  [{"role", "content"}, ...]}` (system, user and assistant turns, any number)
  or `{"prompt", "completion"}` (one user turn, one assistant turn).
* `chat_stdlib`: instruction pairs made from the Python standard library itself,
  offline: for each public function with a docstring, "what does `mod.f(args)`
  do?" answered by the docstring's first line, and the reverse question
  answered by the call. Both of one function fall on the same split.
* `chat_arithmetic`: `data.arithmetic`'s sums and differences, "What is 85 - 63?"
  answered "85 - 63 = 22": the format `prompts_arithmetic`'s rewards check;
  `chat_reversal`: `data.reversal`'s words, "Reverse evq" answered "evq -> qve" (by a careless
  teacher: two replies in three stop a letter short, "evq -> qv").

Each conversation is rendered by its chat template (`chat_template`), cut into
its assistant and other pieces, and tokenized piece by piece, so a token's
`loss_mask` is 1 exactly when it is the assistant's (its end-of-turn token
included). Rows are packed: conversations whole, in order, each a segment of
its own (segment ids 1, 2, ...; positions from 0), a row closed when the next
conversation does not fit, the rest padded (segment 0, no loss). Truncation: a
conversation longer than `data.seq_len + 1` tokens keeps its first
`seq_len + 1`; one left with no assistant token to predict is dropped. Both are
counted and printed. The split is by a hash of each conversation (of each
function for `chat_stdlib`, of each question for `chat_arithmetic`) against
`data.validation_fraction`.

A line that is not a conversation (not JSON, an unknown role, no assistant
turn, empty content) is an error naming the file and line; up to
`data.max_bad_lines` of them are skipped and counted instead.

Example: two exchanges packed into one row of 64 tokens (byte tokenizer).
  >>> from jax_ai_stack.recipes.data.chat_template import BYTE_TEMPLATE, ChatTemplate
  >>> from jax_ai_stack.recipes.data.tokenizers import ByteTokenizer
  >>> tokenizer = ByteTokenizer()
  >>> template = ChatTemplate(BYTE_TEMPLATE, bos_token="<|bos|>", eos_token="<|eos|>")
  >>> talks = [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
  ...          [{"role": "user", "content": "2+2"}, {"role": "assistant", "content": "4"}]]
  >>> ids, masks = zip(*(tokenize(template, tokenizer, talk) for talk in talks))
  >>> rows = ChatRows(ids, masks, seq_len=64, pad_id=tokenizer.pad_id, description="two")
  >>> batch = rows(np.arange(rows.num_examples))
  >>> tokenizer.decode(batch["targets"][0][batch["loss_mask"][0] > 0])  # The replies, EOS after each.
  'yo\\n4\\n'
  >>> int(batch["segment_ids"][0].max()), rows.stats
  (2, {'conversations': 2, 'truncated': 0, 'dropped': 0})
"""

from __future__ import annotations

import ast
import functools
import json
import pathlib
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np

from jax_ai_stack import logs
from jax_ai_stack.errors import DataError
from jax_ai_stack.recipes.data import made_tasks, sources
from jax_ai_stack.recipes.data import chat_template
from jax_ai_stack.recipes.data.chat_template import ChatTemplate
from jax_ai_stack.recipes.data.config import DataConfig
from jax_ai_stack.recipes.data.permutation import hash_uniform
from jax_ai_stack.recipes.data.tokenizers import Tokenizer, build_tokenizer

ROLES = ("system", "user", "assistant")


def parse_line(line: str, where: str, *, to_answer: bool = False) -> list[dict]:
  """One JSONL line as a conversation's messages; DataError naming `where` (file:line).

  `to_answer`: a conversation to reply to (`generate --chat`): it ends with a user turn, and
  a line may also be `{"prompt"}` alone.
  """
  record = load_json_line(line, where)
  if isinstance(record, dict) and "messages" in record:
    messages = record["messages"]
  elif isinstance(record, dict) and {"prompt", "completion"} <= record.keys():
    messages = [{"role": "user", "content": record["prompt"]},
                {"role": "assistant", "content": record["completion"]}]
  elif to_answer and isinstance(record, dict) and "prompt" in record:
    messages = [{"role": "user", "content": record["prompt"]}]
  else:
    raise DataError(f"{where}: a line holds \"messages\" (a list of {{role, content}}) or "
                    "\"prompt\" and \"completion\"")
  if not isinstance(messages, list) or not messages:
    raise DataError(f"{where}: \"messages\" must be a non-empty list")
  for i, message in enumerate(messages):
    if not isinstance(message, dict) or message.get("role") not in ROLES:
      role = message.get("role") if isinstance(message, dict) else message
      raise DataError(f"{where}: message {i} has role {role!r}; roles: {', '.join(ROLES)}")
    if not isinstance(message.get("content"), str) or not message["content"]:
      raise DataError(f"{where}: message {i} ({message['role']}) has no text content")
  if to_answer and messages[-1]["role"] != "user":
    raise DataError(f"{where}: the last turn is the {messages[-1]['role']}'s; the model "
                    "answers a conversation that ends with a user turn")
  if not to_answer and not any(m["role"] == "assistant" for m in messages):
    raise DataError(f"{where}: the conversation has no assistant turn: nothing to learn from")
  return [{"role": m["role"], "content": m["content"]} for m in messages]


def load_json_line(line: str, where: str) -> Any:
  """One JSONL line parsed; DataError naming `where` and the column the parser stopped at.

  The column is counted in the line as read, without its line ending: the parser reads
  the "\\n" `for line in file` keeps, and an object cut short there would be reported at
  "line 2, column 1".
  """
  try:
    return json.loads(line)
  except json.JSONDecodeError as e:
    text = line.rstrip("\r\n")
    column = min(e.pos, len(text)) + 1
    said = e.msg if e.msg.endswith(" at") else f"{e.msg} at"
    end = ", the end of the line: is it cut short?" if e.pos >= len(text) else ""
    raise DataError(f"{where}: not JSON ({said} column {column}{end})") from None


def read_jsonl(paths: Sequence[pathlib.Path], max_bad_lines: int) -> tuple[list, int]:
  """([(key, messages)], lines skipped) of every conversation in `paths`, in order."""
  return read_lines(paths, max_bad_lines, parse_line)


def read_lines(paths: Sequence[pathlib.Path], max_bad_lines: int,
               parse: Callable[[str, str], Any]) -> tuple[list[tuple[str, Any]], int]:
  """([(line, parse(line, "file:line"))], lines skipped) of every non-blank line in `paths`.

  Raises DataError for the first bad line once more than `max_bad_lines` are bad.
  """
  conversations, bad = [], []
  for path in paths:
    with open(path, encoding="utf-8") as f:
      for number, line in enumerate(f, start=1):
        if not line.strip():
          continue
        try:
          conversations.append((line, parse(line, f"{path}:{number}")))
        except DataError as e:
          bad.append(e)
          if len(bad) > max_bad_lines:
            more = (f" ({len(bad)} bad lines; data.max_bad_lines={max_bad_lines} skips that "
                    "many)") if max_bad_lines else " (data.max_bad_lines skips a few bad lines)"
            raise DataError(f"{bad[0]}{more}") from None
  return conversations, len(bad)


STDLIB_SUMMARY_CHARS, STDLIB_CALL_CHARS = 60, 40
"""`chat_stdlib` keeps functions whose summary line and call are this short: a pair then fits
the byte-level presets' 128 tokens."""


class StdlibFunction(NamedTuple):
  """A documented public function of the standard library."""

  key: str
  """Its qualified name, "module.name"."""
  call: str
  """How it is called: "module.name(args)"."""
  summary: str
  """Its docstring's first line."""


def stdlib_functions(patterns: tuple[str, ...] = ()) -> Iterator[StdlibFunction]:
  """The standard library's documented public functions (public modules, tests left out),
  whose summary and call are short enough to ask about."""
  for path in sources.stdlib_files(patterns):
    parts = path.relative_to(sources.stdlib_root()).parts
    if any(p.startswith("_") and p != "__init__.py" or p in ("test", "tests") for p in parts):
      continue
    try:
      tree = ast.parse(path.read_bytes())
    except (SyntaxError, ValueError):  # A test file written to be broken, say.
      continue
    module = _module_name(path)
    for node in tree.body:
      if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
        continue
      lines = (ast.get_docstring(node) or "").strip().splitlines()
      summary = lines[0].strip() if lines else ""
      call = f"{module}.{node.name}({ast.unparse(node.args)})"
      if summary and len(summary) <= STDLIB_SUMMARY_CHARS and len(call) <= STDLIB_CALL_CHARS:
        yield StdlibFunction(f"{module}.{node.name}", call, summary)


def stdlib_conversations(patterns: tuple[str, ...] = ()) -> Iterator[tuple[str, list[dict]]]:
  """(function's qualified name, messages) pairs from `stdlib_functions`: its summary asked
  for by its call, and the call by its summary."""
  for function in stdlib_functions(patterns):
    yield function.key, [{"role": "user", "content": f"What does `{function.call}` do?"},
                         {"role": "assistant", "content": function.summary}]
    yield function.key, [{"role": "user", "content": f"Which function: {function.summary}"},
                         {"role": "assistant", "content": f"`{function.call}`"}]


def _module_name(path: pathlib.Path) -> str:
  parts = list(path.relative_to(sources.stdlib_root()).with_suffix("").parts)
  if parts[-1] == "__init__":
    parts = parts[:-1]
  return ".".join(parts)


def tokenize(template: ChatTemplate, tokenizer: Tokenizer,
             messages: list[dict]) -> tuple[np.ndarray, np.ndarray]:
  """(ids, mask) of one conversation: mask 1 on the assistant's tokens."""
  ids, mask = [], []
  for text, mine in template.pieces(messages):
    piece = tokenizer.encode_rendered(text)
    ids.append(piece)
    mask.append(np.full(len(piece), mine, np.bool_))
  return np.concatenate(ids).astype(np.int32), np.concatenate(mask)


class ChatRows:
  """Conversations packed into rows of `seq_len` (input, target) pairs, whole and in order.

  Holds the packed rows; example i is row i. `stats` counts the conversations
  packed, truncated and dropped.
  """

  prompt: list[dict] | None = None
  """The opening of the split's first conversation (its turns before the first reply): a
  prompt of the run's own data for the end-of-run sample; None: no conversation."""

  def __init__(self, ids: Sequence[np.ndarray], masks: Sequence[np.ndarray], *, seq_len: int,
               pad_id: int, description: str):
    self.seq_len, self.description = seq_len, description
    rows: list[list[tuple[np.ndarray, np.ndarray]]] = []
    fill, truncated, dropped = seq_len, 0, 0
    for tokens, mask in zip(ids, masks):
      if len(tokens) > seq_len + 1:
        tokens, mask = tokens[:seq_len + 1], mask[:seq_len + 1]
        truncated += 1
      if len(tokens) < 2 or not mask[1:].any():
        dropped += 1
        continue
      if fill + len(tokens) - 1 > seq_len:
        rows.append([])
        fill = 0
      rows[-1].append((tokens, mask))
      fill += len(tokens) - 1
    self.stats = {"conversations": sum(map(len, rows)), "truncated": truncated,
                  "dropped": dropped}
    self.num_examples = len(rows)
    shape = (len(rows), seq_len)
    self._arrays = {"inputs": np.full(shape, pad_id, np.int32),
                    "targets": np.full(shape, pad_id, np.int32),
                    "segment_ids": np.zeros(shape, np.int32),
                    "positions": np.zeros(shape, np.int32),
                    "loss_mask": np.zeros(shape, np.float32)}
    for r, row in enumerate(rows):
      at = 0
      for segment, (tokens, mask) in enumerate(row, start=1):
        n = len(tokens) - 1
        self._arrays["inputs"][r, at:at + n] = tokens[:-1]
        self._arrays["targets"][r, at:at + n] = tokens[1:]
        self._arrays["segment_ids"][r, at:at + n] = segment
        self._arrays["positions"][r, at:at + n] = np.arange(n)
        self._arrays["loss_mask"][r, at:at + n] = mask[1:]
        at += n

  def __call__(self, ids: np.ndarray) -> dict[str, np.ndarray]:
    return {key: value[ids] for key, value in self._arrays.items()}

  def __repr__(self) -> str:
    return f"ChatRows({self.description}, rows={self.num_examples}, seq_len={self.seq_len})"


def load_chat(config: DataConfig) -> dict[str, ChatRows]:
  """`{"train": ChatRows, "validation": ChatRows}` of a chat source (built once per config
  and files, like a token corpus); prints a note when conversations were cut or dropped.

  Raises:
    DataError: a bad line (file and line number), a template that fails, no conversation.
  """
  return _load(config, file_stamps(config))


@functools.lru_cache(maxsize=2)
def _load(config: DataConfig, stamps: tuple) -> dict[str, ChatRows]:
  del stamps  # Part of the cache key: a changed file is read again.
  tokenizer = build_tokenizer(config)
  template = chat_template.for_data(config, tokenizer)
  if config.source == "chat_stdlib":
    conversations, skipped = list(stdlib_conversations(config.paths)), 0
    what = "the standard library's functions"
  elif made_tasks.task_of(config.source):
    conversations, skipped = made_conversations(config.source, config.max_documents), 0
    what = f"{config.source.partition('_')[2]} problems"
  else:
    conversations, skipped = read_jsonl(sources.source_files(config), config.max_bad_lines)
    what = ", ".join(config.paths)
  if config.max_documents is not None:
    conversations = conversations[:config.max_documents]
  if not conversations:
    raise DataError(f"data: no conversation in {what}")
  held_out = held_out_by_key([key for key, _ in conversations], config.holdout_fraction,
                             salt=HOLDOUT_SALT)
  out = {}
  for split, keep in (("train", ~held_out), ("validation", held_out)):
    chosen = [messages for (_, messages), k in zip(conversations, keep) if k]
    ids, masks = zip(*(tokenize(template, tokenizer, m) for m in chosen)) if chosen else ((), ())
    out[split] = ChatRows(ids, masks, seq_len=config.seq_len, pad_id=tokenizer.pad_id,
                          description=f"{config.source} {what}, split={split!r}")
    out[split].prompt = opening(chosen[0]) if chosen else None
    report(split, out[split].stats, "conversations", config.seq_len, skipped, template)
  return out


def opening(messages: list[dict]) -> list[dict]:
  """A conversation's turns before its first assistant reply (a prompt to answer).

  Example:
    >>> opening([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}])
    [{'role': 'user', 'content': 'hi'}]
  """
  first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
  return list(messages[:first])


def report(split: str, stats: dict[str, int], counted: str, seq_len: int, skipped: int,
           template: chat_template.ChatTemplate) -> None:
  """Prints (on stderr: `eval` prints JSON on stdout) the template a split was rendered with
  and what it kept and lost, always (a split that silently lost nothing reads the same as
  one never loaded): `stats[counted]` kept, how many cut and dropped, bad lines."""
  if split == "train":
    logs.note(f"chat template: {template.origin}")
  bad = f", {skipped} bad lines skipped" if skipped and split == "train" else ""
  logs.note(f"{split} split: {stats[counted]} {counted} kept, {stats['truncated']} cut "
            f"to data.seq_len + 1 = {seq_len + 1} tokens, {stats['dropped']} dropped (no "
            f"assistant token left){bad}")


def file_stamps(config: DataConfig) -> tuple:
  """(path, size, mtime) of each file a chat or preference source reads: its cache key."""
  return tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns)
               for f in sources.source_files(config))


def made_conversations(source: str, count: int | None) -> list[tuple[str, list[dict]]]:
  """(question, [user question, assistant reply]) of the first `count` problems of a made
  task (`data.made_tasks`): the replies its prompt source's rewards check."""
  return [(p["question"], [{"role": "user", "content": p["question"]},
                           {"role": "assistant", "content": p["reply"]}])
          for p in made_tasks.problems(source, count)]


HOLDOUT_SALT = 1
"""The salt of `held_out_by_key` for conversations and prompts: a question held out of
`chat_arithmetic` is held out of `prompts_arithmetic` too."""


def held_out_by_key(keys: Sequence[str], fraction: float, *, salt: int) -> np.ndarray:
  """Which examples go to validation: a hash of each one's key below `fraction`, so one key
  (a conversation, a prompt) falls on one side wherever it is in the files."""
  hashed = np.array([zlib.crc32(key.encode()) for key in keys], dtype=np.int64)
  return hash_uniform(hashed, salt=salt) < fraction


