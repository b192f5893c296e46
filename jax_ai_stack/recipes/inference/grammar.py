"""Structured output: a request's grammar, and the tokens it allows at each step.

A request may carry a grammar (`Request.grammar`): a JSON schema, a regular expression, a
choice of strings or a Lark grammar, compiled by llguidance (the `serve` extra), the
grammar engine vLLM and SGLang use. It has no dependencies of its own, handles a 262k
vocabulary in microseconds a token, and reports a schema it cannot compile by the part it
refused. Each step, a `Matcher` gives the bit mask of the tokens that keep the output
valid (`masks`, [B, V/32] int32); sampling sets the others to -inf before choosing, the
log-probabilities reported staying the model's. Once the grammar is complete only the
end tokens remain.

Example: a choice, over the byte tokenizer.
  >>> from jax_ai_stack.recipes.data.tokenizers import ByteTokenizer
  >>> vocab = vocabulary(ByteTokenizer())
  >>> matcher = Matcher(vocab, choice(["yes", "no"]))
  >>> allowed = lambda: [t for t in range(259) if masks([matcher], 259)[0, t // 32] >> t % 32 & 1]
  >>> [chr(t) for t in allowed()], matcher.take(ord("n")), [chr(t) for t in allowed()]
  (['n', 'y'], True, ['o'])
"""

from __future__ import annotations

import functools
import json
import pathlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from jax_ai_stack.errors import MissingExtraError

__all__ = ["Matcher", "check", "choice", "from_response_format", "from_structured_outputs",
           "json_object", "json_rule", "json_schema", "lark", "masks", "regex", "vocabulary"]

JSON_OPTIONS = {"whitespace_flexible": False}
"""JSON without whitespace (`{"a":1,"b":[2,3]}`): a sampled reply cannot spend its tokens
on blank space (a random model's does, under flexible JSON)."""


def _llguidance():
  try:
    import llguidance  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise MissingExtraError("structured output needs the 'llguidance' package: pip install "
                            "'jax-ai-stack[serve]'") from None
  return llguidance


def json_schema(schema: dict | bool) -> str:
  """The grammar of JSON values that validate under `schema` (a JSON schema)."""
  return _llguidance().LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)


def json_object() -> str:
  """The grammar of any JSON object (OpenAI's `response_format: json_object`)."""
  return json_schema({"type": "object"})


def regex(pattern: str) -> str:
  """The grammar of the strings that `pattern` matches whole."""
  return _llguidance().LLMatcher.grammar_from_regex(pattern)


def choice(options: Sequence[str]) -> str:
  """The grammar of exactly one of `options`."""
  return _llguidance().LLMatcher.grammar_from_lark(
      "start: " + " | ".join(json.dumps(option) for option in options))


def lark(grammar: str) -> str:
  """A Lark grammar (llguidance's dialect, whose `start` rule is the output)."""
  return _llguidance().LLMatcher.grammar_from_lark(grammar)


def json_rule(schema: dict | bool) -> str:
  """A Lark rule's body matching JSON that validates under `schema` (for `lark` grammars
  that hold JSON in a larger text: a tool call's arguments)."""
  if isinstance(schema, dict):
    schema = {**schema, "x-guidance": {**JSON_OPTIONS, **schema.get("x-guidance", {})}}
  return f"%json {json.dumps(schema)}"


def from_response_format(value: Any) -> str | None:
  """The grammar of OpenAI's `response_format`: {"type": "text"} (None: free text),
  {"type": "json_object"}, or {"type": "json_schema", "json_schema": {"name", "schema",
  "strict"}} (strict or not, the output follows the schema). ValueError saying what is
  wrong."""
  kind = value.get("type") if isinstance(value, dict) else None
  if kind == "text":
    return None
  if kind == "json_object":
    return json_object()
  if kind == "json_schema":
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), (dict, bool)):
      raise ValueError("response_format.json_schema must be an object whose 'schema' is a "
                       "JSON schema")
    return json_schema(spec.get("schema", {}))
  raise ValueError("response_format must be {\"type\": \"text\"}, {\"type\": \"json_object\"} "
                   f"or {{\"type\": \"json_schema\", \"json_schema\": {{...}}}}; got "
                   f"{json.dumps(value)[:100]}")


