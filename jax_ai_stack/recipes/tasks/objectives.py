"""Training objectives: what a model learns, a value its Task is built with.

An objective has `loss(model, batch) -> (loss, metrics)` and `evaluation(means)`
(derived held-out metrics). A Task gets the one its config asks for
(`for_config`), or the one it is given: `LanguageModel(config, objective=...)`,
passed to `build_run(config, task=...)`. A new objective is a class here (or in
a module of one's own) and the data it reads, plus a preset.

`Classification` is the cross-entropy of class logits (the image family).
The decoder is one; what it learns differs. `NextToken` is the mean
cross-entropy of the next token over the tokens a batch's `loss_mask` keeps:
pretraining on text, and chat fine-tuning (the mask is the assistant's tokens).
`DirectPreference` is DPO (Rafailov et al., 2023) on preference pairs: with
log-probabilities of each reply summed over its tokens, for the model being
trained (pi) and for a frozen reference (ref),

  margin = (log pi(chosen) - log ref(chosen)) - (log pi(rejected) - log ref(rejected))
  loss   = -(1 - eps) log sigmoid(beta margin) - eps log sigmoid(-beta margin)   (sigmoid)
  loss   = (margin - 1 / (2 beta))^2                                           (ipo)

with eps the label smoothing (conservative DPO). The reference is the base the
run started from, as the run's model transform gives it
(`ModelTransform.reference_model`): with LoRA the same weights with the
adapters switched off (no second copy of the parameters), in full fine-tuning
a frozen copy of the base's weights (`finetune.reference`).
The metrics are the mean implicit rewards (beta times each side's log-ratio),
their margin, the share of pairs whose chosen reply wins (preference
accuracy), and the policy's mean log-probability of each side.

`for_config` picks the objective from the recipe: preference data trains DPO,
anything else the next token. A new objective is a class with `loss` and
`evaluation` here, and the data it reads.

Example: the DPO loss on fixed log-probabilities.
  >>> loss, metrics = dpo_loss(jnp.array([-1.0]), jnp.array([-3.0]), jnp.array([-2.0]),
  ...                          jnp.array([-2.0]), beta=0.5)
  >>> round(float(loss), 4), float(metrics["reward_margin"]), float(metrics["preference_accuracy"])
  (0.3133, 1.0, 1.0)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jax_ai_stack.errors import ConfigError

Batch = dict[str, jax.Array]
SIDES = ("chosen", "rejected")


def classification_loss(model: nnx.Module, batch: Batch
                        ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Mean cross-entropy of class logits, with accuracy for the logs."""
  logits = model(batch["images"])
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()
  accuracy = (logits.argmax(-1) == batch["labels"]).mean()
  return loss, {"accuracy": accuracy}


class Classification:
  """Cross-entropy of class logits from `batch["images"]` against `batch["labels"]`."""

  def loss(self, model: nnx.Module, batch: Batch) -> tuple[jax.Array, dict[str, jax.Array]]:
    return classification_loss(model, batch)

  def evaluation(self, means: dict[str, float]) -> dict[str, float]:
    return means


def lm_loss(model: nnx.Module, batch: Batch) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Mean next-token cross-entropy over the tokens `loss_mask` keeps.

  Without a `loss_mask`, padding (segment id 0) is left out. A mixture-of-experts
  model's router losses are added (`llama.moe_losses`); the cross-entropy alone is
  then the metric `lm_loss`, beside the router's metrics.
  """
  logps, moe = model(batch["inputs"], segment_ids=batch.get("segment_ids"),
                     positions=batch.get("positions"), with_moe_losses=True,
                     targets=batch["targets"])  # The head in chunks: no [B, T, V] logits.
  losses = -logps
  if "loss_mask" in batch:
    mask = batch["loss_mask"].astype(jnp.float32)
  elif "segment_ids" in batch:
    mask = (batch["segment_ids"] != 0).astype(jnp.float32)
  else:
    mask = jnp.ones_like(losses)
  tokens = jnp.maximum(mask.sum(), 1.0)
  loss = (losses * mask).sum() / tokens
  return with_router_losses(loss, {"tokens": mask.sum()}, moe, alone="lm_loss")


def with_router_losses(loss: jax.Array, metrics: dict[str, jax.Array],
                       moe: dict[str, jax.Array], *, alone: str
                       ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """`loss` plus a mixture of experts' router losses (`llama.moe_losses`: {} for a dense
  model, which keeps `loss` and `metrics` as they are), with `loss` alone as the metric
  `alone` beside the router's metrics."""
  if not moe:
    return loss, metrics
  router = {k: v for k, v in moe.items() if k != "moe_loss"}
  return loss + moe["moe_loss"], {**metrics, alone: loss, **router}


