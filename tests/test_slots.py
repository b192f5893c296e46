"""A request in one of the engine's slots: each token it takes, and when it has ended."""

from __future__ import annotations

from jax_ai_stack.recipes.inference.requests import Completion, Request
from jax_ai_stack.recipes.inference.slots import Slot
from jax_ai_stack.recipes.inference.text import TextStream


def _slot(request: Request, text: TextStream | None = None) -> Slot:
  return Slot(0, request, Completion(0, [], [], ""), len(request.prompt), text)


def test_a_request_ends_at_a_stop_id_or_max_tokens_and_keeps_the_alternatives_asked_for():
  slot = _slot(Request((1,), max_tokens=3, stop_ids=(7,), top_logprobs=1))
  assert not slot.take(4, -1.0, [4, 5], [-1.0, -2.0])
  assert slot.take(7, -0.5, [7, 4], [-0.5, -1.5])
  assert slot.completion.tokens == [4, 7] and slot.completion.finish_reason == "stop"
  assert slot.completion.top_logprobs == [[(4, -1.0)], [(7, -0.5)]]
  assert slot.completion.first_token_s is not None
  long = _slot(Request((1,), max_tokens=2))
  assert [long.take(3, 0.0, [], []), long.take(3, 0.0, [], [])] == [False, True]
  assert long.completion.finish_reason == "length"


def test_a_stop_string_in_the_text_ends_the_request():
  text = TextStream(lambda ids: "".join(chr(96 + i) for i in ids), ("cd",), ())
  slot = _slot(Request((1,), max_tokens=10, stop=("cd",)), text)
  assert [slot.take(t, 0.0, [], []) for t in (1, 2, 3, 4)] == [False, False, False, True]
  assert slot.completion.finish_reason == "stop" and slot.completion.text == "ab"
