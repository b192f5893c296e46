"""The GRPO family of objectives: a policy's sampled completions, weighted by how much better
than their group each one scored.

For a prompt, the rollout (`rl.rollout`) samples a group of G completions and
scores each (the rewards, weighted and summed: r). Each completion's advantage
A compares it with its group (`advantages`):

  grpo      A = (r - mean(r)) / (std(r) + 1e-4)     (Shao et al., 2024)
  dr_grpo   A = r - mean(r)                          (Liu et al., 2025: no std)
  rloo      A = r - mean of the group's other rewards (leave-one-out)

Each completion token t then has the clipped policy-gradient loss of PPO, with
its importance ratio rho = pi(t) / pi_old(t) and [1 - eps, 1 + eps_high] the
clip (eps_high > eps: DAPO's clip-higher), plus, with beta > 0, the k3
estimate of the KL divergence to the reference (Schulman's unbiased one):

  loss_t = -min(rho A, clip(rho) A) + beta (exp(ref - logp) - (ref - logp) - 1)

aggregated over the completion tokens (`aggregate`): each completion's mean,
averaged ("sequence", GRPO); every token alike ("token", DAPO); the sum over
rows x max_completion_tokens ("constant", Dr. GRPO). std is the group's sample
standard deviation (ddof 1), as TRL's and Tunix's (tests/test_grpo_references.py
compares with both).

At the first update on a rollout (`fresh` rows), pi_old is the policy itself:
rho is exactly 1 (`logp - stop_gradient(logp)`) and the gradient is the policy
gradient, whatever the engine's arithmetic. At the later ones
(`rl.updates_per_rollout`), pi_old is the sampling policy's log-probability as
the engine reported it (`sampler_logps`), and the clip applies. At each first
update the engine's log-probabilities are compared with the trainer's and the
largest gap is logged (`sampler_logp_gap`: near 1e-5 at most on CPU; 0 at the later
updates), to show that they are the same policy. Where a backend's kernels make
them differ, truncated importance sampling corrects the first update (TRL's
`vllm_importance_sampling_correction`; `importance_weights`): each token's
policy-gradient loss is weighted by min(pi / pi_engine, `rl.importance_cap`),
exactly 1 where the two agree bitwise.

`entropy` is the mean of -log pi over the completion tokens: the sampled tokens'
estimate of the policy's per-token entropy (exact in expectation at temperature
1; at another `rl.temperature`, of the cross-entropy from the sampler), with no
[B, T, V] logits kept to compute it whole. A policy collapsing onto one reply
shows as entropy falling towards 0.

Example: a group of four; the two right answers share the advantage.
  >>> print(advantages(np.array([[1.0, 0.0, 1.0, 0.0]]), "grpo").round(3))
  [[ 0.866 -0.866  0.866 -0.866]]
  >>> print(advantages(np.array([[1.0, 0.0, 0.0, 0.0]]), "rloo").round(3))
  [[ 1.    -0.333 -0.333 -0.333]]
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jax_ai_stack.recipes.tasks.objectives import (ROUTER_LOSSES, TOKEN_FIELDS, Objective,
                                                   target_logps, token_spec)

STD_EPSILON = 1e-4
"""Added to a group's standard deviation (grpo): a group of equal rewards gets 0, not NaN."""


def advantages(rewards: np.ndarray, kind: str) -> np.ndarray:
  """Each completion's advantage [P, G] from its group's rewards [P, G] (see the module)."""
  rewards = np.asarray(rewards, np.float32)
  mean = rewards.mean(axis=1, keepdims=True)
  if kind == "grpo":
    std = rewards.std(axis=1, ddof=1, keepdims=True)
    return (rewards - mean) / (std + np.float32(STD_EPSILON))
  if kind == "dr_grpo":
    return rewards - mean
  if kind == "rloo":
    size = rewards.shape[1]
    return rewards - (rewards.sum(axis=1, keepdims=True) - rewards) / np.float32(size - 1)
  raise ValueError(f"unknown advantage {kind!r}: grpo, dr_grpo or rloo")


def token_losses(logps: jax.Array, old_logps: jax.Array, advantage: jax.Array, *,
                 epsilon: float, epsilon_high: float) -> tuple[jax.Array, jax.Array]:
  """(clipped policy-gradient loss per token [N, T], whether its ratio was clipped) for
  per-token log-probabilities under the policy and the sampling policy, and each row's
  advantage [N]."""
  ratio = jnp.exp(logps - old_logps)
  advantage = advantage[:, None]
  unclipped = ratio * advantage
  clipped = jnp.clip(ratio, 1.0 - epsilon, 1.0 + epsilon_high) * advantage
  return -jnp.minimum(unclipped, clipped), clipped < unclipped


def importance_weights(logps: jax.Array, sampler_logps: jax.Array, fresh: jax.Array,
                       cap: float) -> jax.Array:
  """Truncated importance sampling: each token's weight [N, T], min(pi / pi_engine, cap) on
  the rows of a first update (`fresh`), 1 on the later ones (their ratio already compares
  with the engine's log-probabilities). No gradient flows through it."""
  weights = jnp.minimum(jnp.exp(jax.lax.stop_gradient(logps) - sampler_logps), cap)
  return jnp.where(fresh[:, None] > 0, weights, 1.0)


