"""Speculative decoding: prompt lookup proposes the tokens that followed the last match, the
engine's output with speculation is its output without (greedy and seeded sampling, alone and
in a batch, for each kind of cache), the drafts kept are exactly those the output confirms,
and a model that cannot take back a guess is refused."""

from __future__ import annotations

import dataclasses
import functools
import pathlib

import jax

import numpy as np
import pytest
from flax import nnx

from jax_ai_stack.errors import UsageError
from jax_ai_stack.recipes.generate_cli import check_speculation
from jax_ai_stack.recipes.inference import Engine, Request, Speculation
from jax_ai_stack.recipes.inference.speculation import lookup, propose
from jax_ai_stack.recipes.models import hf
from jax_ai_stack.recipes.models.decoder import Decoder, DecoderConfig

REFERENCES = pathlib.Path(__file__).parent / "references" / "hf"
RNG = np.random.default_rng(0)


@pytest.fixture(scope="module")
def tiny():
  return Decoder(DecoderConfig.tiny(), rngs=nnx.Rngs(0))


def _repeating(vocab: int, period: int, times: int) -> tuple[int, ...]:
  """A prompt that repeats itself: what prompt lookup can guess from."""
  return tuple(int(t) for t in RNG.integers(0, vocab, period)) * times


def _requests(vocab: int) -> list[Request]:
  return [Request(_repeating(vocab, 7, 4), 24, temperature=0),
          Request(_repeating(vocab, 3, 6), 17, temperature=1.0, seed=3),
          Request(tuple(int(t) for t in RNG.integers(0, vocab, 30)), 21, temperature=0.7,
                  seed=5, top_k=20, top_p=0.9),
          Request(_repeating(vocab, 5, 3), 9, temperature=0, stop_ids=(3, 7, 11))]


def test_prompt_lookup_proposes_what_followed_the_latest_longest_match():
  context = np.array([5, 6, 7, 8, 1, 6, 7, 9, 2, 6, 7])
  # "6 7" occurs twice before the end; the latest is followed by 9, 2, 6, 7.
  assert propose(context, 3, ngram_max=2).tolist() == [9, 2, 6]
  # "3 8 1" does not occur before the end, "8 1" does: the longest n that occurs.
  assert propose(np.array([4, 8, 1, 3, 3, 8, 1]), 5, ngram_max=3).tolist() == [3, 3, 8, 1]
  assert propose(np.array([1, 2, 3, 2, 9, 1, 2]), 2, ngram_max=2).tolist() == [3, 2]
  assert propose(np.array([1, 2, 3, 2, 9, 1, 2]), 2, ngram_max=1).tolist() == [9, 1]
  assert propose(np.array([1, 2, 3, 4]), 4, ngram_max=3).size == 0  # Nothing repeats.
  assert propose(np.array([1, 2, 3, 1]), 4, ngram_max=3, ngram_min=2).size == 0
  assert propose(np.array([7]), 4, ngram_max=3).size == 0
  assert propose(np.array([1, 2, 1, 2]), 0, ngram_max=2).size == 0


@pytest.mark.parametrize("ngram_max, ngram_min", [(1, 1), (3, 1), (4, 2)])
def test_the_device_s_lookup_proposes_what_numpy_s_does(ngram_max, ngram_min):
  """`lookup` (in the compiled loop) against `propose`, on short texts of a few tokens
  (many matches), in a history padded past them, with rooms from none to more than fit."""
  rng = np.random.default_rng(ngram_max)
  find = jax.jit(functools.partial(lookup, count=5, ngram_max=ngram_max, ngram_min=ngram_min))
  for _ in range(200):
    known, room = int(rng.integers(1, 30)), int(rng.integers(-1, 7))
    history = np.zeros((32,), np.int32)
    history[:known] = rng.integers(0, 4, known)
    drafts, count = find(history, np.int32(known), np.int32(room))
    expected = propose(history[:known], max(min(room, 5), 0), ngram_max=ngram_max,
                       ngram_min=ngram_min)
    assert np.asarray(drafts)[:int(count)].tolist() == expected.tolist(), (history[:known], room)


def test_bad_settings_are_named():
  with pytest.raises(ValueError, match="tokens=0"):
    Speculation(tokens=0)
  with pytest.raises(ValueError, match="ngram_min=3 and ngram_max=2"):
    Speculation(ngram_min=3, ngram_max=2)


@pytest.mark.parametrize("tokens", [1, 4])
def test_the_output_is_the_output_without_speculation(tiny, tokens):
  """Greedy and seeded sampling, top-k and top-p, a stop id, a request admitted mid-way
  (3 slots for 4 requests): the same tokens, log-probs within float32 rounding (a pass over
  1 + tokens positions is another program)."""
  requests = _requests(tiny.config.vocab_size)
  plain = Engine(tiny, max_slots=3).run(requests)
  engine = Engine(tiny, max_slots=3, speculation=Speculation(tokens=tokens))
  guessed = engine.run(requests)
  for a, b in zip(plain, guessed):
    assert b.tokens == a.tokens and b.finish_reason == a.finish_reason
    np.testing.assert_allclose(b.logprobs, a.logprobs, atol=2e-5)
  assert engine.speculator.guesses.tolist() == [sum(c.drafted for c in guessed),
                                     sum(c.accepted for c in guessed)]
  assert engine.speculator.guesses[0] > 0


