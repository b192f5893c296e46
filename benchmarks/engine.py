"""The generation engine against today's loop (`decoding.generate`): same model, same requests.

64 greedy requests, prompts of 16-512 tokens and outputs of 8-256 (drawn from a
seed), on a tiny and a ~25M-parameter Decoder, timed in one process:

  engine         `inference.Engine(model, max_slots=16).run(requests)`: continuous batching
  loop           `decoding.generate` per request, one after the other
  loop-batched   `decoding.generate` on the requests grouped by prompt length (same-length
                 batches), each batch to its longest output, cut per request afterwards

Each variant runs once to compile (every prompt length the loop sees is a program of its
own) and is then timed (`--repeats` N: the fastest of N runs, since on a shared machine
the others' load only ever slows a run). Reports new tokens per second of each, the engine's time to
first token (from the start of the run to each request's first token: median and worst),
and the KV cache: the engine's pool (slots x max_len in pages) and the most of it its
requests held at once, against a full-length cache per request (what the loop allocates,
one request at a time, times the requests in flight).
Greedy, so every variant must give the same tokens: the record says whether they do.
Target: the engine's tokens/s at least `TARGET_VS_LOOP` times the better loop's.

And the prefix cache (`prefix`): 16 requests that share a 768-token system prompt, each with
a question of its own, on 8 slots, with the engine's prefix cache off and on, in two bursts:
the first with nothing kept at its start, the second after it (the system prompt kept).
Reports the seconds of each, the prompt tokens the cache spared, and whether every request's
tokens and log-probs are the same either way (they must be).

With `--transformers`, the same model exported (`models.hf.save`) and the same requests
also go through transformers' `generate` (per request, and in left-padded batches of
`slots`), in a child process (`hf_generate.py`) run by `--torch-python` (an interpreter
with torch and transformers; default this one): tokens/s, whether its greedy tokens are
the engine's, and the engine against the better of the two (target >= 1x).

    python benchmarks/engine.py            # both sizes, 64 requests
    python benchmarks/engine.py --quick    # smoke test
    python benchmarks/engine.py --sizes tiny --repeats 3
    python benchmarks/engine.py --transformers --torch-python ~/hf/bin/python
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import common
from jax_ai_stack.recipes.inference import Engine, Request
from jax_ai_stack.recipes.models import hf
from jax_ai_stack.recipes.models.decoding import generate
from jax_ai_stack.recipes.models.decoder import Decoder, DecoderConfig

TARGET_VS_LOOP = 3.0
"""The engine's tokens/s must reach this many times the better loop variant's."""
TARGET_VS_TRANSFORMERS = 1.0
"""... and at least the better of transformers' `generate` variants' (when measured)."""
SIZES = {
    "tiny": DecoderConfig(num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, mlp_dim=128,
                        max_seq_len=1024),
    "25m": DecoderConfig(num_layers=8, d_model=512, num_heads=8, num_kv_heads=2, mlp_dim=1536,
                       max_seq_len=1024),
    "quick": DecoderConfig(num_layers=1, d_model=32, num_heads=2, num_kv_heads=1, mlp_dim=64,
                         max_seq_len=64),
}
PREFIX = {"full": dict(requests=16, system=768, question=32, output=32, slots=8, chunk=256,
                      page=64),
          "quick": dict(requests=4, system=24, question=4, output=4, slots=2, chunk=8, page=8)}
WORKLOADS = {"full": dict(requests=64, prompt=(16, 512), output=(8, 256), slots=16),
             "quick": dict(requests=5, prompt=(3, 12), output=(2, 6), slots=2)}


def requests_for(workload: dict, vocab: int, seed: int = 0) -> list[Request]:
  rng = np.random.default_rng(seed)
  requests = []
  for _ in range(workload["requests"]):
    prompt = rng.integers(0, vocab, int(rng.integers(*workload["prompt"])))
    requests.append(Request(tuple(int(t) for t in prompt), int(rng.integers(*workload["output"])),
                            temperature=0))
  return requests


def run_engine(model, requests: Sequence[Request], slots: int,
               steps_per_call: int | None = None) -> tuple[list[list[int]], list[float], Engine]:
  """The engine's tokens per request, each request's time to its first token (s), and the
  engine (its pages)."""
  options = {} if steps_per_call is None else {"steps_per_call": steps_per_call}
  engine = Engine(model, max_slots=slots, **options)
  started, first, tokens = time.perf_counter(), {}, {}
  for request in requests:
    engine.add(request)
  while engine.busy:
    for completion in engine.step():
      first.setdefault(completion.index, time.perf_counter() - started)
      if completion.finish_reason:
        tokens[completion.index] = completion.tokens
  return ([tokens[i] for i in range(len(requests))], [first[i] for i in range(len(requests))],
          engine)


def run_loop(model, requests: Sequence[Request]) -> list[list[int]]:
  out = []
  for request in requests:
    tokens = generate(model, jnp.asarray([request.prompt]), request.max_tokens, temperature=0,
                      rng=jax.random.key(0))
    out.append(np.asarray(tokens)[0, len(request.prompt):].tolist())
  return out


def run_loop_batched(model, requests: Sequence[Request]) -> list[list[int]]:
  groups: dict[int, list[int]] = {}
  for index, request in enumerate(requests):
    groups.setdefault(len(request.prompt), []).append(index)
  out: list[list[int]] = [[] for _ in requests]
  for length, members in groups.items():
    longest = max(requests[i].max_tokens for i in members)
    prompts = jnp.asarray([requests[i].prompt for i in members])
    tokens = np.asarray(generate(model, prompts, longest, temperature=0, rng=jax.random.key(0)))
    for row, index in enumerate(members):
      out[index] = tokens[row, length:length + requests[index].max_tokens].tolist()
  return out


def run_transformers(model, requests: Sequence[Request], batch: int, python: str) -> dict:
  """transformers' `generate` on `model` exported, in a child process (`hf_generate.py`)."""
  with tempfile.TemporaryDirectory() as tmp:
    out = pathlib.Path(tmp) / "model"
    hf.save(model, out)
    (out / "requests.json").write_text(json.dumps({"batch": batch, "requests": [
        {"prompt": list(r.prompt), "max_tokens": r.max_tokens} for r in requests]}))
    done = subprocess.run([python, str(pathlib.Path(__file__).with_name("hf_generate.py")),
                           str(out)], capture_output=True, text=True, check=False)
  if done.returncode != 0:
    raise RuntimeError(f"hf_generate.py failed under {python}:\n{done.stderr[-3000:]}")
  return json.loads(done.stdout.strip().splitlines()[-1])


