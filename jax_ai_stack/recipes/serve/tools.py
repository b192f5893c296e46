"""Tool calls: OpenAI's `tools` and `tool_choice` checked, and the calls a reply makes read.

A chat request may offer functions (`tools`: name, description, JSON-schema parameters).
They are rendered into the prompt by the model's own chat template (its `tools`
variable, as transformers renders it), and the reply's calls are read back in the syntax
that template teaches (`ToolSyntax`): Hermes' `<tool_call>{"name": ..., "arguments":
{...}}</tool_call>`, which Qwen2.5, Qwen3 and the Hermes fine-tunes use, or Llama 3.1's
bare `{"name": ..., "parameters": {...}}` reply. A template without tools, or with a syntax
this server does not read, is refused with one line.
`tool_choice`: "auto" (the model decides; the default with tools), "none" (the tools are
shown, no call is read), "required" or one named function: the reply then begins with the
call's opening (and the function's name), written into the prompt, and the rest is held to
one valid call by a grammar (`ToolSyntax.grammar`). The calls a reply makes
come back as `message.tool_calls` (finish reason "tool_calls"); text outside them is the
message's content; a call whose JSON does not parse stays text. Earlier turns' calls
(an assistant's `tool_calls`) and their results (`role: tool`) go back to the template as
transformers' convention has them (arguments as an object).

Example: a reply with one call.
  >>> syntax = ToolSyntax.of("{% if tools %}<tools>{{ tools | tojson }}</tools>{% endif %}"
  ...                        "{# <tool_call> #}", "the template")
  >>> content, calls = syntax.read('Let me look.\\n<tool_call>\\n{"name": "weather", '
  ...                              '"arguments": {"city": "Paris"}}\\n</tool_call>')
  >>> content, calls[0]["function"]
  ('Let me look.\\n', {'name': 'weather', 'arguments': '{"city": "Paris"}'})
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Any

from jax_ai_stack.recipes.serve.api_error import ApiError

__all__ = ["ToolSyntax", "parse_tool_choice", "parse_tools", "tool_turn"]

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def parse_tools(tools: Any) -> tuple[dict, ...]:
  """The request's `tools`, checked: each {"type": "function", "function": {"name", and
  optionally "description", "parameters" (a JSON schema object), "strict"}}."""
  if not isinstance(tools, list) or not tools:
    raise ApiError("'tools' must be a non-empty list of {type: 'function', function: {...}}",
                   "tools")
  names = set()
  for number, tool in enumerate(tools):
    where = f"tools[{number}]"
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(
        function, dict):
      raise ApiError(f"{where}: must be {{type: 'function', function: {{name, description, "
                     "parameters}}}", where)
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
      raise ApiError(f"{where}.function.name: must be 1-64 letters, digits, '_' or '-'; got "
                     f"{name!r}", f"{where}.function.name")
    if name in names:
      raise ApiError(f"{where}.function.name: {name!r} is offered twice", f"{where}.function.name")
    names.add(name)
    extra = set(function) - {"name", "description", "parameters", "strict"}
    if extra:
      raise ApiError(f"{where}.function: {', '.join(sorted(extra))} not supported",
                     f"{where}.function.{sorted(extra)[0]}")
    if not isinstance(function.get("description", ""), str):
      raise ApiError(f"{where}.function.description: must be a string",
                     f"{where}.function.description")
    if not isinstance(function.get("parameters", {}), dict):
      raise ApiError(f"{where}.function.parameters: must be a JSON schema object",
                     f"{where}.function.parameters")
  return tuple(tools)


def parse_tool_choice(choice: Any, tools: tuple[dict, ...]) -> str | dict:
  """`tool_choice` checked against the `tools` offered: "none", "auto", "required", or
  {"type": "function", "function": {"name": one of them}}."""
  if choice is None:
    return "auto" if tools else "none"
  if not tools and choice != "none":
    raise ApiError("'tool_choice' needs 'tools'", "tool_choice")
  if choice in ("none", "auto", "required"):
    return choice
  names = [tool["function"]["name"] for tool in tools]
  name = (choice.get("function") or {}).get("name") if isinstance(choice, dict) else None
  if not isinstance(choice, dict) or choice.get("type") != "function" or name not in names:
    raise ApiError(f"'tool_choice' must be 'none', 'auto', 'required' or {{type: 'function', "
                   f"function: {{name}}}} naming one of the tools ({', '.join(names)}); got "
                   f"{json.dumps(choice)[:100]}", "tool_choice")
  return {"type": "function", "function": {"name": name}}


def tool_turn(message: dict, where: str) -> dict:
  """An assistant turn with `tool_calls` or a `tool` turn (a call's result), as the chat
  template reads it: the calls' arguments as objects."""
  if message["role"] == "tool":
    if not isinstance(message.get("tool_call_id"), str):
      raise ApiError(f"{where}: a tool turn needs 'tool_call_id' (the call it answers)",
                     f"{where}.tool_call_id")
    return {"role": "tool", "content": message["content"],
            "tool_call_id": message["tool_call_id"]}
  calls = message.get("tool_calls")
  if not isinstance(calls, list) or not calls:
    raise ApiError(f"{where}: 'tool_calls' must be a non-empty list", f"{where}.tool_calls")
  read = []
  for number, call in enumerate(calls):
    at = f"{where}.tool_calls[{number}]"
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
      raise ApiError(f"{at}: must be {{id, type: 'function', function: {{name, arguments}}}}",
                     at)
    try:
      arguments = json.loads(function.get("arguments", "{}"))
    except (TypeError, json.JSONDecodeError):
      arguments = None
    if not isinstance(arguments, dict):
      raise ApiError(f"{at}.function.arguments: must be a JSON object, as a string",
                     f"{at}.function.arguments")
    read.append({"id": call.get("id"), "type": "function",
                 "function": {"name": function["name"], "arguments": arguments}})
  return {"role": "assistant", "content": message["content"], "tool_calls": read}


@dataclasses.dataclass(frozen=True)
class ToolSyntax:
  """How a chat template writes a tool call: a JSON object {"name", `key`}, between `opening`
  and `closing` (Hermes' tags), or bare as the whole reply (Llama 3.1's)."""

  name: str
  """What the syntax is called in messages."""
  opening: str
  closing: str
  key: str
  """The name of the call's arguments in its JSON."""

  @classmethod
  def of(cls, template: str, origin: str) -> ToolSyntax:
    """The syntax `template` (a chat template's Jinja text) teaches; ApiError where it shows
    no tools or writes calls in a syntax this server does not read."""
    if "tools" not in template:
      raise ApiError(f"{origin} does not show tools to the model: ask without 'tools'", "tools")
    if HERMES.opening in template:
      return HERMES
    if '"parameters"' in template and "ipython" in template:  # Results as ipython turns.
      return LLAMA3_JSON
    raise ApiError(f"{origin} writes tool calls in a syntax this server does not read (it "
                   f"reads {HERMES.name}, as Qwen's templates have it, and {LLAMA3_JSON.name}): "
                   "ask without 'tools'", "tools")

  def reply_start(self, choice: str | dict) -> str:
    """What the reply must begin with for `tool_choice` (written into the prompt)."""
    opening = f"{self.opening}\n" if self.opening else ""
    if choice == "required":
      return opening
    if isinstance(choice, dict):
      return f'{opening}{{"name": {json.dumps(choice["function"]["name"])}, "{self.key}": '
    return ""

  def grammar(self, choice: str | dict, tools: tuple[dict, ...]) -> str | None:
    """The grammar of the rest of a reply that must call a tool (`tool_choice` "required" or a
    named function), after `reply_start`: one call of an offered function whose arguments
    validate under its parameters' schema (`inference.grammar`), closed. None otherwise."""
    if choice != "required" and not isinstance(choice, dict):
      return None
    from jax_ai_stack.recipes.inference import grammar  # pylint: disable=g-import-not-at-top

    named = isinstance(choice, dict)
    functions = [tool["function"] for tool in tools
                 if not named or tool["function"]["name"] == choice["function"]["name"]]
    tail = "}" + (f"\n{self.closing}" if self.closing else "")
    rules = ["start: " + " | ".join(f"call_{i}" for i in range(len(functions)))]
    for i, function in enumerate(functions):
      head = "" if named else f'{{"name": {json.dumps(function["name"])}, "{self.key}": '
      rules += [f"call_{i}: {json.dumps(head)} arguments_{i} {json.dumps(tail)}",
                f"arguments_{i}: {grammar.json_rule(_object(function))}"]
    return grammar.lark("\n".join(rules))

  def read(self, text: str) -> tuple[str | None, list[dict]]:
    """(the text outside the calls, or None where that is blank; the calls, in OpenAI's
    shape) of a reply's `text`. A call whose JSON does not parse is left in the text."""
    if not self.opening:
      calls = _bare_calls(text)
      return (None, calls) if calls else (text if text.strip() else None, [])
    calls, content, at = [], [], 0
    pattern = re.compile(re.escape(self.opening) + r"(.*?)" + re.escape(self.closing) + "|"
                         + re.escape(self.opening) + r"(.*)$", re.DOTALL)
    for match in pattern.finditer(text):
      body = match.group(1) if match.group(1) is not None else match.group(2)
      call = _call(body)
      if call is None:
        continue
      content.append(text[at:match.start()])
      at = match.end()
      calls.append(call)
    content.append(text[at:])
    joined = "".join(content)
    return (joined if joined.strip() else None), calls

  def held_back(self, text: str) -> int:
    """Where a streamed reply's text must stop being sent as content: at a call's opening,
    or at an end that may begin one (a bare call: a reply that begins with "{", or nothing
    yet but blank)."""
    if not self.opening:
      return 0 if text.lstrip()[:1] in ("", "{") else len(text)
    start = text.find(self.opening)
    if start >= 0:
      return start
    for keep in range(min(len(self.opening) - 1, len(text)), 0, -1):
      if self.opening.startswith(text[-keep:]):
        return len(text) - keep
    return len(text)


HERMES = ToolSyntax("Hermes' <tool_call>...</tool_call>", "<tool_call>", "</tool_call>",
                    "arguments")
LLAMA3_JSON = ToolSyntax('Llama 3.1\'s bare {"name": ..., "parameters": ...}', "", "",
                         "parameters")


def _bare_calls(text: str) -> list[dict]:
  """The calls of a reply that is nothing but JSON objects, separated by ";" (Llama 3.1's:
  its `<|python_tag|>` is a special token, gone from the text); none where it is not."""
  decoder, calls, at = json.JSONDecoder(), [], 0
  text = text.strip()
  while at < len(text):
    try:
      _, end = decoder.raw_decode(text, at)
    except (json.JSONDecodeError, RecursionError):
      return []
    call = _call(text[at:end])
    if call is None:
      return []
    calls.append(call)
    at = end
    while at < len(text) and text[at] in "; \n\t":
      at += 1
  return calls


def _object(function: dict) -> dict:
  """A function's parameters' schema, of an object always (as OpenAI's arguments are)."""
  return {"type": "object", **function.get("parameters", {})}


def _call(body: str) -> dict | None:
  """A call in OpenAI's shape from the JSON between a call's opening and closing."""
  try:
    value = json.loads(body)
  except (json.JSONDecodeError, RecursionError):  # A reply may nest past Python's stack.
    return None
  if not isinstance(value, dict) or not isinstance(value.get("name"), str):
    return None
  arguments = value.get("arguments", value.get("parameters", {}))
  return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
          "function": {"name": value["name"], "arguments": json.dumps(arguments)}}
