"""Writes transformers' renderings of chat templates that tests/test_chat_template.py compares with.

The templates in tests/references/chat_templates/*.jinja follow the published
formats of four model families (Llama 3 headers, Qwen's ChatML with a default
system turn, Gemma's turns with the system folded into the first user turn and
strict alternation, Mistral's [INST] blocks). Each is rendered by transformers'
own `render_jinja_template` on multi-turn conversations, with and without the
generation prompt, into

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


def main() -> None:
  references = {"transformers": transformers.__version__, "jinja2": jinja2.__version__,
                "templates": {}}
  for name, tokens in SPECIAL_TOKENS.items():
    source = (OUT / f"{name}.jinja").read_text(encoding="utf-8")
    cases = []
    for messages in CONVERSATIONS:
      for generation_prompt in (False, True):
        rendered, _ = render_jinja_template(conversations=[messages], chat_template=source,
                                            add_generation_prompt=generation_prompt, **tokens)
        cases.append({"messages": messages, "add_generation_prompt": generation_prompt,
                      "text": rendered[0]})
    references["templates"][name] = {**tokens, "cases": cases}
  path = OUT / "references.json"
  path.write_text(json.dumps(references, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
