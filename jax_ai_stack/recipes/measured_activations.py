"""Activations measured, not estimated: XLA's bytes of a one-device train step.

The memory plan (`memory.estimate_memory`) measures what a step keeps for its backward
pass where it has no analytic estimate (a family other than llama's) or where the target
chip's XLA does what the estimate cannot see (a small model on a topology's chip: its
tiles and fusions). `per_row` compiles the step for one device's rows and reads XLA's
memory analysis; `compiled_for` compiles a function for a topology's compile-only device.

Example:
  >>> from flax import nnx
  >>> from jax_ai_stack.recipes import config, optim
  >>> task = tasks.for_config(config.load("lm-tiny", overrides=["model.num_layers=1"]))
  >>> model, optimizer = nnx.eval_shape(lambda: (
  ...     (m := task.build_model(0)), optim.build_optimizer(task.config.optim, m, train_steps=1)))
  >>> rows, source = per_row(task, task.training_loss(task.model_transforms()), model,
  ...                        optimizer, rows=2)
  >>> rows > 0, source
  (True, 'measured: XLA temp bytes of the step on cpu')
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh

from jax_ai_stack import kernels
from jax_ai_stack.recipes import step, tasks


def per_row(task: tasks.Task, loss: step.LossFn, model: nnx.Module, optimizer: nnx.Optimizer,
            rows: int, device: Any = None, *,
            rebuild: Callable[[Any, bool], tuple[nnx.Module, nnx.Optimizer]] | None = None
            ) -> tuple[int, str]:
  """XLA's temporary bytes of the one-device train step for `rows` rows, less gradients,
  per row; and how they were obtained.

  Compiled for `device` (a topology's compile-only device: its chip's XLA and kernels,
  e.g. a TPU's grouped matmul where this host's CPU would pad experts' rows to blocks),
  or for this host's default device. Where XLA reports the peak of its heap (TPU), the
  peak less the arguments (the train state) stands for the temporary bytes: XLA:TPU's
  temporaries leave out most of what the backward pass keeps (lm-tiny on v5e:2x2, 16 rows
  a device: 9 MiB of temporaries, a 114 MiB peak). The batch is `Task.batch_spec` where
  the Task describes it, else the train split's first. Tensor parallelism is not taken
  into account (an overestimate under `fsdp_tp`).

  A step larger than one of `device`'s chips (XLA:TPU refuses to compile it) is measured
  through `rebuild(config, here)`, the run's model and optimizer for another config, built
  for the chip or (`here`) with this host's kernels: a scanned model's identical blocks
  with 2 and 4 layers on the chip, extrapolated to its layers (`fewer_layers`), else the
  whole step here.
  """
  try:
    first = task.batch_spec(1)  # The step's batch (a run on prompts: its completions').
  except NotImplementedError:
    first = None
  if not first:  # Only the data says: its first batch's fields.
    iterator = iter(task.dataset("train", task.config.train.seed))
    try:
      first = next(iterator)
    finally:
      if hasattr(iterator, "close"):
        iterator.close()  # Stops its prefetch thread now.
  batch = {k: jax.ShapeDtypeStruct((rows, *v.shape[1:]), v.dtype) for k, v in first.items()}

  def measure(model, optimizer, device):
    train_step, _, state = step.make_steps(model, optimizer, loss)
    if device is not None:
      analysis = compiled_for(device, train_step, state, batch)
    else:
      analysis = train_step.lower(state, batch).compile().memory_analysis()
    if analysis is None:
      return None, "no memory analysis"
    gradients = sum(x.size * x.dtype.itemsize
                    for x in jax.tree.leaves(nnx.state(model, optimizer.wrt)))
    peak = getattr(analysis, "peak_memory_in_bytes", 0) if device is not None else 0
    if peak:  # XLA:TPU's temporaries leave out most of what the backward pass keeps.
      return peak - analysis.argument_size_in_bytes - gradients, "peak heap bytes"
    return analysis.temp_size_in_bytes - gradients, "temp bytes"

  where = jax.default_backend() if device is None else device.device_kind
  try:
    measured, what = measure(model, optimizer, device)
  except jax.errors.JaxRuntimeError as e:  # XLA:TPU refuses a step larger than its HBM.
    if "RESOURCE_EXHAUSTED" not in str(e):
      raise
    config = task.config.model
    if rebuild is not None and getattr(config, "scan_layers", False) and config.num_layers > 4:
      # Each scanned block keeps the same; 2 and 4, not 1: XLA unrolls a scan of one.
      two, what = measure(*rebuild(fewer_layers(task.config, 2), False), device)
      four, _ = measure(*rebuild(fewer_layers(task.config, 4), False), device)
      measured = two + (four - two) * (config.num_layers - 2) // 2
      where += (f" with 2 and 4 layers, extrapolated to {config.num_layers} (the whole step "
                "does not fit one chip)")
    else:
      built = rebuild(task.config, True) if rebuild is not None else (model, optimizer)
      measured, what = measure(*built, None)
      where = f"{jax.default_backend()} (the step does not fit one {where})"
  if measured is None:
    return 0, f"unknown: XLA reports no memory analysis on {where}"
  return -(-max(measured, 0) // max(rows, 1)), f"measured: XLA {what} of the step on {where}"


def fewer_layers(config: Any, layers: int) -> Any:
  """A recipe config whose scanned decoder has `layers` of its identical blocks."""
  model = config.model
  types = None if model.layer_types is None else model.layer_types[:layers]
  return dataclasses.replace(config, model=dataclasses.replace(model, num_layers=layers,
                                                               layer_types=types))


def compiled_for(device: Any, function: Any, *args: Any) -> Any:
  """XLA's memory analysis of `function` compiled for `device` alone, with the kernels
  lowered for its platform (`kernels.compiling_for`, under a one-device mesh of it)."""
  placed = jax.sharding.SingleDeviceSharding(device)
  args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=placed), args)
  mesh = Mesh([device], ("one",))
  enabled = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)  # No client loads these back.
  try:
    with kernels.compiling_for(device.platform), jax.sharding.use_abstract_mesh(
        mesh.abstract_mesh):
      return function.lower(*args).compile().memory_analysis()
  finally:
    jax.config.update("jax_enable_compilation_cache", enabled)
