"""Model transforms: what a run does to the model its Task builds.

QAT's fake quantization, LoRA adapters on a frozen base, a base run's weights to
start from: each changes the model, what trains, what a checkpoint holds or
what decodes. The trainer names none of them. `build_run` asks the Task for the
run's transform (`Task.model_transforms`: by default what the recipe's
`finetune` and `quant` sections ask, `finetune.transforms.for_config`) and
calls its hooks at fixed points of a run:

  apply(model)               the model as built (traced, under eval_shape or jit)
  wrt                        what the optimizer updates and the gradient is taken of
  saved(state)               the part of the (model, optimizer) state a checkpoint holds
  initialised(state)         the part of a fresh run's saved state made from the seed
  load(state, ...)           weights read from elsewhere (a base run) into the state
  metadata()                 what a checkpoint records beside the arrays
  reference_model(model)     the frozen model a preference objective compares with
  inference_model(model, plain)   the model that decodes (a LoRA run's, merged)
  exported_model(model, plain)    the model export-hf writes, and lines saying how
  describe(model)            how the run's parameter count reads

No hook sees the run or the trainer. What a transform asks of them, it states
as a value: `evaluates_before_training` (a fine-tuning run's base evaluated as
step 0, and the held-out change printed at the end: the trainer's work).

A new transform subclasses `ModelTransform` and overrides the hooks it needs;
`Chain` runs several in order (QAT, then a base with adapters). Like optax's
`chain`, it is checked as it is built: two transforms that each narrow what
trains (`wrt`), each give a reference model, or each apply a Qwix provider
(Qwix keeps one per model) are refused, naming both (`TransformConflict`).

Example: no transform leaves the model and what trains as they are.
  >>> from flax import nnx
  >>> identity = Chain([ModelTransform()])
  >>> identity.wrt is nnx.Param, identity.metadata()
  (True, {})
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from flax import nnx

from jax_ai_stack.errors import ConfigError

__all__ = ["Chain", "Frozen", "ModelTransform", "TransformConflict"]


class TransformConflict(ConfigError):
  """Two transforms of one chain claim what only one can have (see the module)."""


class Frozen(nnx.Variable):
  """A frozen copy of weights a transform keeps beside the model (a full fine-tuning run's
  DPO reference): never trained, never saved, read again from where it came on resume."""


class ModelTransform:
  """One transform of a run's model; every hook's default changes nothing."""

  wrt: Any = nnx.Param
  """What the optimizer updates and the gradient is taken of (an nnx filter)."""
  provides_reference: bool = False
  """Whether `reference_model` gives a model (DPO's reference)."""
  qwix_provider: str | None = None
  """The Qwix provider `apply` puts on the model (e.g. "QtProvider"), if any."""
  evaluates_before_training: bool = False
  """Whether the trainer evaluates the model before the first step (step 0) and prints the
  held-out change at the end (a fine-tuning run: the base against what tuning made of it)."""

  @property
  def label(self) -> str:
    """How an error names this transform (a config field where one asks for it)."""
    return type(self).__name__

  def apply(self, model: nnx.Module) -> nnx.Module:
    """The model the run trains, from the Task's (called while tracing: no I/O)."""
    return model

  def saved(self, state: nnx.State) -> nnx.State:
    """The part of a (model, optimizer) state that checkpoints hold."""
    return state

  def initialised(self, state: nnx.State) -> nnx.State:
    """The part of a fresh run's `saved` state that is initialised from the seed. What it
    leaves out, `load` reads from elsewhere: initialising it too would only be thrown away
    (a full fine-tune's base weights, and its compiled initialisation's memory)."""
    return state

  def load(self, state: nnx.State, abstract: nnx.State, shardings: nnx.State,
           metadata: dict | None, *, model: nnx.Module) -> nnx.State:
    """`state` (what `saved` keeps, restored or initialised) completed with what the
    transform reads from elsewhere. `abstract` and `shardings`: the whole state's shapes
    and placement; `metadata`: the restored checkpoint's, None for a fresh run;
    `model`: the abstract transformed model."""
    del abstract, shardings, metadata, model
    return state

  def metadata(self) -> dict[str, Any]:
    """Entries of a checkpoint's metadata (what `load` needs again on resume)."""
    return {}

  def reference_model(self, model: nnx.Module) -> nnx.Module | None:
    """The frozen model a preference objective (DPO) compares `model` with, computed from
    `model`'s state inside the step; None: this run keeps no reference."""
    del model
    return None

  def inference_model(self, model: nnx.Module, plain: Callable[[], nnx.Module]) -> nnx.Module:
    """The model that decodes and is exported; `plain` builds the Task's untransformed model."""
    del plain
    return model

  def exported_model(self, model: nnx.Module,
                     plain: Callable[[], nnx.Module]) -> tuple[nnx.Module, list[str]]:
    """The model `export-hf` writes (by default the inference model), and one line for each
    way it differs from what the run computes (a QAT run's float weights, say)."""
    return self.inference_model(model, plain), []

  def describe(self, model: nnx.Module) -> str | None:
    """The run's parameter count in words when it is not simply 'N parameters'."""
    del model
    return None


class Chain(ModelTransform):
  """Several transforms, applied in order; refuses two that claim the same thing."""

  def __init__(self, transforms: Sequence[ModelTransform]):
    self.transforms = list(transforms)
    narrowing = _one_at_most(self.transforms, lambda t: t.wrt is not nnx.Param,
                             "narrow what trains (wrt)")
    self.wrt = narrowing.wrt if narrowing else nnx.Param
    self.provides_reference = bool(_one_at_most(
        self.transforms, lambda t: t.provides_reference, "give the reference model"))
    qwix = _one_at_most(self.transforms, lambda t: t.qwix_provider is not None,
                        "apply a Qwix provider (Qwix keeps one per model)")
    self.qwix_provider = qwix.qwix_provider if qwix else None
    self.evaluates_before_training = any(t.evaluates_before_training for t in self.transforms)

  def apply(self, model):
    for transform in self.transforms:
      model = transform.apply(model)
    return model

  def saved(self, state):
    for transform in self.transforms:
      state = transform.saved(state)
    return state

  def initialised(self, state):
    for transform in self.transforms:
      state = transform.initialised(state)
    return state

  def load(self, state, abstract, shardings, metadata, *, model):
    for transform in self.transforms:
      state = transform.load(state, abstract, shardings, metadata, model=model)
    return state

  def metadata(self):
    return {k: v for transform in self.transforms for k, v in transform.metadata().items()}

  def reference_model(self, model):
    for transform in self.transforms:
      if transform.provides_reference:
        return transform.reference_model(model)
    return None

  def inference_model(self, model, plain):
    for transform in self.transforms:
      model = transform.inference_model(model, plain)
    return model

  def exported_model(self, model, plain):
    notes = []
    for transform in self.transforms:
      model, said = transform.exported_model(model, plain)
      notes += said
    return model, notes

  def describe(self, model):
    return next((text for t in self.transforms if (text := t.describe(model))), None)


def _one_at_most(transforms: Sequence[ModelTransform], claims: Callable[[ModelTransform], bool],
                 what: str) -> ModelTransform | None:
  """The one transform that `claims`, or None; a TransformConflict naming two that do."""
  claiming = [t for t in transforms if claims(t)]
  if len(claiming) > 1:
    raise TransformConflict(f"{claiming[0].label} and {claiming[1].label} each {what}: "
                            f"a run's transforms may have one that does")
  return claiming[0] if claiming else None
