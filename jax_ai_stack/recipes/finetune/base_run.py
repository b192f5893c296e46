"""The trained run a fine-tune starts from: where it is, its weights, a checksum of them.

`finetune.base` names a trained run's workdir or one of its step directories.
Its weights are read into the fine-tuning model's shapes and shardings; a LoRA
run as a base is its own base with its adapters merged in; a QLoRA run's base
is quantized as the run's scheme says. A checksum of what was read goes into the
fine-tune's checkpoints, so a base that vanished or changed is a
`BaseCheckpointError` on resume, never a silent mix. The checksum is of the
weights at the `model.param_dtype` the run started with (the pointer's `dtype`):
a finished run opened with another dtype reads its base at that one, checks it,
then casts, so a dtype override is no false alarm.

Example:
  >>> import jax.numpy as jnp
  >>> bool((checksum({"w": jnp.ones(3)}) != checksum({"w": jnp.zeros(3)})).any())
  True
"""

from __future__ import annotations

import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_ai_stack import logs
from jax_ai_stack.errors import WorkdirError
from jax_ai_stack.recipes import checkpoint
from jax_ai_stack.recipes.finetune.adapters import A_SUFFIX, B_SUFFIX, with_delta


class BaseCheckpointError(WorkdirError):
  """The base run of a fine-tuning run is missing, unreadable or changed."""


def resolve_base(base: str | pathlib.Path) -> tuple[pathlib.Path, int | None]:
  """(checkpoint directory, step or None for the newest) that `finetune.base` names."""
  path = pathlib.Path(base)
  if (path / "checkpoints").is_dir():
    return (path / "checkpoints").absolute(), None
  if path.name.isdigit() and path.is_dir():
    return path.parent.absolute(), int(path.name)
  if path.is_dir() and any(p.name.isdigit() for p in path.iterdir()):
    return path.absolute(), None
  raise BaseCheckpointError(
      f"finetune.base={str(base)!r}: no trained run there (a workdir with checkpoints/, or "
      "one step directory <workdir>/checkpoints/<step>); train the base first")


CHECKSUM_BLOCK = 1 << 20
"""Elements of a weight summed at a time. XLA:CPU writes an elementwise product out whole
before it reduces it: summed at once, Qwen3-0.6B's weights took 4.6 GiB beside themselves."""


@jax.jit
def _position_weighted_sums(leaf: jax.Array, index: jax.Array) -> jax.Array:
  """The two sums `checksum` takes of one weight's bits, mod 2**32, a block of
  `CHECKSUM_BLOCK` at a time (the same sums: addition mod 2**32 is exact). One weight a
  program: only its own unsigned copy (the loop's operand) is held at once."""
  unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[leaf.dtype.itemsize]
  bits = jax.lax.bitcast_convert_type(leaf, unsigned).ravel()  # Integers: XLA:CPU keeps them.

  def sums(start, size):
    block = jax.lax.dynamic_slice(bits, (start,), (size,)).astype(jnp.uint32)
    position = jnp.asarray(start).astype(jnp.uint32) + jnp.arange(size, dtype=jnp.uint32)
    return jnp.stack([((position * jnp.uint32(2654435761) + 1) * block).sum(dtype=jnp.uint32),
                      ((position + index) * block).sum(dtype=jnp.uint32)])

  whole, rest = divmod(bits.size, CHECKSUM_BLOCK)
  total = jnp.zeros(2, jnp.uint32)
  if whole:
    total = jax.lax.fori_loop(
        0, whole, lambda i, total: total + sums(i * CHECKSUM_BLOCK, CHECKSUM_BLOCK), total)
  return total + sums(whole * CHECKSUM_BLOCK, rest) if rest else total


def checksum(tree: Any) -> np.ndarray:
  """Two uint32 sums of every bit of `tree`'s arrays, position-weighted: a change detector."""
  total = np.zeros(2, np.uint32)
  for index, leaf in enumerate(jax.tree.leaves(tree)):  # uint32 arithmetic wraps, as on XLA.
    total = total * np.uint32(31) + np.asarray(_position_weighted_sums(leaf, np.uint32(index)))
  return total


