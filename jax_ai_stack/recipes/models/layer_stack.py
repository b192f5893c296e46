"""Moves Llama weights between the unrolled and the scanned (`scan_layers`) layouts.

Unrolled, block i's parameters sit at `layers/i/...`, one array per block;
scanned, they sit at `layers/...` with a leading axis of size num_layers. The
numbers are the same, so a checkpoint (or a Hugging Face import) of one layout
serves the other: stacking and unstacking copy, never compute, and a round trip
is bitwise.

The functions on trees take pure dicts (`nnx.to_pure_dict(state)`, arrays at the
leaves, integer keys under `layers` when unrolled); `convert` does a whole model.

Example:
  >>> from flax import nnx
  >>> model = Llama(LlamaConfig.tiny(num_layers=2), rngs=nnx.Rngs(0))
  >>> convert(model, scan_layers=True).layers.mlp.up_proj.kernel.shape
  (2, 128, 384)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jax_ai_stack.errors import ConfigError
from jax_ai_stack.recipes.models.llama import Llama, LlamaConfig


def is_scanned(tree: Mapping[str, Any]) -> bool:
  """Whether a pure dict of Llama parameters has the scanned layout."""
  layers = tree["layers"]
  return not any(isinstance(key, int) or str(key).isdigit() for key in layers)


def stack_layers(tree: Mapping[str, Any]) -> dict[str, Any]:
  """Unrolled pure dict -> scanned: `layers/i/x` become one `layers/x` [L, ...]."""
  layers = tree["layers"]
  blocks = [layers[i] for i in sorted(layers, key=int)]
  stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *blocks)
  return {**tree, "layers": stacked}


def unstack_layers(tree: Mapping[str, Any]) -> dict[str, Any]:
  """Scanned pure dict -> unrolled: `layers/x` [L, ...] becomes `layers/i/x`."""
  stacked = tree["layers"]
  count = jax.tree.leaves(stacked)[0].shape[0]
  blocks = {i: jax.tree.map(lambda x, i=i: x[i], stacked) for i in range(count)}
  return {**tree, "layers": blocks}


def convert(model: Llama, *, scan_layers: bool) -> Llama:
  """`model` in the layout `scan_layers` asks for (itself if it has it already).

  The new model has the same weights, attention plan and layout; only
  `config.scan_layers` and the parameters' arrangement differ.
  """
  if model.config.scan_layers == scan_layers:
    return model
  config: LlamaConfig = dataclasses.replace(model.config, scan_layers=scan_layers)
  first = model.layers if model.config.scan_layers else model.layers[0]
  plan = first.attention.attention_plan
  target = nnx.eval_shape(
      lambda: Llama(config, rngs=nnx.Rngs(0), attention=plan, layout=model.layout))
  graphdef, state = nnx.split(target)
  pure = nnx.to_pure_dict(nnx.state(model))
  pure = stack_layers(pure) if scan_layers else unstack_layers(pure)
  nnx.replace_by_pure_dict(state, pure)
  return nnx.merge(graphdef, state)


def unrolled(model: nnx.Module) -> nnx.Module:
  """`model` with one module per block, for code that reads `layers/N/...` paths."""
  if isinstance(model, Llama) and model.config.scan_layers:
    return convert(model, scan_layers=False)
  return model


def refuse_scanned(model_config: Any, what: str, hint: str) -> None:
  """ConfigError if `model_config` asks for stacked layers, which `what` cannot handle.

  For code that finds layers by their `layers/N/...` paths (Qwix rules, the
  Hugging Face names); `hint` says what to do instead.
  """
  if getattr(model_config, "scan_layers", False):
    raise ConfigError(f"model.scan_layers=true is not supported by {what} yet: {hint}")
