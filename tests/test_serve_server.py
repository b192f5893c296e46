"""The OpenAI-compatible server: in-process for each error path, then `jax-ai-stack serve` on
loopback spoken to with the official `openai` client (concurrent streams, a client that goes
away, SIGTERM)."""

import concurrent.futures
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx2 as httpx  # The HTTP client the openai client brings (httpx's successor).
import openai
import pytest
from flax import nnx
from starlette.testclient import TestClient

from jax_ai_stack.recipes import data, inference, models
from jax_ai_stack.recipes.serve import server
from training_helpers import TINY

TOKENIZER = data.ByteTokenizer()


def encode(item):
  """Text prompts as bytes (ended by EOS); a conversation as 'user: ...\\nassistant: '."""
  if "messages" in item:
    text = "".join(f"{m['role']}: {m['content']}\n" for m in item["messages"]) + "assistant: "
    return TOKENIZER.encode(text), (TOKENIZER.eos_id,)
  return TOKENIZER.encode(item["prompt"]), ()


@pytest.fixture(scope="module")
def model():
  return models.Decoder(models.DecoderConfig.tiny(), rngs=nnx.Rngs(0))


def app_client(model, pool: dict | None = None, **fields):
  engine = inference.Engine(model, max_slots=2, max_len=64, decode=TOKENIZER.decode,
                            **(pool or {}))
  served = server.Served("tiny", engine, TOKENIZER, encode, **fields)
  return TestClient(server.build_app(served))


def events(body: str) -> list:
  lines = [line.removeprefix("data: ") for line in body.split("\n\n") if line]
  assert lines[-1] == "[DONE]"
  return [json.loads(line) for line in lines[:-1]]


def test_a_completion_and_its_stream_give_the_same_greedy_text(model):
  ask = {"model": "tiny", "prompt": "Hi", "max_tokens": 12, "temperature": 0}
  with app_client(model) as client:
    whole = client.post("/v1/completions", json=ask).json()
    streamed = events(client.post("/v1/completions", json={**ask, "stream": True}).text)
    expected = inference.Engine(model, max_slots=2, max_len=64).run(
        [inference.Request(tuple(TOKENIZER.encode("Hi")), 12, temperature=0)])[0]
  assert whole["choices"][0]["text"] == TOKENIZER.decode(expected.tokens)
  assert "".join(chunk["choices"][0]["text"] for chunk in streamed) == whole["choices"][0]["text"]
  assert streamed[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
  assert whole["usage"] == {"prompt_tokens": 2, "completion_tokens": 12, "total_tokens": 14}


def test_a_stop_string_ends_the_request_in_the_engine_and_cuts_the_text(model):
  """The engine ends it in the step that made the stop string: no token after it is
  decoded, and nothing is left to cancel."""
  with app_client(model) as client:
    ask = {"model": "tiny", "prompt": "Hi", "max_tokens": 12, "temperature": 0}
    full = client.post("/v1/completions", json=ask).json()["choices"][0]["text"]
    # Two characters, the second not U+FFFD (whose byte the next token could still finish).
    at = next(i for i in range(3, len(full) - 1) if full[i + 1] != "\ufffd")
    stop = full[at:at + 2]
    whole = client.post("/v1/completions", json={**ask, "stop": stop}).json()
    streamed = events(client.post("/v1/completions", json={**ask, "stop": [stop],
                                                           "stream": True}).text)
    health = client.get("/health").json()
  cut = whole["choices"][0]
  assert cut["text"] == full[:full.index(stop)] and cut["finish_reason"] == "stop"
  tokens = inference.Engine(model, max_slots=1, max_len=64).run(
      [inference.Request(tuple(TOKENIZER.encode("Hi")), 12, temperature=0)])[0].tokens
  made = next(k for k in range(1, 13) if stop in TOKENIZER.decode(tokens[:k]))
  assert whole["usage"]["completion_tokens"] == made < 12  # The token that made the stop, last.
  assert "".join(chunk["choices"][0]["text"] for chunk in streamed) == cut["text"]
  assert streamed[-1]["choices"][0]["finish_reason"] == "stop"
  assert health == {"status": "ok", "running": 0, "cancelled": 0, "pages_in_use": 0,
                    "peak_pages": 1, "max_pages": 2, "shared_prompts": 0, "prefix_hits": 0,
                    "cached_tokens": 0, "cached_pages": 0}  # Prompts shorter than a chunk.


def test_a_logit_bias_steers_the_reply_and_a_token_past_the_vocabulary_is_a_400(model):
  a = int(TOKENIZER.encode("a")[0])
  ask = {"model": "tiny", "prompt": "Hi", "max_tokens": 4, "temperature": 0}
  with app_client(model) as client:
    forced = client.post("/v1/completions", json={**ask, "logit_bias": {str(a): 100}})
    outside = client.post("/v1/completions", json={**ask, "logit_bias": {"999": -5}})
  assert forced.status_code == 200 and forced.json()["choices"][0]["text"] == "aaaa"
  error = outside.json()["error"]
  assert outside.status_code == 400 and error["param"] == "logit_bias"
  assert "token ids in [0, 259)" in error["message"] and "999: -5.0" in error["message"]


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["answer", "sure"],
          "properties": {"answer": {"type": "string", "maxLength": 6},
                         "sure": {"type": "boolean"}}}


