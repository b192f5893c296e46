"""The OpenAI-compatible server: in-process for each error path, then `jax-ai-stack serve` on
loopback spoken to with the official `openai` client (concurrent streams, a client that goes
away, SIGTERM)."""

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
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
    stop = full[3:5]
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
                    "peak_pages": 1, "max_pages": 2}


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
    ("/v1/completions", {"model": "tiny", "prompt": "x", "n": 3}, 429, None, "busy"),
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


def test_with_an_api_key_a_request_without_it_is_401(model):
  with app_client(model, api_key="sesame") as client:
    refused = client.get("/v1/models")
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert client.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    listed = client.get("/v1/models", headers={"Authorization": "Bearer sesame"}).json()
    assert [card["id"] for card in listed["data"]] == ["tiny"]


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
  return process, line.split(" at ")[1].split(";")[0]


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
  _, url = served
  health = f"{url.removesuffix('/v1')}/health"
  before = httpx.get(health).json()["cancelled"]
  # 1000 tokens: on a loaded machine the engine must not finish before the server hears
  # the client go.
  body = {"model": "run", "prompt": "a", "max_tokens": 1000, "stream": True}
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
])
def test_bad_flags_are_one_line_and_exit_2(workdir, flags, words):
  result = subprocess.run(
      [sys.executable, "-m", "jax_ai_stack.cli", "serve", "--workdir", str(workdir), *flags],
      capture_output=True, text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert result.returncode == 2 and words in result.stderr, result.stderr
  assert "Traceback" not in result.stderr


def test_a_missing_workdir_is_named(tmp_path):
  result = subprocess.run(
      [sys.executable, "-m", "jax_ai_stack.cli", "serve", "--workdir", str(tmp_path / "none")],
      capture_output=True, text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert result.returncode == 2 and str(tmp_path / "none") in result.stderr, result.stderr
