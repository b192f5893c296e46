"""The jitted train and eval steps shared by every recipe.

Speed: `nnx.jit` walks the object graph on every call (about 10 ms of Python
per step on a CPU); here the graph is split once into a static `graphdef` and a
`state` pytree, and each step is a plain `jax.jit` over that pytree (about
0.2 ms), merged back inside the trace. The state argument is donated, so XLA
updates parameters and optimizer moments in place. The numbers are the same
bits as `nnx.jit`; benchmarks/train_step.py measures the gap.

Example:
  >>> import optax
  >>> from flax import nnx
  >>> from jax_ai_stack.recipes.models.cnn import CNN, CNNConfig
  >>> model = CNN(CNNConfig(), rngs=nnx.Rngs(0))
  >>> optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
  >>> train_step, _, state = make_steps(model, optimizer, classification_loss)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

Batch = dict[str, jax.Array]
LossFn = Callable[[nnx.Module, Batch], tuple[jax.Array, dict[str, jax.Array]]]


def lm_loss(model: nnx.Module, batch: Batch) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Mean next-token cross-entropy over the tokens `loss_mask` keeps.

  Without a `loss_mask`, padding (segment id 0) is left out.
  """
  logits = model(batch["inputs"], segment_ids=batch.get("segment_ids"),
                 positions=batch.get("positions"))
  losses = optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), batch["targets"]
  )
  if "loss_mask" in batch:
    mask = batch["loss_mask"].astype(jnp.float32)
  elif "segment_ids" in batch:
    mask = (batch["segment_ids"] != 0).astype(jnp.float32)
  else:
    mask = jnp.ones_like(losses)
  tokens = jnp.maximum(mask.sum(), 1.0)
  loss = (losses * mask).sum() / tokens
  return loss, {"tokens": mask.sum()}


def classification_loss(model: nnx.Module, batch: Batch) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Mean cross-entropy of class logits, with accuracy for the logs."""
  logits = model(batch["images"])
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()
  accuracy = (logits.argmax(-1) == batch["labels"]).mean()
  return loss, {"accuracy": accuracy}


def make_steps(
    model: nnx.Module, optimizer: nnx.Optimizer, loss_fn: LossFn
) -> tuple[Callable, Callable, nnx.State]:
  """Returns `(train_step, eval_step, state)`.

  `train_step(state, batch) -> (state, metrics)` donates `state`;
  `eval_step(state, batch) -> metrics` runs the model in eval mode (no
  dropout) and changes nothing.
  """
  model.eval()
  eval_graphdef, _ = nnx.split((model, optimizer))
  model.train()
  graphdef, state = nnx.split((model, optimizer))

  @jax.jit
  def eval_step(state: nnx.State, batch: Batch) -> dict[str, jax.Array]:
    model, _ = nnx.merge(eval_graphdef, state)
    loss, aux = loss_fn(model, batch)
    return {"loss": loss, **aux}

  def train_step_fn(state: nnx.State, batch: Batch) -> tuple[nnx.State, dict[str, jax.Array]]:
    model, optimizer = nnx.merge(graphdef, state)
    (loss, aux), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, batch)
    optimizer.update(model, grads)
    metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), **aux}
    return nnx.state((model, optimizer)), metrics

  train_step = jax.jit(train_step_fn, donate_argnums=0)
  return train_step, eval_step, state


def merge(model: nnx.Module, optimizer: nnx.Optimizer, state: nnx.State) -> None:
  """Writes a step's `state` back into the live `model` and `optimizer` objects."""
  nnx.update((model, optimizer), state)


def host_metrics(metrics: dict[str, Any]) -> dict[str, float]:
  """Device metrics as Python floats (one transfer for the whole dict)."""
  return {k: float(v) for k, v in jax.device_get(metrics).items()}