def from_structured_outputs(value: Any) -> str:
  """The grammar of vLLM's `structured_outputs`: one of {"json": schema}, {"regex": pattern},
  {"choice": [strings]} or {"grammar": Lark text}. ValueError saying what is wrong."""
  makers = {"json": (json_schema, "a JSON schema", lambda v: isinstance(v, (dict, bool))),
            "regex": (regex, "a string", lambda v: isinstance(v, str)),
            "choice": (choice, "a list of non-empty strings", lambda v: isinstance(v, list)
                       and v and all(isinstance(option, str) and option for option in v)),
            "grammar": (lark, "a string", lambda v: isinstance(v, str))}
  given = [key for key in makers if isinstance(value, dict) and value.get(key) is not None]
  if len(given) != 1 or set(value) - set(makers):
    raise ValueError(f"structured_outputs takes exactly one of {', '.join(makers)}; got "
                     f"{json.dumps(value)[:100]}")
  make, kind, fits = makers[given[0]]
  if not fits(value[given[0]]):
    raise ValueError(f"structured_outputs.{given[0]} must be {kind}")
  return make(value[given[0]])


@functools.lru_cache(maxsize=8)
def vocabulary(tokenizer) -> Any:
  """llguidance's view of `tokenizer` (a `data.tokenizers.Tokenizer`): each token's bytes,
  and its end-of-turn ids as the tokens that end a grammar's output. Built once per
  tokenizer (about a second at a 150k vocabulary)."""
  from jax_ai_stack.recipes.data import tokenizers  # pylint: disable=g-import-not-at-top

  llg = _llguidance()
  ends = tokenizer.end_of_turn_ids()
  if isinstance(tokenizer, tokenizers.HuggingFaceTokenizer):  # Its own pre-tokenizer rules.
    return llg.LLTokenizer(pathlib.Path(tokenizer.path).read_text(encoding="utf-8"),
                           n_vocab=tokenizer.vocab_size, eos_token=ends)
  return llg.LLTokenizer(llg.TokenizerWrapper(_Pieces(tokenizer)),
                         n_vocab=tokenizer.vocab_size, eos_token=ends)


class _Pieces:
  """A byte or SentencePiece tokenizer as llguidance's `TokenizerWrapper` reads one: each
  id's bytes (its `token_bytes`), and a tokenization of the text a grammar forces, longest
  piece first (SentencePiece's own `encode` would begin it with a word's space)."""

  def __init__(self, tokenizer):
    self.eos_token_id, self.bos_token_id = tokenizer.eos_id, tokenizer.bos_id
    self.tokens = tokenizer.token_bytes()  # Those that spell nothing: specials to it.
    self.special_token_ids = sorted(set(tokenizer.special_ids) |
                                    {i for i, piece in enumerate(self.tokens) if not piece})
    self._ids = {piece: i for i, piece in reversed(list(enumerate(self.tokens))) if piece}
    self._longest = max(map(len, self._ids))
    for special in self.special_token_ids:
      self.tokens[special] = f"<|special_{special}|>".encode()

  def __call__(self, text: str | bytes) -> list[int]:
    data = text if isinstance(text, bytes) else text.encode("utf-8")
    ids, start = [], 0
    while start < len(data):
      end = next((end for end in range(min(len(data), start + self._longest), start, -1)
                  if data[start:end] in self._ids), start + 1)
      if data[start:end] in self._ids:  # (A byte no piece spells is left out.)
        ids.append(self._ids[data[start:end]])
      start = end
    return ids


@functools.lru_cache(maxsize=256)
def check(grammar: str, vocab: Any) -> str:
  """What is wrong with `grammar` for `vocab` (llguidance's message, naming the part it
  refused), or "" if it compiles. Once per grammar: a request's `n` choices share it."""
  return _llguidance().LLMatcher.validate_grammar(grammar, vocab)


class Matcher:
  """One request's place in its grammar."""

  def __init__(self, vocab: Any, grammar: str):
    self._matcher = _llguidance().LLMatcher(vocab, grammar)
    if self._matcher.is_error():
      raise ValueError(self._matcher.get_error())
    self._words = -(-vocab.vocab_size // 32)

  def fill(self, row: np.ndarray) -> None:
    """Writes the mask of the tokens allowed next into `row` ([V/32] int32, contiguous; a
    model's ids past the tokenizer's never allowed)."""
    row[self._words:] = 0
    self._matcher.unsafe_compute_mask_ptr(row.ctypes.data, self._words * 4)

  def take(self, token: int) -> bool:
    """Moves past a sampled token; whether the grammar allowed it."""
    return self._matcher.consume_token(int(token))


def masks(matchers: Sequence[Matcher | None], vocab_size: int) -> np.ndarray:
  """The allowed tokens of each row as bits, [B, ceil(V/32)] int32 (token t: bit t % 32 of
  word t // 32), every token for a row without a grammar; [B, 0] where no row has one (no
  mask traced)."""
  if not any(matchers):
    return np.zeros((len(matchers), 0), np.int32)
  bits = np.full((len(matchers), -(-vocab_size // 32)), -1, np.int32)
  for row, matcher in enumerate(matchers):
    if matcher is not None:
      matcher.fill(bits[row])
  return bits
