"""`OptimConfig`: the `optim` section of a recipe.

Kept out of `optim` (which imports Optax and jax) so that a recipe config loads
and prints without them; `optim` re-exports it.

Example:
  >>> OptimConfig(name="lion", learning_rate=1e-4).schedule
  'cosine'
"""

from __future__ import annotations

import re
from typing import Literal

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
  restarts: tuple[int, ...] = ()
  """Steps at which the schedule starts over ("pit stops"): from each, warmup again (from the
  rate reached) and the schedule's shape over the steps to the next restart or the end."""
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
    for i, step in enumerate(self.restarts):
      before = self.restarts[i - 1] if i else 0
      if step <= before:
        raise ValueError(f"optim.restarts[{i}]={step} must come after "
                         + (f"the restart before ({before})" if i else "step 0"))
    if self.accumulate_steps < 1:
      raise ValueError(f"optim.accumulate_steps must be >= 1, got {self.accumulate_steps}")
    for pattern in self.no_decay:
      try:
        re.compile(pattern)
      except re.error as e:
        raise ValueError(f"optim.no_decay: {pattern!r} is not a regex: {e}") from None
