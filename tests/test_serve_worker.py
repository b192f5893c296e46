"""EngineWorker: the engine on its own thread; requests from an event loop, each update once."""

import asyncio

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
