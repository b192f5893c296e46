"""Sampling per row: a row's token and log-probability do not depend on what the other rows
of the batch ask for, though the top-k, top-p and sampling work runs only when one asks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_ai_stack.recipes.inference import sampling

VOCAB = 50


def _sample(logits, keys, rows):
  """`sampling.sample` on the rows given as (temperature, top_k, top_p)."""
  temperature, top_k, top_p = (jnp.asarray(column) for column in zip(*rows))
  return [np.asarray(x) for x in sampling.sample(logits, keys, temperature=temperature,
                                                 top_k=top_k, top_p=top_p)]


def test_a_row_gets_the_same_bits_whatever_its_neighbours_ask_for():
  logits = jax.random.normal(jax.random.key(0), (3, VOCAB)) * 3
  keys = jax.random.split(jax.random.key(1), 3)
  plain, greedy, filtered = (1.0, 0, 1.0), (0.0, 0, 1.0), (0.7, 5, 0.8)
  for row, settings in enumerate((plain, greedy)):
    alone = _sample(logits[row:row + 1], keys[row:row + 1], [settings])
    for neighbours in ([plain, greedy, plain], [plain, greedy, filtered]):
      rows = list(neighbours)
      rows[row] = settings
      together = _sample(logits, keys, rows)
      assert together[0][row] == alone[0][0] and together[1][row] == alone[1][0]


def test_filters_keep_the_likeliest_tokens_and_greedy_rows_take_the_argmax():
  logits = jax.random.normal(jax.random.key(2), (64, VOCAB)) * 3
  keys = jax.random.split(jax.random.key(3), 64)
  top3 = set(np.argsort(np.asarray(logits[0]))[-3:].tolist())
  tokens, logps = _sample(jnp.broadcast_to(logits[0], (64, VOCAB)), keys, [(1.0, 3, 1.0)] * 64)
  assert set(tokens.tolist()) <= top3 and len(set(tokens.tolist())) > 1
  np.testing.assert_allclose(logps, jax.nn.log_softmax(logits[0])[tokens], rtol=1e-6)
  probabilities = np.sort(np.asarray(jax.nn.softmax(logits[0])))[::-1]
  nucleus = int(np.searchsorted(np.cumsum(probabilities), 0.5)) + 1
  tokens, _ = _sample(jnp.broadcast_to(logits[0], (64, VOCAB)), keys, [(1.0, 0, 0.5)] * 64)
  assert set(tokens.tolist()) <= set(np.argsort(np.asarray(logits[0]))[-nucleus:].tolist())
  greedy, _ = _sample(logits, keys, [(0.0, 0, 1.0)] * 64)
  assert greedy.tolist() == np.asarray(jnp.argmax(logits, axis=-1)).tolist()
