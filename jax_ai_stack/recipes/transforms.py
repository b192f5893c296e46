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
  load(state, ...)           weights read from elsewhere (a base run) into the state
  metadata()                 what a checkpoint records beside the arrays
  reference_model(model)     the frozen model a preference objective compares with
  inference_model(model, plain)   the model that decodes (a LoRA run's, merged)
  exported_model(model, plain)    the model export-hf writes, and lines saying how
  describe(model)            how the run's parameter count reads
  before_fit(run), after_fit(run) what is logged and printed around training

A new transform subclasses `ModelTransform` and overrides the hooks it needs;
`Chain` runs several in order (QAT, then a base with adapters).

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

__all__ = ["Chain", "Frozen", "ModelTransform"]


class Frozen(nnx.Variable):
  """A frozen copy of weights a transform keeps beside the model (a full fine-tuning run's
  DPO reference): never trained, never saved, read again from where it came on resume."""


class ModelTransform:
  """One transform of a run's model; every hook's default changes nothing."""

  wrt: Any = nnx.Param
  """What the optimizer updates and the gradient is taken of (an nnx filter)."""

  def apply(self, model: nnx.Module) -> nnx.Module:
    """The model the run trains, from the Task's (called while tracing: no I/O)."""
    return model

  def saved(self, state: nnx.State) -> nnx.State:
    """The part of a (model, optimizer) state that checkpoints hold."""
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

  def before_fit(self, run: Any) -> None:
    """Called once before the first step of a run that trains (not on a finished one)."""

  def after_fit(self, run: Any) -> list[str]:
    """Lines to print when a run has finished training."""
    del run
    return []


class Chain(ModelTransform):
  """Several transforms, applied in order; the last one that narrows `wrt` decides it."""

  def __init__(self, transforms: Sequence[ModelTransform]):
    self.transforms = list(transforms)
    narrowed = [t.wrt for t in self.transforms if t.wrt is not nnx.Param]
    self.wrt = narrowed[-1] if narrowed else nnx.Param

  def apply(self, model):
    for transform in self.transforms:
      model = transform.apply(model)
    return model

  def saved(self, state):
    for transform in self.transforms:
      state = transform.saved(state)
    return state

  def load(self, state, abstract, shardings, metadata, *, model):
    for transform in self.transforms:
      state = transform.load(state, abstract, shardings, metadata, model=model)
    return state

  def metadata(self):
    return {k: v for transform in self.transforms for k, v in transform.metadata().items()}

  def reference_model(self, model):
    for transform in self.transforms:
      reference = transform.reference_model(model)
      if reference is not None:
        return reference
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

  def before_fit(self, run):
    for transform in self.transforms:
      transform.before_fit(run)

  def after_fit(self, run):
    return [line for transform in self.transforms for line in transform.after_fit(run)]
