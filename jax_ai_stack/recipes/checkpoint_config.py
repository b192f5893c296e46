"""`CheckpointConfig`: the `checkpoint` section of a recipe.

Kept out of `checkpoint` (which imports Orbax and jax) so that a recipe config
loads and prints without them; `checkpoint` re-exports it.

Example:
  >>> CheckpointConfig(save_every=50).keep_last
  3
"""

from __future__ import annotations

from jax_ai_stack.recipes.configlib import config_dataclass


@config_dataclass
class CheckpointConfig:
  """When a run saves and which steps it keeps (the `checkpoint` section)."""

  save_every: int = 100
  """Save every this many steps (and always at the end or on SIGTERM/SIGINT)."""
  keep_last: int = 3
  """Keep this many most recent steps."""
  keep_every: int | None = None
  """Also keep every step divisible by this, forever (None: only the last ones)."""
  async_save: bool = True
  """Write in a background thread; training blocks only while arrays are copied."""

  def __post_init__(self):
    if self.save_every < 1:
      raise ValueError(f"checkpoint.save_every must be >= 1, got {self.save_every}")
    if self.keep_last < 1:
      raise ValueError(f"checkpoint.keep_last must be >= 1, got {self.keep_last}")
    if self.keep_every is not None and self.keep_every < 1:
      raise ValueError(f"checkpoint.keep_every must be >= 1 or null, got {self.keep_every}")
