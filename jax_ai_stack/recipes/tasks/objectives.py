"""Training objectives: what a model learns, a value its Task is built with.

An objective is a frozen dataclass (an `Objective`): `loss(model, batch,
reference) -> (loss, metrics)`, `evaluation(means)` (derived held-out metrics),
`batch_axes()` (its batch's fields and their logical axes), the data kind it
reads (`data_kind`) and whether it compares with a reference model
(`needs_reference`). A Task gets the one its config asks for (`for_config`),
or the one it is given: `LanguageModel(config, objective=...)`, passed to
`build_run(config, task=...)`. `training_loss` makes the step's loss of it:
it hands the objective the run's reference model (from the run's transforms,
built once) and adds, for every objective alike, the router losses a mixture
of experts computed in the trained model's forward pass, which the objective
hands up in its metrics (`ROUTER_LOSSES`); each objective's own loss is then
logged as its `loss_metric`. A new objective is
a class here (or in a module of one's own) and the data it reads, plus a
preset.

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
anything else the next token.

Example: the DPO loss on fixed log-probabilities.
  >>> loss, metrics = dpo_loss(jnp.array([-1.0]), jnp.array([-3.0]), jnp.array([-2.0]),
  ...                          jnp.array([-2.0]), beta=0.5)
  >>> round(float(loss), 4), float(metrics["reward_margin"]), float(metrics["preference_accuracy"])
  (0.3133, 1.0, 1.0)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jax_ai_stack.errors import ConfigError

Batch = dict[str, jax.Array]
SIDES = ("chosen", "rejected")
TOKEN_FIELDS = ("inputs", "targets", "segment_ids", "positions")
"""A token batch's [B, T] fields that a mesh splits along ("batch", "length")."""


class Objective:
  """What a model learns; subclasses are frozen dataclasses (values: equal when their
  settings are)."""

  data_kind: ClassVar[str] = "any"
  """The data it reads: "tokens" (text or chat), "preference" (pairs), "images"."""
  needs_reference: ClassVar[bool] = False
  """Whether `loss` compares with a frozen reference model (the run's transforms give it)."""
  loss_metric: ClassVar[str] = "objective_loss"
  """The metric its own loss is logged as where a model's router losses are added."""
  headline_metrics: ClassVar[tuple[str, ...]] = ()
  """The train metrics besides the loss that say how a run goes (`headline`)."""

  def loss(self, model: nnx.Module, batch: Batch, reference: nnx.Module | None = None
           ) -> tuple[jax.Array, dict[str, jax.Array]]:
    raise NotImplementedError

  def evaluation(self, means: dict[str, float]) -> dict[str, float]:
    """Derived metrics from the mean held-out metrics; default: as they are."""
    return means

  def headline(self, metrics: Mapping[str, float]) -> dict[str, float]:
    """Of a step's `metrics`, those the progress line and the run's last line show beside
    the loss (a loss alone says little of DPO or GRPO); default: `headline_metrics`."""
    return {name: metrics[name] for name in self.headline_metrics if name in metrics}

  def batch_axes(self) -> dict[str, tuple[str, ...]]:
    """Logical axes of the batch fields (a field left out: split along its first axis)."""
    return {}

  def batch_spec(self, rows: int, length: int) -> dict[str, jax.ShapeDtypeStruct]:
    """One step's batch of `rows` rows of `length` tokens, abstractly: what a program is
    compiled for before any data is read (`train --dry-run --topology`); the tests hold
    it to the data pipeline's first batch."""
    raise NotImplementedError(f"{type(self).__name__} does not describe its batch")


def token_spec(rows: int, length: int, prefix: str = "") -> dict[str, jax.ShapeDtypeStruct]:
  """The token fields of a batch [rows, length] (int32) and its `loss_mask` (float32)."""
  spec = {f"{prefix}{name}": jax.ShapeDtypeStruct((rows, length), jnp.int32)
          for name in TOKEN_FIELDS}
  return {**spec, f"{prefix}loss_mask": jax.ShapeDtypeStruct((rows, length), jnp.float32)}


