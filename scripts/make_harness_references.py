"""Writes lm-evaluation-harness's own scores (its `hf` backend on transformers) that
tests/test_harness_references.py compares the project's adapter with.

For each decoder family's tiny model in tests/references/hf/ (make_hf_references.py), the
harness's `HFLM` scores fixed multiple-choice shaped requests at the token level
(`_loglikelihood_tokens`: a context, four continuations each, the first the model's own
greedy continuation; two contexts longer than the model's window, which the harness cuts
from the left):

  tests/references/harness/<name>.json   requests (context ids, continuation ids) and
                                         per request the log-likelihood and is-greedy flag

and its `generate_until` (greedy, `until` strings, `max_gen_toks`, contexts cut from the
left to leave room) on text contexts of a stand-in tokenizer, one word per id ("t7 t42"):

  tests/references/harness/<name>-generate_until.json   contexts, settings and the strings

Token level for the scores, so no tokenizer is compared (the stand-in gives the harness its
EOS); the generations go through the stand-in on both sides, where stop strings act. Needs torch, transformers and lm-eval, which CI does not install: CI
compares against the committed files. Run it again after changing the requests here:

  /tmp/refenv/bin/pip install torch==2.13.0 transformers==5.24.0 lm-eval==0.4.13 accelerate
  /tmp/refenv/bin/python scripts/make_harness_references.py

Written with lm-eval 0.4.13, transformers 5.24.0 and torch 2.13.0 (CPU).
"""

from __future__ import annotations

import json
import pathlib

import lm_eval
import numpy as np
import tokenizers
import torch
import transformers
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM

ROOT = pathlib.Path(__file__).resolve().parent.parent
MODELS = ROOT / "tests" / "references" / "hf"
OUT = ROOT / "tests" / "references" / "harness"
FAMILIES = ["qwen2", "qwen3", "mistral", "gemma2", "gemma3", "mixtral", "qwen3_moe"]
QUESTIONS, CHOICES = 6, 4
LONG_CONTEXT = 80
"""Longer than every reference model's 64 positions: the harness keeps the last ones."""
GENERATIONS = 6


def requests(model, seed: int = 0) -> list[tuple[list[int], list[int]]]:
  """(context ids, continuation ids): `CHOICES` continuations of each of `QUESTIONS`
  contexts, the first of them the model's own greedy continuation (is_greedy true) where the
  context fits; the last two contexts longer than the window."""
  vocab = model.config.vocab_size
  rng = np.random.default_rng(seed)
  out = []
  for question in range(QUESTIONS):
    long = question >= QUESTIONS - 2
    context = rng.integers(1, vocab, LONG_CONTEXT if long else int(rng.integers(3, 30)))
    for choice in range(CHOICES):
      size = int(rng.integers(1, 6))
      if choice == 0 and not long:
        with torch.no_grad():
          greedy = model.generate(torch.tensor([context]), max_new_tokens=size, do_sample=False,
                                  pad_token_id=0)
        continuation = greedy[0, len(context):].tolist()
      else:
        continuation = rng.integers(1, vocab, size).tolist()
      out.append((context.tolist(), continuation))
  return out


def stand_in_tokenizer(vocab: int) -> transformers.PreTrainedTokenizerFast:
  """A word-level tokenizer over the model's ids ("t0" ... ), whose EOS is the last id."""
  words = {f"t{i}": i for i in range(vocab)}
  tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token="t0"))
  tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
  return transformers.PreTrainedTokenizerFast(
      tokenizer_object=tokenizer, eos_token=f"t{vocab - 1}", unk_token="t0", pad_token="t0")


def generations(harness: HFLM, vocab: int, seed: int = 1) -> list[dict]:
  """`GENERATIONS` greedy `generate_until` requests and the harness's strings: contexts of
  3-30 words (the last one longer than the window), `max_gen_toks` 3-12, and `until` one
  word of the request's own greedy continuation for every other request (so the stop acts)
  or, for the rest, "t0", the stand-in's padding token, which decoding leaves out (so
  `max_gen_toks` or EOS ends it)."""
  rng = np.random.default_rng(seed)
  asked = []
  for number in range(GENERATIONS):
    size = LONG_CONTEXT if number == GENERATIONS - 1 else int(rng.integers(3, 30))
    context = " ".join(f"t{t}" for t in rng.integers(1, vocab - 1, size))
    settings = {"until": ["t0"], "max_gen_toks": int(rng.integers(3, 12)), "do_sample": False}
    if number % 2 == 0:
      free = harness.generate_until([_instance(context, settings)], disable_tqdm=True)[0]
      if len(free.split()) > 2:
        settings["until"] = [free.split()[2]]  # Its third word ends it there.
    asked.append({"context": context, "settings": settings})
  strings = harness.generate_until([_instance(r["context"], dict(r["settings"])) for r in asked],
                                   disable_tqdm=True)
  return [{**request, "string": string} for request, string in zip(asked, strings)]


def _instance(context: str, settings: dict) -> Instance:
  return Instance(request_type="generate_until", doc={}, arguments=(context, dict(settings)),
                  idx=0)


def main() -> None:
  OUT.mkdir(parents=True, exist_ok=True)
  for name in FAMILIES:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        MODELS / name, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    harness = HFLM(pretrained=model, tokenizer=stand_in_tokenizer(vocab), batch_size=4)
    asked = requests(model)
    scores = harness._loglikelihood_tokens(
        [(("", ""), context, continuation) for context, continuation in asked],
        disable_tqdm=True)
    record = {"family": name, "max_length": harness.max_length,
              "versions": {"lm_eval": lm_eval.__version__,
                           "transformers": transformers.__version__,
                           "torch": torch.__version__},
              "requests": [{"context": c, "continuation": t, "loglikelihood": float(logp),
                            "is_greedy": bool(greedy)}
                           for (c, t), (logp, greedy) in zip(asked, scores)]}
    (OUT / f"{name}.json").write_text(json.dumps(record) + "\n")
    generated = {"family": name, "max_length": harness.max_length,
                 "versions": record["versions"], "requests": generations(harness, vocab)}
    (OUT / f"{name}-generate_until.json").write_text(json.dumps(generated) + "\n")
    print(f"{name}: {len(asked)} requests, max_length {harness.max_length}; "
          f"{len(generated['requests'])} generations")


if __name__ == "__main__":
  main()