class NextToken:
  """Next-token prediction on the tokens the batch's `loss_mask` keeps."""

  def loss(self, model: nnx.Module, batch: Batch) -> tuple[jax.Array, dict[str, jax.Array]]:
    return lm_loss(model, batch)

  def evaluation(self, means: dict[str, float]) -> dict[str, float]:
    """Perplexity of the cross-entropy (`eval_lm_loss` where router losses were added)."""
    loss = means.get("eval_lm_loss", means["eval_loss"])
    return {**means, "eval_perplexity": math.exp(min(loss, 50.0))}


def sequence_logps(model: nnx.Module, batch: Batch, *, with_moe_losses: bool = False
                   ) -> tuple[jax.Array, ...]:
  """Summed log-probabilities of each pair's chosen and of its rejected reply, [B] each,
  from one forward pass over both sides' rows; `with_moe_losses`: and the MoE layers'
  losses and metrics (`llama.moe_losses`; {} for a dense model) as a third value."""
  both = {key: jnp.concatenate([batch[f"{side}_{key}"] for side in SIDES])
          for key in ("inputs", "targets", "segment_ids", "positions", "loss_mask")}
  out = model(both["inputs"], segment_ids=both["segment_ids"], positions=both["positions"],
              with_moe_losses=with_moe_losses, targets=both["targets"])
  logps, moe = out if with_moe_losses else (out, None)
  summed = (logps * both["loss_mask"].astype(jnp.float32)).sum(axis=-1)
  chosen, rejected = jnp.split(summed, 2)
  return (chosen, rejected, moe) if with_moe_losses else (chosen, rejected)


def dpo_loss(policy_chosen: jax.Array, policy_rejected: jax.Array, reference_chosen: jax.Array,
             reference_rejected: jax.Array, *, beta: float, kind: str = "sigmoid",
             label_smoothing: float = 0.0) -> tuple[jax.Array, dict[str, jax.Array]]:
  """(mean DPO loss, metrics) of summed log-probabilities [B] (see the module)."""
  chosen = policy_chosen - reference_chosen
  rejected = policy_rejected - reference_rejected
  margin = chosen - rejected
  if kind == "ipo":
    losses = (margin - 1.0 / (2.0 * beta)) ** 2
  else:
    losses = (-(1.0 - label_smoothing) * jax.nn.log_sigmoid(beta * margin)
              - label_smoothing * jax.nn.log_sigmoid(-beta * margin))
  metrics = {"reward_chosen": (beta * chosen).mean(), "reward_rejected": (beta * rejected).mean(),
             "reward_margin": (beta * margin).mean(),
             "preference_accuracy": (margin > 0).astype(jnp.float32).mean(),
             "logp_chosen": policy_chosen.mean(), "logp_rejected": policy_rejected.mean()}
  return losses.mean(), metrics


class DirectPreference:
  """DPO against a reference computed from the trained model (`reference(model)`)."""

  def __init__(self, *, beta: float, kind: str, label_smoothing: float,
               reference: Callable[[nnx.Module], nnx.Module | None]):
    self.beta, self.kind, self.label_smoothing = beta, kind, label_smoothing
    self.reference = reference

  def loss(self, model: nnx.Module, batch: Batch) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The DPO loss; a mixture of experts' router losses are added (as in `lm_loss`),
    the DPO loss alone is then the metric `dpo_loss`."""
    *policy, moe = sequence_logps(model, batch, with_moe_losses=True)
    frozen = self.reference(model)
    if frozen is None:
      raise ConfigError("DPO needs a reference model and this run keeps none: set "
                        "finetune.base (the run to start from and compare with)")
    reference = jax.lax.stop_gradient(sequence_logps(frozen, batch))
    loss, metrics = dpo_loss(*policy, *reference, beta=self.beta, kind=self.kind,
                             label_smoothing=self.label_smoothing)
    return with_router_losses(loss, metrics, moe, alone="dpo_loss")

  def evaluation(self, means: dict[str, float]) -> dict[str, float]:
    return means


def for_config(config: Any, reference: Callable[[nnx.Module], nnx.Module | None]
               ) -> NextToken | DirectPreference:
  """The objective a recipe trains: DPO on preference data (`finetune.dpo`) against the
  `reference` of the run's model (`ModelTransform.reference_model`), else the next token."""
  if not config.data.is_preference:
    return NextToken()
  dpo = config.finetune.dpo
  return DirectPreference(beta=dpo.beta, kind=dpo.loss, label_smoothing=dpo.label_smoothing,
                          reference=reference)
