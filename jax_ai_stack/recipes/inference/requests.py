"""What a request to the engine asks (`Request`) and what it produced (`Completion`), the
error naming a request's field that does not fit an engine (`RequestError`), and the slot
length a list of requests needs (`slot_length`).

Example:
  >>> Request((1, 2), max_tokens=4, temperature=0).top_k is None
  True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from jax_ai_stack.recipes.inference import grammar as grammar_lib

__all__ = ["Completion", "Request", "RequestError", "check", "row_settings", "slot_length"]

SHORTEST_SLOT = 64
"""`slot_length`'s least length: one page of the engine's default size."""
MAX_LOGIT_BIAS = 300
"""The most tokens one request may bias (`Request.logit_bias`)."""


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
  logit_bias: tuple[tuple[int, float], ...] = ()
  """(token id, value) pairs added to the logits a token is chosen from (OpenAI's
  `logit_bias`: -100 bans a token, 100 all but forces it), at most `MAX_LOGIT_BIAS`; the
  log-probabilities reported stay the model's."""
  grammar: str | None = None
  """The output's grammar (`inference.grammar`: a JSON schema's, a regex's, ...): each token
  is chosen among those that keep the output valid, the log-probabilities reported staying
  the model's; the engine needs `grammar_vocabulary`. None: free text."""


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
  first_token_s: float | None = dataclasses.field(default=None, compare=False)
  """Seconds from the request's queueing (`add`, `stream`) to its first token: time to
  first token, waiting and prefill (and any compile) included; None before it. Not
  compared: two runs of the same request are equal."""
  drafted: int = dataclasses.field(default=0, compare=False)
  """Speculative decoding's guesses for it (`speculation`), and of those the `accepted`."""
  accepted: int = dataclasses.field(default=0, compare=False)


def slot_length(requests: Sequence[Request], limit: int) -> int:
  """The positions an engine's slot needs for `requests` (the longest prompt with its new
  tokens), as a power of two from `SHORTEST_SLOT`, so that calls of similar lengths reuse one
  compiled program; at most `limit` (the model's `max_seq_len`).

  An engine's pool is its slots times this length. Sized by the model's whole context
  instead, one slot of Qwen3-0.6B (40,960 positions) holds 4.7 GB of keys and values, to
  write 32 tokens.

  Example:
    >>> slot_length([Request((1,) * 10, max_tokens=100), Request((1, 2), max_tokens=8)], 4096)
    128
    >>> slot_length([Request((1,) * 10, max_tokens=100)], 100), slot_length([], 4096)
    (100, 64)
  """
  longest = max((len(r.prompt) + r.max_tokens for r in requests), default=1)
  return min(limit, max(SHORTEST_SLOT, 1 << (longest - 1).bit_length()))