def test_a_hundred_sampled_replies_validate_under_their_json_schema(model):
  """Temperature 1, a random model: every reply the client reads is JSON its schema accepts,
  ended by the model's end token; a schema the grammar engine refuses is a 400 naming it."""
  jsonschema = pytest.importorskip("jsonschema")
  engine = inference.Engine(model, max_slots=8, max_len=128, decode=TOKENIZER.decode,
                            grammar_vocabulary=inference.grammar.vocabulary(TOKENIZER))
  ask = {"model": "tiny", "messages": [{"role": "user", "content": "json?"}], "n": 10,
         "max_tokens": 80, "response_format": {"type": "json_schema", "json_schema": {
             "name": "reply", "schema": SCHEMA, "strict": True}}}
  with TestClient(server.build_app(server.Served("tiny", engine, TOKENIZER, encode))) as client:
    replies = [openai.types.chat.ChatCompletion.model_validate(
        client.post("/v1/chat/completions", json={**ask, "seed": seed}).json())
        for seed in range(10)]
    refused = client.post("/v1/chat/completions", json={**ask, "response_format": {
        "type": "json_schema", "json_schema": {"name": "r", "schema": {
            "type": "string", "format": "no-such-format"}}}})
  choices = [choice for reply in replies for choice in reply.choices]
  assert len(choices) == 100 and all(c.finish_reason == "stop" for c in choices)
  for choice in choices:
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)
  assert len({c.message.content for c in choices}) > 10
  assert refused.status_code == 400 and refused.json()["error"]["param"] == "response_format"
  assert "no-such-format" in refused.json()["error"]["message"]


def test_a_request_larger_than_the_page_pool_is_a_400_naming_max_pages(model):
  with app_client(model, {"page_size": 8, "max_pages": 3}) as client:
    ask = {"model": "tiny", "prompt": "Hi", "max_tokens": 22, "temperature": 0}
    fits = client.post("/v1/completions", json=ask)
    too_big = client.post("/v1/completions", json={**ask, "max_tokens": 23})
    health = client.get("/health").json()
  assert fits.status_code == 200, fits.text  # 2 + 22 positions: 3 pages of 8.
  assert too_big.status_code == 400 and "(max_pages)" in too_big.json()["error"]["message"]
  assert (health["pages_in_use"], health["peak_pages"], health["max_pages"]) == (0, 3, 3)


def test_an_engine_that_cannot_decode_text_is_refused(model):
  with pytest.raises(ValueError, match="an engine given `decode`"):
    server.Served("tiny", inference.Engine(model, max_slots=1), TOKENIZER, encode)


def test_chat_logprobs_of_greedy_tokens_are_the_likeliest(model):
  with app_client(model) as client:
    reply = client.post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
        "temperature": 0, "logprobs": True, "top_logprobs": 3}).json()
  content = reply["choices"][0]["logprobs"]["content"]
  assert len(content) == 5
  for entry in content:
    assert entry["logprob"] == pytest.approx(entry["top_logprobs"][0]["logprob"], abs=1e-6)
    assert entry["logprob"] >= entry["top_logprobs"][-1]["logprob"]