def token_mask(batch: Batch, like: jax.Array) -> jax.Array:
  """float32 [B, T]: the tokens a loss counts, the batch's `loss_mask` (a chat: the
  assistant's); without one, all but padding (segment id 0); without segments, all."""
  if "loss_mask" in batch:
    return batch["loss_mask"].astype(jnp.float32)
  if "segment_ids" in batch:
    return (batch["segment_ids"] != 0).astype(jnp.float32)
  return jnp.ones(like.shape, jnp.float32)


# ---- a model's router losses, added once for every objective ------------------------

ROUTER_LOSSES = "router_losses"
"""The metrics entry in which an objective hands up the router losses of the trained model's
forward pass (`target_logps(..., with_router=True)`); `training_loss` adds them."""


def target_logps(model: nnx.Module, inputs: jax.Array, targets: jax.Array, *,
                 segment_ids: jax.Array | None = None, positions: jax.Array | None = None,
                 with_router: bool = False) -> jax.Array | tuple[jax.Array, dict]:
  """log p(targets) [B, T] under a decoder (its head in chunks: no [B, T, V] logits);
  `with_router`: and the mixture-of-experts router losses of this pass (`decoder.moe_losses`;
  {} for a dense model), for the model being trained (not a reference)."""
  return model(inputs, segment_ids=segment_ids, positions=positions,
               with_moe_losses=with_router, targets=targets)


def training_loss(objective: Objective,
                  reference: Callable[[nnx.Module], nnx.Module | None] | None = None
                  ) -> Callable[[nnx.Module, Batch], tuple[jax.Array, dict[str, jax.Array]]]:
  """`objective` as a step's `loss(model, batch)`: `reference(model)` (the run's transforms'
  `reference_model`) handed to an objective that needs one, and the router losses it hands
  up (`ROUTER_LOSSES`) added (`with_router_losses`)."""

  def loss(model: nnx.Module, batch: Batch) -> tuple[jax.Array, dict[str, jax.Array]]:
    frozen = None
    if objective.needs_reference:
      frozen = reference(model) if reference is not None else None
      if frozen is None:
        raise ConfigError(f"{type(objective).__name__} needs a reference model and this run "
                          f"keeps none: set finetune.base (the run to start from and compare "
                          f"with)")
    value, metrics = objective.loss(model, batch, frozen)
    metrics = dict(metrics)
    router = metrics.pop(ROUTER_LOSSES, {})
    return with_router_losses(value, metrics, router, alone=objective.loss_metric)

  return loss


