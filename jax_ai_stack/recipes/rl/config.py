"""The recipe's `rl` section: how a run on prompts samples, scores and updates.

A run whose `data.source` is a prompt source (`prompts`, `prompts_arithmetic`)
trains the GRPO-family objective (`tasks.grpo`) with these settings; any other
run ignores them.

Example:
  >>> RlConfig(rewards=("my_rewards:exact",)).resolved_weights
  (1.0,)
  >>> from jax_ai_stack.recipes import config
  >>> config.load("lm-tiny-grpo", overrides=["rl.num_generations=1"])
  Traceback (most recent call last):
  ...
  jax_ai_stack.errors.ConfigError: preset lm-tiny-grpo + overrides rl.num_generations=1: field 'rl': Value error, rl.num_generations must be >= 2 (a group's rewards are compared with each other), got 1
"""

from __future__ import annotations

from typing import Literal

from jax_ai_stack.recipes.configlib import config_dataclass


@config_dataclass
class RlConfig:
  """Reinforcement learning with verifiable rewards (GRPO and its variants)."""

  num_generations: int = 8
  """Completions sampled per prompt: a group, whose rewards set each one's advantage."""
  max_completion_tokens: int = 32
  """The most new tokens a completion has (fewer where a prompt leaves less of data.seq_len)."""
  temperature: float = 1.0
  """Sampling temperature of the rollouts (> 0: a group needs different completions)."""
  top_k: int | None = None
  """Sample among the k likeliest tokens only; None: all."""
  top_p: float | None = None
  """Sample among the likeliest tokens whose probabilities reach top_p; None: all."""
  advantage: Literal["grpo", "dr_grpo", "rloo"] = "grpo"
  """grpo: (reward - group mean) / group std; dr_grpo: reward - group mean (Dr. GRPO);
  rloo: reward - the mean of the group's other rewards (leave-one-out)."""
  loss_aggregation: Literal["sequence", "token", "constant"] = "sequence"
  """sequence: each completion's mean token loss, averaged (GRPO); token: every completion
  token weighs the same (DAPO); constant: the token losses summed over
  rows x max_completion_tokens (Dr. GRPO)."""
  epsilon: float = 0.2
  """The importance ratio is clipped to [1 - epsilon, 1 + epsilon_high]."""
  epsilon_high: float | None = None
  """The upper clip (DAPO's clip-higher); None: epsilon."""
  beta: float = 0.0
  """Weight of the KL penalty to the reference (the base with LoRA adapters off, or a frozen
  copy); 0: no penalty and no reference kept."""
  updates_per_rollout: int = 1
  """Optimizer steps on each rollout batch (a train step each: `train.steps`, saves and
  evaluations fall on rollout boundaries). From the second on, the importance ratio is the
  policy's probability over the sampling policy's (the engine's) and the clip applies."""
  importance_cap: float | None = 3.0
  """Truncated importance sampling at the first update on each rollout: each token's loss is
  weighted by min(p_trainer / p_engine, importance_cap), for kernels whose log-probabilities
  differ from the trainer's (exactly 1 where they agree; on CPU the gap stays near 1e-5);
  None: no correction."""
  dynamic_sampling: bool = False
  """DAPO's dynamic sampling: a group whose rewards are all equal (no signal) is dropped and
  groups of further prompts take its place, up to `max_draws` batches of prompts a step."""
  max_draws: int = 3
  """With dynamic_sampling: the most batches of prompts one step draws; short of groups
  with a signal after them, the step keeps some without (logged)."""
  overlong_buffer: int | None = None
  """DAPO's soft overlong penalty: a completion longer than max_completion_tokens minus
  this many tokens loses reward linearly, up to overlong_penalty at the limit; None: none."""
  overlong_penalty: float = 1.0
  """The most reward the overlong penalty takes away."""
  rewards: tuple[str, ...] = ()
  """Reward functions, 'module:function', each `f(prompts, completions, **columns) ->
  list[float]` (imported as model.task is)."""
  reward_weights: tuple[float, ...] | None = None
  """Each reward's weight in the total; None: 1 each."""

  def __post_init__(self):
    if self.num_generations < 2:
      raise ValueError(f"rl.num_generations must be >= 2 (a group's rewards are compared with "
                       f"each other), got {self.num_generations}")
    if self.max_completion_tokens < 1:
      raise ValueError(f"rl.max_completion_tokens must be >= 1, got {self.max_completion_tokens}")
    if self.temperature <= 0:
      raise ValueError(f"rl.temperature must be > 0 (a group needs different completions), "
                       f"got {self.temperature}")
    if self.epsilon <= 0:
      raise ValueError(f"rl.epsilon must be > 0, got {self.epsilon}")
    if self.epsilon_high is not None and self.epsilon_high < self.epsilon:
      raise ValueError(f"rl.epsilon_high ({self.epsilon_high}) must be >= rl.epsilon "
                       f"({self.epsilon})")
    if self.updates_per_rollout < 1:
      raise ValueError(f"rl.updates_per_rollout must be >= 1, got {self.updates_per_rollout}")
    if self.importance_cap is not None and self.importance_cap < 1:
      raise ValueError(f"rl.importance_cap must be >= 1 (or null: no correction), got "
                       f"{self.importance_cap}")
    if self.max_draws < 1:
      raise ValueError(f"rl.max_draws must be >= 1, got {self.max_draws}")
    if self.overlong_buffer is not None and not 0 < self.overlong_buffer <= (
        self.max_completion_tokens):
      raise ValueError(f"rl.overlong_buffer must be in [1, rl.max_completion_tokens="
                       f"{self.max_completion_tokens}], got {self.overlong_buffer}")
    if self.beta < 0:
      raise ValueError(f"rl.beta must be >= 0, got {self.beta}")
    for ref in self.rewards:
      if ":" not in ref:
        raise ValueError(f"rl.rewards: {ref!r} is not 'module:function'")
    if self.reward_weights is not None and len(self.reward_weights) != len(self.rewards):
      raise ValueError(f"rl.reward_weights has {len(self.reward_weights)} weights for "
                       f"{len(self.rewards)} rl.rewards")

  @property
  def resolved_weights(self) -> tuple[float, ...]:
    return self.reward_weights or (1.0,) * len(self.rewards)

  @property
  def upper_clip(self) -> float:
    return self.epsilon if self.epsilon_high is None else self.epsilon_high
