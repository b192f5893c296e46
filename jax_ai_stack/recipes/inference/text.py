"""A completion's text as its tokens arrive: the new text at each step, cut at a stop string.

Tokens do not map to whole characters (a byte-level token may be half of one) and a stop
string may be split over several tokens. A step costs what its new tokens do, however
long the completion and its stop strings are:

- the tokens are decoded in a window: the tokens of the last text settled (the context a
  tokenizer needs, such as a word's leading space) and those after them; the window's
  text past the context's is the new text. Where it ends in U+FFFD (an unfinished UTF-8
  sequence), it is settled up to the last of its final 3 tokens whose text the window's
  starts with and does not end at (an unfinished character has at most 3 bytes), and
  the rest waits for the next tokens. An invalid byte reads the same, so its U+FFFD (and
  a stop string that ends in one) is settled a token later.
- each stop string is matched by a Knuth-Morris-Pratt automaton fed each settled
  character once; its state is the longest ending that could still grow into that stop
  string, which is held back (at most the stop's length less one characters).

The stop string itself is never sent, nor a last token that ended the completion (EOS,
end of turn: `end_ids`).

Example: stop at "\\n\\n", tokens as UTF-8 bytes.
  >>> stream = TextStream(lambda ids: bytes(ids).decode("utf-8", "replace"), stops=["\\n\\n"])
  >>> stream.add([72, 105, 10]), stream.stopped  # "Hi\\n": the "\\n" may start a stop.
  ('Hi', False)
  >>> stream.add([10, 66]), stream.stopped, stream.text
  ('', True, 'Hi')
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["TextStream"]

_UNFINISHED = "\ufffd"
_MOST_UNFINISHED = 3
"""The bytes of an unfinished UTF-8 character, so the most tokens it spans."""


def _failure(stop: str) -> list[int]:
  """KMP's failure function: for each prefix of `stop`, its longest proper border."""
  fail, border = [0] * len(stop), 0
  for at in range(1, len(stop)):
    while border and stop[at] != stop[border]:
      border = fail[border - 1]
    if stop[at] == stop[border]:
      border += 1
    fail[at] = border
  return fail


class TextStream:
  """The text of a growing list of tokens, sent piece by piece (see the module)."""

  def __init__(self, decode: Callable[[list[int]], str], stops: Sequence[str] = (),
               end_ids: Sequence[int] = ()):
    self._decode = decode
    self._stops = tuple(stop for stop in stops if stop)
    self._fails = [_failure(stop) for stop in self._stops]
    self._states = [0] * len(self._stops)  # Each stop's matched prefix at the text's end.
    self._end_ids = frozenset(int(t) for t in end_ids)
    self._tokens: list[int] = []
    self._start = self._read = 0  # The window: tokens[start:]; tokens[:read] are settled.
    self._context = ""  # The text of tokens[start:read], decoded alone.
    self._settled = 0  # Characters settled (sent or held back).
    self._held = ""  # Settled characters not sent yet: they may begin a stop string.
    self.text = ""
    """What has been sent so far."""
    self.stopped = False
    """Whether a stop string has appeared (the text ends before it)."""

  def add(self, tokens: Sequence[int], *, final: bool = False) -> str:
    """Takes the next tokens; returns the text that may be sent now (all of it when
    `final`: the completion has ended)."""
    if self.stopped:
      return ""
    tokens = [int(t) for t in tokens]
    if final and tokens and tokens[-1] in self._end_ids:  # The token that ended it: not text.
      tokens = tokens[:-1]
    self._tokens.extend(tokens)
    end, window = len(self._tokens), self._decode(self._tokens[self._start:])
    if not final and window[len(self._context):].endswith(_UNFINISHED):
      end, window = self._finished(window)
    new = window[len(self._context):]
    if end > self._read:
      settled = self._decode(self._tokens[self._read:end])
      if settled:  # The settled tokens' text: the next window's context.
        self._start, self._context = self._read, settled
      else:  # Tokens that decode to nothing (padding, a special token) give no context (a
        self._context = self._decode(self._tokens[self._start:end])  # word's space): keep.
      self._read = end
    cut = self._match(new)
    self._settled += len(new)
    self._held += new
    if cut is not None:
      self.stopped, end = True, cut - (self._settled - len(self._held))
    else:
      end = len(self._held) - (0 if final else max(self._states, default=0))
    sent, self._held = self._held[:end], self._held[end:]
    self.text += sent
    return sent

  def _finished(self, window: str) -> tuple[int, str]:
    """The tokens whose text is settled though `window` ends unfinished, and that text:
    the longest of all but 1-3 tokens whose text `window` extends (its last character,
    the unfinished one, is not in it; none: wait for more)."""
    last = len(self._tokens)
    for end in range(last - 1, max(self._read, last - _MOST_UNFINISHED - 1), -1):
      text = self._decode(self._tokens[self._start:end])
      if len(text) < len(window) and window.startswith(text):
        return end, text
    return self._read, self._context

  def _match(self, new: str) -> int | None:
    """Feeds `new` to each stop's automaton; where the earliest stop string found starts
    (in characters settled), or None."""
    cut = None
    for number, (stop, fail) in enumerate(zip(self._stops, self._fails)):
      state = self._states[number]
      for at, char in enumerate(new):
        while state and char != stop[state]:
          state = fail[state - 1]
        if char == stop[state]:
          state += 1
        if state == len(stop):  # This stop's first match: the earliest it can start.
          start = self._settled + at + 1 - len(stop)
          cut = start if cut is None else min(cut, start)
          break
      self._states[number] = state
    return cut
