"""Tool calls: OpenAI's `tools` and `tool_choice` checked, rendered by the chat template, and
a reply's calls read back as `tool_calls`, whole and streamed."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import openai
import pytest
from flax import nnx
from starlette.testclient import TestClient

from jax_ai_stack.recipes import data, inference, models
from jax_ai_stack.recipes.data.chat_template import ChatTemplate
from jax_ai_stack.recipes.inference.requests import Completion
from jax_ai_stack.recipes.serve import openai_api, server
from jax_ai_stack.recipes.serve.openai_api import ApiError
from jax_ai_stack.recipes.serve.tools import (LLAMA3_JSON, ToolSyntax, parse_tool_choice,
                                              parse_tools)

TEMPLATES = pathlib.Path(__file__).parent / "references" / "chat_templates"
QWEN = ChatTemplate((TEMPLATES / "qwen_tools.jinja").read_text(encoding="utf-8"), bos_token="",
                    eos_token="<|im_end|>", origin="qwen_tools.jinja")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
SYNTAX = ToolSyntax.of(QWEN.source, "qwen")
LLAMA = ChatTemplate((TEMPLATES / "llama3_tools.jinja").read_text(encoding="utf-8"),
                     bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
                     origin="llama3_tools.jinja")
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.mark.parametrize("tools, param, words", [
    ({}, "tools", "non-empty list"),
    ([{"type": "retrieval"}], "tools[0]", "type: 'function'"),
    ([{"type": "function", "function": {"name": "a b"}}], "tools[0].function.name", "letters"),
    ([WEATHER, WEATHER], "tools[1].function.name", "offered twice"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}],
     "tools[0].function.parameters", "JSON schema object"),
    ([{"type": "function", "function": {"name": "f", "returns": {}}}],
     "tools[0].function.returns", "not supported"),
])
def test_bad_tools_are_refused_naming_the_field(tools, param, words):
  with pytest.raises(ApiError, match=words) as caught:
    parse_tools(tools)
  assert caught.value.param == param


def test_tool_choice_defaults_to_auto_and_must_name_an_offered_function():
  tools = parse_tools([WEATHER])
  assert parse_tool_choice(None, tools) == "auto" and parse_tool_choice(None, ()) == "none"
  named = {"type": "function", "function": {"name": "get_weather"}}
  assert parse_tool_choice(named, tools) == named
  for bad in ({"type": "function", "function": {"name": "other"}}, "always"):
    with pytest.raises(ApiError, match="naming one of the tools \\(get_weather\\)"):
      parse_tool_choice(bad, tools)
  with pytest.raises(ApiError, match="needs 'tools'"):
    parse_tool_choice("required", ())


def test_earlier_calls_and_their_results_reach_the_template_as_transformers_has_them():
  ask = openai_api.parse_chat({"model": "m", "tools": [WEATHER], "messages": [
      {"role": "user", "content": "Paris?"},
      {"role": "assistant", "content": None, "tool_calls": [
          {"id": "c1", "type": "function",
           "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
      {"role": "tool", "tool_call_id": "c1", "content": "21"}]}, max_top_logprobs=0)
  assert ask.messages[1] == {"role": "assistant", "content": "", "tool_calls": [
      {"id": "c1", "type": "function",
       "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
  assert ask.messages[2] == {"role": "tool", "content": "21", "tool_call_id": "c1"}
  assert ask.tool_choice == "auto" and ask.tools[0] == WEATHER
  text = QWEN.render(list(ask.messages), tools=list(ask.tools), add_generation_prompt=True)
  assert CALL.replace("\n</tool_call>", "") in text and "<tool_response>\n21\n" in text
  for turn, words in [({"role": "tool", "content": "21"}, "tool_call_id"),
                      ({"role": "assistant", "content": "", "tool_calls": [
                          {"function": {"name": "f", "arguments": "[1]"}}]}, "JSON object")]:
    with pytest.raises(ApiError, match=words):
      openai_api.parse_chat({"model": "m", "messages": [turn]}, max_top_logprobs=0)


def test_a_template_without_tools_or_with_another_syntax_is_refused_in_one_line():
  with pytest.raises(ApiError, match="does not show tools"):
    ToolSyntax.of(data.chat_template.BYTE_TEMPLATE, "the built-in chat template")
  with pytest.raises(ApiError, match=r"does not read \(it reads Hermes' <tool_call>.*Llama 3"):
    ToolSyntax.of("{{ tools }}[TOOL_CALLS]", "mistral")
  assert ToolSyntax.of(LLAMA.source, "llama") == LLAMA3_JSON


def test_llama_3_1_s_bare_calls_are_read_and_held_back_while_they_may_be_one():
  content, calls = LLAMA3_JSON.read(' {"name": "get_weather", "parameters": {"city": "Paris"}}; '
                                    '{"name": "get_weather", "parameters": {"city": "Lyon"}}')
  assert content is None and [json.loads(c["function"]["arguments"])["city"]
                              for c in calls] == ["Paris", "Lyon"]
  for text in ("The weather is {fine}.", '{"name": "f"} and more', "{broken"):
    assert LLAMA3_JSON.read(text) == (text, [])
  assert [LLAMA3_JSON.held_back(t) for t in ("", "  ", ' {"na', "Sunny {")] == [0, 0, 0, 7]


def test_calls_are_read_and_a_call_that_does_not_parse_stays_text():
  content, calls = SYNTAX.read("I will look.\n" + CALL + "\n" + CALL.replace("Paris", "Lyon"))
  assert content == "I will look.\n\n"
  assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Paris"},
                                                                     {"city": "Lyon"}]
  assert len({c["id"] for c in calls}) == 2 and all(c["type"] == "function" for c in calls)
  broken = "<tool_call>\n{not json}\n</tool_call>"
  assert SYNTAX.read(broken) == (broken, [])
  deep = "<tool_call>" + "[" * 100_000 + "</tool_call>"  # Past json's recursion: text.
  assert SYNTAX.read(deep) == (deep, [])
  unclosed = '<tool_call>\n{"name": "f", "parameters": {"x": 1}}'  # Ended at end of turn.
  content, calls = SYNTAX.read(unclosed)
  assert content is None and calls[0]["function"] == {"name": "f", "arguments": '{"x": 1}'}


def test_streamed_text_is_held_back_from_a_call_s_opening_on():
  assert SYNTAX.held_back("Hello") == 5
  assert SYNTAX.held_back("Hello <tool") == 6  # It may open a call.
  assert SYNTAX.held_back("Hello <tool_call>{") == 6
  assert SYNTAX.held_back("a < b") == 5


class Scripted(inference.Engine):
  """An engine that answers every request with `reply`, in two steps: what the server makes
  of a reply is tested here, not what a tiny model would say. Keeps each prompt's text."""

  reply = ""

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self.prompts, self._running = [], []

  def step(self):
    while self._waiting:
      index, request, *_ = self._waiting.popleft()
      self.prompts.append(TOKENIZER.decode(list(request.prompt)))
      self._running.append(Completion(index, [], [], ""))
    half = len(self.reply) // 2
    for completion in self._running:
      done = bool(completion.text)
      completion.text = self.reply if done else self.reply[:half]
      completion.tokens = list(TOKENIZER.encode(completion.text))
      completion.logprobs = [-0.5] * len(completion.tokens)
      completion.finish_reason = "stop" if done else ""
    grown, self._running = self._running, [c for c in self._running if not c.finish_reason]
    return grown

  @property
  def busy(self):
    return bool(self._waiting or self._running)