def post(client, path, body):
  reply = client.post(path, content=body) if isinstance(body, bytes) else \
      client.post(path, json=body)
  return reply.status_code, reply.json()["error"]


@pytest.mark.parametrize("path, body, status, param, words", [
    ("/v1/completions", {"model": "other", "prompt": "x"}, 404, "model", "does not exist"),
    ("/v1/completions", b"{not json", 400, None, "not valid JSON"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 100}, 400, "max_tokens",
     "exceed the context of 64"),
    ("/v1/completions", {"model": "tiny", "prompt": "x" * 70}, 400, "prompt", "70 tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "top_k": 999}, 400, "top_k",
     "[1, 259]"),
    ("/v1/chat/completions", {"model": "tiny", "messages": "hi"}, 400, "messages", "list"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "n": 3}, 400, "n",
     "takes at most 2 at once"),
    ("/v1/completions", {"model": "tiny", "prompt": ["x"] * 100_000}, 400, "prompt",
     "100000 prompts x n=1"),
    ("/v1/nothing", {}, 404, None, "Not Found"),
])
def test_each_bad_request_gets_its_status_and_names_the_field(model, path, body, status, param,
                                                              words):
  with app_client(model, max_queue=0) as client:
    answered, error = post(client, path, body)
    assert answered == status
    assert error["param"] == param and words in error["message"]
    assert client.get("/health").json()["running"] == 0  # Nothing left behind.
    ok = client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2})
    assert ok.status_code == 200  # The server goes on serving.


def test_a_request_past_the_free_slots_and_queue_is_a_429_while_the_others_run(model,
                                                                              monkeypatch):
  engine = inference.Engine(model, max_slots=2, max_len=64, decode=TOKENIZER.decode)
  step, release = engine.step, threading.Event()
  monkeypatch.setattr(engine, "step", lambda: release.wait(30) and step())
  ask = {"model": "tiny", "prompt": "x", "max_tokens": 2}
  with TestClient(server.build_app(server.Served("tiny", engine, TOKENIZER, encode,
                                                 max_queue=0))) as client:
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
      first = pool.submit(client.post, "/v1/completions", json={**ask, "n": 2})
      deadline = time.monotonic() + 30
      while client.get("/health").json()["running"] < 2:  # Both choices in the engine.
        assert time.monotonic() < deadline
        time.sleep(0.01)
      busy = client.post("/v1/completions", json=ask)
      release.set()
      assert first.result().status_code == 200
  error = raw_error(busy, 429)
  assert error["code"] == "rate_limit_exceeded" and "2 requests are queued or running" in \
      error["message"]


def test_with_an_api_key_a_request_without_it_is_401(model):
  with app_client(model, api_key="sesame") as client:
    refused = client.get("/v1/models")
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert client.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    listed = client.get("/v1/models", headers={"Authorization": "Bearer sesame"}).json()
    assert [card["id"] for card in listed["data"]] == ["tiny"]


def raw_error(reply, status):
  assert reply.status_code == status, reply.text
  assert reply.headers["content-type"] == "application/json", reply.text  # Never plain text.
  return reply.json()["error"]


