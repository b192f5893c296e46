"""A completion's text as its tokens arrive: the new text at each step, cut at a stop string.

Tokens do not map to whole characters (a byte-level token may be half of one) and
a stop string may be split over several tokens, so the text of the tokens so far
is decoded whole each time, and what is sent holds back two things: a trailing
U+FFFD (an unfinished UTF-8 sequence) and an ending that could still grow into a
stop string. The stop string itself is never sent, nor a last token that ended the
completion (EOS, end of turn: `end_ids`).

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


class TextStream:
  """The text of a growing list of tokens, sent piece by piece (see the module)."""

  def __init__(self, decode: Callable[[list[int]], str], stops: Sequence[str] = (),
               end_ids: Sequence[int] = ()):
    self._decode, self._stops = decode, tuple(stop for stop in stops if stop)
    self._end_ids = frozenset(int(t) for t in end_ids)
    self._tokens: list[int] = []
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
    full = self._decode(self._tokens)
    cut = min((at for at in (full.find(stop) for stop in self._stops) if at >= 0), default=-1)
    if cut >= 0:
      self.stopped, end = True, cut
    elif final:
      end = len(full)
    else:
      end = len(full) - self._held_back(full)
    new = full[len(self.text):end] if end > len(self.text) else ""
    self.text += new
    return new

  def _held_back(self, full: str) -> int:
    """How many characters at the end of `full` may still change or begin a stop string."""
    unfinished = len(full) - len(full.rstrip(_UNFINISHED))
    rest = full[:len(full) - unfinished]
    partial = max((size for stop in self._stops for size in range(len(stop) - 1, 0, -1)
                   if rest.endswith(stop[:size])), default=0)
    return unfinished + partial