def check(engine: Any, request: Request, index: int = 0) -> None:
  """Raises `RequestError` (a ValueError) naming the request and the field that does not
  fit `engine` (an `Engine`: its vocabulary, context, pool, tokenizer and alternatives)."""
  def bad(field: str, message: str) -> RequestError:
    return RequestError(field, f"request {index}: {message}")

  if not request.prompt:
    raise bad("prompt", "the prompt is empty")
  if min(request.prompt) < 0 or max(request.prompt) >= engine.vocab_size:
    raise bad("prompt", f"prompt token ids must be in [0, {engine.vocab_size})")
  if request.max_tokens < 1:
    raise bad("max_tokens", f"max_tokens must be >= 1; got {request.max_tokens}")
  if len(request.prompt) + request.max_tokens > engine.max_len:
    raise bad("max_tokens", f"the prompt ({len(request.prompt)} tokens) and max_tokens "
              f"({request.max_tokens}) exceed the context of {engine.max_len} tokens")
  if engine.pages_for(request) > engine.replica_pages:
    pool = (f"the engine's pool holds {engine.max_pages} (max_pages)" if engine.replicas == 1
            else f"each of the engine's {engine.replicas} data-parallel pools holds "
            f"{engine.replica_pages} (max_pages / {engine.replicas})")
    raise bad("max_tokens", f"the prompt ({len(request.prompt)} tokens) and max_tokens "
              f"({request.max_tokens}) need {engine.pages_for(request)} pages of "
              f"{engine.page_size} positions; {pool}")
  if request.temperature < 0:
    raise bad("temperature", f"temperature must be >= 0; got {request.temperature}")
  if request.top_k is not None and not 1 <= request.top_k <= engine.vocab_size:
    raise bad("top_k", f"top_k must be in [1, {engine.vocab_size}]; got {request.top_k}")
  if request.top_p is not None and not 0 < request.top_p <= 1:
    raise bad("top_p", f"top_p must be in (0, 1]; got {request.top_p}")
  if any(not 0 <= t < engine.vocab_size for t in request.stop_ids):
    raise bad("stop_ids", f"stop token ids must be in [0, {engine.vocab_size}); got "
              f"{list(request.stop_ids)}")
  if request.stop and engine.detokenize is None:
    raise bad("stop", "stop strings need the tokenizer: give the engine `decode`")
  if isinstance(request.stop, str) or not all(isinstance(stop, str) and stop
                                              for stop in request.stop):
    raise bad("stop", f"stop strings must be non-empty strings; got {list(request.stop)}")
  bias = request.logit_bias
  if len(bias) > MAX_LOGIT_BIAS or any(not 0 <= t < engine.vocab_size or not -100 <= v <= 100
                                       for t, v in bias):
    raise bad("logit_bias", f"logit_bias: at most {MAX_LOGIT_BIAS} token ids in [0, "
              f"{engine.vocab_size}), each with a value in [-100, 100]; got {len(bias)} "
              f"({', '.join(f'{t}: {v}' for t, v in bias[:3])}{', ...' if len(bias) > 3 else ''})")
  if request.grammar is not None:
    if engine.grammar_vocabulary is None:
      raise bad("grammar", "a grammar needs the tokenizer's vocabulary: give the engine "
                "`grammar_vocabulary` (inference.grammar.vocabulary(tokenizer))")
    error = grammar_lib.check(request.grammar, engine.grammar_vocabulary)
    if error:
      raise bad("grammar", f"the grammar does not compile: {error}")
  if not 0 <= request.top_logprobs <= engine.max_top_logprobs:
    raise bad("top_logprobs", f"top_logprobs must be in [0, {engine.max_top_logprobs}]; got "
              f"{request.top_logprobs}")


def row_settings(rows: Sequence[tuple[Request, int] | None]) -> tuple[np.ndarray, ...]:
  """Per-row sampling inputs (seeds, token counts, temperature, top_k, top_p, and the logit
  bias's token ids and values [B, K]: K is 0 where no row has one, else `MAX_LOGIT_BIAS`, two
  compiled programs at most) of rows that are (a request, the tokens it has) or None (idle:
  greedy, seed 0)."""
  rows = [row or (Request((0,), 1, temperature=0), 0) for row in rows]
  width = MAX_LOGIT_BIAS if any(r.logit_bias for r, _ in rows) else 0
  bias = np.zeros((2, len(rows), width), np.float32)  # Padded with 0.0 added to token 0.
  for row, (request, _) in enumerate(rows):
    if request.logit_bias:
      bias[:, row, :len(request.logit_bias)] = np.asarray(request.logit_bias, np.float32).T
  return (np.asarray([r.seed for r, _ in rows], np.uint32),
          np.asarray([count for _, count in rows], np.int32),
          np.asarray([r.temperature for r, _ in rows], np.float32),
          np.asarray([r.top_k or 0 for r, _ in rows], np.int32),
          np.asarray([1.0 if r.top_p is None else r.top_p for r, _ in rows], np.float32),
          bias[0].astype(np.int32), bias[1])

