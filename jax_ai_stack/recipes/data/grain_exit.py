"""Grain iterators still open when the interpreter exits, closed while Grain can close them.

Left to the garbage collector during shutdown, Grain's `DatasetIterator.__del__`
finds its modules torn down and prints "Exception ignored in ... 'NoneType'
object has no attribute 'Empty'". `build_dataset` wraps its pipeline in
`ClosedAtExit`, whose iterators an `atexit` hook closes first.

Example:
  >>> import grain
  >>> ds = ClosedAtExit(grain.MapDataset.range(3).to_iter_dataset())
  >>> iterator = iter(ds)
  >>> next(iterator), iterator in _open_iterators
  (0, True)
"""

from __future__ import annotations

import atexit
import weakref

import grain


class ClosedAtExit(grain.IterDataset):
  """Its parent, whose iterators are closed at interpreter exit if still open.

  The iterator is the parent's own (same `get_state`/`set_state` and Orbax
  checkpointing); it is only remembered in a `WeakSet`, so tracking keeps
  nothing alive.
  """

  def __iter__(self) -> grain.DatasetIterator:
    iterator = self._parent.__iter__()
    _open_iterators.add(iterator)
    return iterator

  def __str__(self) -> str:
    return "ClosedAtExit"


_open_iterators: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_open_iterators() -> None:
  """Closes this module's iterators still open, while Grain can still close cleanly.

  atexit runs before module teardown. Grain closes every iterator again from
  `__del__` later in shutdown, and its thread-prefetch `close` (also used by
  `mp_prefetch` for each worker) is not idempotent: a second call looks up
  module globals that are gone by then. Once ours are closed, a closed one
  has nothing left to release, so from here on a second `close` returns.

  That last part patches a grain class: grain 0.2.18's `DatasetIterator.close`
  promises to be idempotent and `ThreadPrefetchDatasetIterator.close` breaks
  the promise (even after an explicit `close()`, a script prints "Exception
  ignored" at exit). The patch only adds the check the base class has, and
  only once the interpreter is exiting; per-object fixes cannot reach the
  iterators `mp_prefetch` builds inside. Remove it with a grain that checks.
  """
  iterators = list(_open_iterators)
  for iterator in iterators:
    iterator.close()
  if not iterators:
    return
  thread_prefetch = grain.experimental.ThreadPrefetchDatasetIterator
  close = thread_prefetch.close

  def close_once(self) -> None:
    if not self._closed:  # pylint: disable=protected-access
      close(self)

  thread_prefetch.close = close_once
