"""The engine's compiled programs, and the sizes they are compiled for.

`programs(graphdef, structure, ...)` gives the two jitted calls an `Engine` makes: a
prefill of prompt chunks (a row per data-parallel replica) into the model's cache (its
pages and slots: a pytree the model lays out and only its layers read), and a loop on the
device that decodes `count` tokens for every slot, each fed to the next. Shapes are
rounded so that few programs serve many requests: a chunk to a power of two
(`padded_length`), a block table to 1, 2, 3, 4, 6, 8, 12, ... pages (`half_octave`).
Token i of a request is sampled with `fold_in(key(seed), i)` (`sample_rows`), so its
tokens do not depend on how many steps one call takes. `forward` is a decoding step without
its sampling (grammars' masks come between); `speculate` a loop of speculative steps.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_ai_stack.recipes.inference import sampling
from jax_ai_stack.recipes.models import cache as cache_lib
from jax_ai_stack.recipes.models.layers import KVCache

__all__ = ["MIN_PADDED", "first_token", "forward", "half_octave", "padded_length",
           "programs", "sample_rows", "speculate"]

MIN_PADDED = 16
"""A prompt's chunks are padded to a power of two of at least this many tokens (one program
each)."""


def half_octave(size: int) -> int:
  """`size` rounded up to 1, 2, 3, 4, 6, 8, 12, 16, 24, ...: two steps an octave, at most a
  third of padding (where a power of two pads up to half), so few compiled programs serve
  many sizes.

  Example:
    >>> [half_octave(n) for n in (1, 3, 5, 9, 13, 17, 100)]
    [1, 3, 6, 12, 16, 24, 128]
  """
  octave = 1 << (max(size, 1) - 1).bit_length()
  return octave * 3 // 4 if size <= octave * 3 // 4 else octave


def padded_length(size: int, limit: int) -> int:
  """`size` tokens padded to the next power of two (at least MIN_PADDED), at most `limit`:
  lengths share a few compiled programs."""
  return min(max(MIN_PADDED, 1 << (size - 1).bit_length()), limit)


def sample_rows(logits, seeds, counts, temperature, top_k, top_p, bias_ids, bias_values,
                allowed, max_top: int):
  """`sampling.sample` with token i of a request keyed `fold_in(key(seed), i)`."""
  keys = jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(seeds, counts)
  tokens, logps = sampling.sample(logits, keys, temperature=temperature, top_k=top_k,
                                  top_p=top_p, bias_ids=bias_ids, bias_values=bias_values,
                                  allowed=allowed)
  top_tokens, top_logps = sampling.top_logprobs(logits, max(max_top, 1))
  return tokens, logps, top_tokens, top_logps


@functools.cache
def page_copy(specs: tuple, stacked: bool) -> Callable:
  """`cache.copy_pages` of a model's cache (`specs`: each layer's spec as a tuple of items),
  compiled once for every engine of that model: the pages of prompts requests share."""
  return jax.jit(functools.partial(cache_lib.copy_pages, [dict(spec) for spec in specs],
                                   stacked=stacked), donate_argnums=0)


first_tokens = jax.jit(sample_rows, static_argnums=9)
"""`sample_rows` of rows of logits [B, V]: the first tokens of requests whose prompt another
request's prefill ended (the engine's shared prompts)."""


@functools.partial(jax.jit, static_argnums=10)
def first_token(logits, row, seeds, counts, temperature, top_k, top_p, bias_ids, bias_values,
                allowed, max_top: int):
  """`sample_rows` of row `row` of a prefill's last logits [R, V], compiled once."""
  logits = jax.lax.dynamic_slice_in_dim(logits, row, 1)
  return sample_rows(logits, seeds, counts, temperature, top_k, top_p, bias_ids, bias_values,
                     allowed, max_top)


@functools.cache
def programs(graphdef, structure, max_top: int, count: int) -> tuple[Callable, Callable]:
  """The compiled prefill and decoding steps (`_prefill`, `_steps`) of a model's graph and
  parameters' structure: built once, and shared by engines of the same model structure and
  sizes. They take the parameters as a list of arrays, the graph bound here: as jit's
  static argument a graph is hashed at every call, and a model's state pytree flattened
  (together 0.3-0.5 ms of host time a call for the benchmark's tiny model, a tenth of a
  decoding call)."""
  model = _bound(graphdef, structure)
  return (jax.jit(functools.partial(_prefill, model), donate_argnums=1),
          jax.jit(functools.partial(_steps, model, max_top, count), donate_argnums=1))