@pytest.mark.parametrize("body, param, words", [
    (b'{"model": "tiny", "prompt": "x", "seed": ' + b"7" * 4301 + b"}", None,
     "more than 4300 digits"),
    (b'{"model": "tiny", "prompt": "x", "temperature": 1' + b"0" * 400 + b"}", "temperature",
     "out of range"),
    (b'{"model": "tiny", "prompt": "a\\ud800"}', "prompt", "lone surrogate"),
    (b'{"model": "\\ud800", "prompt": "a"}', "model", "lone surrogate"),
    (b'{"model": "tiny", "prompt": "a", "\\udc00": 1}', "\\udc00", "field name"),
    (b'{"model": "tiny", "prompt": "x", "a": ' + b"[" * 5000 + b"]" * 5000 + b"}", None,
     "deeper than 64 levels"),
    (b'{"model": "tiny", "prompt": "x", "a": ' + b"[" * 100 + b"]" * 100 + b"}",
     None, "deeper than 64 levels"),
    (b'{"model": "tiny", "prompt": "x", "stop": "' + b"s" * 1025 + b'"}', "stop",
     "at most 1024 bytes"),
    (b'{"model": "tiny", "prompt": [1, 2, 999]}', "prompt", "[0, 259)"),
])
def test_what_python_reads_but_cannot_answer_is_a_400_in_openais_shape(model, body, param,
                                                                        words):
  with app_client(model) as client:
    error = raw_error(client.post("/v1/completions", content=body), 400)
    assert error["param"] == param and words in error["message"], error
    chat = b'{"model": "tiny", "messages": [{"role": "user", "content": "\\udfff"}]}'
    error = raw_error(client.post("/v1/chat/completions", content=chat), 400)
    assert error["param"] == "messages[0].content"


def test_a_body_over_the_limit_is_a_413_before_it_is_read_whole(model):
  with app_client(model, max_request_bytes=1000) as client:
    declared = client.post("/v1/completions", content=b"x" * 1001)
    chunked = client.post("/v1/completions", content=iter([b"x" * 600] * 3))
    fits = client.post("/v1/completions", json={"model": "tiny", "prompt": "x" * 900,
                                                "max_tokens": 1})
  assert "1000 (serve --max-request-bytes)" in raw_error(declared, 413)["message"]
  assert raw_error(chunked, 413)["code"] == "request_too_large"
  assert fits.status_code == 400 and "900 tokens" in fits.json()["error"]["message"]


def test_the_api_key_is_read_as_rfc_6750_says_and_health_needs_none(model):
  with app_client(model, api_key="sesame") as client:
    for header, status in [("Bearer sesame", 200), ("bearer sesame", 200),
                           ("BEARER  sesame ", 200), ("sesame", 401), ("Basic sesame", 401),
                           ("Bearer", 401), ("Bearer sesamex", 401)]:
      reply = client.get("/v1/models", headers={"Authorization": header})
      assert reply.status_code == status, header
    assert client.get("/health").status_code == 200
  with pytest.raises(ValueError, match="must not be empty"):
    server.Served("tiny", inference.Engine(model, max_slots=1, decode=TOKENIZER.decode),
                  TOKENIZER, encode, api_key=" ")


def test_on_loopback_only_loopback_host_names_are_answered(model):
  with app_client(model, allowed_hosts=frozenset({"box.lan:8000"})) as client:
    for host, status in [("localhost:8000", 200), ("127.0.0.1", 200), ("127.3.4.5:1", 200),
                         ("[::1]:8000", 200), ("LOCALHOST", 200), ("box.lan:80", 200),
                         ("evil.example", 403), ("evil.example:8000", 403),
                         ("localhost.evil.example", 403), ("10.0.0.1", 403), ("", 403)]:
      reply = client.get("/health", headers={"Host": host})
      assert reply.status_code == status, host
    error = raw_error(client.post("/v1/completions", headers={"Host": "rebound.example"},
                                  json={}), 403)
    assert error["code"] == "host_not_allowed" and "--allowed-hosts" in error["message"]
  with app_client(model, allowed_hosts=frozenset({"*"})) as client:
    assert client.get("/health", headers={"Host": "evil.example"}).status_code == 200


def test_a_trailing_slash_is_served_not_redirected_and_a_model_is_retrieved_by_id(model):
  with app_client(model) as client:
    listed = client.get("/v1/models/", headers={"Host": "evil.example"},
                        follow_redirects=False)
    card = client.get("/v1/models/tiny").json()
    unknown = client.get("/v1/models/other")
    slashed = client.post("/v1/completions/", json={"model": "tiny", "prompt": "x",
                                                    "max_tokens": 1})
  assert listed.status_code == 200 and "location" not in listed.headers
  assert [entry["id"] for entry in listed.json()["data"]] == ["tiny"]
  assert card["id"] == "tiny" and card["object"] == "model"
  error = raw_error(unknown, 404)
  assert error["code"] == "model_not_found" and error["param"] == "model"
  assert slashed.status_code == 200


