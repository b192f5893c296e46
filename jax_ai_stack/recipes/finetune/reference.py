"""DPO's reference model in a full fine-tuning run: a frozen copy of the base's weights.

With LoRA the reference costs nothing (`adapters.adapters_off`: the same weights,
adapters switched off). When every parameter trains, the base must be kept as
it was: `add_frozen_copy` puts a copy of each weight beside the model, as
`transforms.Frozen` variables under the model's `reference` attribute (laid out
like the weight it copies). They are not parameters, so the optimizer and the
gradient pass them by; checkpoints leave them out (the fine-tuning transform
reads them from the base run again on resume). `frozen_copy_model` is the model
with its weights replaced by the copies, a relabelling of arrays inside the
step; `without_frozen_copy` is the trained model alone, to decode or export.

The copy costs the parameters' memory once more (no optimizer state, no
gradient); `train --dry-run` states it as "reference".

Example:
  >>> from flax import nnx
  >>> model = add_frozen_copy(nnx.Linear(2, 3, rngs=nnx.Rngs(0)))
  >>> sorted(k for k, _ in nnx.to_flat_state(nnx.state(model, Frozen)))
  [('reference', 'bias'), ('reference', 'kernel')]
"""

from __future__ import annotations

from typing import Any

from flax import nnx

from jax_ai_stack.recipes.transforms import Frozen

__all__ = ["ATTRIBUTE", "Frozen", "add_frozen_copy", "copy_path", "frozen_copy_model",
           "without_attribute", "without_frozen_copy"]

ATTRIBUTE = "reference"
"""The model attribute that holds the copy (state paths `reference/<weight's path>`)."""


def copy_path(path: tuple) -> tuple:
  """The path, in the model's state, of the copy of the weight at `path`."""
  return (ATTRIBUTE, *map(str, path))


def _copy(tree: Any) -> Any:
  """`nnx.Dict`s of `Frozen` variables mirroring a state of parameters (keys as strings:
  an `nnx.Dict`'s keys are attribute names)."""
  if isinstance(tree, nnx.Variable):
    return Frozen(tree.get_value(), **tree.get_metadata())
  return nnx.Dict({str(key): _copy(value) for key, value in tree.items()})


def add_frozen_copy(model: nnx.Module) -> nnx.Module:
  """`model` with a frozen copy of its parameters as they are now (traced: under
  `eval_shape` it costs nothing, and `load` fills it with the base's weights)."""
  setattr(model, ATTRIBUTE, _copy(nnx.state(model, nnx.Param)))
  return model


def frozen_copy_model(model: nnx.Module) -> nnx.Module:
  """The model whose parameters are the frozen copies: what `model` computed at the start."""
  graphdef, state = nnx.split(model)
  flat = dict(nnx.to_flat_state(state))
  out = []
  for path, variable in flat.items():
    if isinstance(variable, nnx.Param) and path[0] != ATTRIBUTE:
      variable = variable.replace(flat[copy_path(path)].get_value())
    out.append((path, variable))
  return nnx.merge(graphdef, nnx.from_flat_state(out))


def without_frozen_copy(model: nnx.Module) -> nnx.Module:
  """A shallow copy of `model` without the frozen copy (the same arrays): what decodes."""
  return without_attribute(model, ATTRIBUTE)


def without_attribute(model: nnx.Module, attribute: str) -> nnx.Module:
  """A copy of `model` without what a transform keeps at `attribute` (a frozen copy, a
  distillation teacher); `model` itself where it has none."""
  if not hasattr(model, attribute):
    return model
  bare = nnx.clone(model)
  delattr(bare, attribute)
  return bare