def start_dtype(pointer: dict, metadata: dict | None) -> str:
  """The `model.param_dtype` a pointer's checksum was taken at: its own `dtype`, or (a
  pointer written before it had one) the param_dtype of the config saved beside it."""
  if pointer.get("dtype"):
    return pointer["dtype"]
  return (((metadata or {}).get("config") or {}).get("model") or {}).get("param_dtype", "")


def with_dtype(tree: Any, old: str, new: str) -> Any:
  """`tree` (shapes or arrays) with its leaves of dtype `old` at dtype `new` (others as
  they are): the weights at the param_dtype a checksum was taken at, and back."""
  if not old or not new or jnp.dtype(old) == jnp.dtype(new):
    return tree
  old, new = jnp.dtype(old), jnp.dtype(new)

  def cast(leaf):
    if leaf.dtype != old:
      return leaf
    if isinstance(leaf, jax.ShapeDtypeStruct):
      return jax.ShapeDtypeStruct(leaf.shape, new, sharding=leaf.sharding)
    return leaf.astype(new)

  if any(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves(tree)):
    return jax.tree.map(cast, tree)
  return jax.jit(lambda t: jax.tree.map(cast, t))(tree)  # One program, not one per weight.


def read_checked(pointer: dict, dtype: str, target: nnx.State, origin: str, *,
                 then: str) -> tuple[nnx.State, int, list[int]]:
  """The base weights `pointer` names, read into `target` at `dtype` (where the leaves are
  of the run's param_dtype) and cast to the target's: (weights, step, their checksum at
  `dtype`). `then`: the param_dtype the target's leaves are at now."""
  directory = pathlib.Path(pointer["base"])
  weights, step = read_base(directory, pointer["step"], with_dtype(target, then, dtype), origin,
                            param_dtype=dtype)
  found = np.asarray(checksum(nnx.to_pure_dict(weights))).tolist()
  return with_dtype(weights, dtype, then), step, found


def float_target(target: nnx.State, dtype: str) -> nnx.State:
  """The float weights a QLoRA base is quantized from: `w/array/qvalue` -> `w` (its shape)."""
  out = []
  for path, variable in nnx.to_flat_state(target):
    if path[-2:] == ("array", "qvalue"):
      value = variable.get_value()
      out.append((path[:-2], variable.replace(
          jax.ShapeDtypeStruct(value.shape, jnp.dtype(dtype), sharding=value.sharding))))
    elif path[-2:-1] != ("array",):  # The scale is recomputed from the float weight.
      out.append((path, variable))
  return nnx.from_flat_state(out)


def quantized(weights: nnx.State, target: nnx.State, model: nnx.Module) -> nnx.State:
  """The float base `weights` quantized as the QLoRA `model` does (Qwix PTQ), into `target`."""
  import qwix
  from flax import traverse_util

  floats = nnx.to_pure_dict(weights)[0]
  # One compiled program (eagerly, each op of each weight would compile on its own).
  quantized = traverse_util.flatten_dict(jax.jit(lambda f: qwix.quantize_params(f, model))(floats))
  out = []
  for path, variable in nnx.to_flat_state(target):
    value = quantized[path[1:]]  # Qwix gives an NNX model's params as a pure dict.
    out.append((path, variable.replace(jax.device_put(value, variable.get_value().sharding))))
  return nnx.from_flat_state(out)


def read_base(directory: pathlib.Path, step: int | None, target: nnx.State,
              origin: str, *, param_dtype: str) -> tuple[nnx.State, int]:
  """The base's weights at `step` (None: newest) into `target`'s shapes and shardings
  (`param_dtype`: the dtype of its weights there)."""
  if not directory.is_dir():
    raise BaseCheckpointError(f"the base run's checkpoints {directory} are gone "
                              f"(finetune.base={origin!r})")
  manager = checkpoint.build_manager(directory, checkpoint.CheckpointConfig(), read_only=True)
  try:
    steps = manager.all_steps()
    if step is None:
      if not steps:
        raise BaseCheckpointError(f"no checkpoint in {directory} (finetune.base={origin!r})")
      step = max(steps)
    elif step not in steps:
      raise BaseCheckpointError(f"step {step} of the base run {directory} is gone "
                                f"(finetune.base={origin!r}); steps there: {sorted(steps)}")
    adapted = _lora_section(checkpoint.read_metadata(manager, step))
    if adapted is not None:  # A LoRA run: its own base, with its adapters merged in.
      return _merged_lora_base(manager, step, adapted, target, origin, param_dtype), step
    try:
      weights = checkpoint.restore_subset(manager, step, target,
                                          what=f"the base run finetune.base={origin!r}")
    except Exception as e:
      damage = checkpoint.corruption(e)  # Out of memory, I/O errors, bugs: as they are.
      if damage is None:
        raise
      raise BaseCheckpointError(f"the base run {directory} step {step} is unreadable "
                                f"({damage}; finetune.base={origin!r})") from None
    return weights, step
  finally:
    manager.close()


