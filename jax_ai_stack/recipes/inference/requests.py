"""What a request to the engine asks (`Request`) and what it produced (`Completion`), and
the error naming a request's field that does not fit an engine (`RequestError`).

Example:
  >>> Request((1, 2), max_tokens=4, temperature=0).top_k is None
  True
"""

from __future__ import annotations

import dataclasses

__all__ = ["Completion", "Request", "RequestError"]


@dataclasses.dataclass(frozen=True)
class Request:
  """One prompt to continue, and how."""

  prompt: tuple[int, ...]
  """Token ids, at least one."""
  max_tokens: int
  """The most new tokens; the prompt and they must fit the engine's `max_len`."""
  temperature: float = 1.0
  """0: the most likely token each time (greedy)."""
  top_k: int | None = None
  """Sample among the k likeliest tokens only; None: all of them."""
  top_p: float | None = None
  """Sample among the likeliest tokens whose probabilities reach top_p; None: all of them."""
  seed: int = 0
  """The same seed gives the same tokens, whatever else is in the batch."""
  stop_ids: tuple[int, ...] = ()
  """Token ids that end the completion (EOS, end-of-turn); the stop token is kept."""
  top_logprobs: int = 0
  """How many alternatives (the likeliest tokens and their log-probabilities) to report
  for each new token; at most the engine's `max_top_logprobs`."""
  stop: tuple[str, ...] = ()
  """Strings that end the completion once its text holds one (read with the engine's
  `decode`); the completion's `text` ends before it."""


class RequestError(ValueError):
  """A request that does not fit the engine; `field` names the `Request` field."""

  def __init__(self, field: str, message: str):
    super().__init__(message)
    self.field = field


@dataclasses.dataclass
class Completion:
  """What a request produced."""

  index: int
  """The request's place in the list given to `run` / `stream`."""
  tokens: list[int]
  """The new tokens (a stop token included)."""
  logprobs: list[float]
  """Each new token's log-probability under the model (raw logits, float32)."""
  finish_reason: str
  """"stop" (a stop token) or "length" (`max_tokens`, or the context was full)."""
  top_logprobs: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)
  """Per new token, the request's `top_logprobs` likeliest (token, log-probability)."""
  text: str = ""
  """With the engine's `decode`: the new tokens' text so far that no stop string can still
  change (a stop token left out), cut before the stop string that ended it."""
