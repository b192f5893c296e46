"""Request bodies as OpenAI's client sends them: checked into an Ask, or an error naming the
field."""

import pytest

from jax_ai_stack.recipes.serve import openai_api
from jax_ai_stack.recipes.serve.openai_api import ApiError

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def chat(**fields):
  return openai_api.parse_chat({**CHAT, **fields}, max_top_logprobs=5)


def completion(**fields):
  return openai_api.parse_completion({"model": "m", "prompt": "x", **fields}, max_top_logprobs=5)


def test_a_chat_request_reads_every_supported_field():
  ask = chat(max_completion_tokens=7, temperature=0, top_p=0.5, n=3, seed=4, stop=["a", "b"],
             stream=True, stream_options={"include_usage": True}, logprobs=True,
             top_logprobs=2, top_k=-1, user="u", presence_penalty=0)
  assert (ask.max_tokens, ask.temperature, ask.top_p, ask.n, ask.seed, ask.stop) == (
      7, 0.0, 0.5, 3, 4, ("a", "b"))
  assert ask.stream and ask.include_usage and ask.logprobs and ask.top_logprobs == 2
  assert ask.top_k is None and ask.messages == ({"role": "user", "content": "hi"},)


def test_a_completion_defaults_to_sixteen_tokens_and_reads_a_list_of_prompts():
  ask = completion(prompt=["a", "b"], logprobs=0)
  assert ask.prompts == ("a", "b") and ask.max_tokens == 16
  assert ask.logprobs and ask.top_logprobs == 0
  assert not completion().logprobs


def test_content_parts_join_and_a_developer_turn_is_a_system_turn():
  ask = chat(messages=[{"role": "developer", "content": "be brief"},
                       {"role": "user", "content": [{"type": "text", "text": "a"},
                                                    {"type": "text", "text": "b"}]}])
  assert ask.messages == ({"role": "system", "content": "be brief"},
                          {"role": "user", "content": "ab"})


@pytest.mark.parametrize("fields, param, words", [
    ({"tempreature": 1}, "tempreature", "Unrecognized request argument"),
    ({"model": ""}, "model", "'model' is required"),
    ({"temperature": "hot"}, "temperature", "must be a number"),
    ({"temperature": 2.5}, "temperature", "[0, 2]"),
    ({"top_p": 0}, "top_p", "(0, 1]"),
    ({"top_k": 0}, "top_k", ">= 1"),
    ({"n": 0}, "n", "[1, 16]"),
    ({"max_tokens": 0}, "max_tokens", ">= 1"),
    ({"max_tokens": True}, "max_tokens", "must be an integer"),
    ({"stop": ["a"] * 5}, "stop", "at most 4"),
    ({"stop": [""]}, "stop", "non-empty"),
    ({"presence_penalty": 0.5}, "presence_penalty", "not supported"),
    ({"logit_bias": {"a": 2}}, "logit_bias", "values in [-100, 100]; got 'a': 2"),
    ({"logit_bias": {"1": 101}}, "logit_bias", "got '1': 101"),
    ({"logit_bias": {"1": True}}, "logit_bias", "got '1': True"),
    ({"logit_bias": {str(t): 1 for t in range(301)}}, "logit_bias", "at most 300 tokens"),
    ({"top_logprobs": 9, "logprobs": True}, "top_logprobs", "[0, 5]"),
    ({"top_logprobs": 2}, "top_logprobs", "needs 'logprobs'"),
    ({"messages": []}, "messages", "non-empty list"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "one of"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content", "a string"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]},
     "messages[0].tool_calls", "not supported"),
])
def test_each_bad_chat_field_is_named(fields, param, words):
  with pytest.raises(ApiError) as caught:
    chat(**fields)
  assert caught.value.param == param and caught.value.status == 400
  assert words in caught.value.message


@pytest.mark.parametrize("fields, param", [
    ({"prompt": 3}, "prompt"), ({"prompt": []}, "prompt"), ({"echo": True}, "echo"),
    ({"logprobs": 6}, "logprobs"), ({"messages": []}, "messages")])
