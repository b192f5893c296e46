"""SIGTERM and SIGINT as a request to stop: the step in flight finishes, the run saves, then stops.

A training loop asks `received` after each step. On one process a signal is
only recorded. With several, one process must not stop alone (the others would
wait for it in the next collective forever), so the signal goes to JAX's
preemption notifier and Orbax makes every process stop at the same step.

Example:
  >>> import os, signal
  >>> with StopSignal() as stop:
  ...   os.kill(os.getpid(), signal.SIGINT)
  >>> stop.received
  'SIGINT'
"""

from __future__ import annotations

import os
import signal
import threading


class StopSignal:
  """Records SIGTERM/SIGINT so the loop can finish its step, save and stop.

  With several processes (`shared=True`) one process must not stop alone: the
  others would wait for it in the next collective (or the save) forever. So
  SIGTERM is left to JAX's preemption notifier (which `jax.distributed`
  installs), and a SIGINT is passed on to it as a SIGTERM to this process:
  Orbax's `reached_preemption` then makes every process stop and save at the
  same step, the one that got the signal reporting it by name.
  """

  def __init__(self, *, shared: bool = False):
    self.received: str | None = None
    self._shared = shared
    self._signals = (signal.SIGINT,) if shared else (signal.SIGTERM, signal.SIGINT)
    self._previous = {}

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      for sig in self._signals:
        self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def _handle(self, signum, frame):
    del frame
    self.received = signal.Signals(signum).name
    if self._shared:
      os.kill(os.getpid(), signal.SIGTERM)  # To the preemption notifier: every process stops.

  def __exit__(self, *exc):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
