"""`train.profile`: a trace of a range of steps, and the memory they hold, for XProf.

`train.profile: "10:15"` traces steps 10 to 14 (a Python range of the step
numbers the logs print) with `jax.profiler` into `WORKDIR/profile/`, each step
annotated as `train_step` with its number, so XProf's overview page and trace
viewer show each step and what ran in it. The device memory held after the
first traced step is saved beside it (`memory.prof`, pprof's format). One line
says where the trace is and how to open it: `xprof --logdir WORKDIR/profile`
(the `profile` extra installs XProf; TensorBoard's profile plugin reads it too).

Tracing slows the traced steps, so their step times are not the run's; the
losses and the bits of the run are unchanged.

Example:
  >>> describe(range(10, 15)), describe(range(3, 4))
  ('steps 10-14', 'step 3')
"""

from __future__ import annotations

import contextlib
import pathlib
from typing import Any

import jax

PROFILE_DIR = "profile"
"""In the workdir: the trace (`plugins/profile/<time>/*.xplane.pb`) and `memory.prof`."""
MEMORY_FILE = "memory.prof"
STEP_NAME = "train_step"
"""What each traced step is annotated as (with its number)."""


def describe(steps: range) -> str:
  last = steps.stop - 1
  return f"step {steps.start}" if last == steps.start else f"steps {steps.start}-{last}"


class StepProfiler:
  """Starts the trace as the range's first step is dispatched, stops it after its last.

  `steps` None (or `enabled` False: a process of a multi-host job other than
  the first) traces nothing.
  """

  def __init__(self, steps: range | None, workdir: pathlib.Path, *, enabled: bool = True):
    self.steps = steps if enabled else None
    self.directory = pathlib.Path(workdir) / PROFILE_DIR
    self.tracing = False

  @contextlib.contextmanager
  def step(self, number: int):
    """Around dispatching step `number`: the trace starts with the range, and each
    traced step is annotated."""
    if self.steps is not None and number == self.steps.start and not self.tracing:
      self.directory.mkdir(parents=True, exist_ok=True)
      jax.profiler.start_trace(str(self.directory))
      self.tracing = True
    if not self.tracing:
      yield
      return
    with jax.profiler.StepTraceAnnotation(STEP_NAME, step_num=number):
      yield

  def after(self, number: int, state: Any) -> str | None:
    """After step `number` was dispatched: the memory profile after the first traced
    step; at the range's last step the trace ends, and the line to print comes back."""
    if not self.tracing:
      return None
    if number == self.steps.start:
      jax.block_until_ready(state)
      jax.profiler.save_device_memory_profile(str(self.directory / MEMORY_FILE))
    return self.stop(state) if number >= self.steps.stop - 1 else None

  def stop(self, state: Any) -> str | None:
    """Ends a trace in progress (once the steps in flight are done; the run stopping
    inside the range ends it early); the line to print, None when none was running."""
    if not self.tracing:
      return None
    jax.block_until_ready(state)
    jax.profiler.stop_trace()
    self.tracing = False
    return (f"profile of {describe(self.steps)} in {self.directory}: open it with "
            f"`xprof --logdir {self.directory}` (pip install 'jax-ai-stack[profile]')")