def test_each_bad_completion_field_is_named(fields, param):
  with pytest.raises(ApiError) as caught:
    completion(**fields)
  assert caught.value.param == param


def test_a_body_that_is_not_an_object_is_refused():
  with pytest.raises(ApiError, match="JSON object"):
    openai_api.parse_chat([1], max_top_logprobs=5)


def test_the_error_body_has_openais_shape():
  error = ApiError("no such model", "model", status=404, code="model_not_found")
  assert openai_api.error_body(error) == {"error": {
      "message": "no such model", "type": "invalid_request_error", "param": "model",
      "code": "model_not_found"}}


def test_completion_logprobs_offsets_follow_the_token_texts():
  out = openai_api.completion_logprobs(["ab", "c"], [-1.0, -2.0], [[("ab", -1.0)], [("c", -2.0)]],
                                       offset=3)
  assert out["text_offset"] == [3, 5] and out["top_logprobs"] == [{"ab": -1.0}, {"c": -2.0}]


@pytest.mark.parametrize("fields, param, words", [
    ({"stop": "x" * 1025}, "stop",
     "at most 1024 bytes (UTF-8; the server's --max-stop-bytes); got 1025"),
    ({"stop": ["a", "é" * 513]}, "stop", "got 1026"),
    ({"stream": True, "stream_options": {"include_usage": "yes"}},
     "stream_options.include_usage", "must be a boolean; got 'yes'"),
    ({"stream": True, "stream_options": {"include_usage": True, "continuous": 1}},
     "stream_options.continuous", "Unrecognized stream_options argument"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed when"),
    ({"temperature": 10**400}, "temperature", "out of range"),
    ({"n": 10**4000}, "n", "characters)"),  # The value cut short.
])
def test_stop_lengths_stream_options_and_huge_numbers_are_refused_by_name(fields, param, words):
  with pytest.raises(ApiError) as caught:
    chat(**fields)
  assert caught.value.param == param and words in caught.value.message, caught.value.message
  assert len(caught.value.message) < 200


def test_a_stop_string_limit_is_settable():
  assert openai_api.parse_chat({**CHAT, "stop": "x" * 2000}, max_top_logprobs=5,
                               max_stop_bytes=2000).stop == ("x" * 2000,)
  with pytest.raises(ApiError, match="at most 8 bytes"):
    openai_api.parse_chat({**CHAT, "stop": "x" * 9}, max_top_logprobs=5, max_stop_bytes=8)


def test_a_prompt_may_be_token_ids_checked_against_the_vocabulary():
  def prompts(prompt):
    return openai_api.parse_completion({"model": "m", "prompt": prompt}, max_top_logprobs=5,
                                       vocab_size=10).prompts

  assert prompts([1, 2, 3]) == ((1, 2, 3),)
  assert prompts([[1], [2, 9]]) == ((1,), (2, 9))
  for bad, words in [([1, 10], "'prompt': token id 10 is not in the vocabulary [0, 10)"),
                     ([[1], [-1]], "'prompt[1]': token id -1"),
                     ([1, "a"], "must be a string"), ([[1], []], "must be a string"),
                     ([True], "must be a string"), ([[1], "a"], "must be a string")]:
    with pytest.raises(ApiError) as caught:
      prompts(bad)
    assert caught.value.param == "prompt" and words in caught.value.message, bad


@pytest.mark.parametrize("raw, param, words", [
    (b'{"model": "m", "seed": ' + b"9" * 5000 + b"}", None, "more than 4300 digits"),
    (b'{"model": "\\ud800"}', "model", "lone surrogate (such as \\ud800 alone)"),
    (b'{"messages": [{"role": "user", "content": "a\\udfffb"}]}', "messages[0].content",
     "lone surrogate"),
    (b'{"\\ud800x": 1}', "\\ud800x", "field name '\\\\ud800x' is not valid Unicode"),
    (b"[" * 5000 + b"]" * 5000, None, "deeper than 64 levels"),
    (b'{"a": ' + b"[" * 100 + b"]" * 100 + b"}", None, "deeper than 64 levels"),
    (b'{"model": "\xed\xa0\x80"}', "model", "lone surrogate"),  # Encoded, not escaped.
    (b'{"model": "\xff"}', None, "not valid UTF-8"),
    (b"{not json", None, "not valid JSON"),
])
def test_a_body_that_python_reads_but_cannot_answer_is_a_400_naming_where(raw, param, words):
  with pytest.raises(ApiError) as caught:
    openai_api.parse_json(raw)
  assert caught.value.status == 400 and caught.value.param == param
  assert words in caught.value.message, caught.value.message
  openai_api.error_body(caught.value)["error"]["message"].encode("utf-8")  # Sendable.


def test_a_large_body_is_checked_in_milliseconds_not_walked_value_by_value():
  """The event loop reads every body: 4 MB of token ids (or of short strings, brackets
  and escapes among them) costs it about what `json.loads` does."""
  import json
  import time

  for body in [{"model": "m", "prompt": list(range(600_000))},
               {"model": "m", "prompt": ['a\\"[b\\\\'] * 300_000},
               {"model": "m", "prompt": ["\U0001F600"] * 300_000}]:  # Escaped pairs: valid.
    raw = json.dumps(body).encode()
    assert openai_api.parse_json(raw) == body

    def best_of_3(parse) -> float:  # The least of three: a loaded machine's pauses left out.
      times = []
      for _ in range(3):
        started = time.perf_counter()
        parse(raw)
        times.append(time.perf_counter() - started)
      return min(times)

    assert best_of_3(openai_api.parse_json) < 5 * best_of_3(json.loads) + 0.1


@pytest.mark.parametrize("text, depth", [
    ("[]", 1), ('{"a": "[[[[", "b": [{"c": "]]"}]}', 3), ('["\\\\", [["\\"]"]]]', 3),
    ('"\\\\\\"[["', 0), ("[" * 64 + "]" * 64, 64), ("[" * 65 + "]" * 65, 65)])
def test_depth_counts_brackets_outside_strings_only(text, depth):
  assert openai_api._depth(text.encode()) == depth  # pylint: disable=protected-access


def test_a_logit_bias_is_read_as_token_id_and_value_pairs():
  from jax_ai_stack.recipes.inference import requests  # pylint: disable=import-outside-toplevel

  assert chat(logit_bias={"5": -100, "7": 2.5}).logit_bias == ((5, -100.0), (7, 2.5))
  assert completion(logit_bias={}).logit_bias == ()
  assert openai_api.MAX_LOGIT_BIAS == requests.MAX_LOGIT_BIAS


def test_response_format_and_structured_outputs_become_the_grammar_the_engine_follows():
  pytest.importorskip("llguidance")
  from jax_ai_stack.recipes.inference import grammar

  schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
  assert chat().grammar is None and chat(response_format={"type": "text"}).grammar is None
  assert chat(response_format={"type": "json_schema", "json_schema": {
      "name": "x", "schema": schema, "strict": True}}).grammar == grammar.json_schema(schema)
  assert chat(response_format={"type": "json_object"}).grammar == grammar.json_object()
  assert completion(structured_outputs={"choice": ["yes", "no"]}).grammar == grammar.choice(
      ["yes", "no"])
  assert completion(structured_outputs={"regex": "[0-9]+"}).grammar == grammar.regex("[0-9]+")


@pytest.mark.parametrize("fields, param, words", [
    ({"response_format": {"type": "xml"}}, "response_format", "must be {\"type\": \"text\"}"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": []}}},
     "response_format", "whose 'schema' is a JSON schema"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", "list of non-empty strings"),
    ({"structured_outputs": {"regex": "a", "json": {}}}, "structured_outputs", "exactly one of"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs", "not both"),
    ({"response_format": {"type": "json_object"}, "tools": [
        {"type": "function", "function": {"name": "f"}}], "tool_choice": "required"},
     "tool_choice", "has the call's own grammar"),
])
def test_a_malformed_output_format_is_named(fields, param, words):
  pytest.importorskip("llguidance")
  with pytest.raises(ApiError, match=words) as caught:
    chat(**fields)
  assert caught.value.param == param