def measure(size: str, workload: dict, steps_per_call: int | None = None,
            torch_python: str | None = None, repeats: int = 1) -> dict[str, Any]:
  config = SIZES[size]
  model = Decoder(config, rngs=nnx.Rngs(0))
  requests = requests_for(workload, config.vocab_size)
  new_tokens = sum(r.max_tokens for r in requests)
  variants = {"engine": lambda: run_engine(model, requests, workload["slots"],
                                           steps_per_call)[0],
              "loop": lambda: run_loop(model, requests),
              "loop-batched": lambda: run_loop_batched(model, requests)}
  tokens, seconds = {}, {}
  for name, call in variants.items():
    call()  # Compiles every program this variant needs.
    for _ in range(repeats):
      started = time.perf_counter()
      tokens[name] = call()
      seconds[name] = min(seconds.get(name, math.inf), time.perf_counter() - started)
  _, first, engine = run_engine(model, requests, workload["slots"], steps_per_call)
  rates = {name: new_tokens / s for name, s in seconds.items()}
  best_loop = max(rates["loop"], rates["loop-batched"])
  page_bytes = _cache_bytes(model, 1, engine.page_size)
  transformers = None
  if torch_python:
    transformers = run_transformers(model, requests, workload["slots"], torch_python)
    for name, s in transformers.pop("seconds").items():
      rates[f"transformers {name}"] = new_tokens / s
    transformers["same_tokens"] = {name: got == tokens["engine"]
                                   for name, got in transformers.pop("tokens").items()}
  return {
      "model": dataclasses.asdict(config) | {"params": _params(model)},
      "requests": len(requests), "new_tokens": new_tokens, "slots": workload["slots"],
      "repeats": repeats,
      "steps_per_call": steps_per_call or Engine.__init__.__kwdefaults__["steps_per_call"],
      "seconds": seconds, "tokens_per_s": rates,
      "same_tokens": tokens["engine"] == tokens["loop"] == tokens["loop-batched"],
      "time_to_first_token_s": {"median": statistics.median(first), "worst": max(first)},
      "prefix": measure_prefix(model, PREFIX["quick" if size == "quick" else "full"]),
      "kv_cache_bytes": {"engine_pool": engine.max_pages * page_bytes,
                         "engine_peak_held": engine.peak_pages * page_bytes,
                         "full_length_per_request": _cache_bytes(model, len(requests),
                                                                 config.max_seq_len),
                         "tokens_held": _cache_bytes(model, 1, sum(
                             len(r.prompt) + r.max_tokens for r in requests))},
      "engine_vs_best_loop": common.target(rates["engine"] / best_loop, TARGET_VS_LOOP,
                                           at_least=True),
  } | ({} if transformers is None else {
      "transformers": transformers,
      "engine_vs_transformers": common.target(
          rates["engine"] / max(v for k, v in rates.items() if k.startswith("transformers")),
          TARGET_VS_TRANSFORMERS, at_least=True)})


