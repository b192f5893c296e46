"""The engine's compiled programs: the sizes they are compiled for pad little and stay few,
engines of one model share them, and a row's sampled token depends on its own seed and
count alone."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_ai_stack.recipes.inference import Engine, programs
from jax_ai_stack.recipes.models.decoder import Decoder, DecoderConfig


def test_half_octave_pads_at_most_a_third_with_two_sizes_an_octave():
  sizes = [programs.half_octave(n) for n in range(1, 1025)]
  assert all(n <= size and 2 * size <= 3 * n for n, size in enumerate(sizes, 1))
  assert sizes == sorted(sizes)
  assert sorted(set(sizes)) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256,
                                384, 512, 768, 1024]


@pytest.mark.parametrize("size, limit, padded", [
    (1, 256, programs.MIN_PADDED), (16, 256, 16), (17, 256, 32), (200, 256, 256),
    (300, 256, 256), (5, 8, 8)])
def test_a_chunk_is_padded_to_a_power_of_two_within_the_limit(size, limit, padded):
  assert programs.padded_length(size, limit) == padded


def test_engines_of_one_model_share_their_compiled_programs():
  model = Decoder(DecoderConfig.tiny(), rngs=nnx.Rngs(0))
  # pylint: disable=protected-access
  first, second = Engine(model, max_slots=2), Engine(model, max_slots=4)
  assert first._steps is second._steps and first._prefill is second._prefill
  assert Engine(model, steps_per_call=2)._steps is not first._steps


def test_a_row_s_token_depends_on_its_seed_and_count_alone():
  """Rows 0 and 2 share (seed, count): the same token, whatever the other rows; greedy rows
  take the argmax."""
  logits = jnp.asarray(np.random.default_rng(0).normal(size=(4, 50)), jnp.float32)
  logits = logits.at[2].set(logits[0])
  seeds = np.asarray([7, 8, 7, 9], np.uint32)
  counts = np.asarray([3, 3, 3, 0], np.int32)
  temperature = np.asarray([1.0, 1.0, 1.0, 0.0], np.float32)
  none_k, all_p = np.zeros(4, np.int32), np.ones(4, np.float32)
  tokens, logps, top, _ = programs.sample_rows(logits, seeds, counts, temperature, none_k,
                                               all_p, None, None, None, 2)
  assert tokens[0] == tokens[2] and logps[0] == logps[2]
  assert tokens[3] == int(jnp.argmax(logits[3])) == top[3, 0]
  again = programs.sample_rows(logits[:1], seeds[:1], counts[:1], temperature[:1],
                               none_k[:1], all_p[:1], None, None, None, 2)[0]
  assert again[0] == tokens[0]
  later = [programs.sample_rows(logits[:1], seeds[:1], np.asarray([c], np.int32),
                                temperature[:1], none_k[:1], all_p[:1], None, None, None, 2)[0][0]
           for c in range(20)]
  assert len(set(int(t) for t in later)) > 1  # Each count its own key.


def test_a_logit_bias_moves_the_choice_not_the_log_probability_and_only_its_own_row():
  """Row 0 bans its likeliest token (-100) and row 1 forces token 7 (+100), greedy; row 2,
  unbiased, gives what it gives in a batch without bias; log-probs are the model's."""
  logits = jnp.asarray(np.random.default_rng(1).normal(size=(3, 50)), jnp.float32)
  best = int(jnp.argmax(logits[0]))
  ids = np.zeros((3, 4), np.int32)
  values = np.zeros((3, 4), np.float32)
  ids[0, 0], values[0, 0] = best, -100.0
  ids[1, :2], values[1, :2] = (7, 9), (100.0, -3.0)
  rows = (np.arange(3, dtype=np.uint32), np.zeros(3, np.int32), np.zeros(3, np.float32),
          np.zeros(3, np.int32), np.ones(3, np.float32))
  tokens, logps, top, _ = programs.sample_rows(logits, *rows, ids, values, None, 2)
  plain, plain_logps, plain_top, _ = programs.sample_rows(logits, *rows, None, None, None, 2)
  assert int(tokens[0]) != best and int(tokens[0]) == int(jnp.argsort(logits[0])[-2])
  assert int(tokens[1]) == 7 and tokens[2] == plain[2] and logps[2] == plain_logps[2]
  raw = jax.nn.log_softmax(logits, axis=-1)
  assert float(logps[1]) == float(raw[1, 7])  # The model's, not the biased one.
  np.testing.assert_array_equal(top, plain_top)  # Alternatives: the model's too.


def test_a_token_mask_limits_the_choice_to_its_row_s_allowed_tokens():
  """Row 0 may take tokens 3 and 40 only (sampled at temperature 1, 30 keys); row 1's mask
  allows everything: the tokens and log-probs of a batch without a mask. Log-probs stay the
  model's."""
  logits = jnp.asarray(np.random.default_rng(2).normal(size=(2, 50)), jnp.float32)
  logits = logits.at[0, 3].set(logits[0, 40])  # Even odds between the two.
  allowed = np.full((2, 2), -1, np.int32)  # 50 tokens: two words of bits.
  allowed[0] = 0
  allowed[0, 0] |= 1 << 3
  allowed[0, 1] |= 1 << (40 - 32)
  plain_rows = lambda count: (np.arange(2, dtype=np.uint32), np.full(2, count, np.int32),
                              np.ones(2, np.float32), np.zeros(2, np.int32),
                              np.ones(2, np.float32))
  chosen = set()
  for count in range(30):
    tokens, logps, _, _ = programs.sample_rows(logits, *plain_rows(count), None, None,
                                               allowed, 2)
    plain, plain_logps, _, _ = programs.sample_rows(logits, *plain_rows(count), None, None,
                                                    None, 2)
    chosen.add(int(tokens[0]))
    assert tokens[1] == plain[1] and logps[1] == plain_logps[1]
    assert float(logps[0]) == float(jax.nn.log_softmax(logits[0])[tokens[0]])
  assert chosen == {3, 40}
