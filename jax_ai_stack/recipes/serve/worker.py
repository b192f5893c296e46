"""The engine on a thread of its own, fed from the server's event loop.

The engine is synchronous: one `step` decodes a few tokens for every running
request, and a step takes as long as the model does. It runs on one thread
(`EngineWorker`), which alone touches the engine; HTTP handlers on the event
loop `submit` requests and `cancel` them (a client went away), and receive each
request's new tokens on an `asyncio.Queue` as the steps produce them.

Example:
  >>> import asyncio
  >>> from flax import nnx
  >>> from jax_ai_stack.recipes import inference, models
  >>> model = models.Decoder(models.DecoderConfig.tiny(), rngs=nnx.Rngs(0))
  >>> async def main():
  ...   worker = EngineWorker(inference.Engine(model, max_slots=2))
  ...   job = worker.submit(inference.Request((256, 104), max_tokens=3, temperature=0))
  ...   updates = [update async for update in job.updates()]
  ...   worker.stop()
  ...   return sum(len(u.tokens) for u in updates), updates[-1].finish_reason
  >>> asyncio.run(main())
  (3, 'length')
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable

from jax_ai_stack.recipes.inference import engine as engine_lib

__all__ = ["EngineStopped", "EngineWorker", "Job", "Update"]

_log = logging.getLogger(__name__)


class EngineStopped(RuntimeError):
  """The engine's thread has ended (stopped, or a step failed): nothing more is decoded."""


@dataclasses.dataclass(frozen=True)
class Update:
  """What one step added to a request: its new tokens, their log-probs (and alternatives),
  and the new text (an engine given `decode`: cut at a stop string, an end token left out)."""

  tokens: list[int]
  logprobs: list[float]
  top_logprobs: list[list[tuple[int, float]]]
  finish_reason: str
  """"" while it runs; "stop" (a stop token or string) or "length" with its last update."""
  text: str = ""


class Job:
  """One request in the engine, as the event loop sees it."""

  def __init__(self, request: engine_lib.Request, loop: asyncio.AbstractEventLoop):
    self.request = request
    self.index: int | None = None  # The engine's, set on the worker's thread.
    self.sent = 0  # Tokens handed to the loop so far (worker's thread).
    self.sent_text = 0  # Characters of text handed to the loop so far (worker's thread).
    self._loop = loop
    self._updates: asyncio.Queue[Update | BaseException] = asyncio.Queue()

  async def updates(self) -> AsyncIterator[Update]:
    """Each step's update until the request ends; raises `EngineStopped` if the engine does."""
    while True:
      update = await self._updates.get()
      if isinstance(update, BaseException):
        raise update
      yield update
      if update.finish_reason:
        return

  def _send(self, item: Update | BaseException) -> None:
    """From the worker's thread: hands `item` to the loop."""
    self._loop.call_soon_threadsafe(self._updates.put_nowait, item)


class EngineWorker:
  """Runs `engine` on a daemon thread until `stop` (see the module)."""

  def __init__(self, engine: engine_lib.Engine,
               around: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext):
    """`around`: a context the thread runs in (tokamax's tuned kernel configs, which it
    reads when the engine traces a program)."""
    self.engine, self._around = engine, around
    self._commands: queue.Queue = queue.Queue()
    self._jobs: dict[int, Job] = {}
    self._failure: BaseException | None = None
    self.cancelled = 0
    """Requests cancelled before they ended (their clients went away)."""
    self._thread = threading.Thread(target=self._run, name="jax-ai-stack-engine", daemon=True)
    self._thread.start()

  @property
  def running(self) -> int:
    """Requests added and not yet ended (waiting or decoding)."""
    return len(self._jobs) + self._commands.qsize()

  def submit(self, request: engine_lib.Request) -> Job:
    """Queues a request checked with `engine.check`; its updates arrive on the running loop."""
    if not self._thread.is_alive():
      raise EngineStopped(f"the generation engine has stopped: {self._failure or 'shut down'}")
    job = Job(request, asyncio.get_running_loop())
    self._commands.put(("add", job))
    return job

  def cancel(self, job: Job) -> None:
    """Frees the request's slot (its client went away); no more updates are sent."""
    self._commands.put(("cancel", job))

  def stop(self) -> None:
    """Ends the thread after the step under way; requests still running get `EngineStopped`."""
    self._commands.put(("stop", None))
    self._thread.join()

  def _run(self) -> None:
    try:
      with self._around():
        while self._obey(block=not self.engine.busy):
          if self.engine.busy:
            self._step()
      self._fail(EngineStopped("the generation engine has stopped: shut down"))
    except BaseException as e:  # pylint: disable=broad-except
      _log.exception("the generation engine failed")
      self._failure = e
      self._fail(EngineStopped(f"the generation engine has stopped: {e!r}"))

  def _obey(self, block: bool) -> bool:
    """Carries out the commands queued so far (waiting for one if `block`); False at stop."""
    while True:
      try:
        command, job = self._commands.get(block=block)
      except queue.Empty:
        return True
      block = False
      if command == "stop":
        return False
      if command == "add":
        try:
          job.index = self.engine.add(job.request)
        except ValueError as e:  # Unchecked by the caller: this request's error alone.
          job._send(e)  # pylint: disable=protected-access
          continue
        self._jobs[job.index] = job
      elif job.index in self._jobs:
        self.cancelled += self.engine.cancel(job.index)
        del self._jobs[job.index]

  def _step(self) -> None:
    for completion in self.engine.step():
      job = self._jobs.get(completion.index)
      if job is None:
        continue
      if completion.finish_reason:  # Not counted as running once its last update is out.
        del self._jobs[completion.index]
      start, job.sent = job.sent, len(completion.tokens)
      text_start, job.sent_text = job.sent_text, len(completion.text)
      update = Update(completion.tokens[start:], completion.logprobs[start:],
                      completion.top_logprobs[start:], completion.finish_reason,
                      completion.text[text_start:])
      job._send(update)  # pylint: disable=protected-access

  def _fail(self, error: BaseException) -> None:
    """Ends every request running or still queued with `error`."""
    while not self._commands.empty():
      command, job = self._commands.get()
      if command == "add":
        self._jobs[id(job)] = job
    for job in self._jobs.values():
      job._send(error)  # pylint: disable=protected-access
    self._jobs.clear()
