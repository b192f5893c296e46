"""Reinforcement learning with verifiable rewards: rewards as plain Python functions
(`rewards`), and the rollout that samples a group of completions per prompt through the
generation engine, scores them and makes the batch the GRPO-family objective trains on
(`rollout`; the objective is `tasks.grpo`). The settings are the recipe's `rl` section
(`config`).

Names load on first use.

Example:
  >>> from jax_ai_stack.recipes import rl
  >>> rl.RlConfig().num_generations
  8
"""

from jax_ai_stack.lazy import lazy_attributes

_SUBMODULES = ("config", "rewards", "rollout")
_EXPORTS = {"RlConfig": "config", "Rollouts": "rollout", "Reward": "rewards"}
__all__ = [*_SUBMODULES, *_EXPORTS]
__getattr__, __dir__ = lazy_attributes(__name__, _SUBMODULES, _EXPORTS)
