"""Speculative decoding: tokens guessed ahead, then checked by the model in one call.

Without it, a decoding call feeds each slot one token per step. With `Speculation`, each
running slot also feeds up to `tokens` guesses of what follows (drafts), and one pass of the
model gives the logits at all of them (`programs.verify`). Token i is still sampled from the
model's own logits at its position, with the request's key `fold_in(seed, i)` (greedy: the
most likely); a draft is kept while it equals the token sampled before it, and the first
token that differs is itself the next token. So a slot gains 1 + its kept drafts per call,
and the output is the output without speculation: greedy or sampled, token for token, up
to the last bits of the logits (a pass over 1 + `tokens` positions is another program than
a one-token step; each speculating call is the same program, so a request's tokens still
depend on the request alone). In Leviathan et al.'s terms a draft is a proposal with all its
probability on one token: their rejection step keeps it with probability p(draft) and else
samples p without it, which is what sampling p and comparing does.

Drafts come from the request's own tokens (`propose`, prompt lookup: no second model): the
latest earlier place where its last n tokens occur (the longest n from `ngram_max` down to
`ngram_min`), and the tokens that followed there. Text that repeats its context (code
edited, a document quoted, a JSON's keys) is where it pays.

Example: the tokens that followed the last "1, 2" before the end.
  >>> import numpy as np
  >>> propose(np.array([1, 2, 3, 4, 9, 1, 2]), 3, ngram_max=2)
  array([3, 4, 9])
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

__all__ = ["Speculation", "Speculator", "drafts", "propose"]


@dataclasses.dataclass(frozen=True)
class Speculation:
  """How an engine guesses ahead: up to `tokens` drafts per slot and call, by prompt lookup
  over n-grams of `ngram_min` to `ngram_max` tokens."""

  tokens: int = 4
  ngram_max: int = 4
  ngram_min: int = 1

  def __post_init__(self):
    if self.tokens < 1:
      raise ValueError(f"speculation tokens={self.tokens} must be >= 1 (drafts per call)")
    if not 1 <= self.ngram_min <= self.ngram_max:
      raise ValueError(f"speculation ngram_min={self.ngram_min} and ngram_max="
                       f"{self.ngram_max} must satisfy 1 <= ngram_min <= ngram_max")


class Speculator:
  """An engine's speculation: the drafts of its slots, checked by the compiled `verify`
  (`programs.verify`), and how many were drafted and kept so far, in all and per request
  (`Completion.drafted`, `Completion.accepted`)."""

  def __init__(self, speculation: Speculation, verify, max_len: int):
    self.speculation, self._verify, self.max_len = speculation, verify, max_len
    self.drafted = self.accepted = 0

  @property
  def acceptance(self) -> float | None:
    """The share of drafts kept so far (None before any)."""
    return self.accepted / self.drafted if self.drafted else None

  def __call__(self, params, cache, slots: Sequence, lengths, table, rows, settings):
    """One speculating decoding call of `slots` (None: idle) at `lengths`: (the sampled
    tokens, log-probs and alternatives [1 + tokens, B, ...], the tokens each row takes [B],
    the cache)."""
    fed, valid = drafts(slots, self.speculation, self.max_len)
    *sampled, kept, cache = self._verify(params, cache, fed, lengths, valid, table, rows,
                                         *settings)
    kept = np.asarray(kept)
    for slot, guessed, right in zip(slots, valid - 1, kept):
      if slot is not None:
        slot.completion.drafted += int(guessed)
        slot.completion.accepted += int(right)
    self.drafted += int((valid - 1).sum())
    self.accepted += int(kept.sum())
    return (*sampled, kept + 1, cache)


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


def drafts(slots: Sequence, speculation: Speculation, max_len: int
           ) -> tuple[np.ndarray, np.ndarray]:
  """The tokens a speculating call feeds (`Engine`'s `slots`, None: idle): [B, 1 + tokens],
  each slot's last token then its drafts, and how many of a row's are its own [B] (the rest
  padding, which the model writes past the row's tokens and nobody reads). A slot drafts no
  more than its request may still take, less the token the call samples anyway, nor past
  the engine's `max_len` positions."""
  tokens = np.zeros((len(slots), 1 + speculation.tokens), np.int32)
  valid = np.ones((len(slots),), np.int32)
  for row, slot in enumerate(slots):
    if slot is None:
      continue
    generated = slot.completion.tokens
    room = min(speculation.tokens, slot.request.max_tokens - len(generated) - 1,
               max_len - 1 - slot.length)
    guess = propose(np.asarray((*slot.request.prompt, *generated), np.int32), max(room, 0),
                    ngram_max=speculation.ngram_max, ngram_min=speculation.ngram_min)
    tokens[row, 0], tokens[row, 1:1 + guess.size] = generated[-1], guess
    valid[row] += guess.size
  return tokens, valid
