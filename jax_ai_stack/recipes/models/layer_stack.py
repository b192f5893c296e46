"""Moves Llama weights between the unrolled and the scanned (`scan_layers`) layouts.

Unrolled, block i's parameters sit at `layers/i/...`, one array per block;
scanned, they sit at `layers/...` with a leading axis of size num_layers. The
numbers are the same, so a checkpoint (or a Hugging Face import) of one layout
serves the other: stacking and unstacking copy, never compute, and a round trip
is bitwise.

The functions on trees take pure dicts (`nnx.to_pure_dict(state)`, arrays or
`jax.ShapeDtypeStruct`s at the leaves, integer keys under `layers` when
unrolled); `convert` does a whole model, `match_layout` every `layers` subtree of
a bigger tree (a checkpoint's parameters and the optimizer moments that mirror
them), which is how a run resumes after `model.scan_layers` was flipped.

Example:
  >>> from flax import nnx
  >>> model = Decoder(DecoderConfig.tiny(num_layers=2), rngs=nnx.Rngs(0))
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
from jax.sharding import PartitionSpec as P

from jax_ai_stack.errors import ConfigError
from jax_ai_stack.recipes.models.decoder import Decoder, DecoderConfig


def is_scanned(tree: Mapping[str, Any]) -> bool:
  """Whether a pure dict of Llama parameters has the scanned layout."""
  layers = tree["layers"]
  return not any(isinstance(key, int) or str(key).isdigit() for key in layers)


def stack_layers(tree: Mapping[str, Any]) -> dict[str, Any]:
  """Unrolled pure dict -> scanned: `layers/i/x` become one `layers/x` [L, ...]."""
  layers = tree["layers"]
  blocks = [layers[i] for i in sorted(layers, key=int)]
  stacked = jax.tree.map(_stack, *blocks)
  return {**tree, "layers": stacked}


def unstack_layers(tree: Mapping[str, Any]) -> dict[str, Any]:
  """Scanned pure dict -> unrolled: `layers/x` [L, ...] becomes `layers/i/x`."""
  stacked = tree["layers"]
  count = jax.tree.leaves(stacked)[0].shape[0]
  blocks = {i: jax.tree.map(lambda x, i=i: _take(x, i), stacked) for i in range(count)}
  return {**tree, "layers": blocks}


def _stack(*xs):
  """`jnp.stack`; for shapes, the sharding gains an unsharded leading 'layers' axis."""
  first = xs[0]
  if not isinstance(first, jax.ShapeDtypeStruct):
    return jnp.stack(xs)
  if any((x.shape, x.dtype) != (first.shape, first.dtype) for x in xs):
    raise ValueError(f"blocks differ: cannot stack {[(x.shape, str(x.dtype)) for x in xs]}")
  sharding = first.sharding
  if isinstance(sharding, jax.sharding.NamedSharding):
    sharding = jax.sharding.NamedSharding(sharding.mesh, P(None, *sharding.spec))
  return jax.ShapeDtypeStruct((len(xs), *first.shape), first.dtype, sharding=sharding)


def _take(x, i: int):
  """`x[i]`; for shapes, the sharding loses the leading 'layers' axis."""
  if not isinstance(x, jax.ShapeDtypeStruct):
    return x[i]
  sharding = x.sharding
  if isinstance(sharding, jax.sharding.NamedSharding):
    sharding = jax.sharding.NamedSharding(sharding.mesh, P(*sharding.spec[1:]))
  return jax.ShapeDtypeStruct(x.shape[1:], x.dtype, sharding=sharding)


def place(x: jax.Array, like: Any) -> jax.Array:
  """`x` on the sharding of `like` (a `jax.ShapeDtypeStruct`), if it names one."""
  sharding = getattr(like, "sharding", None)
  return x if sharding is None else jax.device_put(x, sharding)


def _delete(*arrays: Any) -> None:
  for x in arrays:
    if isinstance(x, jax.Array):
      x.delete()


def _stack_moving(layers: Mapping[Any, Any], like: Mapping[str, Any]) -> dict:
  """`stack_layers` of `layers` (blocks by index), one parameter at a time (see match_layout)."""
  blocks = [layers[i] for i in sorted(layers, key=int)]

  def stack(target, *xs):
    stacked = place(jnp.stack(xs), target)
    _delete(*xs)
    return stacked

  return jax.tree.map(stack, dict(like), *blocks)


def _unstack_moving(stacked: Mapping[str, Any], like: Mapping[Any, Any]) -> dict:
  """`unstack_layers` of `stacked`, one parameter at a time (see match_layout)."""
  leaves, treedef = jax.tree.flatten(dict(stacked))
  keys = sorted(like, key=int)
  targets = [treedef.flatten_up_to(dict(like[key])) for key in keys]
  columns = []
  for j, x in enumerate(leaves):
    columns.append([place(x[i], targets[i][j]) for i in range(len(keys))])
    _delete(x)
  return {key: treedef.unflatten([column[i] for column in columns])
          for i, key in enumerate(keys)}


def layout_name(scanned: bool) -> str:
  return "scanned" if scanned else "unrolled"


def match_layout(tree: Mapping[Any, Any], like: Mapping[Any, Any], *,
                 consume: bool = False) -> tuple[dict, bool | None]:
  """`tree` with each `layers` subtree in the layout of the same subtree of `like`.

  Walks `tree`'s nested dicts; `like` may name integer keys as strings (as
  Orbax's metadata of a checkpoint does) and have anything at its leaves (only
  its keys are read). A subtree that already has `like`'s layout, or that
  `like` lacks, is left as it is. The arrays are only copied, so converting
  back gives bitwise the same tree.

  With `consume`, for a tree of arrays and a `like` of `jax.ShapeDtypeStruct`s
  with the same keys (a model's abstract state): each parameter is converted on
  its own, placed on `like`'s sharding, and the arrays it came from are
  deleted, so converting a whole training state (a restore after
  `scan_layers` flipped) needs room for one parameter of every layer more, not
  for a second state. `tree`'s converted arrays are unusable afterwards.

  Returns:
    The tree, and the layout it was converted to (True: scanned, False:
    unrolled), or None if nothing was converted.

  Example:
    >>> params = {"layers": {0: {"w": jnp.zeros(3)}, 1: {"w": jnp.ones(3)}}}
    >>> stacked, scanned = match_layout(params, {"layers": {"w": None}})
    >>> stacked["layers"]["w"].shape, scanned
    ((2, 3), True)
    >>> match_layout(stacked, {"layers": {"0": {"w": None}, "1": {"w": None}}})[0]["layers"][1]
    {'w': Array([1., 1., 1.], dtype=float32)}
  """
  converted: list[bool] = []

  def walk(node, other):
    if not isinstance(node, Mapping) or not isinstance(other, Mapping):
      return node
    out = {}
    for key, child in node.items():
      counterpart = other.get(key, other.get(str(key)))
      if (key == "layers" and isinstance(child, Mapping) and isinstance(counterpart, Mapping)
          and child and counterpart and is_scanned(node) != is_scanned({key: counterpart})):
        scanned = is_scanned({key: counterpart})
        if consume:
          child = (_stack_moving if scanned else _unstack_moving)(child, counterpart)
        else:
          child = (stack_layers if scanned else unstack_layers)({key: child})[key]
        converted.append(scanned)
      else:
        child = walk(child, counterpart)
      out[key] = child
    return out

  result = walk(tree, like)
  return result, (converted[0] if converted else None)


def convert(model: Decoder, *, scan_layers: bool) -> Decoder:
  """`model` in the layout `scan_layers` asks for (itself if it has it already).

  The new model has the same weights, attention plan and layout; only
  `config.scan_layers` and the parameters' arrangement differ.
  """
  if model.config.scan_layers == scan_layers:
    return model
  config: DecoderConfig = dataclasses.replace(model.config, scan_layers=scan_layers)
  first = model.layers if model.config.scan_layers else model.layers[0]
  plan = first.attention.attention_plan
  target = nnx.eval_shape(
      lambda: Decoder(config, rngs=nnx.Rngs(0), attention=plan, layout=model.layout))
  graphdef, state = nnx.split(target)
  pure = nnx.to_pure_dict(nnx.state(model))
  pure = stack_layers(pure) if scan_layers else unstack_layers(pure)
  nnx.replace_by_pure_dict(state, pure)
  return nnx.merge(graphdef, state)


def unrolled(model: nnx.Module) -> nnx.Module:
  """`model` with one module per block, for code that reads `layers/N/...` paths."""
  if isinstance(model, Decoder) and model.config.scan_layers:
    return convert(model, scan_layers=False)
  return model


def refuse_scanned(model_config: Any, what: str, hint: str) -> None:
  """ConfigError if `model_config` asks for stacked layers, which `what` cannot handle.

  For code that finds layers by their `layers/N/...` paths (Qwix rules, the
  Hugging Face names); `hint` says what to do instead.
  """
  if getattr(model_config, "scan_layers", False):
    raise ConfigError(f"model.scan_layers=true is not supported by {what} yet: {hint}")