@functools.cache
def forward(graphdef, structure) -> Callable:
  """The compiled step that computes every row's next logits [B, V] (and the updated cache)
  without sampling (`_forward`): the engine samples them once the grammars' masks are in,
  computed on the host while this runs. Built once per model structure, as `programs`."""
  return jax.jit(functools.partial(_forward, _bound(graphdef, structure)), donate_argnums=1)


@functools.cache
def speculate(graphdef, structure, max_top: int, rounds: int, speculation, lookup: Callable,
              draft: tuple | None = None) -> Callable:
  """The compiled call of speculative decoding (`_speculate`): `rounds` steps, each every
  row's last token and its guesses in one pass; `draft`: a draft model's (graph, structure),
  None: prompt lookup (`lookup`, `speculation.lookup`). Built once per model structure and
  sizes."""
  return jax.jit(functools.partial(_speculate, _bound(graphdef, structure),
                                   draft and _bound(*draft), max_top, rounds, speculation,
                                   lookup), donate_argnums=(1, 3))


def _bound(graphdef, structure) -> Callable[[list[jax.Array]], nnx.Module]:
  """The model of a graph and parameters' structure, from its parameters as a list of
  arrays (`programs`)."""
  def model(params: list[jax.Array]) -> nnx.Module:
    return nnx.merge(graphdef, jax.tree.unflatten(structure, params))

  return model


def _forward(model: Callable, params, state, tokens, lengths, block_table, slots):
  """One decoding step's logits [B, V] for every row at its own position (each of `_steps`'
  steps, without its sampling), and the updated cache state."""
  logits, cache = model(params).decode(tokens[:, None],
                                       KVCache(state, lengths, block_table, slots))
  return logits[:, 0], cache.state


def _prefill(model: Callable, params, state, tokens, start, block_table, slots, last):
  """Chunks of prompts, tokens [R, T] (a row per replica) at positions start[r] ..., into
  their pages (`block_table` [R, W]) and slots (`slots` [R]): the logits [R, V] of each
  row's token last[r], and the updated cache state (`KVCache.state`, which the engine
  passes through unread). `model(params)`: the decoder."""
  model = model(params)
  cache = KVCache(state, start, block_table, slots, valid=last + 1)
  logits, cache = model.decode(tokens, cache, logits_at=last)
  return logits[:, 0], cache.state


def _steps(model: Callable, max_top: int, count: int, params, state, tokens, lengths,
           block_table, slots, seeds, counts, temperature, top_k, top_p, bias_ids, bias_values,
           allowed):
  """`count` tokens for every row, each at its own position of its pages (`block_table`)
  and in its slot (`slots`), each step's tokens fed to the next, in a loop on the device:
  outputs [count, B, ...] and the updated cache state. A row's token i is keyed
  `fold_in(seed, i)`, so the tokens do not depend on `count`. `allowed`: [B, 0] (a mask
  would hold for every step: a grammar's rows go through `forward`, a token a call).
  `model(params)`: the decoder."""
  def one(carry, _):
    # The parameters ride in the carry: a scanned-layer model splits them again inside
    # `decode`, which NNX allows only for values of the loop's own trace.
    params, state, tokens, lengths, counts = carry
    logits, state = _forward(model, params, state, tokens, lengths, block_table, slots)
    sampled = sample_rows(logits, seeds, counts, temperature, top_k, top_p, bias_ids,
                          bias_values, allowed, max_top)
    return (params, state, sampled[0], lengths + 1, counts + 1), sampled

  carry = (params, state, tokens, lengths, counts)
  (_, state, *_), sampled = jax.lax.scan(one, carry, None, length=count)
  return (*sampled, state)