def test_a_prompt_of_token_ids_is_the_prompt_of_their_text(model):
  ask = {"model": "tiny", "max_tokens": 8, "temperature": 0}
  ids = TOKENIZER.encode("Hi")
  with app_client(model) as client:
    text = client.post("/v1/completions", json={**ask, "prompt": "Hi"}).json()
    one = client.post("/v1/completions", json={**ask, "prompt": [int(t) for t in ids]}).json()
    two = client.post("/v1/completions", json={**ask, "prompt": [[int(t) for t in ids],
                                                                  [256, 72]]}).json()
  assert one["choices"][0]["text"] == text["choices"][0]["text"] == two["choices"][0]["text"]
  assert one["usage"]["prompt_tokens"] == len(ids) and len(two["choices"]) == 2


def test_an_error_the_engine_raises_for_a_request_is_answered_never_left_hanging(model,
                                                                                 monkeypatch):
  """An error from `Engine.add` (after its check passed), whole or streamed: an answer in
  OpenAI's shape, and the server goes on serving."""
  engine = inference.Engine(model, max_slots=2, max_len=64, decode=TOKENIZER.decode)
  add, ask = engine.add, {"model": "tiny", "prompt": "Hi", "max_tokens": 4}

  def refusing(request):
    raise ValueError("the engine says no")

  with TestClient(server.build_app(server.Served("tiny", engine, TOKENIZER, encode))) as client:
    monkeypatch.setattr(engine, "add", refusing)
    whole = client.post("/v1/completions", json=ask)
    streamed = client.post("/v1/completions", json={**ask, "stream": True})
    monkeypatch.setattr(engine, "add", add)
    ok = client.post("/v1/completions", json=ask)
  assert "ValueError" in raw_error(whole, 500)["message"]
  assert raw_error(streamed, 500)["type"] == "server_error"
  assert ok.status_code == 200


def test_a_conversation_the_chat_template_refuses_is_a_400_naming_messages(model):
  from jax_ai_stack.errors import DataError

  def strict(item):
    if "messages" in item and item["messages"][0]["role"] != "user":
      raise DataError("the chat template failed to render: roles must start with user")
    return encode(item)

  engine = inference.Engine(model, max_slots=1, max_len=64, decode=TOKENIZER.decode)
  with TestClient(server.build_app(server.Served("tiny", engine, TOKENIZER, strict))) as client:
    reply = client.post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "assistant", "content": "hi"}]})
  error = raw_error(reply, 400)
  assert error["param"] == "messages" and "roles must start with user" in error["message"]


def test_only_the_engines_thread_checks_requests_and_measures_health(model, monkeypatch):
  threads = set()
  check, pages = inference.Engine.check, inference.Engine.pages_in_use

  def recorded_check(self, request, index=0):
    threads.add(threading.current_thread().name)
    return check(self, request, index)

  def recorded_pages(self):
    threads.add(threading.current_thread().name)
    return pages.fget(self)

  with app_client(model) as client:
    monkeypatch.setattr(inference.Engine, "check", recorded_check)
    monkeypatch.setattr(inference.Engine, "pages_in_use", property(recorded_pages))
    assert client.post("/v1/completions", json={"model": "tiny", "prompt": "x",
                                                "max_tokens": 2}).status_code == 200
    health = client.get("/health").json()
  assert threads == {"jax-ai-stack-engine"}
  assert health["running"] == 0 and health["pages_in_use"] == 0


