"""Activations measured from XLA's compiled one-device step: per row, and said so."""

from __future__ import annotations

import types

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


def _run(*overrides: str):
  """A task of lm-tiny and its abstract model and optimizer."""
  task = tasks.for_config(config.load("lm-tiny", overrides=list(overrides)))
  return task, *_built(task.config)


def _built(run):
  def create():
    model = tasks.for_config(run).build_model(0)
    return model, optim.build_optimizer(run.optim, model, train_steps=1)
  return nnx.eval_shape(create)


def _chip_refusing_the_first_step(monkeypatch):
  """A chip (here: this CPU, compiled as a chip's step is) that refuses the first step it is
  given, as XLA:TPU refuses one larger than its HBM, and compiles the others."""
  import jax

  given = []

  def compiled_for(device, function, *args):
    given.append(args)
    if len(given) == 1:
      raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: larger than the chip's HBM")
    analysis = function.lower(*args).compile().memory_analysis()  # XLA:CPU's temporaries
    return types.SimpleNamespace(temp_size_in_bytes=analysis.temp_size_in_bytes)  # alone.
  monkeypatch.setattr(measured_activations, "compiled_for", compiled_for)


def test_a_step_the_chip_refuses_is_measured_here_with_this_host_s_kernels(monkeypatch):
  """Unrolled: the whole step is measured on this host, rebuilt with this host's kernels
  (the chip's Mosaic kernels compile for the chip only)."""
  import jax

  _chip_refusing_the_first_step(monkeypatch)
  task, model, optimizer = _run("model.num_layers=3")
  loss = task.training_loss(task.model_transforms())
  rebuilt = []
  chip = jax.devices()[0]
  measured, source = measured_activations.per_row(
      task, loss, model, optimizer, rows=2, device=chip,
      rebuild=lambda run, here: rebuilt.append((run.model.num_layers, here)) or _built(run))
  assert rebuilt == [(3, True)] and measured > 0
  assert source == f"measured: XLA temp bytes of the step on cpu (the step does not fit one " \
                   f"{chip.device_kind})"


def test_a_scanned_step_the_chip_refuses_is_extrapolated_from_two_and_four_layers_on_it(
    monkeypatch):
  import jax

  task, model, optimizer = _run("model.num_layers=6", "model.scan_layers=true")
  loss = task.training_loss(task.model_transforms())
  whole, _ = measured_activations.per_row(task, loss, model, optimizer, rows=2)
  _chip_refusing_the_first_step(monkeypatch)
  rebuilt = []
  extrapolated, source = measured_activations.per_row(
      task, loss, model, optimizer, rows=2, device=jax.devices()[0],
      rebuild=lambda run, here: rebuilt.append((run.model.num_layers, here)) or _built(run))
  assert rebuilt == [(2, False), (4, False)]
  assert source.endswith("with 2 and 4 layers, extrapolated to 6 (the whole step does not fit "
                         "one chip)"), source
  assert 0.95 < extrapolated / whole < 1.05, (extrapolated, whole)
