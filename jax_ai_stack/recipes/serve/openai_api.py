"""OpenAI's API shapes: request bodies checked into values, and the JSON sent back.

`parse_json` reads a request body: JSON nested at most `MAX_DEPTH` deep, its text
valid Unicode (no lone surrogate), its integers of at most 4300 digits.
`parse_completion` and `parse_chat` read a `/v1/completions` or
`/v1/chat/completions` body (as the official `openai` client sends it) into an
`Ask`; a field that is missing, of the wrong type, out of range, unknown, or
asks for what this server does not do raises `ApiError` naming it (`param`),
which `error_body` turns into OpenAI's error shape. The `*_choice` / `*_chunk`
functions build the replies, streamed or whole.

Example:
  >>> ask = parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}],
  ...                   "max_tokens": 8, "stop": "\\n"}, max_top_logprobs=5)
  >>> ask.max_tokens, ask.stop, ask.n, ask.stream
  (8, ('\\n',), 1, False)
  >>> parse_chat({"model": "m", "messages": [], "tempreature": 1}, max_top_logprobs=5)
  Traceback (most recent call last):
  ...
  jax_ai_stack.recipes.serve.api_error.ApiError: Unrecognized request argument supplied: tempreature
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from jax_ai_stack.recipes.inference.requests import MAX_LOGIT_BIAS
from jax_ai_stack.recipes.serve import tools
from jax_ai_stack.recipes.serve.api_error import ApiError, error_body

__all__ = ["ApiError", "Ask", "error_body", "parse_chat", "parse_completion", "parse_json"]

MAX_N = 16
"""The most choices one request may ask for."""
MAX_STOPS = 4
"""The most stop strings, as OpenAI allows."""
DEFAULT_MAX_STOP_BYTES = 1024
"""The longest stop string, in UTF-8 bytes (`serve --max-stop-bytes`)."""
MAX_DEPTH = 64
"""The deepest a request body's JSON may nest (OpenAI's requests nest 5 deep)."""
_STREAM_OPTIONS = {"include_usage"}
_BRACKETS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")
_NOT_BRACKETS = bytes(set(range(256)) - set(b"[]{}"))

# Fields each endpoint reads; others are refused by name rather than silently ignored.
_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "n", "seed", "stop",
           "stream", "stream_options", "user", "presence_penalty", "frequency_penalty",
           "logit_bias", "response_format", "structured_outputs"}
_COMPLETION = _COMMON | {"prompt", "logprobs", "echo"}
_CHAT = _COMMON | {"messages", "logprobs", "top_logprobs", "max_completion_tokens", "tools",
                   "tool_choice", "parallel_tool_calls"}
_ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclasses.dataclass(frozen=True)
class Ask:
  """What a request asks for, checked."""

  model: str
  prompts: tuple[str | tuple[int, ...], ...] = ()
  """/v1/completions: the texts (or token ids) to continue (one choice set each)."""
  messages: tuple[dict, ...] = ()
  """/v1/chat/completions: the conversation, as {"role", "content": str} turns."""
  max_tokens: int | None = None
  """None: as many as fit the context (chat), 16 (completions, as OpenAI)."""
  temperature: float = 1.0
  top_p: float | None = None
  top_k: int | None = None
  n: int = 1
  seed: int | None = None
  stop: tuple[str, ...] = ()
  logit_bias: tuple[tuple[int, float], ...] = ()
  """(token id, value) pairs added to the logits each token is chosen from."""
  stream: bool = False
  include_usage: bool = False
  """Streaming: a last chunk with the token counts (`stream_options.include_usage`)."""
  logprobs: bool = False
  top_logprobs: int = 0
  tools: tuple[dict, ...] = ()
  """Chat: the functions offered (`serve.tools`), rendered by the chat template."""
  tool_choice: str | dict = "none"
  """Chat: "none" (calls are not read), "auto", "required" or {"type": "function", ...}."""
  grammar: str | None = None
  """What the output must follow (`response_format`, or vLLM's `structured_outputs`), as
  `inference.grammar` compiles it; None: free text."""


def parse_json(raw: bytes) -> Any:
  """A request body's JSON; raises `ApiError` (400) where it is not JSON, nests deeper than
  `MAX_DEPTH`, holds a lone surrogate or an integer of more than 4300 digits."""
  try:
    body = json.loads(raw)
  except json.JSONDecodeError as e:
    raise ApiError(f"the request body is not valid JSON: {e}") from None
  except UnicodeDecodeError as e:
    raise ApiError(f"the request body is not valid UTF-8: {e.reason} at byte {e.start}") \
        from None
  except RecursionError:
    raise ApiError(f"the request body nests deeper than {MAX_DEPTH} levels") from None
  except ValueError:  # An integer past `sys.get_int_max_str_digits()`.
    raise ApiError("the request body holds an integer of more than 4300 digits") from None
  _check_text(raw, body)
  return body


def _check_text(raw: bytes, body: Any) -> None:
  """Raises `ApiError` where `body` (parsed from `raw`) nests deeper than `MAX_DEPTH` or a
  string or key is not valid Unicode (a lone surrogate), naming where. At C speed: a 4 MiB
  body costs the event loop milliseconds, not a walk of its every value in Python."""
  if _depth(raw) > MAX_DEPTH:
    raise ApiError(f"the request body nests deeper than {MAX_DEPTH} levels")
  if (b"\\u" in raw or b"\xed" in raw) and not _encodes(body):  # Escaped or surrogatepass.
    where, key = _first_invalid(body)
    if key:
      raise ApiError(f"the field name {where!r} is not valid Unicode (a lone surrogate)", where)
    raise ApiError(f"'{where}' is not valid Unicode: it holds a lone surrogate (such as "
                   "\\ud800 alone)", where or None)


def _depth(raw: bytes) -> int:
  """How deep the valid JSON `raw` nests: its brackets outside strings, counted (bytes'
  own C loops: escaped backslashes, then escaped quotes, then strings, then all but
  brackets dropped)."""
  import numpy as np  # pylint: disable=import-outside-toplevel  # Not for `serve --help`.

  unescaped = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
  brackets = b"".join(unescaped.split(b'"')[::2]).translate(_BRACKETS, _NOT_BRACKETS)
  return int(np.cumsum(np.frombuffer(brackets, np.int8), dtype=np.int64).max(initial=0))


def _encodes(value: Any) -> bool:
  try:
    json.dumps(value, ensure_ascii=False).encode("utf-8")
  except UnicodeEncodeError:
    return False
  return True


def _first_invalid(body: Any) -> tuple[str, bool]:
  """Where the first string that does not encode is in `body`, and whether it is a key:
  each container halved until one item holds it (C's work, once over the body)."""
  where, value = "", body
  while isinstance(value, (dict, list)):
    items = list(value.items()) if isinstance(value, dict) else list(enumerate(value))
    low, high = 0, len(items)
    while high - low > 1:
      middle = (low + high) // 2
      low, high = (middle, high) if _encodes(items[low:middle]) else (low, middle)
    key, value = items[low]
    if isinstance(key, str) and not _encodes(key):
      return _shown(f"{where}.{key}" if where else key), True
    where = f"{where}[{key}]" if isinstance(key, int) else (f"{where}.{key}" if where else key)
  return _shown(where), False


def _valid(text: str) -> bool:
  try:
    text.encode("utf-8")
  except UnicodeEncodeError:
    return False
  return True


def _shown(text: str) -> str:
  """`text` as it can be sent back: a lone surrogate as its escape (\\ud800)."""
  return text.encode("utf-8", "backslashreplace").decode("utf-8")


def parse_completion(body: Any, *, max_top_logprobs: int, vocab_size: int | None = None,
                     max_stop_bytes: int = DEFAULT_MAX_STOP_BYTES) -> Ask:
  """The `/v1/completions` request in `body` (JSON already parsed); raises `ApiError`.
  `vocab_size`: the bound of token ids in a prompt given as ids (None: any id)."""
  fields = _common(body, _COMPLETION, max_stop_bytes)
  prompts = _prompts(body.get("prompt"), vocab_size)
  if _get(body, "echo", bool, False):
    raise ApiError("'echo' is not supported: the reply holds the new text only", "echo")
  logprobs = _get(body, "logprobs", int, None)
  if logprobs is not None and not 0 <= logprobs <= max_top_logprobs:
    raise ApiError(f"'logprobs' must be in [0, {max_top_logprobs}]; got {_brief(logprobs)}",
                   "logprobs")
  fields.setdefault("max_tokens", 16)
  return Ask(prompts=prompts, logprobs=logprobs is not None, top_logprobs=logprobs or 0,
             **fields)


def parse_chat(body: Any, *, max_top_logprobs: int,
               max_stop_bytes: int = DEFAULT_MAX_STOP_BYTES) -> Ask:
  """The `/v1/chat/completions` request in `body` (JSON already parsed); raises `ApiError`."""
  fields = _common(body, _CHAT, max_stop_bytes)
  newer = _get(body, "max_completion_tokens", int, None)  # The newer name of max_tokens.
  if newer is not None:
    fields["max_tokens"] = _at_least_one(newer, "max_completion_tokens")
  logprobs = _get(body, "logprobs", bool, False)
  top = _get(body, "top_logprobs", int, 0)
  if not 0 <= top <= max_top_logprobs:
    raise ApiError(f"'top_logprobs' must be in [0, {max_top_logprobs}]; got {_brief(top)}",
                   "top_logprobs")
  if top and not logprobs:
    raise ApiError("'top_logprobs' needs 'logprobs': true", "top_logprobs")
  offered = tools.parse_tools(body["tools"]) if body.get("tools") is not None else ()
  _get(body, "parallel_tool_calls", bool, True)  # Every call a reply makes is read.
  choice = tools.parse_tool_choice(body.get("tool_choice"), offered)
  if fields["grammar"] is not None and (choice == "required" or isinstance(choice, dict)):
    raise ApiError("a 'tool_choice' that forces a call has the call's own grammar: give no "
                   "'response_format' with it", "tool_choice")
  return Ask(messages=_messages(body.get("messages")), logprobs=logprobs, top_logprobs=top,
             tools=offered, tool_choice=choice, **fields)


def _prompts(prompt: Any, vocab_size: int | None) -> tuple[str | tuple[int, ...], ...]:
  """/v1/completions' `prompt`: a string, a list of them, a list of token ids, or a list of
  such lists (each id checked against the vocabulary)."""
  def ids(value: Any) -> bool:
    return (isinstance(value, list) and bool(value)
            and all(isinstance(t, int) and not isinstance(t, bool) for t in value))

  if isinstance(prompt, str):
    prompts = (prompt,)
  elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
    prompts = tuple(prompt)
  elif ids(prompt):
    prompts = (tuple(prompt),)
  elif isinstance(prompt, list) and prompt and all(ids(p) for p in prompt):
    prompts = tuple(tuple(p) for p in prompt)
  else:
    raise ApiError("'prompt' must be a string, a non-empty list of strings, a non-empty "
                   "list of token ids, or a list of such lists", "prompt")
  for number, tokens in enumerate(prompts):
    bad = [] if isinstance(tokens, str) else [
        t for t in tokens if t < 0 or vocab_size is not None and t >= vocab_size]
    if bad:
      where = "prompt" if isinstance(prompt[0], int) else f"prompt[{number}]"
      raise ApiError(f"'{where}': token id {_brief(bad[0])} is not in the vocabulary "
                     f"[0, {vocab_size})", "prompt")
  return prompts


def _common(body: Any, known: set[str], max_stop_bytes: int) -> dict:
  """The fields both endpoints share, checked (`Ask`'s keyword arguments)."""
  if not isinstance(body, dict):
    raise ApiError("the request body must be a JSON object")
  for name in body:
    if name not in known:
      raise ApiError(f"Unrecognized request argument supplied: {name}", name)
  model = body.get("model")
  if not isinstance(model, str) or not model:
    raise ApiError("'model' is required: the name /v1/models lists", "model")
  for name in ("presence_penalty", "frequency_penalty"):
    if _get(body, name, float, 0.0) != 0:
      raise ApiError(f"'{name}' is not supported (only 0)", name)
  logit_bias = _logit_bias(_get(body, "logit_bias", dict, None) or {})
  temperature = _get(body, "temperature", float, 1.0)
  if not 0 <= temperature <= 2:
    raise ApiError(f"'temperature' must be in [0, 2]; got {_brief(temperature)}", "temperature")
  top_p = _get(body, "top_p", float, None)
  if top_p is not None and not 0 < top_p <= 1:
    raise ApiError(f"'top_p' must be in (0, 1]; got {_brief(top_p)}", "top_p")
  top_k = _get(body, "top_k", int, None)
  if top_k is not None and top_k < 1 and top_k != -1:  # -1: all tokens, as vLLM reads it.
    raise ApiError(f"'top_k' must be >= 1 (or -1: no limit); got {_brief(top_k)}", "top_k")
  n = _get(body, "n", int, 1)
  if not 1 <= n <= MAX_N:
    raise ApiError(f"'n' must be in [1, {MAX_N}]; got {_brief(n)}", "n")
  stop = _get(body, "stop", (str, list), [])
  stop = [stop] if isinstance(stop, str) else stop
  if len(stop) > MAX_STOPS or not all(isinstance(s, str) and s for s in stop):
    raise ApiError(f"'stop' must be a string or a list of at most {MAX_STOPS} non-empty "
                   "strings", "stop")
  for text in stop:
    if len(text.encode("utf-8")) > max_stop_bytes:
      raise ApiError(f"a stop string may be at most {max_stop_bytes} bytes (UTF-8; the "
                     f"server's --max-stop-bytes); got {len(text.encode('utf-8'))}", "stop")
  stream = _get(body, "stream", bool, False)
  fields = dict(model=model, temperature=temperature, top_p=top_p,
                top_k=None if top_k == -1 else top_k, n=n, seed=_get(body, "seed", int, None),
                stop=tuple(stop), stream=stream, include_usage=_include_usage(body, stream),
                logit_bias=logit_bias, grammar=_grammar(body))
  max_tokens = _get(body, "max_tokens", int, None)
  if max_tokens is not None:
    fields["max_tokens"] = _at_least_one(max_tokens, "max_tokens")
  return fields


def _logit_bias(bias: dict) -> tuple[tuple[int, float], ...]:
  """`logit_bias`, {"token id": value in [-100, 100]}, as (id, value) pairs (the engine checks
  the ids against the vocabulary)."""
  pairs = []
  for key, value in bias.items():
    if not key.isdigit() or isinstance(value, bool) or not isinstance(value, (int, float)) or (
        not -100 <= value <= 100):
      raise ApiError(f"'logit_bias' maps token ids to values in [-100, 100]; got "
                     f"{_brief(key)}: {_brief(value)}", "logit_bias")
    pairs.append((int(key), float(value)))
  if len(pairs) > MAX_LOGIT_BIAS:
    raise ApiError(f"'logit_bias' may bias at most {MAX_LOGIT_BIAS} tokens; got {len(pairs)}",
                   "logit_bias")
  return tuple(pairs)


def _grammar(body: dict) -> str | None:
  """The grammar of `response_format` or `structured_outputs` (not both); ApiError naming the
  field where it is malformed or the `serve` extra's llguidance is missing."""
  given = [name for name in ("response_format", "structured_outputs") if body.get(name)]
  if len(given) > 1:
    raise ApiError("give 'response_format' or 'structured_outputs', not both", given[1])
  if not given:
    return None
  from jax_ai_stack.recipes.inference import grammar  # pylint: disable=g-import-not-at-top

  read = (grammar.from_response_format if given[0] == "response_format"
          else grammar.from_structured_outputs)
  try:
    return read(body[given[0]])
  except (ValueError, ImportError) as e:
    raise ApiError(str(e), given[0]) from None


def _include_usage(body: dict, stream: bool) -> bool:
  """`stream_options.include_usage`, checked: a boolean, the only key, and only with
  `stream`."""
  options = _get(body, "stream_options", dict, None)
  if options is None:
    return False
  if not stream:
    raise ApiError("'stream_options' is only allowed when 'stream' is true", "stream_options")
  for name in options:
    if name not in _STREAM_OPTIONS:
      raise ApiError(f"Unrecognized stream_options argument supplied: {name}",
                     f"stream_options.{name}")
  value = options.get("include_usage", False)
  if not isinstance(value, bool):
    raise ApiError(f"'stream_options.include_usage' must be a boolean; got {_brief(value)}",
                   "stream_options.include_usage")
  return value


def _brief(value: Any) -> str:
  """`repr(value)`, cut to 60 characters: what an error message quotes of a value."""
  shown = repr(value)
  return shown if len(shown) <= 60 else f"{shown[:50]}... ({len(shown)} characters)"


def _get(body: dict, name: str, kind, default):
  """body[name] if present and not null, of type `kind` (an int is a float too; a bool
  is not a number); else `default`."""
  value = body.get(name)
  if value is None:
    return default
  kinds = kind if isinstance(kind, tuple) else (kind,)
  number = float in kinds and isinstance(value, int) and not isinstance(value, bool)
  if isinstance(value, bool) and bool not in kinds or not (isinstance(value, kinds) or number):
    names = " or ".join({str: "a string", int: "an integer", float: "a number",
                         bool: "a boolean", dict: "an object", list: "a list"}[k] for k in kinds)
    raise ApiError(f"'{name}' must be {names}; got {_brief(value)}", name)
  if number:
    try:
      return float(value)
    except OverflowError:
      raise ApiError(f"'{name}' is out of range; got {_brief(value)}", name) from None
  return value


def _at_least_one(value: int, name: str) -> int:
  if value < 1:
    raise ApiError(f"'{name}' must be >= 1; got {_brief(value)}", name)
  return value


def _messages(messages: Any) -> tuple[dict, ...]:
  """The conversation as {"role", "content": str} turns (text parts joined), with tool calls
  and their results as the chat template reads them (`tools.tool_turn`)."""

  if not isinstance(messages, list) or not messages:
    raise ApiError("'messages' must be a non-empty list of {role, content} objects",
                   "messages")
  turns = []
  for number, message in enumerate(messages):
    where = f"messages[{number}]"
    if not isinstance(message, dict) or message.get("role") not in _ROLES:
      raise ApiError(f"{where}: 'role' must be one of {', '.join(_ROLES)}", f"{where}.role")
    content = message.get("content")
    if content is None and message.get("tool_calls") and message["role"] == "assistant":
      content = ""  # A turn of calls alone.
    if isinstance(content, list):  # Content parts: text only.
      if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                 for p in content):
        raise ApiError(f"{where}: only text content parts are supported", f"{where}.content")
      content = "".join(part["text"] for part in content)
    if not isinstance(content, str):
      raise ApiError(f"{where}: 'content' must be a string", f"{where}.content")
    extra = set(message) - {"role", "content", "name", *{
        "assistant": ["tool_calls"], "tool": ["tool_call_id"]}.get(message["role"], [])}
    if extra:
      raise ApiError(f"{where}: {', '.join(sorted(extra))} not supported (text turns only)",
                     f"{where}.{sorted(extra)[0]}")
    if message["role"] == "tool" or message.get("tool_calls") is not None:
      turns.append(tools.tool_turn({**message, "content": content}, where))
      continue
    turns.append({"role": "system" if message["role"] == "developer" else message["role"],
                  "content": content})
  return tuple(turns)


# Replies.


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
  return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
          "total_tokens": prompt_tokens + completion_tokens}


def completion_logprobs(token_texts: list[str], logprobs: list[float],
                        top: list[list[tuple[str, float]]], offset: int) -> dict:
  """/v1/completions' `logprobs` object for some tokens; `offset`: where their text starts."""
  offsets = []
  for text in token_texts:
    offsets.append(offset)
    offset += len(text)
  return {"tokens": token_texts, "token_logprobs": logprobs,
          "top_logprobs": [dict(alternatives) for alternatives in top] if top else None,
          "text_offset": offsets}


def chat_logprobs(token_texts: list[str], logprobs: list[float],
                  top: list[list[tuple[str, float]]]) -> dict:
  """/v1/chat/completions' `logprobs` object ({"content": [...]}) for some tokens."""
  def entry(text, logprob):
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

  return {"content": [
      {**entry(text, logprob), "top_logprobs": [entry(t, v) for t, v in alternatives]}
      for text, logprob, alternatives in zip(token_texts, logprobs,
                                             top or [[] for _ in token_texts])]}
