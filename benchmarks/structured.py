"""Structured output's cost per token: the same sampled requests with a JSON schema and free.

A byte-level BPE tokenizer of 8,000 tokens (trained here on the standard library's source)
and a random Decoder of each size with that vocabulary; 16 requests of 32-token prompts at
temperature 1, seeds 0-15, each with the same JSON schema (a string, an integer, an enum, a
boolean and a list of up to three strings), or without it and as many tokens as its
structured run made:

  free           the engine as it decodes by default (`steps_per_call` tokens a call)
  free-1         one token a call, as the engine decodes while a grammar runs
  structured     the schema's grammar (llguidance): each token's mask computed on the host

Each variant runs once to compile, then all are timed in rounds (`--repeats` N: each one's
fastest of N). Reports
seconds per generated token of each, structured against free (target <= 1.2x) and against
free-1 (the masks' own cost), the host's mask time per token, and whether every structured
output validates under the schema.

    python benchmarks/structured.py             # tiny and 25M
    python benchmarks/structured.py --quick     # smoke test
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import jsonschema
import numpy as np
from flax import nnx

import common
from engine import SIZES
from jax_ai_stack.recipes.data.tokenizers import HuggingFaceTokenizer
from jax_ai_stack.recipes.inference import Engine, Request, grammar
from jax_ai_stack.recipes.models.decoder import Decoder

TARGET = 1.2
"""Structured output's seconds per token at most this many times free decoding's."""
SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "age", "kind", "ok", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "kind": {"enum": ["cat", "dog", "bird"]}, "ok": {"type": "boolean"},
                         "tags": {"type": "array", "maxItems": 3,
                                  "items": {"type": "string", "maxLength": 8}}}}
WORK = {"full": dict(vocab=8000, requests=16, prompt=32, output=96, slots=16),
        "quick": dict(vocab=400, requests=3, prompt=4, output=60, slots=2)}


def bpe_tokenizer(folder: pathlib.Path, vocab: int) -> HuggingFaceTokenizer:
  """A byte-level BPE of `vocab` tokens trained on the standard library's source."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  tokenizer.train_from_iterator(
      [f.read_text(errors="replace") for f in sorted(pathlib.Path(json.__file__).parent.parent
                                                     .glob("*.py"))[:80]],
      trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                          show_progress=False,
                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  tokenizer.save(str(folder / "tokenizer.json"))
  return HuggingFaceTokenizer(str(folder / "tokenizer.json"))


class _TimedMasks:
  """`grammar.masks` with its seconds summed (the host's share of structured decoding)."""

  def __init__(self):
    self.seconds, self.masks = 0.0, grammar.masks

  def __call__(self, *args):
    started = time.perf_counter()
    try:
      return self.masks(*args)
    finally:
      self.seconds += time.perf_counter() - started


def measure(size: str, work: dict, tokenizer, repeats: int) -> dict[str, Any]:
  config = dataclasses.replace(SIZES[size], vocab_size=tokenizer.vocab_size)
  model = Decoder(config, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(0)
  prompts = [tuple(int(t) for t in rng.integers(1, tokenizer.vocab_size, work["prompt"]))
             for _ in range(work["requests"])]
  rule, vocab = grammar.json_schema(SCHEMA), grammar.vocabulary(tokenizer)
  ends = tuple(tokenizer.end_of_turn_ids())
  structured = [Request(p, work["output"], seed=seed, stop_ids=ends, grammar=rule)
                for seed, p in enumerate(prompts)]
  engine = lambda **options: Engine(model, max_slots=work["slots"], grammar_vocabulary=vocab,  # noqa: E731
                                    decode=tokenizer.decode, **options)
  lengths = [len(c.tokens) for c in engine().run(structured)]  # (And compiles its programs.)
  # Free: as many tokens per request as its structured run made (no end token).
  free = [dataclasses.replace(r, grammar=None, stop_ids=(), max_tokens=n)
          for r, n in zip(structured, lengths)]
  variants = {"structured": (structured, {}), "free": (free, {}),
              "free-1": (free, {"steps_per_call": 1})}
  for requests, options in variants.values():
    engine(**options).run(requests)  # Compiles its programs.
  seconds, mask_s, done = {}, {}, {}
  timed = _TimedMasks()
  for _ in range(repeats):  # Rounds of every variant: the machine's drift reaches them alike.
    for name, (requests, options) in variants.items():
      timed.seconds, grammar.masks = 0.0, timed  # (The engine's slots call grammar.masks.)
      started = time.perf_counter()
      try:
        done[name] = engine(**options).run(requests)
      finally:
        grammar.masks = timed.masks
      elapsed = time.perf_counter() - started
      if elapsed < seconds.get(name, float("inf")):
        seconds[name], mask_s[name] = elapsed, timed.seconds
  tokens = {name: sum(len(c.tokens) for c in done[name]) for name in variants}
  masked_s = mask_s["structured"]
  per_token = {name: seconds[name] / tokens[name] for name in variants}
  valid = 0
  for completion in done["structured"]:
    try:
      jsonschema.validate(json.loads(completion.text), SCHEMA)
      valid += 1
    except (ValueError, jsonschema.ValidationError):
      pass
  return {"model": dataclasses.asdict(config), "seconds": seconds, "new_tokens": tokens,
          "seconds_per_token": per_token,
          "mask_seconds_per_token": masked_s / tokens["structured"],
          "valid_outputs": f"{valid}/{len(structured)}",
          "structured_vs_free": common.target(per_token["structured"] / per_token["free"],
                                              TARGET),
          "structured_vs_free_one_per_call": per_token["structured"] / per_token["free-1"]}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  parser = argparse.ArgumentParser(prog="benchmarks/structured.py",
                                   description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true", help="a smoke test: 3 tiny requests")
  parser.add_argument("--sizes", default="tiny,25m", help="models to measure (default tiny,25m)")
  parser.add_argument("--repeats", type=common.positive_int, default=1,
                      help="timed runs of each variant; the fastest counts (default 1)")
  common.add_out_argument(parser, "structured")
  args = parser.parse_args(argv)
  work = WORK["quick" if args.quick else "full"]
  sizes = ["quick"] if args.quick else args.sizes.split(",")
  unknown = set(sizes) - set(SIZES)
  if unknown:
    parser.error(f"--sizes: no size {sorted(unknown)}; choose from {sorted(SIZES)}")
  record = {**common.header("structured"), **common.versions(), "workload": work,
            "schema": SCHEMA, "sizes": {}}
  with tempfile.TemporaryDirectory() as folder:
    tokenizer = bpe_tokenizer(pathlib.Path(folder), work["vocab"])
    for size in sizes:
      result = record["sizes"][size] = measure(size, work, tokenizer, args.repeats)
      ms = {k: 1000 * v for k, v in result["seconds_per_token"].items()}
      ratio = result["structured_vs_free"]["value"]
      masks = 1000 * result["mask_seconds_per_token"]
      print(f"{size}: ms per token free {ms['free']:.2f}, free one a call {ms['free-1']:.2f}, "
            f"structured {ms['structured']:.2f} (masks {masks:.3f}); structured / free "
            f"{ratio:.2f} (target <= {TARGET}: "
            f"{common.verdict(ratio, TARGET)}); valid {result['valid_outputs']}", flush=True)
  common.write(record, args.out)
  return record


if __name__ == "__main__":
  main(sys.argv[1:])
  sys.exit(0)