def _replayed(request: Request, tokens: list[int], speculation: Speculation):
  """The drafts and kept drafts of a request whose output is `tokens`, replayed on the host:
  each call guesses from the text so far and keeps the guesses the output confirms."""
  drafted = accepted = 0
  taken = 1  # The prefill samples the first token.
  while taken < len(tokens):
    room = min(speculation.tokens, request.max_tokens - taken - 1)
    guess = propose(np.asarray(request.prompt + tuple(tokens[:taken])), max(room, 0),
                    ngram_max=speculation.ngram_max, ngram_min=speculation.ngram_min)
    right = 0
    while right < guess.size and taken + right < len(tokens) and (
        guess[right] == tokens[taken + right]):
      right += 1
    drafted, accepted, taken = drafted + guess.size, accepted + right, taken + right + 1
  return drafted, accepted


@pytest.mark.slow
def test_the_kept_drafts_are_exactly_those_the_output_confirms(tiny):
  speculation = Speculation(tokens=3, ngram_max=3)
  requests = [dataclasses.replace(r, stop_ids=()) for r in _requests(tiny.config.vocab_size)]
  engine = Engine(tiny, max_slots=4, speculation=speculation)
  for request, completion in zip(requests, engine.run(requests)):
    expected = _replayed(request, completion.tokens, speculation)
    assert (completion.drafted, completion.accepted) == expected
  assert engine.speculator.guesses[1] > 0  # A repeating greedy output is guessed right.


def test_a_request_gets_the_same_bits_alone_or_in_a_batch(tiny):
  requests = _requests(tiny.config.vocab_size)
  speculation = Speculation(tokens=4)
  batch = Engine(tiny, max_slots=4, speculation=speculation).run(requests)
  alone = Engine(tiny, max_slots=4, speculation=speculation).run(requests[1:2])[0]
  assert alone.tokens == batch[1].tokens and alone.logprobs == batch[1].logprobs


def test_drafts_stop_at_max_tokens_and_the_slot_s_last_position(tiny):
  """A request of 32 positions in a slot of 32: guesses never run past either end."""
  prompt = _repeating(tiny.config.vocab_size, 4, 5)
  request = Request(prompt, 12, temperature=0)
  plain = Engine(tiny, max_slots=2, max_len=32).run([request])[0]
  guessed = Engine(tiny, max_slots=2, max_len=32, page_size=8,
                   speculation=Speculation(tokens=8)).run([request])[0]
  assert guessed.tokens == plain.tokens and len(guessed.tokens) == 12


@pytest.mark.slow
def test_a_draft_model_s_guesses_keep_the_output(tiny):
  """Another model of the vocabulary drafts: the same tokens as without, greedy and sampled;
  the model as its own draft: every greedy guess kept, which holds only if the draft's pages
  hold each token it guessed from, through shared prompts (a group of one prompt) and kept
  prefix chunks (prompts that begin alike) as well as its own prefills."""
  other = Decoder(dataclasses.replace(DecoderConfig.tiny(), num_layers=1), rngs=nnx.Rngs(7))
  requests = _requests(tiny.config.vocab_size)
  plain = Engine(tiny, max_slots=3).run(requests)
  engine = Engine(tiny, max_slots=3, speculation=Speculation(tokens=3, draft=other))
  assert [c.tokens for c in engine.run(requests)] == [c.tokens for c in plain]
  prefix = tuple(int(t) for t in RNG.integers(0, tiny.config.vocab_size, 40))
  greedy = [Request(prefix + (5, 6), 12, temperature=0)] * 3 + [
      Request(prefix + (9,), 12, temperature=0), Request(prefix[:20], 12, temperature=0)]
  options = dict(max_slots=2, page_size=8, prefill_chunk=16)
  plain = Engine(tiny, **options).run(greedy)
  engine = Engine(tiny, **options, speculation=Speculation(tokens=4, draft=tiny))
  guessed = engine.run(greedy)
  assert [c.tokens for c in guessed] == [c.tokens for c in plain]
  assert engine.shared_prompts > 0 and engine.prefix_hits > 0
  made, kept = engine.speculator.guesses
  assert kept == made > 0, (made, kept)  # Every guess kept.
  with pytest.raises(ValueError, match="draft model's vocab_size=300 is not the model's"):
    Engine(tiny, speculation=Speculation(draft=Decoder(
        dataclasses.replace(DecoderConfig.tiny(), vocab_size=300), rngs=nnx.Rngs(0))))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gemma2", "deepseek_v3-moe", "gpt_oss", "llama4", "mixtral"])
def test_each_kind_of_attention_speculates_to_its_greedy_tokens(name):
  """Sliding windows, latent attention's pages of latents, sinks, chunked attention, MoE."""
  model = hf.load_model(REFERENCES / name)
  requests = [Request(_repeating(model.config.vocab_size, 5, 3), 10, temperature=0),
              Request(_repeating(model.config.vocab_size, 3, 4), 8, temperature=0)]
  plain = Engine(model, max_slots=2).run(requests)
  guessed = Engine(model, max_slots=2, speculation=Speculation(tokens=3)).run(requests)
  assert [c.tokens for c in guessed] == [c.tokens for c in plain]


@pytest.mark.slow
def test_a_model_with_per_request_state_is_refused():
  model = hf.load_model(REFERENCES / "qwen3_next")
  with pytest.raises(ValueError, match="speculation needs models whose cache is pages alone"):
    Engine(model, max_slots=2, speculation=Speculation())
  with pytest.raises(ValueError, match="speculation needs models whose cache is pages alone"):
    Engine(Decoder(dataclasses.replace(DecoderConfig.tiny(), vocab_size=model.config.vocab_size),
                   rngs=nnx.Rngs(0)), max_slots=2, speculation=Speculation(draft=model))
  with pytest.raises(UsageError, match="--speculate: model.kind='qwen3_next' has linear"):
    check_speculation(model.config, "--speculate")
  check_speculation(DecoderConfig.tiny(), "--speculate")  # Pages alone: no error.
