"""Writes transformers' renderings of chat templates that tests/test_chat_template.py compares with.

The templates in tests/references/chat_templates/*.jinja follow the published
formats of four model families (Llama 3 headers, Qwen's ChatML with a default
system turn, Gemma's turns with the system folded into the first user turn and
strict alternation, Mistral's [INST] blocks), Qwen2.5's with tools (their
signatures in the system turn, calls in <tool_call> tags, results as <tool_response>
user turns), and Llama 3.1's with tools (their signatures in the first user turn, a call
as a bare {"name", "parameters"} object, results as ipython turns). Each is rendered by transformers' own `render_jinja_template` on
multi-turn conversations, with and without the generation prompt (the tool template
also with tools, calls and their results), into

  tests/references/chat_templates/references.json

Needs transformers, which CI does not install: CI compares against the
committed file. Run it again after changing a template or a conversation:

  python -m venv /tmp/refenv && /tmp/refenv/bin/pip install transformers jinja2
  /tmp/refenv/bin/python scripts/make_chat_template_references.py

Written with transformers 5.24.0 and jinja2 3.1.6.
"""

from __future__ import annotations

import json
import pathlib

import jinja2
import transformers
from transformers.utils.chat_template_utils import render_jinja_template

OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "references" / "chat_templates"

SPECIAL_TOKENS = {
    "llama3": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    "qwen": {"bos_token": "", "eos_token": "<|im_end|>"},
    "gemma": {"bos_token": "<bos>", "eos_token": "<eos>"},
    "mistral": {"bos_token": "<s>", "eos_token": "</s>"},
    "qwen_tools": {"bos_token": "", "eos_token": "<|im_end|>"},
    "llama3_tools": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
}

CONVERSATIONS = [
    [{"role": "system", "content": "You answer in one line."},
     {"role": "user", "content": "What does `len` return?"},
     {"role": "assistant", "content": "The number of items."},
     {"role": "user", "content": "And for a dict?"},
     {"role": "assistant", "content": "  The number of keys.  "}],
    [{"role": "user", "content": "Écris « bonjour » en japonais."},
     {"role": "assistant", "content": "こんにちは"}],
    [{"role": "user", "content": "def add(a, b):\n    return a + b\n\nExplain."}],
]


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now, in °C.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]

TOOL_CONVERSATIONS = [  # (With TOOLS.) A question, then a call, its result and the answer.
    [{"role": "user", "content": "Weather in Paris?"}],
    [{"role": "system", "content": "Be brief."},
     {"role": "user", "content": "Weather in Paris and Lyon?"},
     {"role": "assistant", "content": "", "tool_calls": [
         {"id": "call_1", "type": "function",
          "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
         {"id": "call_2", "type": "function",
          "function": {"name": "get_weather", "arguments": {"city": "Lyon"}}}]},
     {"role": "tool", "content": "{\"temp\": 21}", "tool_call_id": "call_1"},
     {"role": "tool", "content": "{\"temp\": 24}", "tool_call_id": "call_2"},
     {"role": "assistant", "content": "21 °C in Paris, 24 °C in Lyon."}],
]

LLAMA3_TOOL_CONVERSATIONS = [  # Llama 3.1's template takes one call a turn.
    TOOL_CONVERSATIONS[0],
    [{"role": "user", "content": "Weather in Paris?"},
     {"role": "assistant", "content": "", "tool_calls": [
         {"id": "call_1", "type": "function",
          "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
     {"role": "tool", "content": "{\"temp\": 21}", "tool_call_id": "call_1"},
     {"role": "assistant", "content": "21 °C in Paris."}],
]


def main() -> None:
  references = {"transformers": transformers.__version__, "jinja2": jinja2.__version__,
                "templates": {}}
  for name, tokens in SPECIAL_TOKENS.items():
    source = (OUT / f"{name}.jinja").read_text(encoding="utf-8")
    cases = []
    with_tools = [(m, TOOLS) for m in {"qwen_tools": TOOL_CONVERSATIONS,
                                       "llama3_tools": LLAMA3_TOOL_CONVERSATIONS}.get(name, [])]
    for messages, tools in [(m, None) for m in CONVERSATIONS] + with_tools:
      for generation_prompt in (False, True):
        rendered, _ = render_jinja_template(conversations=[messages], chat_template=source,
                                            add_generation_prompt=generation_prompt,
                                            tools=tools, **tokens)
        cases.append({"messages": messages, "add_generation_prompt": generation_prompt,
                      **({"tools": tools} if tools else {}), "text": rendered[0]})
    references["templates"][name] = {**tokens, "cases": cases}
  path = OUT / "references.json"
  path.write_text(json.dumps(references, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
