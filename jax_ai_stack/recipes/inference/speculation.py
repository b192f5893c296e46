"""Speculative decoding: tokens guessed ahead, then checked by the model in one pass.

Without it, a decoding step feeds each slot one token. With `Speculation`, each step also
feeds up to `tokens` guesses of what follows (drafts), and one pass of the model gives the
logits at all of them (`programs.speculate`). Token i is still sampled from the model's own
logits at its position, with the request's key `fold_in(seed, i)` (greedy: the most likely);
a draft is kept while it equals the token sampled before it, and the first token that
differs is itself the next token. So a slot gains 1 + its kept drafts per step, and the
output is the output without speculation: greedy or sampled, token for token, up to the
last bits of the logits (a pass over 1 + `tokens` positions is another program than a
one-token step; every speculating call is the same program, so a request's tokens still
depend on the request alone). In Leviathan et al.'s terms a draft is a proposal with all
its probability on one token: their rejection step keeps it with probability p(draft) and
else samples p without it, which is what sampling p and comparing does.

Drafts come from the request's own tokens (prompt lookup: no second model): the latest
earlier place where its last n tokens occur (the longest n from `ngram_max` down to
`ngram_min`), and the tokens that followed there. `propose` says it in NumPy, `lookup` is
the same on the device, where a call runs `steps_per_call` such steps in a loop, each
slot's tokens appended to its history as they come, so that each step guesses from all of
them (`Speculator` lays out the histories, then each row's tokens in order). Text that
repeats its context (code edited, a document quoted, a JSON's keys) is where it pays.
Or they are a `draft` model's greedy tokens: a smaller decoder of the same vocabulary, with
a cache of its own in pages numbered as the model's (prefilled and copied with them).

Example: the tokens that followed the last "1, 2" before the end.
  >>> import numpy as np
  >>> propose(np.array([1, 2, 3, 4, 9, 1, 2]), 3, ngram_max=2)
  array([3, 4, 9])
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_ai_stack.recipes.inference import programs

__all__ = ["Speculation", "Speculator", "lookup", "propose"]


@dataclasses.dataclass(frozen=True)
class Speculation:
  """How an engine guesses ahead: up to `tokens` drafts per slot and step, by prompt lookup
  over n-grams of `ngram_min` to `ngram_max` tokens, or by a `draft` model."""

  tokens: int = 4
  ngram_max: int = 4
  ngram_min: int = 1
  draft: Any = dataclasses.field(default=None, compare=False, repr=False)
  """A draft model (a smaller decoder with the model's vocabulary) whose greedy tokens are
  the guesses; None: prompt lookup."""

  def __post_init__(self):
    if self.tokens < 1:
      raise ValueError(f"speculation tokens={self.tokens} must be >= 1 (drafts per step)")
    if not 1 <= self.ngram_min <= self.ngram_max:
      raise ValueError(f"speculation ngram_min={self.ngram_min} and ngram_max="
                       f"{self.ngram_max} must satisfy 1 <= ngram_min <= ngram_max")


class Speculator:
  """An engine's speculation: each call's histories for the compiled `speculate`
  (`programs.speculate`), its tokens put back in each row's order, and the guesses made and
  kept, per token (`tally` adds those of the tokens a request took to its `Completion` and
  to `guesses`); a draft model's parameters and cache, which the engine's prefills and page
  copies fill as its own."""

  def __init__(self, speculation: Speculation, model, graphdef, structure, max_top: int,
               rounds: int, lay_out: Callable):
    """`model` (split into `graphdef` and `structure`): the engine's; `lay_out(model)`: a
    model's cache laid out as the engine's pages."""
    draft, self.speculation = speculation.draft, speculation
    self.guesses = np.zeros((2,), np.int64)
    """The guesses made and kept so far, with the tokens requests took."""
    for which in (model, draft):
      if which is not None and any(a.per_slot for s in which.cache_specs() for a in s.values()):
        raise ValueError("speculation needs models whose cache is pages alone: this one "
                         "keeps a state per slot (a recurrent layer's), which a refused "
                         "guess would move on")
    self._draft = None  # (graph, structure, parameters)
    if draft is not None:
      graph, state = nnx.split(draft)
      self._draft = (graph, *jax.tree.flatten(state)[::-1])
      if draft.config.vocab_size != model.config.vocab_size:
        raise ValueError(f"the draft model's vocab_size={draft.config.vocab_size} is not the "
                         f"model's {model.config.vocab_size}: a draft needs its vocabulary")
      self._draft_cache = lay_out(draft)
      self._draft_prefill = programs.programs(*self._draft[:2], max_top, 1)[0]
      self._draft_copy = programs.page_copy(tuple(tuple(spec.items()) for spec in
                                                  draft.cache_specs()), draft.config.scan_layers)
    self._speculate = programs.speculate(graphdef, structure, max_top, rounds,
                                         dataclasses.replace(speculation, draft=None),
                                         lookup, self._draft and self._draft[:2])

  def tally(self, completion, guesses: np.ndarray) -> None:
    """The guesses made and kept with the tokens a request took in a call ([taken, 2] of
    `__call__`'s), added to its `Completion` and to `guesses`."""
    made, kept = guesses.sum(axis=0)
    completion.drafted += int(made)
    completion.accepted += int(kept)
    self.guesses += (made, kept)

  def prefill(self, *chunks) -> None:
    """A prefill call's chunks (`Engine._prefill_next`'s arguments) into the draft's pages."""
    if self._draft:
      _, self._draft_cache = self._draft_prefill(self._draft[2], self._draft_cache, *chunks)

  def copy(self, replica, sources, targets) -> None:
    """Shared prompts' pages copied in the draft's cache too (`Engine._forked`)."""
    if self._draft:
      self._draft_cache = self._draft_copy(self._draft_cache, replica, sources, targets)

  def __call__(self, params, cache, slots: Sequence, lengths, table, rows, settings,
               page_size: int):
    """One call of `slots` (None: idle) at `lengths`: (tokens, log-probs, alternatives
    [N, B, ...] of each row in order, how many each row takes [B], the guesses made and
    kept with each [N, B, 2], the cache)."""
    history = np.zeros((len(slots), table.shape[1] * page_size), np.int32)
    max_tokens = np.zeros((len(slots),), np.int32)
    for row, slot in enumerate(slots):
      if slot is not None:
        known = (*slot.request.prompt, *slot.completion.tokens)
        history[row, :len(known)], max_tokens[row] = known, slot.request.max_tokens
    drafting = (self._draft[2], self._draft_cache) if self._draft else ((), ())
    *sampled, kept, drafted, cache, draft_cache = self._speculate(
        params, cache, *drafting, history, lengths, table, rows, max_tokens, *settings)
    if self._draft:
      self._draft_cache = draft_cache
    kept, drafted = np.asarray(kept), np.asarray(drafted)  # [rounds, B]
    steps = np.arange(self.speculation.tokens + 1)
    taken = steps <= kept[..., None]  # [rounds, B, T]: each step's tokens a row takes.
    guesses = np.stack([np.where(steps == 0, drafted[..., None], 0),
                        (steps > 0) & taken], axis=-1)
    # Each row's tokens, step after step, first: [rounds, B, T, ...] -> [B, rounds * T, ...].
    flat = lambda x: np.swapaxes(np.asarray(x), 0, 1).reshape(  # noqa: E731
        len(slots), -1, *np.shape(x)[3:])
    order = np.argsort(~flat(taken), axis=1, kind="stable")
    ordered = [np.swapaxes(np.take_along_axis(
        flat(x), order.reshape(*order.shape, *[1] * (flat(x).ndim - 2)), axis=1), 0, 1)
               for x in (*sampled, guesses)]
    return (*ordered[:-1], flat(taken).sum(axis=1), ordered[-1], cache)


def lookup(history: jax.Array, known: jax.Array, room: jax.Array, *, count: int,
           ngram_max: int, ngram_min: int) -> tuple[jax.Array, jax.Array]:
  """`propose` on the device for one row (vmapped by `programs.speculate`): the first
  `known` tokens of `history` [W] as the context, at most `room` drafts; (`count` tokens
  [count], how many of them are drafts)."""
  at = jnp.arange(history.shape[0])
  last = known - 1
  tail = lambda back: history[jnp.maximum(last - back, 0)]  # noqa: E731
  matched = ((history == tail(0)) & (at < last)).astype(jnp.int32)
  for back in range(1, ngram_max):
    going = (matched == back) & (at >= back) & (back < last)
    matched += going & (history[jnp.maximum(at - back, 0)] == tail(back))
  longest = matched.max()
  start = jnp.max(jnp.where(matched == longest, at, -1)) + 1
  drafts = history[jnp.minimum(start + jnp.arange(count), history.shape[0] - 1)]
  made = jnp.minimum(jnp.maximum(known - start, 0), jnp.maximum(room, 0))
  return drafts, jnp.where(longest >= max(ngram_min, 1), made, 0)


def propose(context: np.ndarray, count: int, *, ngram_max: int, ngram_min: int = 1
            ) -> np.ndarray:
  """Up to `count` tokens that followed the latest earlier occurrence of `context`'s last n
  tokens, for the longest n in [ngram_min, ngram_max] that occurs; none if none does.
  (Each earlier place of the last token, then how far back each goes on matching: a few
  vector operations, not one search per n.)"""
  last = len(context) - 1
  ends = np.flatnonzero(context[:-1] == context[-1])  # Each followed by at least one token.
  if count < 1 or not ends.size:
    return context[:0]
  matched = np.ones(ends.shape, np.int64)  # The tokens that match, ending at each place.
  for back in range(1, min(ngram_max, last)):
    going = (matched == back) & (ends >= back)
    going[going] = context[ends[going] - back] == context[last - back]
    matched += going
  longest = matched.max()
  if longest < ngram_min:
    return context[:0]
  start = ends[matched == longest][-1] + 1
  return context[start:start + count]