def with_router_losses(loss: jax.Array, metrics: dict[str, jax.Array],
                       moe: dict[str, jax.Array], *, alone: str
                       ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """`loss` plus a mixture of experts' router losses (`decoder.moe_losses`: {} for a dense
  model, which keeps `loss` and `metrics` as they are), with `loss` alone as the metric
  `alone` beside the router's metrics."""
  if not moe:
    return loss, metrics
  router = {k: v for k, v in moe.items() if k != "moe_loss"}
  return loss + moe["moe_loss"], {**metrics, alone: loss, **router}


# ---- the objectives -------------------------------------------------------------------


def classification_loss(model: nnx.Module, batch: Batch
                        ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Mean cross-entropy of class logits, with accuracy for the logs."""
  logits = model(batch["images"])
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()
  accuracy = (logits.argmax(-1) == batch["labels"]).mean()
  return loss, {"accuracy": accuracy}


@dataclasses.dataclass(frozen=True)
class Classification(Objective):
  """Cross-entropy of class logits from `batch["images"]` against `batch["labels"]`."""

  data_kind: ClassVar[str] = "images"

  def loss(self, model, batch, reference=None):
    del reference
    return classification_loss(model, batch)

  def batch_axes(self):
    return {"images": ("batch", "height", "width", "channels"), "labels": ("batch",)}


@dataclasses.dataclass(frozen=True)
class NextToken(Objective):
  """Next-token prediction on the tokens the batch's `loss_mask` keeps.

  Without a `loss_mask`, padding (segment id 0) is left out.
  """

  data_kind: ClassVar[str] = "tokens"
  loss_metric: ClassVar[str] = "lm_loss"

  def loss(self, model, batch, reference=None):
    del reference
    logps, router = target_logps(model, batch["inputs"], batch["targets"],
                                 segment_ids=batch.get("segment_ids"),
                                 positions=batch.get("positions"), with_router=True)
    losses = -logps
    mask = token_mask(batch, losses)
    tokens = jnp.maximum(mask.sum(), 1.0)
    return (losses * mask).sum() / tokens, {"tokens": mask.sum(), ROUTER_LOSSES: router}

  def evaluation(self, means):
    """Perplexity of the cross-entropy (`eval_lm_loss` where router losses were added)."""
    loss = means.get("eval_lm_loss", means["eval_loss"])
    return {**means, "eval_perplexity": math.exp(min(loss, 50.0))}

  def batch_axes(self):
    return {name: ("batch", "length") for name in TOKEN_FIELDS}

  def batch_spec(self, rows, length):
    return token_spec(rows, length)


lm_loss = training_loss(NextToken())
"""The next token's mean cross-entropy, router losses added: `loss(model, batch)`."""


def sequence_logps(model: nnx.Module, batch: Batch, *, with_router: bool = False
                   ) -> tuple[jax.Array, ...]:
  """Summed log-probabilities of each pair's chosen and of its rejected reply, [B] each,
  from one forward pass over both sides' rows; `with_router`: and that pass's router
  losses (`target_logps`) as a third value."""
  both = {key: jnp.concatenate([batch[f"{side}_{key}"] for side in SIDES])
          for key in ("inputs", "targets", "segment_ids", "positions", "loss_mask")}
  out = target_logps(model, both["inputs"], both["targets"], segment_ids=both["segment_ids"],
                     positions=both["positions"], with_router=with_router)
  logps, router = out if with_router else (out, None)
  summed = (logps * both["loss_mask"].astype(jnp.float32)).sum(axis=-1)
  chosen, rejected = jnp.split(summed, 2)
  return (chosen, rejected, router) if with_router else (chosen, rejected)


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


@dataclasses.dataclass(frozen=True)
class DirectPreference(Objective):
  """DPO against the reference model the run's transforms give (see the module)."""

  beta: float = 0.1
  kind: str = "sigmoid"
  label_smoothing: float = 0.0

  data_kind: ClassVar[str] = "preference"
  needs_reference: ClassVar[bool] = True
  loss_metric: ClassVar[str] = "dpo_loss"
  headline_metrics: ClassVar[tuple[str, ...]] = ("preference_accuracy", "reward_margin")

  def loss(self, model, batch, reference=None):
    *policy, router = sequence_logps(model, batch, with_router=True)
    frozen = jax.lax.stop_gradient(sequence_logps(reference, batch))
    loss, metrics = dpo_loss(*policy, *frozen, beta=self.beta, kind=self.kind,
                             label_smoothing=self.label_smoothing)
    return loss, {**metrics, ROUTER_LOSSES: router}

  def batch_axes(self):
    """A pair's sides, on the same devices."""
    return {f"{side}_{name}": ("batch", "length") for side in SIDES for name in TOKEN_FIELDS}

  def batch_spec(self, rows, length):
    return {k: v for side in SIDES for k, v in token_spec(rows, length, f"{side}_").items()}


def for_config(config: Any) -> NextToken | DirectPreference:
  """The objective a recipe trains: DPO on preference data (`finetune.dpo`), else the
  next token."""
  if not config.data.is_preference:
    return NextToken()
  dpo = config.finetune.dpo
  return DirectPreference(beta=dpo.beta, kind=dpo.loss, label_smoothing=dpo.label_smoothing)