def measure_prefix(model: Decoder, work: dict) -> dict[str, Any]:
  """The prefix cache off and on over two bursts of requests sharing a system prompt (see
  the module); each engine compiles first on another system prompt's burst."""
  rng = np.random.default_rng(1)
  draw = lambda n: tuple(int(t) for t in rng.integers(0, model.config.vocab_size, n))  # noqa: E731
  warm_up, system = draw(work["system"]), draw(work["system"])
  bursts = [[Request(prompt + draw(work["question"]), work["output"], temperature=0)
             for _ in range(work["requests"])] for prompt in (warm_up, system, system)]
  record, done = {}, {}
  for name, cache in (("off", False), ("on", True)):
    engine = Engine(model, max_slots=work["slots"], page_size=work["page"],
                    prefill_chunk=work["chunk"], prefix_cache=cache)
    engine.run(bursts[0])
    seconds, done[name], warm_up_tokens = [], [], engine.cached_tokens
    for burst in bursts[1:]:
      started = time.perf_counter()
      done[name] += engine.run(burst)
      seconds.append(time.perf_counter() - started)
    record[name] = {"first_burst_s": seconds[0], "second_burst_s": seconds[1],
                    "cached_tokens": engine.cached_tokens - warm_up_tokens}
  record["same_tokens_and_logprobs"] = all(
      (a.tokens, a.logprobs) == (b.tokens, b.logprobs) for a, b in zip(done["off"], done["on"]))
  return {"workload": work, **record}


def _cache_bytes(model: Decoder, rows: int, length: int) -> int:
  """What `rows` rows of `length` positions hold in the model's paged cache (its layers'
  `cache_spec`s: keys and values here)."""
  per_token, _ = model.page_bytes(1)
  return rows * length * per_token


def _params(model) -> int:
  return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  parser = argparse.ArgumentParser(prog="benchmarks/engine.py",
                                   description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true", help="a smoke test: 5 tiny requests")
  parser.add_argument("--sizes", default="tiny,25m", help="models to measure (default tiny,25m)")
  parser.add_argument("--steps-per-call", type=int,
                      help="the engine's decode steps per compiled call (default: the engine's)")
  parser.add_argument("--repeats", type=int, default=1,
                      help="timed runs of each variant; the fastest counts (default 1)")
  parser.add_argument("--transformers", action="store_true",
                      help="also time transformers' generate on the exported model")
  parser.add_argument("--torch-python", default=sys.executable,
                      help="the interpreter with torch and transformers (default: this one)")
  common.add_out_argument(parser, "engine")
  args = parser.parse_args(argv)
  workload = WORKLOADS["quick" if args.quick else "full"]
  sizes = ["quick"] if args.quick else args.sizes.split(",")
  unknown = set(sizes) - set(SIZES)
  if unknown:
    parser.error(f"--sizes: no size {sorted(unknown)}; choose from {sorted(SIZES)}")
  record = {**common.header("engine"), **common.versions(), "workload": workload,
            "sizes": {}}
  if not args.transformers:
    record["transformers"] = "not measured (--transformers)"
  for size in sizes:
    record["sizes"][size] = measure(size, workload, args.steps_per_call,
                                    args.torch_python if args.transformers else None,
                                    args.repeats)
    result = record["sizes"][size]
    rates, ratio = result["tokens_per_s"], result["engine_vs_best_loop"]["value"]
    verdict = common.verdict(ratio, TARGET_VS_LOOP, at_least=True)
    print(f"{size}: engine {rates['engine']:,.0f} tokens/s, loop {rates['loop']:,.0f}, "
          f"loop-batched {rates['loop-batched']:,.0f}; engine / best loop {ratio:.2f} "
          f"(target >= {TARGET_VS_LOOP}: {verdict}); same tokens: {result['same_tokens']}",
          flush=True)
    if "transformers" in result:
      versus = result["engine_vs_transformers"]["value"]
      measured = ", ".join(f"{name.split(' ', 1)[1]} {rate:,.0f}"
                           for name, rate in rates.items() if name.startswith("transformers"))
      print(f"{size}: transformers {measured} tokens/s; engine / the better {versus:.2f} "
            f"(target >= {TARGET_VS_TRANSFORMERS}: "
            f"{common.verdict(versus, TARGET_VS_TRANSFORMERS, at_least=True)}); same tokens: "
            f"{result['transformers']['same_tokens']}", flush=True)
    prefix = result["prefix"]
    print(f"{size}: a shared system prompt, bursts of {prefix['workload']['requests']}: "
          + "; ".join(f"cache {k} {prefix[k]['first_burst_s']:.2f} s then "
                      f"{prefix[k]['second_burst_s']:.2f} s" for k in ("off", "on"))
          + f" ({prefix['on']['cached_tokens']:,} prompt tokens spared); same tokens and "
          f"log-probs: {prefix['same_tokens_and_logprobs']}", flush=True)
  common.write(record, args.out)
  return record


if __name__ == "__main__":
  main(sys.argv[1:])
  sys.exit(0)