def kl_to_reference(logps: jax.Array, reference_logps: jax.Array) -> jax.Array:
  """The k3 estimate of KL(policy || reference) per token: exp(d) - d - 1, d = ref - logp."""
  delta = reference_logps - logps
  return jnp.exp(delta) - delta - 1.0


def aggregate(losses: jax.Array, mask: jax.Array, kind: str, max_tokens: int) -> jax.Array:
  """The loss of a batch from per-token losses [N, T] over the completion tokens `mask`."""
  if kind == "sequence":
    per_row = (losses * mask).sum(axis=-1) / jnp.maximum(mask.sum(axis=-1), 1.0)
    return per_row.mean()
  if kind == "token":
    return masked_mean(losses, mask)
  if kind == "constant":
    return (losses * mask).sum() / (mask.shape[0] * max_tokens)
  raise ValueError(f"unknown loss aggregation {kind!r}: sequence, token or constant")


def masked_mean(values: jax.Array, mask: jax.Array) -> jax.Array:
  """The mean of `values` where `mask` is 1 (0 for an empty mask)."""
  return (values * mask).sum() / jnp.maximum(mask.sum(), 1.0)


@dataclasses.dataclass(frozen=True)
class GroupRelative(Objective):
  """The GRPO-family loss on a rollout's batch (see the module).

  The batch: the token fields of prompt-plus-completion rows, `loss_mask` on the
  completion tokens, `advantages` [N], `sampler_logps` [N, T] (the engine's) and `fresh`
  [N] (1: the first update on this rollout).
  """

  epsilon: float = 0.2
  epsilon_high: float = 0.2
  beta: float = 0.0
  aggregation: str = "sequence"
  max_completion_tokens: int = 32
  importance_cap: float | None = 3.0

  data_kind: ClassVar[str] = "prompts"
  loss_metric: ClassVar[str] = "policy_loss"

  @property
  def needs_reference(self) -> bool:  # type: ignore[override]
    """Only a KL penalty compares with the reference."""
    return self.beta > 0

  def headline(self, metrics):
    """The rollout's reward and its parts (`reward_<function>`, the overlong penalty), not
    its spread: the policy loss of a group-relative objective hovers near 0 whatever it
    learns."""
    return {name: value for name, value in metrics.items()
            if name == "reward" or (name.startswith("reward_") and name != "reward_std")}

  def loss(self, model, batch, reference=None):
    fields = {k: batch[k] for k in ("segment_ids", "positions")}
    logps, router = target_logps(model, batch["inputs"], batch["targets"], **fields,
                                 with_router=True)
    mask = batch["loss_mask"].astype(jnp.float32)
    old = jnp.where(batch["fresh"][:, None] > 0, jax.lax.stop_gradient(logps),
                    batch["sampler_logps"])
    losses, clipped = token_losses(logps, old, batch["advantages"], epsilon=self.epsilon,
                                   epsilon_high=self.epsilon_high)
    if self.importance_cap is not None:
      losses = losses * importance_weights(logps, batch["sampler_logps"], batch["fresh"],
                                           self.importance_cap)
    metrics = {"clip_fraction": masked_mean(clipped.astype(jnp.float32), mask),
               "entropy": masked_mean(-jax.lax.stop_gradient(logps), mask),
               "sampler_logp_gap": jnp.max(jnp.abs(logps - batch["sampler_logps"]) * mask
                                           * batch["fresh"][:, None]),
               ROUTER_LOSSES: router}
    if self.beta > 0:
      frozen = jax.lax.stop_gradient(target_logps(reference, batch["inputs"], batch["targets"],
                                                  **fields))
      kl = kl_to_reference(logps, frozen)
      losses = losses + self.beta * kl
      metrics["kl"] = masked_mean(kl, mask)
    return aggregate(losses, mask, self.aggregation, self.max_completion_tokens), metrics

  def batch_axes(self):
    token = ("batch", "length")
    return {**{name: token for name in TOKEN_FIELDS}, "loss_mask": token,
            "sampler_logps": token, "advantages": ("batch",), "fresh": ("batch",)}

  def batch_spec(self, rows, length):
    """`rows` completions (the prompts times `rl.num_generations`)."""
    per_row = jax.ShapeDtypeStruct((rows,), jnp.float32)
    return {**token_spec(rows, length),
            "sampler_logps": jax.ShapeDtypeStruct((rows, length), jnp.float32),
            "advantages": per_row, "fresh": per_row}


def for_config(config) -> GroupRelative:
  """The objective of a run on prompts, from its `rl` section."""
  rl = config.rl
  return GroupRelative(epsilon=rl.epsilon, epsilon_high=rl.upper_clip, beta=rl.beta,
                       aggregation=rl.loss_aggregation,
                       max_completion_tokens=rl.max_completion_tokens,
                       importance_cap=rl.importance_cap)
