"""`generate --input` and `--chat` files: prompts, conversations and stop strings, and a bad
line named by its file and number."""

from __future__ import annotations

import json

import pytest

from jax_ai_stack.errors import DataError, UsageError
from jax_ai_stack.recipes.inference import request_file


def write_lines(path, *records) -> str:
  path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
  return str(path)


def test_prompts_and_conversations_with_their_stop_strings(tmp_path):
  path = write_lines(tmp_path / "in.jsonl", {"prompt": "def f(", "stop": ")"}, "",
                     {"messages": [{"role": "user", "content": "hi"}], "stop": ["\n", "!"]})
  items = request_file.read(path)
  assert items[0] == {"prompt": "def f(", "stop": [")"]}
  assert items[1]["stop"] == ["\n", "!"]
  assert [m["content"] for m in items[1]["messages"]] == ["hi"]


def test_a_line_s_response_format_is_the_grammar_of_its_output(tmp_path):
  pytest.importorskip("llguidance")
  from jax_ai_stack.recipes.inference import grammar

  path = write_lines(tmp_path / "in.jsonl", {"prompt": "x", "response_format": {
      "type": "json_object"}}, {"prompt": "y", "response_format": {"type": "text"}})
  assert request_file.read(path) == [{"prompt": "x", "grammar": grammar.json_object()},
                                     {"prompt": "y"}]


@pytest.mark.parametrize("record, error", [
    ({"prompt": "x", "stop": [""]}, r"in.jsonl:2: \"stop\" must be a string or a list of "
                                    r"non-empty strings"),
    ({"prompt": "x", "response_format": {"type": "json"}}, r"in.jsonl:2: response_format must"),
    ("not json", r"in.jsonl:2"),
])
def test_a_bad_line_is_named_by_file_and_number(tmp_path, record, error):
  path = write_lines(tmp_path / "in.jsonl", {"prompt": "fine"}, record)
  with pytest.raises(DataError, match=error):
    request_file.read(path)


def test_an_empty_or_missing_file_is_a_usage_error(tmp_path):
  with pytest.raises(UsageError, match="no requests in the file"):
    request_file.read(write_lines(tmp_path / "empty.jsonl", ""))
  with pytest.raises(UsageError, match="--input .*missing.jsonl: No such file"):
    request_file.read(str(tmp_path / "missing.jsonl"))


def test_chat_dash_is_the_prompt_as_one_user_turn():
  assert request_file.conversations("-", "hello") == [[{"role": "user", "content": "hello"}]]