# `jax-ai-stack serve` on loopback.


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("served") / "run"
  result = subprocess.run(
      [sys.executable, "-m", "jax_ai_stack.cli", "train", "lm-tiny", "--workdir", str(workdir),
       *TINY, "model.max_seq_len=1024", "train.steps=2", "train.sample_tokens=0"],
      capture_output=True, text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert result.returncode == 0, result.stderr
  return workdir


def start_server(workdir, *extra):
  process = subprocess.Popen(
      [sys.executable, "-m", "jax_ai_stack.cli", "serve", "--workdir", str(workdir), "--port",
       "0", *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
      env=dict(os.environ, JAX_PLATFORMS="cpu"))
  line = process.stdout.readline()
  assert line.startswith("serving 'run' at http://127.0.0.1:"), line + process.stderr.read()
  return process, line.split(" at ")[1].split(";")[0].split(" ")[0]


@pytest.fixture(scope="module")
def served(workdir):
  process, url = start_server(workdir, "--max-slots", "4", "--page-size", "16",
                              "--max-pages", "64")
  yield openai.OpenAI(base_url=url, api_key="unused", max_retries=0), url
  process.terminate()
  process.wait(60)


CHAT = [{"role": "user", "content": "hi"}]


@pytest.mark.slow
def test_the_openai_client_chats_with_the_run_as_run_chat_does(served, workdir):
  from jax_ai_stack.recipes.run import build_run

  client, _ = served
  assert [model.id for model in client.models.list().data] == ["run"]
  reply = client.chat.completions.create(model="run", messages=CHAT, max_tokens=10,
                                         temperature=0)
  run = build_run(None, workdir, mode="read", validation=False)
  try:
    assert reply.choices[0].message.content == run.chat(CHAT, 10, 0.0)
  finally:
    run.close()


@pytest.mark.slow
def test_a_server_with_a_draft_model_answers_as_without_and_counts_its_guesses(served,
                                                                               workdir):
  """`serve --speculate 3 --draft W` (the run drafting for itself): the greedy replies of
  the server without it; /health's guesses, every one kept."""
  client, _ = served
  process, url = start_server(workdir, "--speculate", "3", "--draft", str(workdir))
  try:
    guessing = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
    for prompt in ("def f(x):", "import os\nimport"):
      ask = dict(model="run", prompt=prompt, max_tokens=16, temperature=0)
      assert (guessing.completions.create(**ask).choices[0].text
              == client.completions.create(**ask).choices[0].text)
    health = httpx.get(url.removesuffix("/v1") + "/health").json()
    assert health["accepted_tokens"] == health["drafted_tokens"] > 0, health
  finally:
    process.terminate()
    process.wait(60)


@pytest.mark.slow
def test_the_openai_client_s_json_schema_is_followed_by_every_sampled_reply(served):
  """`serve` builds its engine with the run's tokenizer's grammar vocabulary."""
  jsonschema = pytest.importorskip("jsonschema")
  client, _ = served
  reply = client.chat.completions.create(
      model="run", messages=CHAT, n=8, temperature=1, max_tokens=60, seed=5,
      response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}})
  for choice in reply.choices:
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)


@pytest.mark.slow
def test_sixteen_concurrent_streaming_clients_each_get_their_seeds_text(served):
  client, _ = served

  def streamed(seed):
    chunks = client.chat.completions.create(model="run", messages=CHAT, max_tokens=12,
                                            seed=seed, stream=True)
    return "".join(chunk.choices[0].delta.content or "" for chunk in chunks)

  with concurrent.futures.ThreadPoolExecutor(16) as pool:
    texts = list(pool.map(streamed, range(16)))
  alone = [client.chat.completions.create(model="run", messages=CHAT, max_tokens=12,
                                          seed=seed).choices[0].message.content
           for seed in (0, 7, 15)]
  assert [texts[0], texts[7], texts[15]] == alone
  assert len(set(texts)) > 1  # Seeds matter.


@pytest.mark.slow
def test_a_client_that_goes_away_has_its_request_cancelled(served):
  client, url = served
  # 1000 tokens: on a loaded machine the engine must not finish before the server hears
  # the client go. Greedy, since this model samples its end id early at temperature 1.
  body = {"model": "run", "prompt": "a", "max_tokens": 1000, "temperature": 0}
  alone = client.completions.create(**body)
  assert alone.choices[0].finish_reason == "length"  # Only the client can end it early.
  health = f"{url.removesuffix('/v1')}/health"
  before = httpx.get(health).json()["cancelled"]
  body["stream"] = True
  with httpx.stream("POST", f"{url}/completions", json=body) as response:
    next(response.iter_lines())  # It runs; then the connection closes.
  deadline = time.monotonic() + 30
  while True:  # Its slot and its 63 pages of 16 (the server's --max-pages 64) freed.
    now = httpx.get(health).json()
    if (now["running"], now["cancelled"], now["pages_in_use"]) == (0, before + 1, 0):
      break
    assert time.monotonic() < deadline, now
    time.sleep(0.05)
  assert now["peak_pages"] >= 63 and now["max_pages"] == 64


