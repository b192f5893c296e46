"""A request in one of the engine's slots: where it stands, and each token it takes.

The engine (`inference.Engine`) admits a request to a slot, fills the slot's pages with
its prompt, then feeds it tokens; `Slot.take` appends each sampled token to the request's
`Completion` (its log-probability, the alternatives asked for, its text) and says when
the request has ended: a stop id, `max_tokens`, or a stop string in the text.

Example:
  >>> from jax_ai_stack.recipes.inference.requests import Completion, Request
  >>> slot = Slot(0, Request((1, 2), max_tokens=2, stop_ids=(9,)), Completion(0, [], [], ""), 2)
  >>> slot.take(5, -0.5, [], []), slot.take(9, -0.1, [], []), slot.completion.finish_reason
  (False, True, 'stop')
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from jax_ai_stack.recipes.inference.requests import Completion, Request
from jax_ai_stack.recipes.inference.text import TextStream

__all__ = ["Slot"]


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
  tokens of the slots that share its prompt (`Engine._shared_prompts`)."""
  keys: list = dataclasses.field(default_factory=list)
  """The keys of its prompt's whole prefill chunks (`page_pool.chunk_keys`), to keep each
  chunk's pages once it is in; none where the engine keeps no chunks."""

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
    elif len(completion.tokens) >= request.max_tokens:
      completion.finish_reason = "length"
    if self.text is not None:
      self.text.add([int(token)], final=bool(completion.finish_reason))
      completion.text = self.text.text
      if self.text.stopped:
        completion.finish_reason = "stop"
    return bool(completion.finish_reason)
