"""Distillation: the student learns the teacher's distribution over each next token.

On the run's own data (text or chat: off-policy), or on prompts, on the completions the
student samples itself through the engine as GRPO's rollouts do (on-policy: GKD at lambda
1), at every position the student's and the teacher's distributions over the vocabulary,
both at temperature tau, are compared by

  forward_kl   KL(p_T || p_S) = sum_v p_T (log p_T - log p_S)      Hinton et al.'s KD
  reverse_kl   KL(p_S || p_T)                                      MiniLLM: mode-seeking
  jsd          beta KL(p_T || M) + (1 - beta) KL(p_S || M),         GKD (Agarwal et al.),
               M = beta p_T + (1 - beta) p_S                       as TRL's GKD has it

scaled by tau^2 (the gradient keeps its size as tau grows), averaged over the tokens the
batch's `loss_mask` keeps (a chat run: the assistant's), and optionally mixed with the
next token's cross-entropy (`next_token_weight`). The teacher is the run's reference model
(`finetune.teacher.Teacher`: a frozen trained run). Both models' logits are made a chunk
of positions at a time and dropped (`head.over_positions`), so no [B, T, V] array of either
exists at a large vocabulary.

Example: a student equal to its teacher diverges by nothing.
  >>> logits = jnp.array([[1.0, 2.0, 0.5]])
  >>> float(divergence(logits, logits, "forward_kl", temperature=2.0)[0])
  0.0
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp

from jax_ai_stack.recipes.models.head import LOGPS_CHUNK_TOKENS, over_positions
from jax_ai_stack.recipes.tasks.objectives import (
    ROUTER_LOSSES, TOKEN_FIELDS, Objective, token_mask, token_spec)

LOSSES = ("forward_kl", "reverse_kl", "jsd")


def _kl(log_p: jax.Array, log_q: jax.Array) -> jax.Array:
  """KL(p || q) over the last axis, of log-probabilities (0 log 0 = 0)."""
  return jnp.sum(jnp.where(log_p > -jnp.inf, jnp.exp(log_p) * (log_p - log_q), 0.0), axis=-1)


def divergence(student_logits: jax.Array, teacher_logits: jax.Array, loss: str, *,
               beta: float = 0.5, temperature: float = 1.0) -> jax.Array:
  """Per position [...]: the `loss` divergence of the student's distribution from the
  teacher's, both of logits [..., V] at `temperature`, times temperature^2 (see the
  module)."""
  student = jax.nn.log_softmax(student_logits.astype(jnp.float32) / temperature, axis=-1)
  teacher = jax.nn.log_softmax(teacher_logits.astype(jnp.float32) / temperature, axis=-1)
  if loss == "forward_kl":
    value = _kl(teacher, student)
  elif loss == "reverse_kl":
    value = _kl(student, teacher)
  elif loss == "jsd":
    mixture = jnp.logaddexp(teacher + math.log(beta), student + math.log(1 - beta))
    value = beta * _kl(teacher, mixture) + (1 - beta) * _kl(student, mixture)
  else:
    raise ValueError(f"unknown distillation loss {loss!r}; losses: {', '.join(LOSSES)}")
  return value * temperature**2


@dataclasses.dataclass(frozen=True)
class LogitDistillation(Objective):
  """The divergence from the teacher (the reference model the run's transforms give) on
  the batch's tokens, optionally mixed with the next token's cross-entropy (see the
  module)."""

  loss_kind: str = "forward_kl"
  beta: float = 0.5
  temperature: float = 1.0
  next_token_weight: float = 0.0
  chunk_tokens: int = LOGPS_CHUNK_TOKENS

  data_kind: ClassVar[str] = "tokens"
  needs_reference: ClassVar[bool] = True
  loss_metric: ClassVar[str] = "distill_loss"
  headline_metrics: ClassVar[tuple[str, ...]] = ("divergence", "lm_loss")

  def loss(self, model, batch, reference=None):
    fields = dict(segment_ids=batch.get("segment_ids"), positions=batch.get("positions"))
    teacher_hidden = jax.lax.stop_gradient(reference(batch["inputs"], hidden=True, **fields))
    hidden, router = model(batch["inputs"], hidden=True, with_moe_losses=True, **fields)

    def per_chunk(student_x, teacher_x, targets):
      logits = model.head_logits(student_x)
      teacher_logits = jax.lax.stop_gradient(reference.head_logits(teacher_x))
      gap = divergence(logits, teacher_logits, self.loss_kind, beta=self.beta,
                       temperature=self.temperature)
      logp = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), targets[..., None],
                                 axis=-1)[..., 0]
      return gap, -logp

    gaps, losses = over_positions(per_chunk, (hidden, teacher_hidden, batch["targets"]),
                                  self.chunk_tokens)
    mask = token_mask(batch, gaps)
    tokens = jnp.maximum(mask.sum(), 1.0)
    gap, lm = (gaps * mask).sum() / tokens, (losses * mask).sum() / tokens
    value = (1 - self.next_token_weight) * gap + self.next_token_weight * lm
    return value, {"divergence": gap, "lm_loss": lm, "tokens": mask.sum(), ROUTER_LOSSES: router}

  def evaluation(self, means):
    """The student's perplexity on the data beside the divergence."""
    return {**means, "eval_perplexity": math.exp(min(means["eval_lm_loss"], 50.0))}

  def batch_axes(self):
    return {name: ("batch", "length") for name in TOKEN_FIELDS}

  def batch_spec(self, rows, length):
    return token_spec(rows, length)


def for_config(distill) -> LogitDistillation:
  """The objective of a recipe's `finetune.distill` section."""
  return LogitDistillation(loss_kind=distill.loss, beta=distill.beta,
                           temperature=distill.temperature,
                           next_token_weight=distill.next_token_weight)
