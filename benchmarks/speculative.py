"""Speculative decoding on text that repeats its prompt (prompt lookup, a draft model) against
plain decoding.

The workload is an edit: each prompt is a random text of `span` tokens and a separator, and
the answer is the same text with a few tokens changed (one in `edit_every`). A Decoder of
engine.py's size (its vocabulary cut to `vocab`) is first taught that task here (Adam,
`train_steps` steps; its copy accuracy on held-out texts is reported), as a model that edits
code learns to copy what it does not change. Then 16 held-out prompts, greedy:

  plain          the engine as it decodes by default (`steps_per_call` tokens a call)
  lookup-K       `Speculation(tokens=K)`: up to K tokens guessed a step by prompt lookup
  draft-K        `Speculation(tokens=K, draft=...)`: a small Decoder taught the same task
                 guesses (2 layers, d_model 32)

Each variant runs once to compile, then all are timed in rounds (`--repeats` N: each one's
fastest of N). Reports the decoding tokens/s of each (after the last prompt's first token:
the part speculation changes; the prompts' prefills, the same in each, are reported beside),
the best guesser's against plain (target >= 1.5x), the share of guesses kept, and whether
every variant's tokens equal plain's (they must).

    python benchmarks/speculative.py            # tiny and 25M
    python benchmarks/speculative.py --quick    # smoke test
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import optax
from flax import nnx

import common
from engine import SIZES
from jax_ai_stack.recipes.inference import Engine, Request, Speculation
from jax_ai_stack.recipes.models.decoder import Decoder, DecoderConfig
from jax_ai_stack.recipes.step import make_steps

TARGET = 1.5
"""The best guesser's tokens/s at least this many times plain decoding's."""
DRAFT = DecoderConfig(num_layers=2, d_model=32, num_heads=2, num_kv_heads=1, mlp_dim=64,
                      max_seq_len=1024)
"""The draft model: two layers (copying takes two: an induction head)."""
DRAFT_TRAINING = dict(train_steps=800, batch=32, learning_rate=3e-3)
"""The draft's training at every size but quick (the tiny model's: it is as cheap)."""
WORK = {"tiny": dict(vocab=512, span=96, edit_every=12, train_steps=800, batch=32,
                     learning_rate=3e-3, requests=16, slots=16, lookups=(4, 8)),
        "25m": dict(vocab=512, span=32, edit_every=12, train_steps=400, batch=8,
                    learning_rate=1e-3, requests=16, slots=16, lookups=(4, 8)),
        "quick": dict(vocab=64, span=12, edit_every=6, train_steps=20, batch=4,
                      learning_rate=3e-3, requests=3, slots=2, lookups=(2,))}
"""Per size: the task (`span` tokens, one in `edit_every` changed), its training and the
requests; the 25M model trains on shorter texts (about 1 s a step on 2 cores)."""


def edits(rng: np.random.Generator, work: dict, rows: int) -> tuple[np.ndarray, np.ndarray]:
  """`rows` texts with their edits: [rows, 2 * span + 1] tokens (text, separator 0, edited
  text) and the mask of the edited half, which the loss reads."""
  span, vocab = work["span"], work["vocab"]
  text = rng.integers(1, vocab, (rows, span))
  edited = np.where(rng.random((rows, span)) < 1 / work["edit_every"],
                    rng.integers(1, vocab, (rows, span)), text)
  tokens = np.concatenate([text, np.zeros((rows, 1), text.dtype), edited], axis=1)
  mask = np.zeros(tokens.shape, np.float32)
  mask[:, span + 1:] = 1.0
  return tokens.astype(np.int32), mask


def taught_to_copy(config, work: dict) -> tuple[Decoder, float]:
  """A Decoder of `config` trained on `edits`; (it, its greedy copy accuracy on held-out
  texts: the share of unchanged tokens it predicts)."""
  model = Decoder(config, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.adam(work["learning_rate"]), wrt=nnx.Param)

  def loss_fn(model, batch):
    logits = model(batch["tokens"][:, :-1])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:])
    mask = batch["mask"][:, 1:]
    return (losses * mask).sum() / mask.sum(), {}

  train_step, _, state = make_steps(model, optimizer, loss_fn)
  rng = np.random.default_rng(0)
  for _ in range(work["train_steps"]):
    tokens, mask = edits(rng, work, work["batch"])
    state, _ = train_step(state, {"tokens": tokens, "mask": mask})
  nnx.update(model, state[0])
  tokens, mask = edits(np.random.default_rng(1), work, 64)
  predicted = np.asarray(model(tokens[:, :-1]).argmax(-1))
  copied = mask[:, 1:].astype(bool) & (tokens[:, 1:] == np.roll(tokens, work["span"] + 1,
                                                                axis=1)[:, 1:])
  return model, float((predicted == tokens[:, 1:])[copied].mean())


def measure(size: str, work: dict, repeats: int) -> dict[str, Any]:
  config = dataclasses.replace(SIZES[size], vocab_size=work["vocab"])
  drafting = {} if size == "quick" else DRAFT_TRAINING
  started = time.perf_counter()
  model, accuracy = taught_to_copy(config, work)
  draft, draft_accuracy = taught_to_copy(dataclasses.replace(DRAFT, vocab_size=work["vocab"]),
                                         {**work, **drafting})
  train_s = time.perf_counter() - started
  tokens, _ = edits(np.random.default_rng(2), work, work["requests"])
  span = work["span"]
  requests = [Request(tuple(int(t) for t in row[:span + 1]), span, temperature=0)
              for row in tokens]
  variants = {"plain": None, **{f"lookup-{k}": Speculation(tokens=k) for k in work["lookups"]},
              **{f"draft-{k}": Speculation(tokens=k, draft=draft) for k in work["lookups"]}}
  engine = lambda speculation: Engine(model, max_slots=work["slots"],  # noqa: E731
                                      speculation=speculation)
  for speculation in variants.values():
    engine(speculation).run(requests)  # Compiles its programs.
  seconds, decoding, done, kept = {}, {}, {}, {}
  for _ in range(repeats):  # Rounds of every variant: the machine's drift reaches them alike.
    for name, speculation in variants.items():
      decoder = engine(speculation)
      began = time.perf_counter()
      result = decoder.run(requests)
      elapsed = time.perf_counter() - began
      if elapsed < seconds.get(name, float("inf")):
        # Decoding: after the last prompt's first token (every prompt is in by then).
        seconds[name], done[name] = elapsed, result
        decoding[name] = elapsed - max(c.first_token_s for c in result)
      if decoder.speculator:
        made, right = decoder.speculator.guesses
        kept[name] = float(right / max(made, 1))
  new_tokens = sum(len(c.tokens) for c in done["plain"])
  rate = {name: new_tokens / s for name, s in seconds.items()}
  decode_rate = {name: (new_tokens - len(requests)) / s for name, s in decoding.items()}
  best = max((name for name in variants if name != "plain"), key=decode_rate.get)
  same = {name: [c.tokens for c in done[name]] == [c.tokens for c in done["plain"]]
          for name in variants}
  return {"model": dataclasses.asdict(config), "train_seconds": train_s,
          "copy_accuracy": accuracy, "draft_copy_accuracy": draft_accuracy,
          "new_tokens": new_tokens, "seconds": seconds, "decoding_seconds": decoding,
          "tokens_per_second": rate, "decode_tokens_per_second": decode_rate,
          "acceptance": kept, "same_tokens_as_plain": same,
          "best": best,
          "best_vs_plain": common.target(decode_rate[best] / decode_rate["plain"], TARGET,
                                         at_least=True),
          "best_vs_plain_with_prefill": rate[best] / rate["plain"]}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  parser = argparse.ArgumentParser(prog="benchmarks/speculative.py",
                                   description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true", help="a smoke test: 3 tiny requests")
  parser.add_argument("--sizes", default="tiny,25m",
                      help="models to measure (default tiny,25m; 25m trains for minutes)")
  parser.add_argument("--repeats", type=common.positive_int, default=3,
                      help="timed runs of each variant; the fastest counts (default 3)")
  common.add_out_argument(parser, "speculative")
  args = parser.parse_args(argv)
  sizes = ["quick"] if args.quick else args.sizes.split(",")
  unknown = set(sizes) - set(WORK)
  if unknown:
    parser.error(f"--sizes: no size {sorted(unknown)}; choose from {sorted(WORK)}")
  record = {**common.header("speculative"), **common.versions(), "sizes": {}}
  for size in sizes:
    work = WORK[size]
    result = record["sizes"][size] = {"workload": work, **measure(size, work, args.repeats)}
    rates = ", ".join(f"{name} {rate:.0f}"
                      for name, rate in result["decode_tokens_per_second"].items())
    kept = ", ".join(f"{name} {share:.0%}" for name, share in result["acceptance"].items())
    ratio = result["best_vs_plain"]["value"]
    print(f"{size}: copy accuracy {result['copy_accuracy']:.0%} (draft "
          f"{result['draft_copy_accuracy']:.0%}) after {work['train_steps']} steps; decoding "
          f"tokens/s {rates}; guesses kept {kept}; "
          f"{result['best']} / plain {ratio:.2f} (target >= {TARGET}: "
          f"{common.verdict(ratio, TARGET, at_least=True)}; with the prefills "
          f"{result['best_vs_plain_with_prefill']:.2f}); same tokens as plain: "
          f"{all(result['same_tokens_as_plain'].values())}", flush=True)
  common.write(record, args.out)
  return record


if __name__ == "__main__":
  main(sys.argv[1:])
  sys.exit(0)
