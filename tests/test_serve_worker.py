"""EngineWorker: the engine on its own thread; requests from an event loop, each update once."""

import asyncio
import queue
import threading
import types

import pytest
from flax import nnx

from jax_ai_stack.recipes import inference, models
from jax_ai_stack.recipes.serve.worker import EngineStopped, EngineWorker


@pytest.fixture(scope="module")
def model():
  return models.Decoder(models.DecoderConfig.tiny(), rngs=nnx.Rngs(0))


def greedy(prompt, max_tokens=6):
  return inference.Request(tuple(prompt), max_tokens, temperature=0)


async def collect(job):
  tokens, logprobs, reasons = [], [], []
  async for update in job.updates():
    tokens += update.tokens
    logprobs += update.logprobs
    reasons.append(update.finish_reason)
  return tokens, logprobs, reasons


def test_concurrent_requests_get_what_the_engine_gives_them_alone(model):
  prompts = [(256, 104, 105), (256, 72), (256, 1, 2, 3, 4)]
  engine = inference.Engine(model, max_slots=2)  # Alone in an engine of the same shape.
  alone = [engine.run([greedy(p)])[0] for p in prompts]

  async def main():
    worker = EngineWorker(inference.Engine(model, max_slots=2))
    try:
      return await asyncio.gather(*(collect(worker.submit(greedy(p))) for p in prompts))
    finally:
      worker.stop()

  for (tokens, logprobs, reasons), expected in zip(asyncio.run(main()), alone):
    assert tokens == expected.tokens and logprobs == expected.logprobs
    assert reasons[-1] == "length" and not any(reasons[:-1])


def test_a_cancelled_request_frees_its_slot_for_the_next(model):
  async def main():
    worker = EngineWorker(inference.Engine(model, max_slots=1))
    try:
      long = worker.submit(greedy((256, 7), max_tokens=40))
      updates = long.updates()
      await updates.__anext__()  # Running: it holds the only slot.
      worker.cancel(long)
      tokens, _, reasons = await asyncio.wait_for(collect(worker.submit(greedy((256, 8)))), 60)
      return worker.cancelled, worker.running, len(tokens), reasons[-1]
    finally:
      worker.stop()

  assert asyncio.run(main()) == (1, 0, 6, "length")


def test_a_request_the_engine_refuses_fails_alone(model):
  async def main():
    worker = EngineWorker(inference.Engine(model, max_slots=2))
    try:
      bad = worker.submit(inference.Request((256,), 10**6))
      good = worker.submit(greedy((256,)))
      results = await asyncio.gather(collect(bad), collect(good), return_exceptions=True)
      return results
    finally:
      worker.stop()

  refused, (tokens, _, _) = asyncio.run(main())
  assert isinstance(refused, inference.RequestError) and refused.field == "max_tokens"
  assert len(tokens) == 6


def test_after_stop_running_requests_end_with_engine_stopped_and_new_ones_are_refused(model):
  async def main():
    worker = EngineWorker(inference.Engine(model, max_slots=1))
    job = worker.submit(greedy((256,), max_tokens=40))
    updates = job.updates()
    await updates.__anext__()
    await asyncio.get_running_loop().run_in_executor(None, worker.stop)
    with pytest.raises(EngineStopped):
      async for _ in updates:
        pass
    with pytest.raises(EngineStopped, match="shut down"):
      worker.submit(greedy((256,)))

  asyncio.run(main())


def test_a_request_submitted_as_the_engine_thread_dies_is_never_left_waiting(model, monkeypatch):
  """The thread dies (a step fails) between submit's check that it runs and the request
  reaching its queue: the request ends with EngineStopped all the same."""
  from jax_ai_stack.recipes.serve import worker as worker_lib

  engine = inference.Engine(model, max_slots=1)

  def failing_step():
    raise RuntimeError("the device went away")

  monkeypatch.setattr(engine, "step", failing_step)
  state = {}

  class Dying(queue.Queue):
    """A queue that, as the first request is put, kills the engine's thread first."""

    def put(self, item, *args, **kwargs):
      if item[0] == "add" and "killer" not in state:
        state["killer"] = worker_lib.Job(greedy((256,)), asyncio.get_running_loop())
        super().put(("add", [state["killer"]]))  # Its step fails: the thread ends.
        state["thread"].join(0.5)  # Here it has ended, unless submit holds it off.
      super().put(item, *args, **kwargs)

  monkeypatch.setattr(worker_lib, "queue", types.SimpleNamespace(Queue=Dying, Empty=queue.Empty))

  async def main():
    worker = EngineWorker(engine)
    state["thread"] = worker._thread  # pylint: disable=protected-access
    try:
      job = worker.submit(greedy((256,)))
      with pytest.raises(EngineStopped, match="the device went away"):
        await asyncio.wait_for(collect(job), 10)  # Queued then failed, or refused.
      with pytest.raises(EngineStopped):
        worker.submit(greedy((256,)))
    finally:
      worker.stop()

  asyncio.run(main())


