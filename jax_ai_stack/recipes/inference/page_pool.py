"""One replica's pool of KV-cache pages: who holds each page, and which keep a prompt's chunk.

The engine (`inference.Engine`) takes pages for a request's positions when it admits it and
gives them back when it ends. A request's prompt is prefilled in chunks of the engine's
`prefill_chunk` tokens, always cut at the same places (tokens 0..C-1, C..2C-1, ...), so the
keys and values of a whole chunk depend only on its tokens and those before it, whichever
request computed them. The pages of such a chunk are *kept* under a key that hashes both
(`chunk_keys`); a later request whose prompt begins with the same tokens takes them
(`reuse`), shared and read only, and prefills from the first chunk not kept: automatic prefix
caching, bit for bit what its own prefill would have written. A kept chunk that no request
holds stays until the pool needs its pages, then goes, least recently used first.

Example: a chunk of two pages kept, given back, taken again, then evicted for room.
  >>> pool = PagePool(4, chunk_pages=2)
  >>> pages = pool.take(3)
  >>> keys = chunk_keys((5, 6, 7, 8), chunk=4)
  >>> pool.keep(keys, pages, whole=1); pool.give_back(pages)
  >>> pool.available, pool.kept_pages, pool.reusable(keys)
  (4, 2, 1)
  >>> pool.reuse(keys) == pages[:2], pool.held
  (True, 2)
  >>> pool.give_back(pages[:2]); len(pool.take(4)), pool.kept_pages
  (4, 0)
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Sequence

import numpy as np

__all__ = ["PagePool", "chunk_keys"]


def chunk_keys(prompt: Sequence[int], chunk: int) -> list[bytes]:
  """A key for each whole `chunk`-token chunk of `prompt`: a hash of its tokens and of the
  key before it (so of every token before them)."""
  keys, key = [], b""
  for start in range(0, len(prompt) - chunk + 1, chunk):
    key = hashlib.sha256(key + np.asarray(prompt[start:start + chunk], np.int64).tobytes()
                         ).digest()
    keys.append(key)
  return keys


class PagePool:
  """Pages 1..`pages` of one replica's pool (page 0 is never handed out: idle rows write
  there), each free, held by requests (counted), or kept for a chunk of `chunk_pages` pages
  (see the module)."""

  def __init__(self, pages: int, chunk_pages: int):
    self.chunk_pages = chunk_pages
    self._free = list(range(pages, 0, -1))  # pop() hands out page 1 first.
    self._holders: collections.Counter[int] = collections.Counter()
    self._kept: dict[bytes, tuple[int, ...]] = {}  # A chunk's key -> its pages.
    self._chunk_of: dict[int, bytes] = {}  # A kept page -> its chunk's key.
    self._idle: collections.OrderedDict[bytes, None] = collections.OrderedDict()  # LRU first.
    self._idle_pages = 0  # Theirs, counted as they come and go (`available` is hot).

  @property
  def available(self) -> int:
    """Pages `take` can hand out: the free ones and those of kept chunks no request holds."""
    return len(self._free) + self._idle_pages

  @property
  def held(self) -> int:
    """Pages requests hold (a kept page shared by several counts once)."""
    return len(self._holders)

  @property
  def kept_pages(self) -> int:
    """Pages of kept chunks, held or not."""
    return len(self._chunk_of)

  def reusable(self, keys: Sequence[bytes]) -> int:
    """How many of `keys`, from the first, name kept chunks."""
    count = 0
    while count < len(keys) and keys[count] in self._kept:
      count += 1
    return count

  def fits(self, keys: Sequence[bytes], pages: int) -> bool:
    """Whether a request needing `pages` pages, the first chunks of which `keys` name, can be
    admitted now (the kept chunks it reuses are not also handed out as room)."""
    reused = [self._kept[key] for key in keys[:self.reusable(keys)]]
    idle = sum(len(self._kept[key]) for key in keys[:len(reused)] if key in self._idle)
    return pages - sum(map(len, reused)) <= self.available - idle

  def reuse(self, keys: Sequence[bytes]) -> list[int]:
    """The pages of the kept chunks `keys` name, from the first up to one not kept, each held
    once more."""
    pages = []
    for key in keys[:self.reusable(keys)]:
      if self._idle.pop(key, False) is None:
        self._idle_pages -= len(self._kept[key])
      pages += self._kept[key]
    self._holders.update(pages)
    return pages

  def take(self, count: int) -> list[int]:
    """`count` pages, free ones first, then those of the least recently used idle chunks."""
    while len(self._free) < count:
      key, _ = self._idle.popitem(last=False)
      self._idle_pages -= len(self._kept[key])
      for page in self._kept.pop(key):
        del self._chunk_of[page]
        self._free.append(page)
    pages = [self._free.pop() for _ in range(count)]
    self._holders.update(pages)
    return pages

  def keep(self, keys: Sequence[bytes], pages: Sequence[int], whole: int) -> None:
    """Keeps the last of the first `whole` chunks of a prompt being prefilled (`keys`: its
    chunks', `pages`: the pages it holds) under its key, unless that is no chunk of `keys`
    or a chunk is kept under it already (two requests prefilled it at once: the later one's
    pages stay its own)."""
    if 0 < whole <= len(keys) and keys[whole - 1] not in self._kept:
      chunk = tuple(pages[(whole - 1) * self.chunk_pages:whole * self.chunk_pages])
      self._kept[keys[whole - 1]] = chunk
      self._chunk_of.update((page, keys[whole - 1]) for page in chunk)

  def give_back(self, pages: Sequence[int]) -> None:
    """Each of `pages` held once less. One no longer held is free again, unless it is kept:
    its chunk then waits for reuse, the most recently used (a request's last chunk before
    its first, so that eviction takes a prompt's end before its start)."""
    idle = []
    for page in reversed(pages):
      self._holders[page] -= 1
      if self._holders[page] > 0:
        continue
      del self._holders[page]
      key = self._chunk_of.get(page)
      if key is None:
        self._free.append(page)
      elif key not in idle and not any(p in self._holders for p in self._kept[key]):
        idle.append(key)
    for key in idle:
      self._idle[key] = None
      self._idle_pages += len(self._kept[key])
