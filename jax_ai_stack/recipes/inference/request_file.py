"""What `jax-ai-stack generate` answers: a JSONL file of requests, or conversations to reply to.

Each line of `--input` is a prompt (`{"prompt": ...}`) or a conversation
(`{"messages": [...]}`), with optional `"stop"` strings and an optional
`"response_format"` (OpenAI's: the output follows a JSON schema, `inference.grammar`);
each line of `--chat` is a conversation. A bad line is a DataError naming the file and
the line.

Example:
  >>> import pathlib, tempfile
  >>> path = pathlib.Path(tempfile.mkdtemp()) / "requests.jsonl"
  >>> _ = path.write_text('{"prompt": "def f(", "stop": ")"}')
  >>> read(str(path))
  [{'prompt': 'def f(', 'stop': [')']}]
"""

from __future__ import annotations

import json
import pathlib

from jax_ai_stack.errors import DataError, UsageError
from jax_ai_stack.recipes.data import chat as chat_data


def conversations(chat: str, prompt: str) -> list[list[dict]]:
  """`generate --chat`'s conversations: --prompt as one user turn, or each line of a JSONL file
  (DataError naming the file and line of a bad one)."""
  if chat == "-":
    return [[{"role": "user", "content": prompt}]]
  try:
    lines = pathlib.Path(chat).read_text(encoding="utf-8").splitlines()
  except OSError as e:
    raise UsageError(f"--chat {chat}: {e.strerror}") from None
  return [chat_data.parse_line(line, f"{chat}:{number}", to_answer=True)
          for number, line in enumerate(lines, start=1) if line.strip()]


def read(path: str) -> list[dict]:
  """`generate --input`'s requests: {"prompt"} or a conversation (`{"messages"}`) per line
  (DataError naming the file and line of a bad one)."""
  try:
    lines = pathlib.Path(path).read_text(encoding="utf-8").splitlines()
  except OSError as e:
    raise UsageError(f"--input {path}: {e.strerror}") from None
  items = []
  for number, line in enumerate(lines, start=1):
    if not line.strip():
      continue
    where = f"{path}:{number}"
    try:
      record = json.loads(line)
    except json.JSONDecodeError:
      record = None  # The parser below names the line.
    stop = record.pop("stop", []) if isinstance(record, dict) else []
    rule = _grammar(record.pop("response_format", None) if isinstance(record, dict) else None,
                    where)
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
      raise DataError(f"{where}: \"stop\" must be a string or a list of non-empty strings")
    if isinstance(record, dict) and "messages" not in record and isinstance(
        record.get("prompt"), str):
      item = {"prompt": record["prompt"]}
    else:  # A conversation to answer, or the parser's one-line error naming the line.
      line = json.dumps(record) if isinstance(record, dict) else line
      item = {"messages": chat_data.parse_line(line, where, to_answer=True)}
    items.append({**item, **({"stop": stop} if stop else {}),
                  **({"grammar": rule} if rule else {})})
  if not items:
    raise UsageError(f"--input {path}: no requests in the file")
  return items


def _grammar(response_format, where: str) -> str | None:
  """A line's `response_format` as the grammar its output follows (DataError naming the line
  where it is malformed)."""
  if response_format is None:
    return None
  from jax_ai_stack.recipes.inference import grammar  # pylint: disable=g-import-not-at-top

  try:
    return grammar.from_response_format(response_format)
  except ValueError as e:
    raise DataError(f"{where}: {e}") from None
