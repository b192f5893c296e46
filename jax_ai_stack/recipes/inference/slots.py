"""A request in one of the engine's slots: where it stands, and each token it takes.

The engine (`inference.Engine`) admits a request to a slot, fills the slot's pages with
its prompt, then feeds it tokens; `Slot.take` appends each sampled token to the request's
`Completion` (its log-probability, the alternatives asked for, its text), moves its
grammar on, and says when the request has ended: a stop id, `max_tokens`, or a stop string
in the text. `settings` gives the sampling inputs of a batch of slots, `shared_prompts`
the slots whose prompt another slot has, `prefill_calls` how prompts share prefill calls.

Example:
  >>> from jax_ai_stack.recipes.inference.requests import Completion, Request
  >>> slot = Slot(0, Request((1, 2), max_tokens=2, stop_ids=(9,)), Completion(0, [], [], ""), 2)
  >>> slot.take(5, -0.5, [], []), slot.take(9, -0.1, [], []), slot.completion.finish_reason
  (False, True, 'stop')
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jax_ai_stack.recipes.inference import grammar as grammar_lib
from jax_ai_stack.recipes.inference.requests import Completion, Request, row_settings
from jax_ai_stack.recipes.inference.text import TextStream

__all__ = ["Slot", "prefill_calls", "settings", "shared_prompts"]


@dataclasses.dataclass
class Slot:
  """A request being decoded: where it stands."""

  index: int
  request: Request
  completion: Completion
  length: int
  """Tokens in its pages: its prompt's as chunks are prefilled, then each new token once it
  is fed back. Until the whole prompt is in, the slot has no token and is not decoded."""
  text: TextStream | None = None  # Its text as tokens arrive (an engine given `decode`).
  pages: list[int] = dataclasses.field(default_factory=list)
  """The pool's pages it holds, in the order of its positions."""
  queued_at: float = 0.0  # perf_counter() at its queueing: its first_token_s counts from it.
  first_logits: Any = None
  """The logits [V] its first token was sampled from (its prompt's last), and the first
  tokens of the slots that share its prompt (`shared_prompts`)."""
  keys: list = dataclasses.field(default_factory=list)
  """The keys of its prompt's whole prefill chunks (`page_pool.chunk_keys`), to keep each
  chunk's pages once it is in; none where the engine keeps no chunks."""
  grammar: grammar_lib.Matcher | None = None
  """Where its output stands in the request's grammar (`Request.grammar`)."""

  def take(self, token, logp, top_tokens, top_logps) -> bool:
    """Appends a sampled token to the completion; whether the request has ended."""
    request, completion = self.request, self.completion
    completion.tokens.append(int(token))
    completion.logprobs.append(float(logp))
    if len(completion.tokens) == 1:  # Read from the device by now: it has come.
      completion.first_token_s = time.perf_counter() - self.queued_at
    if request.top_logprobs:
      completion.top_logprobs.append(
          [(int(t), float(v)) for t, v in zip(top_tokens[:request.top_logprobs],
                                              top_logps[:request.top_logprobs])])
    if int(token) in request.stop_ids:
      completion.finish_reason = "stop"
    elif self.grammar is not None and not self.grammar.take(token):
      completion.finish_reason = "stop"  # The grammar allowed no token at all.
    elif len(completion.tokens) >= request.max_tokens:
      completion.finish_reason = "length"
    if self.text is not None:
      self.text.add([int(token)], final=bool(completion.finish_reason))
      completion.text = self.text.text
      if self.text.stopped:
        completion.finish_reason = "stop"
    return bool(completion.finish_reason)


def settings(slots: Sequence[Slot | None], vocab_size: int) -> tuple[np.ndarray, ...]:
  """The sampling inputs of a batch's rows (`requests.row_settings`; None: an idle row), and
  the tokens each row's grammar allows next ([B, 0]: none has one; `grammar.masks`)."""
  rows = [slot and (slot.request, len(slot.completion.tokens)) for slot in slots]
  return (*row_settings(rows),
          grammar_lib.masks([slot and slot.grammar for slot in slots], vocab_size))


def shared_prompts(waiting: list[tuple[int, Slot]], slots: Sequence[Slot | None],
                   replica: Callable[[int], int]
                   ) -> tuple[list[tuple[int, Slot]], list[tuple[int, Slot, Slot]]]:
  """Of the slots `waiting` for their prompt ((number, slot)), (those to prefill, (number,
  slot, source) of those whose prompt another of `slots` in their replica (`replica(number)`),
  running or prefilling, has: a GRPO group's). The source's pages hold the prompt's keys and
  values bit for bit as the slot's own prefill would (a prefill call's shapes do not depend
  on the slot): a request's tokens are the same, shared or not. The source is the furthest
  on. Not for a model with per-slot state (a recurrent layer's moves on with its source's
  tokens)."""
  key = lambda number, slot: (replica(number), slot.request.prompt)  # noqa: E731
  started = [(n, s) for n, s in enumerate(slots)
             if s is not None and (s.completion.tokens or s.length)]
  sources = {key(n, s): s for n, s in sorted(
      started, key=lambda ns: (bool(ns[1].completion.tokens), ns[1].length))}
  prefill, shared = [], []
  for number, slot in waiting:
    source = sources.setdefault(key(number, slot), slot)
    if source is slot:
      prefill.append((number, slot))
    else:
      shared.append((number, slot, source))
  return prefill, shared


def prefill_calls(waiting: list[tuple[int, Slot]], replica: Callable[[int], int],
                  padded: Callable[[Slot], int]) -> list[tuple[int, dict[int, tuple]]]:
  """The slots still prefilling ((number, slot)) in calls: each call one slot per replica
  (`replica(number)`) at most, its row, all of one padded chunk length (`padded(slot)`);
  (that length, {replica: (number, slot)}).
  A call's rows are the replicas', so a slot's prefill has the same shapes whichever
  others share the call (its bits its own), and on a mesh the replicas prefill their
  slots side by side."""
  calls: list[tuple[int, dict[int, tuple]]] = []
  for number, slot in waiting:
    length, row = padded(slot), replica(number)
    for padded_to, call in calls:
      if padded_to == length and row not in call:
        break
    else:
      call = {}
      calls.append((length, call))
    call[row] = (number, slot)
  return calls