def test_any_error_of_the_engine_for_one_request_goes_to_that_request_alone(model, monkeypatch):
  engine = inference.Engine(model, max_slots=2)
  add = engine.add

  def picky_add(request):
    if request.prompt == (256, 13):
      raise KeyError("not this one")
    return add(request)

  monkeypatch.setattr(engine, "add", picky_add)

  async def main():
    worker = EngineWorker(engine)
    try:
      bad, good = worker.submit(greedy((256, 13))), worker.submit(greedy((256, 14)))
      results = await asyncio.gather(collect(bad), collect(good), return_exceptions=True)
      with pytest.raises(KeyError):
        await bad.queued()
      return results, worker.running
    finally:
      worker.stop()

  (refused, (tokens, _, _)), running = asyncio.run(main())
  assert isinstance(refused, KeyError) and len(tokens) == 6 and running == 0


def test_submit_all_queues_all_or_none_checked_on_the_engines_thread(model, monkeypatch):
  engine = inference.Engine(model, max_slots=2)
  check, threads = engine.check, set()

  def recorded(request, index=0):
    threads.add(threading.current_thread().name)
    return check(request, index)

  monkeypatch.setattr(engine, "check", recorded)

  async def main():
    worker = EngineWorker(engine)
    try:
      jobs = worker.submit_all([greedy((256,)), inference.Request((256,), 10**6)])
      outcomes = await asyncio.gather(*(job.queued() for job in jobs), return_exceptions=True)
      return outcomes, worker.running, worker.figures()
    finally:
      worker.stop()

  outcomes, running, figures = asyncio.run(main())
  assert [type(outcome) for outcome in outcomes] == [inference.RequestError] * 2
  assert threads == {"jax-ai-stack-engine"} and running == 0
  assert figures == {"running": 0, "cancelled": 0, "pages_in_use": 0, "peak_pages": 0,
                     "max_pages": engine.max_pages, "shared_prompts": 0, "prefix_hits": 0,
                     "cached_tokens": 0, "cached_pages": 0}


def test_cancels_waiting_in_the_queue_are_not_counted_as_running(model, monkeypatch):
  """A burst of cancels queued behind a long step: `running` (what a 429 is decided on)
  counts the request once, then not at all."""
  engine = inference.Engine(model, max_slots=1)
  step = engine.step
  hold, holding, release = threading.Event(), threading.Event(), threading.Event()

  def slow_step():
    if hold.is_set():
      holding.set()
      release.wait(10)
    return step()

  monkeypatch.setattr(engine, "step", slow_step)

  async def main():
    worker = EngineWorker(engine)
    try:
      job = worker.submit(greedy((256,), max_tokens=40))
      await job.updates().__anext__()
      hold.set()
      await asyncio.get_running_loop().run_in_executor(None, holding.wait, 10)
      for _ in range(5):  # Each of a request's choices, say, or a retry of the cancel.
        worker.cancel(job)
      during = worker.running
      release.set()
      while worker.running:
        await asyncio.sleep(0.01)
      return during, worker.figures()["cancelled"]
    finally:
      release.set()
      worker.stop()

  assert asyncio.run(main()) == (1, 1)


def test_a_speculating_engine_streams_the_same_tokens_and_reports_its_guesses(model):
  """`serve --speculate`: each update may carry several tokens; /health counts the guesses."""
  prompt = (256, 5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6)
  plain = inference.Engine(model, max_slots=2).run([greedy(prompt, 20)])[0]
  engine = inference.Engine(model, max_slots=2, speculation=inference.Speculation(tokens=4))

  async def main():
    worker = EngineWorker(engine)
    try:
      result = await collect(worker.submit(greedy(prompt, 20)))
      return result, worker.figures()
    finally:
      worker.stop()

  (tokens, _, _), figures = asyncio.run(main())
  assert tokens == plain.tokens
  made, kept = engine.speculator.guesses
  assert figures["drafted_tokens"] == made > 0
  assert 0 <= figures["accepted_tokens"] == kept <= figures["drafted_tokens"]
