"""`held_out`: a run's eval metrics, and the iterator it closes on leaving."""

from __future__ import annotations

import types

import pytest

from jax_ai_stack.errors import ConfigError
from jax_ai_stack.recipes import held_out


class Closing:
  """An iterator over 0, 1, 2, ... that records whether it was closed."""

  def __init__(self):
    self.count, self.closed = 0, False

  def __iter__(self):
    return self

  def __next__(self):
    self.count += 1
    return self.count - 1

  def close(self):
    self.closed = True


def test_opened_closes_the_iterator_even_when_the_body_raises():
  iterator = Closing()
  with pytest.raises(RuntimeError):
    with held_out.opened(iterator) as it:
      next(it)
      raise RuntimeError("the body failed")
  assert iterator.closed and iterator.count == 1


def test_a_run_without_validation_says_evaluation_is_off():
  run = types.SimpleNamespace(validation=None)
  with pytest.raises(ConfigError, match=r"evaluation is off \(train.eval_every=0\)"):
    held_out.evaluate(run)


def test_the_means_stop_at_eval_batches_and_name_an_empty_split():
  seen = []

  def eval_step(state, batch):
    seen.append(batch)
    return {"loss": float(batch), "tokens": 4.0}

  run = types.SimpleNamespace(
      config=types.SimpleNamespace(train=types.SimpleNamespace(eval_batches=2)),
      eval_step=eval_step, state=None, placement=types.SimpleNamespace(batch=lambda b: b),
      validation=[1.0, 3.0, 100.0], task=types.SimpleNamespace(
          rollouts=None, evaluation=lambda metrics: metrics))
  assert held_out.evaluate(run) == {"eval_loss": 2.0}  # "tokens" is no metric.
  assert seen == [1.0, 3.0]
  run.validation = []
  with pytest.raises(ConfigError, match="the validation split has no full batch"):
    held_out.evaluate(run)
