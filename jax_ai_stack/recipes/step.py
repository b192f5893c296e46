"""The jitted train and eval steps shared by every recipe.

Speed: `nnx.jit` walks the object graph on every call (about 10 ms of Python
per step on a CPU); here the graph is split once into a static `graphdef` and a
`state` pytree, and each step is a plain `jax.jit` over that pytree (about
0.2 ms), merged back inside the trace. The state argument is donated, so XLA
updates parameters and optimizer moments in place. The numbers are the same
bits as `nnx.jit`; benchmarks/train_step.py measures the gap.

A batch larger than `microbatch_size` rows is split into micro-batches whose
gradients are accumulated inside the one step (a `lax.scan`), so a batch that
grows (`data.batch_schedule`) past what the devices hold at once still takes
one optimizer step. Micro-batch i takes every k-th row from row i: on a mesh
each device keeps its own rows, nothing moves between them.

Under a mesh, `state_sharding` (from `sharding.state_shardings`) fixes where
every parameter and optimizer moment lives after each step; the batch brings
its own sharding (a global array), and XLA's SPMD partitioner does the rest.

Example:
  >>> import optax
  >>> from flax import nnx
  >>> from jax_ai_stack.recipes.models.cnn import CNN, CNNConfig
  >>> from jax_ai_stack.recipes.tasks import classification_loss
  >>> model = CNN(CNNConfig(), rngs=nnx.Rngs(0))
  >>> optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
  >>> train_step, _, state = make_steps(model, optimizer, classification_loss)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

Batch = dict[str, jax.Array]
LossFn = Callable[[nnx.Module, Batch], tuple[jax.Array, dict[str, jax.Array]]]


def make_steps(
    model: nnx.Module, optimizer: nnx.Optimizer, loss_fn: LossFn, *,
    state_sharding: Any = None, microbatch_size: int | None = None,
) -> tuple[Callable, Callable, nnx.State]:
  """Returns `(train_step, eval_step, state)`.

  `train_step(state, batch) -> (state, metrics)` donates `state`;
  `eval_step(state, batch) -> metrics` runs the model in eval mode (no
  dropout) and changes nothing; it reads the model's half of `state` alone, so a
  finished run read without its optimizer state evaluates too. `state_sharding`: a NamedSharding per state
  leaf; the new state keeps it and the metrics are replicated.
  `microbatch_size`: the most rows one forward and backward pass takes (it must
  divide each batch's rows); None: the whole batch at once.
  """
  model.eval()
  eval_graphdef, _ = nnx.split(model)
  model.train()
  graphdef, state = nnx.split((model, optimizer))

  train_placement, eval_placement = {}, {}  # Unspecified: XLA's choice, from the inputs.
  if state_sharding is not None:
    replicated = jax.tree.leaves(state_sharding)[0].update(spec=jax.sharding.PartitionSpec())
    train_placement = {"out_shardings": (state_sharding, replicated)}
    eval_placement = {"out_shardings": replicated}

  @functools.partial(jax.jit, **eval_placement)
  def eval_step(state: nnx.State, batch: Batch) -> dict[str, jax.Array]:
    model = nnx.merge(eval_graphdef, state[0])  # The model's half: the optimizer's is unread.
    loss, aux = loss_fn(model, batch)
    return {"loss": loss, **aux}

  def train_step_fn(state: nnx.State, batch: Batch) -> tuple[nnx.State, dict[str, jax.Array]]:
    model, optimizer = nnx.merge(graphdef, state)
    # Only what the optimizer updates (all parameters, or LoRA adapters) is differentiated.
    grad_fn = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, optimizer.wrt), has_aux=True)
    rows = jax.tree.leaves(batch)[0].shape[0]
    if microbatch_size is None or rows <= microbatch_size:
      (loss, aux), grads = grad_fn(model, batch)
    else:
      loss, aux, grads = _accumulate(grad_fn, model, optimizer.wrt, batch,
                                     rows // microbatch_size)
    optimizer.update(model, grads)
    metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), **aux}
    return nnx.state((model, optimizer)), metrics

  train_step = jax.jit(train_step_fn, donate_argnums=0, **train_placement)
  return train_step, eval_step, state


def _accumulate(grad_fn, model: nnx.Module, wrt, batch: Batch, count: int):
  """(loss, aux, grads) of `batch` from `count` micro-batches, scanned.

  The micro-batches are weighted by their "tokens" metric where the loss
  reports one (an LM's mean over unpadded tokens: the result is the whole
  batch's mean), else equally. Gradients are summed in float32; the other
  aux metrics are averaged with the same weights and "tokens" is summed.
  """
  split = jax.tree.map(lambda x: jnp.swapaxes(x.reshape(-1, count, *x.shape[1:]), 0, 1), batch)

  @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))
  def body(carry, micro):
    model, summed = carry
    (loss, aux), grads = grad_fn(model, micro)
    weight = aux["tokens"].astype(jnp.float32) if "tokens" in aux else jnp.ones((), jnp.float32)
    summed = jax.tree.map(lambda s, g: s + g.astype(jnp.float32) * weight, summed, grads)
    return (model, summed), (loss, aux, weight)

  params = nnx.state(model, wrt)
  zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
  (_, summed), (losses, aux, weights) = body((model, zeros), split)
  total = weights.sum()
  grads = jax.tree.map(lambda s, p: (s / total).astype(p.dtype), summed, params)
  mean = lambda v: jnp.tensordot(weights, v.astype(jnp.float32), axes=1) / total
  aux = {k: v.sum() if k == "tokens" else mean(v) for k, v in aux.items()}
  return mean(losses), aux, grads


def merge(model: nnx.Module, optimizer: nnx.Optimizer, state: nnx.State) -> None:
  """Writes a step's `state` back into the live `model` and `optimizer` objects."""
  nnx.update((model, optimizer), state)


def host_metrics(metrics: dict[str, Any]) -> dict[str, float]:
  """Device metrics as Python floats (one transfer for the whole dict)."""
  return {k: float(v) for k, v in jax.device_get(metrics).items()}
