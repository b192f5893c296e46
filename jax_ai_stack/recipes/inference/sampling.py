"""One token per row of logits, each row with its own settings and random key.

The generation engine decodes many requests in one batch; each keeps its own
temperature, top-k, top-p and seed, so sampling takes them per row. Nothing in
a row's result depends on the other rows: the same request gives the same
tokens alone or beside 31 others.

A row's log-probability is the log-softmax of its raw logits at the sampled
token (temperature 1, no top-k or top-p): what the training objective
computes for that token (`objectives.target_logps`), so a reinforcement
learning step can compare the two.

Example: greedy rows and a sampled one, side by side.
  >>> logits = jnp.log(jnp.array([[0.1, 0.6, 0.3], [0.5, 0.2, 0.3]]))
  >>> keys = jax.random.split(jax.random.key(0), 2)
  >>> tokens, logps = sample(logits, keys, temperature=jnp.array([0.0, 0.0]),
  ...                        top_k=jnp.array([0, 0]), top_p=jnp.array([1.0, 1.0]))
  >>> tokens.tolist(), [round(float(x), 4) for x in jnp.exp(logps)]
  ([1, 0], [0.6, 0.5])
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["sample", "top_logprobs"]


def sample(logits: jax.Array, keys: jax.Array, *, temperature: jax.Array, top_k: jax.Array,
           top_p: jax.Array, bias_ids: jax.Array | None = None,
           bias_values: jax.Array | None = None,
           allowed: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """(tokens [B] int32, their log-probabilities [B] float32) from float32 logits [B, V].

  Per row: `keys` [B] (typed PRNG keys), `temperature` [B] (0: the most likely
  token), `top_k` [B] (0: every token), `top_p` [B] (1: every token), and a logit bias,
  `bias_values` [B, K] added at the token ids `bias_ids` [B, K] to the logits the token is
  chosen from (0.0 at padding: exactly nothing), not to those its log-probability is
  read from; and `allowed` [B, ceil(V/32)] int32, the tokens a row may take as bits (token t:
  bit t % 32 of word t // 32; all set: every token), the others at -inf for the choice alone
  (a grammar's mask, `grammar.masks`).
  """
  raw = logits = logits.astype(jnp.float32)
  if bias_ids is not None and bias_ids.shape[-1]:  # (K = 0: nothing traced.)
    logits = logits.at[jnp.arange(logits.shape[0])[:, None], bias_ids].add(bias_values)
  if allowed is not None and allowed.shape[-1]:  # (No words: nothing traced.)
    ids = jnp.arange(logits.shape[-1])
    bits = jnp.right_shift(allowed[:, ids // 32], ids % 32) & 1
    logits = jnp.where(bits == 1, logits, -jnp.inf)
  # Each filter runs only when some row asks for it (`lax.cond` on the batch): a row that
  # does not ask gets the same bits either way, so no row depends on the others, and a
  # batch of greedy or plain-temperature rows sorts nothing.
  kept = jax.lax.cond(jnp.any(top_k > 0), _top_k_kept, lambda logits, _: logits, logits, top_k)
  scaled = kept / jnp.where(temperature > 0, temperature, 1.0)[:, None]
  scaled = jax.lax.cond(jnp.any(top_p < 1.0), _top_p_kept, lambda scaled, _: scaled, scaled,
                        top_p)
  sampled = jax.lax.cond(
      jnp.any(temperature > 0),
      lambda: jax.vmap(lambda key, row: jax.random.categorical(key, row))(keys, scaled),
      lambda: jnp.zeros(logits.shape[:1], jnp.int32))
  tokens = jnp.where(temperature > 0, sampled, jnp.argmax(logits, axis=-1)).astype(jnp.int32)
  logps = jax.nn.log_softmax(raw, axis=-1)
  return tokens, jnp.take_along_axis(logps, tokens[:, None], axis=-1)[:, 0]


def _top_k_kept(logits: jax.Array, top_k: jax.Array) -> jax.Array:
  """`logits` with each row's tokens below its `top_k` likeliest at -inf (top_k 0: all kept)."""
  ordered = jnp.sort(logits, axis=-1)[:, ::-1]
  kth = jnp.take_along_axis(ordered, jnp.maximum(top_k - 1, 0)[:, None], axis=-1)
  return jnp.where((top_k > 0)[:, None] & (logits < kth), -jnp.inf, logits)


def _top_p_kept(scaled: jax.Array, top_p: jax.Array) -> jax.Array:
  """`scaled` with each row's tokens past its nucleus `top_p` at -inf (1: all kept)."""
  ordered = jnp.sort(scaled, axis=-1)[:, ::-1]
  probabilities = jax.nn.softmax(ordered, axis=-1)
  mass_before = jnp.cumsum(probabilities, axis=-1) - probabilities
  floor = jnp.where(mass_before < top_p[:, None], ordered, jnp.inf).min(axis=-1, keepdims=True)
  return jnp.where((top_p < 1.0)[:, None] & (scaled < floor), -jnp.inf, scaled)


def top_logprobs(logits: jax.Array, n: int) -> tuple[jax.Array, jax.Array]:
  """The `n` likeliest tokens of each row and their log-probabilities: [B, n] each."""
  logps = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  values, tokens = jax.lax.top_k(logps, n)
  return tokens.astype(jnp.int32), values
