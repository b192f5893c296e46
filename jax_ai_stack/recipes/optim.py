"""Optax chains from an `OptimConfig`.

`build` returns a plain `optax.GradientTransformation`;
`build_optimizer` wraps it for a model as an `nnx.Optimizer` over its parameters:
clip by global norm -> optimizer (with masked weight decay) -> optional gradient
accumulation (`optax.MultiSteps`). The learning rate follows `build_schedule`,
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
from typing import Literal

import jax
import optax
from flax import nnx

from jax_ai_stack.recipes.configlib import config_dataclass


@config_dataclass
class OptimConfig:
  name: Literal["adamw", "lion", "adafactor", "sgd", "muon"] = "adamw"
  """Optimizer. muon applies Newton-Schulz orthogonalised momentum to 2-D weights, adam to the rest."""
  learning_rate: float = 3e-4
  """Peak learning rate, reached at the end of warmup."""
  schedule: Literal["constant", "cosine", "linear", "wsd"] = "cosine"
  """Shape after warmup: constant, cosine or linear decay, or warmup-stable-decay (wsd)."""
  warmup_steps: int = 100
  """Steps of linear warmup from 0 to `learning_rate`."""
  final_lr_ratio: float = 0.1
  """Learning rate at the last step, as a fraction of the peak (decaying schedules)."""
  wsd_decay_fraction: float = 0.2
  """wsd: the fraction of all steps spent in the final linear decay."""
  b1: float = 0.9
  """First-moment decay (adamw, lion) or momentum (sgd, muon)."""
  b2: float = 0.95
  """Second-moment decay (adamw, lion)."""
  eps: float = 1e-8
  """Numerical epsilon (adamw, muon)."""
  weight_decay: float = 0.1
  """Decoupled weight decay, applied to parameters not matched by `no_decay`."""
  no_decay: tuple[str, ...] = ("norm", "bias", "(^|/)embed(/|$)")
  """Regexes searched in each parameter's path ('a/b/c'); a match skips weight decay."""
  grad_clip_norm: float | None = 1.0
  """Clip gradients to this global norm; None disables clipping."""
  accumulate_steps: int = 1
  """Average gradients over this many micro-batches per update (optax.MultiSteps)."""

  def __post_init__(self):
    if self.learning_rate <= 0:
      raise ValueError(f"optim.learning_rate must be > 0, got {self.learning_rate}")
    if self.warmup_steps < 0:
      raise ValueError(f"optim.warmup_steps must be >= 0, got {self.warmup_steps}")
    if not 0 <= self.final_lr_ratio <= 1:
      raise ValueError(f"optim.final_lr_ratio must be in [0, 1], got {self.final_lr_ratio}")
    if not 0 < self.wsd_decay_fraction <= 1:
      raise ValueError(
          f"optim.wsd_decay_fraction must be in (0, 1], got {self.wsd_decay_fraction}"
      )
    if self.accumulate_steps < 1:
      raise ValueError(f"optim.accumulate_steps must be >= 1, got {self.accumulate_steps}")
    for pattern in self.no_decay:
      try:
        re.compile(pattern)
      except re.error as e:
        raise ValueError(f"optim.no_decay: {pattern!r} is not a regex: {e}") from None


def build_schedule(config: OptimConfig, total_steps: int) -> optax.Schedule:
  """Learning rate as a function of the optimizer step."""
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
  return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), after], [warmup])


def decay_mask(config: OptimConfig):
  """A mask function: True for parameters that get weight decay."""
  patterns = [re.compile(p) for p in config.no_decay]

  def mask(params):
    return jax.tree_util.tree_map_with_path(
        lambda path, _: not any(p.search(jax.tree_util.keystr(path, simple=True, separator="/")) for p in patterns), params
    )

  return mask


def build(config: OptimConfig, total_steps: int) -> optax.GradientTransformation:
  """The optimizer chain; `total_steps` counts optimizer updates (for the schedule)."""
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
  if config.accumulate_steps > 1:
    tx = optax.MultiSteps(tx, every_k_schedule=config.accumulate_steps).gradient_transformation()
  return tx


def optimizer_updates(config: OptimConfig, train_steps: int) -> int:
  """Optimizer updates in a run of `train_steps` steps (accumulation groups steps).

  The schedule's length, and what the logged learning rate is a function of.
  """
  return max(train_steps // config.accumulate_steps, 1)


def build_optimizer(config: OptimConfig, model: nnx.Module, *, train_steps: int) -> nnx.Optimizer:
  """`build(config)` over `model`'s parameters, scheduled for `train_steps` steps."""
  tx = build(config, total_steps=optimizer_updates(config, train_steps))
  return nnx.Optimizer(model, tx, wrt=nnx.Param)