def read_pointed(pointer: dict, dtype: str, target: nnx.State, origin: str, *,
                 then: str) -> tuple[nnx.State, str]:
  """The base weights a checkpoint's pointer names (read as a base is, into `target`),
  checked against the pointer's checksum at `dtype` (`read_checked`); and 'DIR step N',
  where they were read."""
  directory = pathlib.Path(pointer["base"])
  weights, step, found = read_checked(pointer, dtype, target, origin, then=then)
  if found != pointer["checksum"]:
    raise BaseCheckpointError(f"the base run {directory} step {step} has changed since the run "
                              f"over it trained (finetune.base={origin!r}): restore it")
  return weights, f"{directory} step {step}"


def _lora_section(metadata: dict) -> tuple[dict, dict, str] | None:
  """(finetune.lora, the pointer to its base, the dtype of its checksum) of a LoRA run's
  checkpoint metadata, else None."""
  finetune = (metadata.get("config") or {}).get("finetune") or {}
  if finetune.get("lora") is None:
    return None
  pointer = metadata.get("finetune") or {}
  return finetune["lora"], pointer, start_dtype(pointer, metadata)


def _merged_lora_base(manager, step: int, adapted: tuple[dict, dict, str], target: nnx.State,
                      origin: str, then: str) -> nnx.State:
  """A LoRA run as a base: its own base's float weights (read as a base is, checksum
  checked) plus (alpha / r) A B of the adapters it saved, in `target`'s shapes."""
  config, pointer, dtype = adapted
  if not pointer:
    raise BaseCheckpointError(f"finetune.base={origin!r} is a LoRA run whose checkpoint has "
                              "no pointer to its own base")
  weights, where = read_pointed(pointer, dtype, target, origin, then=then)
  stored = {jax.tree_util.keystr(path, simple=True, separator="/"): leaf
            for path, leaf in jax.tree_util.tree_leaves_with_path(
                manager.item_metadata(step)["state"])}
  flat = dict(nnx.to_flat_state(weights))
  adapters = []
  for path, variable in flat.items():
    for suffix in (A_SUFFIX, B_SUFFIX):
      leaf = stored.get("/".join(map(str, path[:-1] + (path[-1] + suffix,))))
      if leaf is not None:
        sharding = variable.get_value().sharding
        if isinstance(sharding, jax.sharding.NamedSharding):
          sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
        adapters.append((path[:-1] + (path[-1] + suffix,), nnx.LoRAParam(
            jax.ShapeDtypeStruct(tuple(leaf.shape), leaf.dtype, sharding=sharding))))
  read = dict(nnx.to_flat_state(checkpoint.restore_subset(
      manager, step, nnx.from_flat_state(adapters),
      what=f"the adapters of the LoRA run finetune.base={origin!r}")))
  scale = config["alpha"] / config["rank"]

  @jax.jit
  def merge(values, read):
    out = dict(values)
    for path, value in values.items():
      a, b = (read.get(path[:-1] + (path[-1] + suffix,)) for suffix in (A_SUFFIX, B_SUFFIX))
      if a is not None:
        out[path] = with_delta(value, a, b, scale)
    return out

  merged = merge({path: v.get_value() for path, v in flat.items()},
                 {path: v.get_value() for path, v in read.items()})
  logs.note(f"finetune.base={origin!r} is a LoRA run: its adapters (rank {config['rank']}, "
            f"alpha {config['alpha']:g}) are merged into its base ({where}) as it loads")
  return nnx.from_flat_state([(path, flat[path].replace(merged[path])) for path in flat])
