"""The engine on a thread of its own, fed from the server's event loop.

The engine is synchronous: one `step` decodes a few tokens for every running
request, and a step takes as long as the model does. It runs on one thread
(`EngineWorker`), which alone touches the engine: it checks each request
(`engine.check`), adds it, steps, and measures what /health reports. HTTP handlers
on the event loop `submit` requests and `cancel` them (a client went away), and
receive each request's new tokens, or the error that ended it, on an
`asyncio.Queue` as the steps produce them. One lock orders `submit` against the
thread's end, so a request is either refused (`EngineStopped`) or ended by the
thread, never left waiting.

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
    self.ended = False  # Its last update or error is out (worker's thread, under the lock).
    self._loop = loop
    self._updates: asyncio.Queue[Update | BaseException] = asyncio.Queue()
    self._queued = asyncio.Event()
    self._refusal: BaseException | None = None

  async def queued(self) -> None:
    """Returns once the engine has queued the request (checked on the worker's thread);
    raises what refused it (`engine.RequestError`, `EngineStopped`)."""
    await self._queued.wait()
    if self._refusal is not None:
      raise self._refusal

  async def updates(self) -> AsyncIterator[Update]:
    """Each step's update until the request ends; raises the error that ended it instead
    (`EngineStopped` if the engine did)."""
    while True:
      update = await self._updates.get()
      if isinstance(update, BaseException):
        raise update
      yield update
      if update.finish_reason:
        return

  def _send(self, item: Update | BaseException) -> None:
    """From the worker's thread: hands `item` to the loop (gone: nobody waits)."""
    with contextlib.suppress(RuntimeError):  # The loop has closed.
      self._loop.call_soon_threadsafe(self._updates.put_nowait, item)

  def _answer(self, refusal: BaseException | None) -> None:
    """From the worker's thread: the request is queued in the engine, or `refusal` says
    why not."""
    def answer():
      self._refusal = refusal
      self._queued.set()
    with contextlib.suppress(RuntimeError):
      self._loop.call_soon_threadsafe(answer)


class EngineWorker:
  """Runs `engine` on a daemon thread until `stop` (see the module)."""

  def __init__(self, engine: engine_lib.Engine,
               around: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext):
    """`around`: a context the thread runs in (tokamax's tuned kernel configs, which it
    reads when the engine traces a program)."""
    self.engine, self._around = engine, around
    self._commands: queue.Queue = queue.Queue()
    # One lock orders submit against the thread's end: a request is queued before the
    # queue is emptied for the last time, or refused.
    self._lock = threading.Lock()
    self._closed = False
    self._failure: BaseException | None = None
    self._jobs: dict[int, Job] = {}
    self._open = 0  # Jobs submitted that have not ended (under the lock).
    self.cancelled = 0
    """Requests cancelled before they ended (their clients went away)."""
    self._figures = self._measure()
    self._thread = threading.Thread(target=self._run, name="jax-ai-stack-engine", daemon=True)
    self._thread.start()

  @property
  def running(self) -> int:
    """Requests submitted and not yet ended (waiting or decoding); cancels do not count."""
    return self._open

  @property
  def stopped(self) -> bool:
    """Whether the engine's thread has ended (new requests are refused)."""
    return self._closed

  def figures(self) -> dict:
    """What /health reports: requests running and cancelled, the KV cache's pages in use,
    at peak and in all, and what sharing spared: requests that copied a prompt's pages
    (`shared_prompts`), reused kept prompt chunks (`prefix_hits`, the `cached_tokens` they
    spared) and the pages kept (`cached_pages`); with speculation, the tokens guessed and
    kept (`drafted_tokens`, `accepted_tokens`) (read by the worker's thread after each step
    or command)."""
    return {"running": self._open, **self._figures}

  def submit(self, request: engine_lib.Request) -> Job:
    """Queues one request (see `submit_all`)."""
    return self.submit_all([request])[0]

  def submit_all(self, requests: list[engine_lib.Request]) -> list[Job]:
    """Queues requests together, checked on the worker's thread (`engine.check`): all are
    queued, or each gets the first one's error, from `Job.queued` and `Job.updates`.
    Raises `EngineStopped` if the engine's thread has ended."""
    loop = asyncio.get_running_loop()
    jobs = [Job(request, loop) for request in requests]
    with self._lock:
      if self._closed:
        raise EngineStopped(f"the generation engine has stopped: {self._failure or 'shut down'}")
      self._open += len(jobs)
      self._commands.put(("add", jobs))
    return jobs

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
        command, subject = self._commands.get(block=block)
      except queue.Empty:
        self._figures = self._measure()
        return True
      block = False
      if command == "stop":
        return False
      if command == "add":
        self._add(subject)
      elif subject.index in self._jobs:  # Cancel one still running.
        self.cancelled += self.engine.cancel(subject.index)
        del self._jobs[subject.index]
        self._end(subject, None)

  def _add(self, jobs: list[Job]) -> None:
    """Queues `jobs` in the engine if each passes its check, else none: every error goes
    to the jobs (this request's alone), never up to the thread."""
    try:
      for number, job in enumerate(jobs):
        self.engine.check(job.request, number)
    except Exception as e:  # pylint: disable=broad-except
      for job in jobs:
        job._answer(e)  # pylint: disable=protected-access
        self._end(job, e)
      return
    for job in jobs:
      try:
        job.index = self.engine.add(job.request)
      except Exception as e:  # pylint: disable=broad-except
        job._answer(e)  # pylint: disable=protected-access
        self._end(job, e)
        continue
      self._jobs[job.index] = job
      job._answer(None)  # pylint: disable=protected-access

  def _end(self, job: Job, last: Update | BaseException | None) -> None:
    """Counts `job` as ended and hands it `last` (None: nothing, it was cancelled)."""
    with self._lock:
      if job.ended:
        return
      job.ended = True
      self._open -= 1
    if last is not None:
      job._send(last)  # pylint: disable=protected-access

  def _step(self) -> None:
    out = []
    for completion in self.engine.step():
      job = self._jobs.get(completion.index)
      if job is None:
        continue
      if completion.finish_reason:  # Not counted as running once its last update is out.
        del self._jobs[completion.index]
      start, job.sent = job.sent, len(completion.tokens)
      text_start, job.sent_text = job.sent_text, len(completion.text)
      out.append((job, Update(completion.tokens[start:], completion.logprobs[start:],
                              completion.top_logprobs[start:], completion.finish_reason,
                              completion.text[text_start:])))
    self._figures = self._measure()  # Before the updates: a client that has its last
    for job, update in out:          # one then finds /health up to date.
      if update.finish_reason:
        self._end(job, update)
      else:
        job._send(update)  # pylint: disable=protected-access

  def _measure(self) -> dict:
    """The engine's figures for /health (worker's thread, or before it starts)."""
    engine = self.engine
    return {"cancelled": self.cancelled, "pages_in_use": engine.pages_in_use,
            "peak_pages": engine.peak_pages, "max_pages": engine.max_pages,
            "shared_prompts": engine.shared_prompts, "prefix_hits": engine.prefix_hits,
            "cached_tokens": engine.cached_tokens, "cached_pages": engine.cached_pages,
            **({"drafted_tokens": int(engine.speculator.guesses[0]),
                "accepted_tokens": int(engine.speculator.guesses[1])}
               if engine.speculator else {})}

  def _fail(self, error: BaseException) -> None:
    """Refuses new requests, then ends every request running or still queued with `error`."""
    with self._lock:
      self._closed = True
      queued = []
      while not self._commands.empty():
        command, subject = self._commands.get()
        if command == "add":
          queued += subject
    for job in queued:
      job._answer(error)  # pylint: disable=protected-access
    for job in [*self._jobs.values(), *queued]:
      self._end(job, error)
    self._jobs.clear()