def _speculate(model: Callable, draft: Callable | None, max_top: int, rounds: int,
               speculation, lookup: Callable, params, state, draft_params, draft_state,
               history, lengths, block_table, slots, max_tokens, seeds, counts, temperature,
               top_k, top_p, bias_ids, bias_values, allowed):
  """`rounds` steps of speculative decoding (`speculation`) for every row, in a loop on the
  device. A row's `history` [B, W] holds its tokens so far (prompt, then new), the last at
  position lengths[b] (not yet in its pages); each step guesses up to `speculation.tokens`
  more (no more than `max_tokens` allows), from the history (`speculation.lookup`) or as a
  `draft` model's greedy tokens (`_drafted`: its own cache in `draft_state`, its pages
  numbered as the model's), feeds the last token and the guesses at positions lengths[b]
  ... of its pages, samples
  every position as `_steps` samples it (position j is the row's token counts[b] + j,
  keyed so), keeps the guesses equal to the token sampled before them, and appends the
  tokens it takes to the history. Outputs [rounds, B, 1 + tokens, ...] as `_steps`' (the
  tokens of each step, of which a row takes its kept guesses + 1), the guesses kept and
  made [rounds, B], and the cache states (the model's, the draft's)."""
  guesses, batch = speculation.tokens, history.shape[0]
  width = guesses + 1
  every = jnp.arange(batch)[:, None]
  propose = jax.vmap(functools.partial(lookup, count=guesses, ngram_max=speculation.ngram_max,
                                       ngram_min=speculation.ngram_min))
  each = lambda x: jnp.repeat(x, width, axis=0)  # noqa: E731  A row's setting at each position.

  def one(carry, _):
    params, state, draft_params, draft_state, history, lengths, counts = carry
    room = jnp.minimum(guesses, max_tokens - counts - 1)
    last = history[every, lengths[:, None]]
    if draft is None:
      drafts, drafted = propose(history, lengths + 1, room)
    else:
      drafts, draft_state = _drafted(draft, guesses, draft_params, draft_state, last[:, 0],
                                     lengths, block_table, slots)
      drafted = jnp.maximum(room, 0)
    tokens = jnp.concatenate([last, drafts], axis=1)
    logits, cache = model(params).decode(tokens, KVCache(state, lengths, block_table, slots,
                                                         valid=drafted + 1))
    sampled = sample_rows(logits.reshape(batch * width, -1), each(seeds),
                          (counts[:, None] + jnp.arange(width)).reshape(-1), each(temperature),
                          each(top_k), each(top_p), each(bias_ids), each(bias_values),
                          each(allowed), max_top)
    sampled = [x.reshape(batch, width, *x.shape[1:]) for x in sampled]
    same = (sampled[0][:, :-1] == drafts) & (jnp.arange(guesses) < drafted[:, None])
    kept = jnp.cumprod(same.astype(jnp.int32), axis=1).sum(axis=1)
    at = jnp.where(jnp.arange(width) <= kept[:, None], lengths[:, None] + 1 + jnp.arange(width),
                   history.shape[1])  # Past the end: dropped.
    history = history.at[every, at].set(sampled[0], mode="drop")
    carry = (params, cache.state, draft_params, draft_state, history, lengths + kept + 1,
             counts + kept + 1)
    return carry, (*sampled, kept, drafted)

  carry = (params, state, draft_params, draft_state, history, lengths, counts)
  (_, state, _, draft_state, *_), out = jax.lax.scan(one, carry, None, length=rounds)
  return (*out, state, draft_state)


def _drafted(draft: Callable, guesses: int, params, state, last, lengths, block_table, slots):
  """A draft model's `guesses` greedy tokens [B, guesses] after each row's `last` token at
  `lengths`, and its cache state: it takes in the last guess too (one step more), so that
  its cache holds every token the model may keep, all of them kept included."""
  def one(carry, _):
    params, state, tokens, lengths = carry
    logits, state = _forward(draft, params, state, tokens, lengths, block_table, slots)
    tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return (params, state, tokens, lengths + 1), tokens

  (_, state, *_), drafts = jax.lax.scan(one, (params, state, last, lengths), None,
                                        length=guesses + 1)
  return drafts[:guesses].T, state


def lower(program: str, prefill: Callable, steps: Callable, state: tuple, replicas: int,
          chunk: int, max_slots: int, pages_per_slot: int) -> jax.stages.Lowered:
  """An engine's `program` ("prefill" or "decode") at its largest shapes, lowered: a prefill
  of a whole `chunk` in every replica's row, or a decoding call of every slot, over a slot's
  whole block table. `state`: (parameters, cache)."""
  spec = lambda shape, dtype=np.int32: jax.ShapeDtypeStruct(shape, dtype)  # noqa: E731
  if program == "prefill":
    rows = (replicas,)
    return prefill.lower(*state, spec((replicas, chunk)), spec(rows),
                         spec((replicas, pages_per_slot)), spec(rows), spec(rows))
  if program != "decode":
    raise ValueError(f"program={program!r}: the engine's are 'prefill' and 'decode'")
  rows = (max_slots,)
  return steps.lower(*state, spec(rows), spec(rows), spec((*rows, pages_per_slot)),
                     spec(rows), spec(rows, np.uint32), spec(rows), spec(rows, np.float32),
                     spec(rows), spec(rows, np.float32), spec((*rows, 0)),
                     spec((*rows, 0), np.float32),  # No logit bias nor grammar: the common
                     spec((*rows, 0)))  # program.

