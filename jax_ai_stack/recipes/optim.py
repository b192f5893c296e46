"""Optax chains from an `OptimConfig`.

`build` returns a plain `optax.GradientTransformation`;
`build_optimizer` wraps it for a model as an `nnx.Optimizer` over its parameters:
clip by global norm -> optimizer (with masked weight decay) -> optional gradient
accumulation (`optax.MultiSteps`). A mixture of experts' choice bias, where the model moves
it (`MoeConfig.correction_update`), takes its own sign step instead (`BALANCED`). The
learning rate follows `build_schedule`,
which the trainer also calls to log the rate of each step: a pure function of
the step is simpler to log than digging it out of the optimizer state.

Example:
  >>> import jax.numpy as jnp
  >>> config = OptimConfig(name="sgd", learning_rate=0.5, schedule="constant",
  ...                      warmup_steps=0, b1=0.0, weight_decay=0.0, grad_clip_norm=None)
  >>> tx = build(config, total_steps=10)
  >>> params = {"w": jnp.ones(2)}
  >>> updates, _ = tx.update({"w": jnp.ones(2)}, tx.init(params), params)
  >>> updates["w"].tolist()  # Plain SGD: -learning_rate * gradient.
  [-0.5, -0.5]
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jax_ai_stack.recipes.optim_config import OptimConfig


def build_schedule(config: OptimConfig, total_steps: int) -> optax.Schedule:
  """Learning rate as a function of the optimizer step (`total_steps` updates in all).

  With `restarts`, each span between restarts (in updates: a restart's step over
  `accumulate_steps`) is a schedule of its own, warming up from where the span
  before ended (WSD with pit stops: decay, re-warm, go on).
  """
  bounds = sorted({r // config.accumulate_steps for r in config.restarts} - {0})
  edges = [0, *bounds, max(total_steps, bounds[-1] + 1 if bounds else 1)]
  spans, start = [], 0.0
  for begin, end in zip(edges, edges[1:]):
    spans.append(_span(config, end - begin, start))
    with jax.ensure_compile_time_eval():  # Built inside traced code too (the optimizer's init).
      start = float(spans[-1](end - begin - 1))
  return spans[0] if not bounds else optax.join_schedules(spans, bounds)


def _span(config: OptimConfig, total_steps: int, start: float) -> optax.Schedule:
  """One warmup (from `start`) and shape over `total_steps` updates."""
  peak, warmup = config.learning_rate, min(config.warmup_steps, total_steps)
  final = peak * config.final_lr_ratio
  remaining = max(total_steps - warmup, 1)
  if config.schedule == "constant":
    after = optax.constant_schedule(peak)
  elif config.schedule == "cosine":
    after = optax.cosine_decay_schedule(peak, remaining, alpha=config.final_lr_ratio)
  elif config.schedule == "linear":
    after = optax.linear_schedule(peak, final, remaining)
  else:  # wsd
    decay = max(int(round(total_steps * config.wsd_decay_fraction)), 1)
    stable = max(remaining - decay, 0)
    after = optax.join_schedules(
        [optax.constant_schedule(peak), optax.linear_schedule(peak, final, decay)], [stable]
    )
  if warmup == 0:
    return after
  return optax.join_schedules([optax.linear_schedule(start, peak, warmup), after], [warmup])


def decay_mask(config: OptimConfig):
  """A mask function: True for parameters that get weight decay."""
  patterns = [re.compile(p) for p in config.no_decay]

  def mask(params):
    return jax.tree_util.tree_map_with_path(
        lambda path, _: not any(p.search(jax.tree_util.keystr(path, simple=True, separator="/")) for p in patterns), params
    )

  return mask


BALANCED = re.compile(r"correction_bias")
"""The parameters a balancing update moves (DeepSeek-V3's choice bias, `models.moe`): by
`correction_update` against the sign of their gradient, the load above balance."""


def build(config: OptimConfig, total_steps: int, *, correction_update: float = 0.0
          ) -> optax.GradientTransformation:
  """The optimizer chain; `total_steps` counts optimizer updates (for the schedule);
  `correction_update` > 0: the `BALANCED` parameters' sign step, at each update."""
  lr = build_schedule(config, total_steps)
  mask = decay_mask(config)
  wd = config.weight_decay
  if config.name == "adamw":
    optimizer = optax.adamw(lr, b1=config.b1, b2=config.b2, eps=config.eps, weight_decay=wd, mask=mask)
  elif config.name == "lion":
    optimizer = optax.lion(lr, b1=config.b1, b2=config.b2, weight_decay=wd, mask=mask)
  elif config.name == "adafactor":
    optimizer = optax.adafactor(lr, weight_decay_rate=wd or None, weight_decay_mask=mask)
  elif config.name == "sgd":
    optimizer = optax.chain(
        optax.add_decayed_weights(wd, mask=mask),
        optax.sgd(lr, momentum=config.b1 or None, nesterov=bool(config.b1)),
    )
  else:  # muon
    optimizer = optax.contrib.muon(
        lr, beta=config.b1, eps=config.eps, weight_decay=wd, weight_decay_mask=mask,
        adam_b1=config.b1, adam_b2=config.b2,
    )
  parts = [optimizer]
  if config.grad_clip_norm is not None:
    parts.insert(0, optax.clip_by_global_norm(config.grad_clip_norm))
  tx = optax.chain(*parts) if len(parts) > 1 else optimizer
  if correction_update:  # Before accumulation: once an update, on the summed gradients.
    tx = _with_balancing(tx, correction_update)
  if config.accumulate_steps > 1:
    tx = optax.MultiSteps(tx, every_k_schedule=config.accumulate_steps).gradient_transformation()
  return tx


def _with_balancing(tx: optax.GradientTransformation, speed: float
                    ) -> optax.GradientTransformation:
  """`tx` whose `BALANCED` parameters step by -speed * sign(gradient) instead (`tx` sees
  their gradients as zeros, so its state keeps the parameters' tree: no optax.MaskedNode
  for the sharding and checkpoint code to place)."""

  def balanced(tree):
    return jax.tree_util.tree_map_with_path(
        lambda path, _: bool(BALANCED.search(jax.tree_util.keystr(path))), tree)

  def update(grads, state, params=None):
    which = balanced(grads)
    rest = jax.tree.map(lambda g, b: jnp.zeros_like(g) if b else g, grads, which)
    updates, state = tx.update(rest, state, params)
    updates = jax.tree.map(lambda u, g, b: (-speed * jnp.sign(g)).astype(u.dtype) if b else u,
                           updates, grads, which)
    return updates, state

  return optax.GradientTransformation(tx.init, update)


def optimizer_updates(config: OptimConfig, train_steps: int) -> int:
  """Optimizer updates in a run of `train_steps` steps (accumulation groups steps).

  The schedule's length, and what the logged learning rate is a function of.
  """
  return max(train_steps // config.accumulate_steps, 1)


def build_optimizer(config: OptimConfig, model: nnx.Module, *, train_steps: int,
                    wrt=nnx.Param) -> nnx.Optimizer:
  """`build(config)` over `model`'s `wrt` variables (e.g. `nnx.LoRAParam`), for `train_steps`
  steps, with the balancing update a mixture of experts asks for (`correction_update`)."""
  moe = getattr(getattr(model, "config", None), "moe", None)
  tx = build(config, total_steps=optimizer_updates(config, train_steps),
             correction_update=getattr(moe, "correction_update", 0.0))
  return nnx.Optimizer(model, tx, wrt=wrt)