TOKENIZER = data.ByteTokenizer()


@pytest.fixture(scope="module")
def engine():
  config = dataclasses.replace(models.DecoderConfig.tiny(), max_seq_len=2048)  # Never run.
  model = models.Decoder(config, rngs=nnx.Rngs(0))
  return Scripted(model, max_slots=2, max_len=2048, decode=TOKENIZER.decode,
                  grammar_vocabulary=inference.grammar.vocabulary(TOKENIZER))


def _client(engine, template=QWEN):
  def encode(item):
    if "messages" in item:
      text = template.render(item["messages"], tools=item.get("tools"),
                             add_generation_prompt=True)
      return TOKENIZER.encode(text + item.get("reply_start", "")), (TOKENIZER.eos_id,)
    return TOKENIZER.encode(item["prompt"]), ()

  served = server.Served("tiny", engine, TOKENIZER, encode, chat_template=template)
  return TestClient(server.build_app(served))


ASK = {"model": "tiny", "messages": [{"role": "user", "content": "Weather in Paris?"}],
       "tools": [WEATHER]}


def test_a_reply_s_call_comes_back_as_tool_calls_whole_and_streamed(engine):
  engine.reply = "Let me check.\n" + CALL
  with _client(engine) as client:
    whole = client.post("/v1/chat/completions", json=ASK)
    with client.stream("POST", "/v1/chat/completions", json={**ASK, "stream": True}) as events:
      lines = [line for line in events.iter_lines() if line.startswith("data: {")]
  assert whole.status_code == 200, whole.text
  parsed = openai.types.chat.ChatCompletion.model_validate(whole.json())  # The client's view.
  choice = parsed.choices[0]
  assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check.\n"
  call = choice.message.tool_calls[0]
  assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {
      "city": "Paris"} and call.id.startswith("call_")
  assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in engine.prompts[0]
  chunks = [openai.types.chat.ChatCompletionChunk.model_validate(json.loads(line[6:]))
            for line in lines]
  content = "".join(c.choices[0].delta.content or "" for c in chunks)
  assert content == "Let me check.\n"  # Nothing of the call's text, though it came in two.
  last = chunks[-1].choices[0]
  assert last.finish_reason == "tool_calls" and last.delta.tool_calls[0].index == 0
  assert json.loads(last.delta.tool_calls[0].function.arguments) == {"city": "Paris"}


