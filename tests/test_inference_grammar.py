"""Structured output: every completion follows its grammar (a JSON schema, a choice, a regex)
over each kind of tokenizer, a request without one is untouched beside it, and a grammar
that does not compile or an engine without the vocabulary is named."""

from __future__ import annotations

import dataclasses
import json
import re

import jsonschema
import numpy as np
import pytest
from flax import nnx

from data_helpers import hf_tokenizer_file, sentencepiece_file

from jax_ai_stack.recipes.data.tokenizers import (ByteTokenizer, HuggingFaceTokenizer,
                                                  SentencePieceTokenizer)
from jax_ai_stack.recipes.inference import Engine, Request, RequestError, grammar
from jax_ai_stack.recipes.models.decoder import Decoder, DecoderConfig

pytest.importorskip("llguidance")

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "size", "tag"],
          "properties": {"ok": {"type": "boolean"}, "size": {"enum": [1, 20, 300]},
                         "tag": {"type": "string", "pattern": "^[a-c]{1,3}$"}}}


@pytest.fixture(scope="module")
def tiny():
  return Decoder(DecoderConfig.tiny(), rngs=nnx.Rngs(0))


def _random_walk(tokenizer, rule: str, rng: np.random.Generator) -> str:
  """A text drawn uniformly among the tokens `rule` allows at each step, to its end."""
  matcher, ids = grammar.Matcher(grammar.vocabulary(tokenizer), rule), []
  ends = set(tokenizer.end_of_turn_ids())
  for _ in range(200):
    bits = grammar.masks([matcher], tokenizer.vocab_size)[0]
    allowed = [t for t in range(tokenizer.vocab_size) if bits[t // 32] >> (t % 32) & 1]
    ids.append(int(rng.choice(allowed)))
    if ids[-1] in ends:
      return tokenizer.decode(ids)
    assert matcher.take(ids[-1])
  raise AssertionError(f"no end after 200 tokens: {tokenizer.decode(ids)!r}")


@pytest.mark.parametrize("kind", ["byte", "huggingface", "sentencepiece"])
def test_each_tokenizer_s_vocabulary_spells_only_what_the_grammar_allows(kind, tmp_path):
  tokenizer = {"byte": ByteTokenizer,
               "huggingface": lambda: HuggingFaceTokenizer(hf_tokenizer_file(tmp_path)),
               "sentencepiece": lambda: SentencePieceTokenizer(sentencepiece_file(tmp_path)),
               }[kind]()
  options = ["hello world", "the brown dog", "the quick fox"]  # (No "z": SentencePiece's 30.)
  rng = np.random.default_rng(0)
  texts = [_random_walk(tokenizer, grammar.choice(options), rng) for _ in range(16)]
  assert set(texts) == set(options)
  pattern = re.compile("[b-e]{2,4},")
  assert all(pattern.fullmatch(_random_walk(tokenizer, grammar.regex(pattern.pattern), rng))
             for _ in range(4))


def test_sampled_completions_validate_under_their_json_schema(tiny):
  """A random model at temperature 1: every completion is JSON its schema accepts, and ends
  with the end token once the object is closed."""
  tokenizer = ByteTokenizer()
  engine = Engine(tiny, max_slots=4, decode=tokenizer.decode,
                  grammar_vocabulary=grammar.vocabulary(tokenizer))
  rule = grammar.json_schema(SCHEMA)
  done = engine.run([Request((256, 123), max_tokens=60, seed=seed, grammar=rule,
                             stop_ids=(tokenizer.eos_id,)) for seed in range(12)])
  values = [json.loads(c.text) for c in done]
  for value in values:
    jsonschema.validate(value, SCHEMA)
  assert all(c.finish_reason == "stop" and c.tokens[-1] == tokenizer.eos_id for c in done)
  assert len({json.dumps(v) for v in values}) > 1  # Sampled, not one forced string.
  assert all(c.text == json.dumps(json.loads(c.text), separators=(",", ":")) for c in done)


def test_a_request_without_a_grammar_is_untouched_beside_one(tiny):
  """The free request's tokens and log-probs equal its run alone (4 tokens a call), though
  the grammar's neighbour makes the engine decode one token a call."""
  tokenizer = ByteTokenizer()
  make = lambda: Engine(tiny, max_slots=2, decode=tokenizer.decode,  # noqa: E731
                        grammar_vocabulary=grammar.vocabulary(tokenizer))
  free = Request((256, 104, 105), max_tokens=12, seed=3)
  alone = make().run([free])[0]
  ruled, beside = make().run([Request((256, 120), max_tokens=8, seed=1,
                                      grammar=grammar.regex("[xyz]{8}")), free])
  assert (beside.tokens, beside.logprobs) == (alone.tokens, alone.logprobs)
  assert set(ruled.text) <= set("xyz") and len(ruled.text) == 8


def test_a_grammar_that_does_not_compile_or_an_engine_without_the_vocabulary_is_named(tiny):
  tokenizer = ByteTokenizer()
  engine = Engine(tiny, max_slots=1, grammar_vocabulary=grammar.vocabulary(tokenizer))
  bad = grammar.json_schema({"type": "string", "format": "no-such-format"})
  with pytest.raises(RequestError, match="grammar does not compile: .*no-such-format") as e:
    engine.check(Request((1,), max_tokens=2, grammar=bad))
  assert e.value.field == "grammar"
  with pytest.raises(RequestError, match="give the engine `grammar_vocabulary`"):
    Engine(tiny, max_slots=1).check(Request((1,), max_tokens=2, grammar=grammar.json_object()))
  with pytest.raises(ValueError, match="more than the model's vocab_size"):
    Engine(Decoder(dataclasses.replace(DecoderConfig.tiny(), vocab_size=200), rngs=nnx.Rngs(0)),
           grammar_vocabulary=grammar.vocabulary(tokenizer))