@pytest.mark.slow
def test_sigterm_finishes_the_streams_under_way_then_exits_zero(workdir):
  process, url = start_server(workdir)
  client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
  stream = client.completions.create(model="run", prompt="a", max_tokens=100, stream=True,
                                     temperature=0)
  chunks = [next(iter(stream))]
  process.send_signal(signal.SIGTERM)
  chunks += list(stream)
  assert chunks[-1].choices[0].finish_reason == "length"
  assert process.wait(60) == 0
  with pytest.raises(openai.APIConnectionError):
    client.models.list()


@pytest.mark.parametrize("flags, words", [
    (["--max-slots", "0"], "--max-slots must be at least 1"),
    (["--max-pages", "0"], "--max-pages must be at least 1"),
    (["--port", "70000"], "--port must be in [0, 65535]"),
    (["--max-len", "4096"], "past the model's max_seq_len (1024)"),
    (["--api-key", ""], "--api-key is empty"),
    (["--api-key", "k", "--api-key-file", "f"], "not both"),
    (["--api-key-file", "/no/such/key"], "--api-key-file /no/such/key: No such file"),
    (["--max-request-bytes", "0"], "--max-request-bytes must be at least 1"),
    (["--max-stop-bytes", "0"], "--max-stop-bytes must be at least 1"),
    (["--speculate", "0"], "--speculate must be at least 1"),
])
def test_bad_flags_are_one_line_and_exit_2(workdir, flags, words):
  result = subprocess.run(
      [sys.executable, "-m", "jax_ai_stack.cli", "serve", "--workdir", str(workdir), *flags],
      capture_output=True, text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert result.returncode == 2 and words in result.stderr, result.stderr
  assert "Traceback" not in result.stderr


def test_an_empty_key_file_or_key_variable_is_refused_and_an_open_network_server_noted(
    workdir, tmp_path):
  def serve(*flags, **env):
    return subprocess.run(
        [sys.executable, "-m", "jax_ai_stack.cli", "serve", "--workdir", str(workdir),
         "--max-slots", "0", *flags], capture_output=True, text=True,
        env=dict(os.environ, JAX_PLATFORMS="cpu", **env))

  (tmp_path / "key").write_text("\n")
  empty_file = serve("--api-key-file", str(tmp_path / "key"))
  empty_variable = serve(JAX_AI_STACK_API_KEY="")
  open_network = serve("--host", "0.0.0.0")
  assert empty_file.returncode == 2 and "its first line is empty" in empty_file.stderr
  assert empty_variable.returncode == 2 and "is set but empty" in empty_variable.stderr
  assert open_network.returncode == 2  # --max-slots 0: it stops before loading.
  assert open_network.stderr.splitlines()[0] == (
      "note: --host 0.0.0.0 is not loopback and no API key is set: anyone who can reach this "
      "machine can use the model (set --api-key-file)")


def test_a_missing_workdir_is_named(tmp_path):
  result = subprocess.run(
      [sys.executable, "-m", "jax_ai_stack.cli", "serve", "--workdir", str(tmp_path / "none")],
      capture_output=True, text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert result.returncode == 2 and str(tmp_path / "none") in result.stderr, result.stderr


def test_the_openai_client_retrieves_the_model_sends_token_ids_and_hears_the_limits(served):
  client, _ = served
  assert client.models.retrieve("run").id == "run"
  with pytest.raises(openai.NotFoundError, match="does not exist"):
    client.models.retrieve("nope")
  ask = {"model": "run", "max_tokens": 5, "temperature": 0}
  one = client.completions.create(prompt=[1, 2, 3], **ask)
  two = client.completions.create(prompt=[[1, 2, 3], [4, 5]], **ask)
  assert [c.text for c in two.choices][0] == one.choices[0].text and len(two.choices) == 2
  for fields, words in [({"prompt": [1, 10**6]}, "not in the vocabulary"),
                        ({"prompt": "a", "stop": "x" * 2000}, "at most 1024 bytes"),
                        ({"prompt": "a", "stream": True,
                          "stream_options": {"include_usage": "yes"}}, "must be a boolean")]:
    with pytest.raises(openai.BadRequestError, match=re.escape(words)):
      client.completions.create(**{**ask, **fields})


def test_attacks_on_a_real_server_get_json_answers_and_it_goes_on_serving(served):
  client, url = served
  attacks = [b'{"model": "run", "prompt": "a", "seed": ' + b"1" * 5000 + b"}",
             b'{"model": "run", "prompt": "\\ud800"}', b'{"\\ud800": 1}',
             b"[" * 5000 + b"]" * 5000,
             b'{"model": "run", "prompt": "a", "stop": "' + b"s" * 1_000_000 + b'"}']
  started = time.monotonic()
  for body in attacks:
    reply = httpx.post(f"{url}/completions", content=body,
                       headers={"content-type": "application/json"})
    assert reply.status_code == 400 and reply.json()["error"]["message"], reply.text
  assert time.monotonic() - started < 10  # The 1 MB stop string is refused, not run.
  rebound = httpx.get(f"{url}/models", headers={"Host": "attacker.example"})
  assert rebound.status_code == 403 and rebound.json()["error"]["code"] == "host_not_allowed"
  slashed = httpx.get(f"{url}/models/", follow_redirects=False)
  assert slashed.status_code == 200 and "location" not in slashed.headers
  assert client.completions.create(model="run", prompt="a", max_tokens=2).choices[0].text \
      is not None


def test_a_key_from_a_file_is_read_as_rfc_6750_says_and_a_large_body_is_a_413(workdir,
                                                                              tmp_path):
  (tmp_path / "key").write_text("s3cret\n")
  process, url = start_server(workdir, "--api-key-file", str(tmp_path / "key"),
                              "--max-request-bytes", "20000")
  try:
    assert "s3cret" not in " ".join(process.args)  # Not in the process list.
    client = openai.OpenAI(base_url=url, api_key="s3cret", max_retries=0)
    assert [model.id for model in client.models.list().data] == ["run"]
    with pytest.raises(openai.AuthenticationError):
      openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).models.list()
    for header, status in [("bearer s3cret", 200), ("s3cret", 401)]:
      assert httpx.get(f"{url}/models", headers={"Authorization": header}).status_code == status
    assert httpx.get(f"{url.removesuffix('/v1')}/health").status_code == 200  # Open.
    with pytest.raises(openai.APIStatusError) as caught:
      client.completions.create(model="run", prompt="a" * 30000, max_tokens=1)
    assert caught.value.status_code == 413 and "20000" in str(caught.value)
  finally:
    process.terminate()
    process.wait(60)


def test_a_completion_ends_at_the_run_s_end_ids_as_generate_does(model):
  """A prompt's completion, text or token ids, stops at the ids the run's encoder names
  (a generation config's eos_token_id: `generate`'s, the export's), not at the
  tokenizer's EOS alone."""
  greedy = inference.Engine(model, max_slots=1, max_len=64).run(
      [inference.Request(tuple(TOKENIZER.encode("Hi")), 8, temperature=0)])[0].tokens
  end = greedy[2]
  expected = TOKENIZER.decode(greedy[:greedy.index(end)])

  def ending(item):
    return (encode(item) if "messages" in item
            else (TOKENIZER.encode(item["prompt"]), (end,)))

  engine = inference.Engine(model, max_slots=2, max_len=64, decode=TOKENIZER.decode)
  with TestClient(server.build_app(server.Served("tiny", engine, TOKENIZER, ending))) as client:
    for prompt in ("Hi", [int(t) for t in TOKENIZER.encode("Hi")]):
      reply = client.post("/v1/completions", json={
          "model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0}).json()
      assert reply["choices"][0]["finish_reason"] == "stop", prompt
      assert reply["choices"][0]["text"] == expected, prompt
