"""SIGTERM and SIGINT become a request to stop, and the handlers before them come back."""

from __future__ import annotations

import os
import signal

from jax_ai_stack.recipes.stop_signal import StopSignal


def test_a_signal_is_recorded_and_the_previous_handlers_return():
  before = signal.getsignal(signal.SIGTERM)
  with StopSignal() as stop:
    assert stop.received is None
    os.kill(os.getpid(), signal.SIGTERM)
    assert stop.received == "SIGTERM"
  assert signal.getsignal(signal.SIGTERM) is before


def test_with_several_processes_sigint_goes_on_as_sigterm_to_the_preemption_notifier():
  got = []
  previous = signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
  try:  # The SIGTERM handler stands in for JAX's preemption notifier.
    with StopSignal(shared=True) as stop:
      os.kill(os.getpid(), signal.SIGINT)
    assert stop.received == "SIGINT" and got == [signal.SIGTERM]
  finally:
    signal.signal(signal.SIGTERM, previous)
