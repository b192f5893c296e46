"""Activations measured from XLA's compiled one-device step: per row, and said so."""

from __future__ import annotations

from flax import nnx

from jax_ai_stack.recipes import config, measured_activations, optim, tasks


def test_the_measured_bytes_are_per_row_and_grow_with_the_model():
  def measured(*overrides: str, rows: int) -> tuple[int, str]:
    task = tasks.for_config(config.load("lm-tiny", overrides=["model.num_layers=1", *overrides]))
    model, optimizer = nnx.eval_shape(lambda: (
        (m := task.build_model(0)), optim.build_optimizer(task.config.optim, m, train_steps=1)))
    return measured_activations.per_row(task, task.training_loss(task.model_transforms()),
                                        model, optimizer, rows=rows)

  two, source = measured(rows=2)
  four, _ = measured(rows=4)
  deeper, _ = measured("model.num_layers=3", rows=2)
  assert source == "measured: XLA temp bytes of the step on cpu"
  assert 0.7 < four / two < 1.3  # Per row: twice the rows, about the same figure.
  assert deeper > 1.5 * two  # Each block keeps its own.
