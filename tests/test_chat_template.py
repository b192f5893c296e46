"""Chat templates render as transformers renders them, and cut out the assistant's text."""

from __future__ import annotations

import json
import pathlib

import pytest

from jax_ai_stack.errors import DataError
from jax_ai_stack.recipes.data.chat_template import BYTE_TEMPLATE, ChatTemplate, template_source

REFERENCES = pathlib.Path(__file__).parent / "references" / "chat_templates"
RENDERED = json.loads((REFERENCES / "references.json").read_text(encoding="utf-8"))["templates"]
END_OF_TURN = {"llama3": "<|eot_id|>", "qwen": "<|im_end|>", "gemma": "<end_of_turn>",
               "mistral": "</s>", "qwen_tools": "<|im_end|>", "llama3_tools": "<|eot_id|>"}
CASES = [(name, i) for name, entry in RENDERED.items() for i in range(len(entry["cases"]))]


def _template(name: str) -> ChatTemplate:
  entry = RENDERED[name]
  return ChatTemplate((REFERENCES / f"{name}.jinja").read_text(encoding="utf-8"),
                      bos_token=entry["bos_token"], eos_token=entry["eos_token"], origin=name)


@pytest.mark.parametrize("name,case", CASES)
def test_a_published_template_renders_as_transformers_renders_it(name, case):
  expected = RENDERED[name]["cases"][case]
  text = _template(name).render(expected["messages"], tools=expected.get("tools"),
                                add_generation_prompt=expected["add_generation_prompt"])
  assert text == expected["text"]


@pytest.mark.parametrize("name", sorted(RENDERED))
def test_the_pieces_are_the_rendering_and_the_assistant_s_are_its_replies(name):
  template = _template(name)
  for case in RENDERED[name]["cases"]:
    if "tools" in case:  # The conversations of plain turns (tools render above).
      continue
    messages = case["messages"]
    pieces = template.pieces(messages)
    assert "".join(text for text, _ in pieces) == template.render(messages)
    replies = [m["content"] for m in messages if m["role"] == "assistant"]
    theirs = [text for text, mine in pieces if mine]
    assert len(theirs) == len(replies)
    for text, reply in zip(theirs, replies):
      assert text.startswith(reply.strip()) or text.startswith(reply)  # Some templates trim.
      assert END_OF_TURN[name] in text  # Then its end of turn, and nothing of another turn.
      assert not any(m["content"] in text for m in messages if m["role"] != "assistant")


def test_the_end_of_turn_token_is_the_assistant_s():
  pieces = _template("llama3").pieces(RENDERED["llama3"]["cases"][0]["messages"])
  assert [text for text, mine in pieces if mine] == ["The number of items.<|eot_id|>",
                                                     "The number of keys.<|eot_id|>"]
  pieces = _template("gemma").pieces(RENDERED["gemma"]["cases"][0]["messages"])
  assert [text for text, mine in pieces if mine][0] == "The number of items.<end_of_turn>\n"


def test_a_template_that_raises_names_itself_and_its_message():
  with pytest.raises(DataError, match="^gemma failed to render: Conversation roles must "
                                      "alternate"):
    _template("gemma").render([{"role": "assistant", "content": "first"}])


def test_a_template_that_is_no_jinja_names_its_line():
  with pytest.raises(DataError, match=r"^mine.jinja line 2: not a Jinja template"):
    ChatTemplate("ok\n{% for %}", bos_token="", eos_token="", origin="mine.jinja")


def test_a_template_that_rewrites_earlier_turns_is_refused():
  shouting = ("{% for m in messages %}{{ m['content'] | upper if loop.last else m['content'] }}"
              "{% endfor %}")
  template = ChatTemplate(shouting, bos_token="", eos_token="", origin="shouting")
  with pytest.raises(DataError, match=r"^shouting does not render message 1 \(assistant\) as a "
                                      r"continuation of the turns before it"):
    template.pieces([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                     {"role": "user", "content": "c"}])


def test_generation_markers_render_their_body():
  marked = ("{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}"
            "{{ m['content'] }}{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}"
            "{% endfor %}")
  template = ChatTemplate(marked, bos_token="", eos_token="")
  assert template.render([{"role": "user", "content": "a"},
                          {"role": "assistant", "content": "b"}]) == "ab"


def test_the_tokenizer_s_own_template_is_found_beside_it(tmp_path):
  tokenizer = tmp_path / "tokenizer.json"
  assert template_source(None, None) == (BYTE_TEMPLATE, "the built-in chat template")
  with pytest.raises(DataError, match="no chat template beside data.tokenizer_path"):
    template_source(str(tokenizer), None)
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(
      {"chat_template": [{"name": "tool_use", "template": "T"},
                         {"name": "default", "template": "D"}]}))
  assert template_source(str(tokenizer), None)[0] == "D"
  (tmp_path / "chat_template.jinja").write_text("J")
  assert template_source(str(tokenizer), None)[0] == "J"
  (tmp_path / "mine.jinja").write_text("M")
  assert template_source(str(tokenizer), str(tmp_path / "mine.jinja"))[0] == "M"
  with pytest.raises(DataError, match=r"^data.chat_template='nope.jinja': no such file"):
    template_source(None, "nope.jinja")