def test_a_named_tool_choice_makes_the_reply_begin_with_its_call(engine):
  engine.reply = '{"city": "Lyon"}}\n</tool_call>'  # What follows the call's opening.
  named = {"type": "function", "function": {"name": "get_weather"}}
  with _client(engine) as client:
    reply = client.post("/v1/chat/completions", json={**ASK, "tool_choice": named}).json()
  assert engine.prompts[-1].endswith(
      '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": ')
  message = reply["choices"][0]["message"]
  assert message["content"] is None and reply["choices"][0]["finish_reason"] == "tool_calls"
  assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Lyon"}


def test_without_reading_calls_the_reply_is_text(engine):
  engine.reply = CALL
  with _client(engine) as client:
    shown = client.post("/v1/chat/completions", json={**ASK, "tool_choice": "none"}).json()
    plain = client.post("/v1/chat/completions", json={**ASK, "tools": None}).json()
  for reply in (shown, plain):
    assert reply["choices"][0]["message"] == {"role": "assistant", "content": CALL}
    assert reply["choices"][0]["finish_reason"] == "stop"
  assert "<tools>" in engine.prompts[-2] and "<tools>" not in engine.prompts[-1]


def test_tools_with_a_template_that_cannot_show_them_are_a_400_naming_it(engine):
  byte = ChatTemplate(data.chat_template.BYTE_TEMPLATE, bos_token="", eos_token="",
                      origin="the built-in chat template")
  for template, words in [(byte, "the built-in chat template does not show tools"),
                          (None, "no chat template")]:
    with _client(engine, template) as client:
      reply = client.post("/v1/chat/completions", json=ASK)
    assert reply.status_code == 400 and words in reply.json()["error"]["message"]
    assert reply.json()["error"]["param"] == "tools"


@pytest.mark.parametrize("template", [QWEN, LLAMA], ids=["hermes", "llama3"])
def test_a_forced_call_from_a_real_model_always_parses_and_its_arguments_validate(template):
  """A random tiny model at temperature 1, `tool_choice` "required" and named: each reply is
  one call of an offered function whose arguments validate under its parameters (the
  structured output's grammar), read back as `tool_calls`."""
  jsonschema = pytest.importorskip("jsonschema")
  config = dataclasses.replace(models.DecoderConfig.tiny(), max_seq_len=2048)
  engine = inference.Engine(models.Decoder(config, rngs=nnx.Rngs(0)), max_slots=4,
                            decode=TOKENIZER.decode,
                            grammar_vocabulary=inference.grammar.vocabulary(TOKENIZER))
  city = {"type": "object", "properties": {"city": {"enum": ["Paris", "Lyon"]}},
          "required": ["city"], "additionalProperties": False}
  now = {"type": "function", "function": {"name": "now", "parameters": {
      "type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"],
      "additionalProperties": False}}}
  weather = {"type": "function", "function": {"name": "get_weather", "parameters": city}}
  schemas = {"get_weather": city, "now": now["function"]["parameters"]}
  named = {"type": "function", "function": {"name": "now"}}
  with _client(engine, template) as client:
    replies = [client.post("/v1/chat/completions", json={
        **ASK, "tools": [weather, now], "tool_choice": choice, "n": 4, "seed": 1,
        "max_tokens": 80}).json() for choice in ("required", named)]
  called = []
  for reply, choice in zip(replies, ("required", named)):
    for answer in reply["choices"]:
      assert answer["finish_reason"] == "tool_calls", answer
      (call,) = answer["message"]["tool_calls"]
      name = call["function"]["name"]
      jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[name])
      called.append(name)
  assert called[4:] == ["now"] * 4


def test_llama_3_1_s_call_comes_back_as_tool_calls_and_a_named_choice_begins_it(engine):
  engine.reply = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
  first = len(engine.prompts)
  with _client(engine, LLAMA) as client:
    whole = client.post("/v1/chat/completions", json=ASK).json()
    with client.stream("POST", "/v1/chat/completions", json={**ASK, "stream": True}) as events:
      lines = [line for line in events.iter_lines() if line.startswith("data: {")]
    engine.reply = '{"city": "Lyon"}}'
    named = client.post("/v1/chat/completions", json={**ASK, "tool_choice": {
        "type": "function", "function": {"name": "get_weather"}}}).json()
  assert "Given the following functions" in engine.prompts[first]
  message = whole["choices"][0]["message"]
  assert whole["choices"][0]["finish_reason"] == "tool_calls" and message["content"] is None
  assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
  chunks = [json.loads(line[6:]) for line in lines]
  assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == ""
  assert chunks[-1]["choices"][0]["delta"]["tool_calls"][0]["function"]["name"] == "get_weather"
  assert engine.prompts[-1].endswith('<|start_header_id|>assistant<|end_header_id|>\n\n'
                                     '{"name": "get_weather", "parameters": ')
  assert json.loads(named["choices"][0]["message"]["tool_calls"][0]["function"][
      "arguments"]) == {"city": "Lyon"}
