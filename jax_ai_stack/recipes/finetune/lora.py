"""Fine-tuning from a trained run: all parameters, or (Q)LoRA adapters through Qwix.

`finetune.base` names a trained run. Without `finetune.lora` the new run starts
from its weights and trains everything (a fresh optimizer). With it, Qwix's
`LoraProvider` gives each matching layer a pair of `nnx.LoRAParam` adapters
(A [in, r], B [r, out], B zero at first, so step 0 is the base model), and only
they train: the optimizer is built `wrt=nnx.LoRAParam` and the gradient is
taken of them alone. The base stays frozen, float or (QLoRA) quantized by a
scheme of `finetune.quant`.

Checkpoints of a LoRA run hold what changes (adapters, optimizer state, data
position) and, in the metadata, a pointer to the base: its checkpoint
directory, step and a checksum of the weights. Restoring reads the base again
from there, so a run stays small on disk; a base that vanished or changed
(another checksum) is a `BaseCheckpointError`, never a silent mix.

Qwix adds the adapters inside the model's `__call__` only, so what decodes
(generation, `finetune.merge`) uses `merged_model`: W + (alpha / r) A B in a
plain model.

Example:
  >>> from jax_ai_stack.recipes import config
  >>> cfg = config.load("lm-tiny-lora")
  >>> cfg.finetune.base, cfg.finetune.lora.rank
  ('runs/lm-tiny', 8)
"""

from __future__ import annotations

import math
import pathlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_ai_stack import logs
from jax_ai_stack.errors import ConfigError, WorkdirError
from jax_ai_stack.recipes import checkpoint
from jax_ai_stack.recipes.finetune import reference
from jax_ai_stack.recipes.finetune.config import FinetuneConfig, LoraConfig
from jax_ai_stack.recipes.models import adapting
from jax_ai_stack.recipes.transforms import Frozen, ModelTransform

__all__ = ["BaseCheckpointError", "Finetune", "FinetuneConfig", "LoraConfig", "merged_model"]

_A, _B = "_lora_a", "_lora_b"


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


def lora_rules(config: LoraConfig, model_kind: str) -> list:
  """Qwix rules: adapters on `config.modules`; for QLoRA also `finetune.quant`'s weight scheme.

  QLoRA's rules, in Qwix's order of precedence: adapters over each quantized
  layer that `modules` names, the scheme's quantization alone on its other
  layers, then adapters over float layers.
  """
  import qwix

  adapted = f"(?:.*/)?(?:{config.modules})"
  adapters = dict(rank=config.rank, alpha=config.alpha)
  if config.quantize_base is None:
    return [qwix.LoraRule(module_path=adapted, **adapters)]
  from jax_ai_stack.recipes.finetune import quant

  scheme = quant.rules(config.quantize_base, model_kind)  # Weight-only (LoraConfig checks).
  both = [qwix.LoraRule(module_path=f"(?={adapted}$)(?:{rule.module_path})",
                        weight_qtype=rule.weight_qtype, **adapters) for rule in scheme]
  return [*both, *scheme, qwix.LoraRule(module_path=adapted, **adapters)]


def add_adapters(model: nnx.Module, config: LoraConfig, model_config: Any,
                 seed: int) -> nnx.Module:
  """`model` with Qwix LoRA adapters on the layers `config.modules` matches.

  Raises ConfigError when no layer matches or the rank exceeds a layer's width.
  """
  import qwix

  from jax_ai_stack.recipes.models import layer_stack

  layer_stack.refuse_scanned(model_config, "finetune.lora", "its Qwix rules match per-layer "
                             "module paths (layers/N/...); set model.scan_layers=false")
  provider = qwix.LoraProvider(lora_rules(config, model_config.kind))
  model = qwix.apply_lora_to_model(model, provider, *adapting.example_inputs(model_config),
                                   rngs=nnx.Rngs(seed))
  pairs = adapter_pairs(model)
  if not pairs:
    raise ConfigError(f"finetune.lora.modules={config.modules!r} matches no layer of the model")
  for name, (a, b) in pairs.items():
    width = min(math.prod(a.shape[:-1]), math.prod(b.shape[1:]))
    if config.rank > width:
      raise ConfigError(f"finetune.lora.rank={config.rank} is larger than the width ({width}) "
                        f"of layer {name}: choose a rank <= {width}")
  return model


def adapter_pairs(model: nnx.Module) -> dict[str, tuple[jax.Array, jax.Array]]:
  """{'layers/0/mlp/up_proj/kernel': (A, B)} of every adapted weight."""
  flat = {"/".join(map(str, path)): v for path, v in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam))}
  return {name[:-len(_A)]: (flat[name].get_value(), flat[name[:-len(_A)] + _B].get_value())
          for name in flat if name.endswith(_A)}


def adapters_off(model: nnx.Module) -> nnx.Module:
  """`model` as its base computes it: a copy whose adapters' B factors are zero, so each
  adapted layer adds exactly nothing (DPO's reference, without a second copy of the weights).

  Pure: `model` is not changed, and inside a traced step the copy costs one forward pass.
  """
  graphdef, state = nnx.split(model)
  off = jax.tree_util.tree_map_with_path(
      lambda path, x: jnp.zeros_like(x) if any(
          str(getattr(key, "key", "")).endswith(_B) for key in path) else x, state)
  return nnx.merge(graphdef, off)


def adapter_delta(a: jax.Array, b: jax.Array, scale: float, shape: tuple[int, ...]) -> jax.Array:
  """scale * A B in the weight's own shape (Qwix's A holds the weight's input axes, B its output).

  Example:
    >>> adapter_delta(jnp.ones((3, 1)), jnp.ones((1, 2)), 0.5, (3, 2)).tolist()
    [[0.5, 0.5], [0.5, 0.5], [0.5, 0.5]]
  """
  delta = jnp.tensordot(a.astype(jnp.float32), b.astype(jnp.float32), axes=1) * scale
  return delta.reshape(shape)


def with_delta(weight: jax.Array, a: jax.Array, b: jax.Array, scale: float) -> jax.Array:
  """`weight` + scale * A B, summed in float32 and returned in `weight`'s dtype."""
  merged = weight.astype(jnp.float32) + adapter_delta(a, b, scale, weight.shape)
  return merged.astype(weight.dtype)


def merged_model(model: nnx.Module, plain: Callable[[], nnx.Module], scale: float,
                 base: nnx.State | None = None) -> nnx.Module:
  """A plain model (no Qwix) whose weights are the base plus `scale` * A B.

  `plain` builds the model without adapters (its values are replaced); the
  result decodes like `model` computes (Qwix adds the adapters only inside
  `__call__`), up to float rounding of the merged sum. A QLoRA base is
  dequantized first, so the merged model is float; `base` (the plain model's
  weights, e.g. the float weights a QLoRA base was quantized from) replaces
  the model's own base weights where it has them.
  """
  target = nnx.eval_shape(plain)
  graphdef, state = nnx.split(model)

  def merged_state(state, base):
    source = nnx.merge(graphdef, state)
    pairs = adapter_pairs(source)
    given = dict(nnx.to_flat_state(base)) if base is not None else {}
    out = []
    for path, variable in nnx.to_flat_state(nnx.state(target)):
      value = given[path].get_value() if path in given else _float_value(source, path)
      name = "/".join(map(str, path))
      if name in pairs:
        value = with_delta(value, *pairs[name], scale)
      out.append((path, variable.replace(value.astype(variable.get_value().dtype))))
    return nnx.from_flat_state(out)

  nnx.update(target, jax.jit(merged_state)(state, base))
  return target


def _float_value(model: nnx.Module, path: tuple) -> jax.Array:
  """The value at `path` of `model`; a QLoRA base weight (Qwix `WithAux`) dequantized."""
  import qwix
  from qwix._src.utils.flax_util import get_value_from_path

  value = get_value_from_path(model, path)
  if isinstance(value, nnx.Variable):
    return value.get_value()
  return qwix.dequantize(value.array)  # A WithAux[QArray].


def _is_base_weight(path, variable) -> bool:
  """The model's (path[0] == 0) weights other than the adapters: what a LoRA run freezes."""
  return (path[0] == 0 and isinstance(variable, nnx.Param)
          and not isinstance(variable, nnx.LoRAParam))


def _is_model_param(path, variable) -> bool:
  return path[0] == 0 and isinstance(variable, nnx.Param)


@jax.jit
def checksum(tree: Any) -> jax.Array:
  """Two uint32 sums of every bit of `tree`'s arrays, position-weighted: a change detector."""
  total = jnp.zeros(2, jnp.uint32)
  for index, leaf in enumerate(jax.tree.leaves(tree)):
    bits = jax.lax.bitcast_convert_type(leaf, {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32,
                                               8: jnp.uint32}[leaf.dtype.itemsize])
    bits = bits.ravel().astype(jnp.uint32)
    position = jnp.arange(bits.size, dtype=jnp.uint32)
    weights = jnp.stack([position * jnp.uint32(2654435761) + 1, position + jnp.uint32(index)])
    total = total * jnp.uint32(31) + (weights * bits).sum(axis=1, dtype=jnp.uint32)
  return total


class Finetune(ModelTransform):
  """What `finetune` does to a run: the model, what trains, what is saved, the base.

  Inactive (`finetune.base` None) it changes nothing. `base` holds the
  pointer to the loaded base once `load` ran (saved in the metadata). A full
  fine-tuning run on preference data (DPO) keeps a frozen copy of the base as
  its reference (`reference.add_frozen_copy`); a LoRA run's reference is its
  base with the adapters off.
  """

  def __init__(self, config: FinetuneConfig, model_config: Any, seed: int, *,
               keeps_reference: bool = False):
    self.config, self.model_config, self.seed = config, model_config, seed
    self.keeps_reference = keeps_reference
    self.base: dict | None = None

  @classmethod
  def of(cls, recipe: Any) -> Finetune:
    """The recipe's `finetune` section."""
    config = getattr(recipe, "finetune", None) or FinetuneConfig()
    data = getattr(recipe, "data", None)
    compares = getattr(data, "is_preference", False) or (  # DPO, or RL with a KL penalty.
        getattr(data, "is_prompts", False) and recipe.rl.beta > 0)
    return cls(config, recipe.model, recipe.train.seed,
               keeps_reference=config.active and config.lora is None and compares)

  @property
  def label(self) -> str:
    if self.lora is None:
      return "finetune.base"
    return "finetune.lora (a quantized base is finetune.lora.quantize_base)"

  @property
  def qwix_provider(self) -> str | None:
    return "LoraProvider" if self.lora is not None else None

  @property
  def provides_reference(self) -> bool:
    return self.lora is not None or self.keeps_reference

  @property
  def evaluates_before_training(self) -> bool:
    """A fine-tuning run evaluates its base as step 0 (with LoRA, B is zero: the base
    itself), so its later evaluations show what tuning changed on the held-out text."""
    return self.config.active

  @property
  def lora(self) -> LoraConfig | None:
    return self.config.lora

  @property
  def scale(self) -> float:
    return self.lora.alpha / self.lora.rank

  def apply(self, model: nnx.Module) -> nnx.Module:
    """`model` with adapters (LoRA runs), or with a frozen copy of its weights (DPO's
    reference in full fine-tuning); as it is otherwise."""
    if self.lora is not None:
      return add_adapters(model, self.lora, self.model_config, self.seed + 2)
    return reference.add_frozen_copy(model) if self.keeps_reference else model

  @property
  def wrt(self):
    """What the optimizer updates and the gradient is taken of."""
    return nnx.LoRAParam if self.lora is not None else nnx.Param

  def saved(self, state: nnx.State) -> nnx.State:
    """The part of a (model, optimizer) state that checkpoints hold: all but a frozen base."""
    if self.lora is not None:
      return nnx.filter_state(state, nnx.Not(_is_base_weight))
    return nnx.filter_state(state, nnx.Not(Frozen)) if self.keeps_reference else state

  def load(self, state: nnx.State, abstract: nnx.State, shardings: nnx.State,
           metadata: dict | None, *, model: nnx.Module) -> nnx.State:
    """`state` with the base weights read in: always for LoRA and for a frozen reference,
    only at the start otherwise.

    `metadata`: the restored checkpoint's (None for a fresh run); a resumed
    run reads the base its pointer names and checks that it did not change.
    `model`: the (abstract) model with adapters; QLoRA quantizes the base as it says.
    """
    fresh = metadata is None
    if not self.config.active or (self.lora is None and not fresh and not self.keeps_reference):
      self.base = (metadata or {}).get("finetune")
      return state
    which = _is_base_weight if self.lora is not None else _is_model_param
    target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          nnx.filter_state(abstract, which), nnx.filter_state(shardings, which))
    pointer = (metadata or {}).get("finetune")
    if not fresh and not pointer:
      raise BaseCheckpointError("the checkpoint has no pointer to its finetune.base run")
    directory, step = ((pathlib.Path(pointer["base"]), pointer["step"]) if pointer
                       else resolve_base(self.config.base))
    quantized = self.lora is not None and self.lora.quantize_base is not None
    read = _float_target(target, self.model_config.param_dtype) if quantized else target
    weights, step = _read_base(directory, step, read, self.config.base)
    found = np.asarray(checksum(nnx.to_pure_dict(weights))).tolist()
    if pointer and found != pointer["checksum"]:
      raise BaseCheckpointError(
          f"the base run {directory} step {step} has changed since this run started (checksum "
          f"{found} != {pointer['checksum']}): restore it, or fine-tune again in a new --workdir")
    self.base = {"base": str(directory), "step": step, "checksum": found}
    if quantized:
      weights = _quantized(weights, target, model)
    if self.lora is not None:
      return nnx.merge_state(state, weights)
    parts = []
    if self.keeps_reference:  # The copy has buffers of its own (the step donates the state).
      parts.append(_as_frozen(jax.jit(lambda w: jax.tree.map(jnp.copy, w))(weights), abstract))
    if fresh:  # Full fine-tuning starts from the base's weights.
      state = nnx.filter_state(state, nnx.Not(_is_model_param))
      parts.append(weights)
    return nnx.merge_state(state, *parts)

  def metadata(self) -> dict[str, Any]:
    """The pointer to the base, for a checkpoint's metadata."""
    return {"finetune": self.base} if self.base else {}

  def reference_model(self, model: nnx.Module) -> nnx.Module | None:
    """DPO's reference: the base, as the adapters-off model or the frozen copy."""
    if self.lora is not None:
      return adapters_off(model)
    return reference.frozen_copy_model(model) if self.keeps_reference else None

  def inference_model(self, model: nnx.Module, plain: Callable[[], nnx.Module]) -> nnx.Module:
    """A LoRA run's base and adapters merged (Qwix adds the adapters only inside
    `__call__`, not in `decode`); a full run's model without its frozen copy."""
    if self.lora is not None:
      return merged_model(model, plain, self.scale)
    return reference.without_frozen_copy(model)

  def exported_model(self, model: nnx.Module,
                     plain: Callable[[], nnx.Module]) -> tuple[nnx.Module, list[str]]:
    """What `export-hf` writes: the adapters merged (a QLoRA run's into the float base it
    was quantized from, read again from the base run), and a line saying so."""
    if self.lora is None:
      return self.inference_model(model, plain), []
    adapters = f"LoRA adapters (rank {self.lora.rank}, alpha {self.lora.alpha:g})"
    if self.lora.quantize_base is None:
      return merged_model(model, plain, self.scale), [f"merged the {adapters} into the base"]
    base, where = self._float_base(model)
    return merged_model(model, plain, self.scale, base=base), [
        f"QLoRA run: merged the {adapters} into the float weights of its base ({where}), "
        f"not into their {self.lora.quantize_base} quantization the run trained over"]

  def _float_base(self, model: nnx.Module) -> tuple[nnx.State, str]:
    """The float weights this QLoRA run's base was quantized from, as the pointer in its
    checkpoint names them (checked against its checksum), and where they were read."""
    pointer = self.base or {}
    if not pointer:
      raise BaseCheckpointError("the checkpoint has no pointer to its finetune.base run")
    frozen = nnx.filter_state(nnx.state((model,)), _is_base_weight)
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                          frozen)
    weights, where = _read_pointed(pointer, _float_target(target, self.model_config.param_dtype),
                                   self.config.base)
    return weights[0], where

  def describe(self, model: nnx.Module) -> str | None:
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    if self.lora is not None:
      trained = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.LoRAParam)))
      return f"{n_params:,} parameters ({trained:,} in LoRA adapters, the rest frozen)"
    if self.keeps_reference:
      return f"{n_params:,} parameters (and a frozen copy of the base's, DPO's reference)"
    return None


def _as_frozen(weights: nnx.State, abstract: nnx.State) -> nnx.State:
  """The model's `weights` (paths (0, *path)) relabelled as the frozen copy's variables."""
  frozen = dict(nnx.to_flat_state(nnx.filter_state(abstract, Frozen)))
  out = []
  for path, variable in nnx.to_flat_state(weights):
    slot = (path[0], *reference.copy_path(path[1:]))  # path[0]: the model, of (model, optimizer).
    out.append((slot, frozen[slot].replace(variable.get_value())))
  return nnx.from_flat_state(out)


def _float_target(target: nnx.State, dtype: str) -> nnx.State:
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


def _quantized(weights: nnx.State, target: nnx.State, model: nnx.Module) -> nnx.State:
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


def _read_base(directory: pathlib.Path, step: int | None, target: nnx.State,
               origin: str) -> tuple[nnx.State, int]:
  """The base's weights at `step` (None: newest) into `target`'s shapes and shardings."""
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
      return _merged_lora_base(manager, step, adapted, target, origin), step
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


def _read_pointed(pointer: dict, target: nnx.State, origin: str) -> tuple[nnx.State, str]:
  """The base weights a checkpoint's pointer names (read as a base is, into `target`),
  checked against the pointer's checksum; and 'DIR step N', where they were read."""
  directory = pathlib.Path(pointer["base"])
  weights, step = _read_base(directory, pointer["step"], target, origin)
  if np.asarray(checksum(nnx.to_pure_dict(weights))).tolist() != pointer["checksum"]:
    raise BaseCheckpointError(f"the base run {directory} step {step} has changed since the run "
                              f"over it trained (finetune.base={origin!r}): restore it")
  return weights, f"{directory} step {step}"


def _lora_section(metadata: dict) -> tuple[dict, dict] | None:
  """(finetune.lora, the pointer to its base) of a LoRA run's checkpoint metadata, else None."""
  finetune = (metadata.get("config") or {}).get("finetune") or {}
  if finetune.get("lora") is None:
    return None
  return finetune["lora"], metadata.get("finetune") or {}


def _merged_lora_base(manager, step: int, adapted: tuple[dict, dict], target: nnx.State,
                      origin: str) -> nnx.State:
  """A LoRA run as a base: its own base's float weights (read as a base is, checksum
  checked) plus (alpha / r) A B of the adapters it saved, in `target`'s shapes."""
  config, pointer = adapted
  if not pointer:
    raise BaseCheckpointError(f"finetune.base={origin!r} is a LoRA run whose checkpoint has "
                              "no pointer to its own base")
  weights, where = _read_pointed(pointer, target, origin)
  stored = {jax.tree_util.keystr(path, simple=True, separator="/"): leaf
            for path, leaf in jax.tree_util.tree_leaves_with_path(
                manager.item_metadata(step)["state"])}
  flat = dict(nnx.to_flat_state(weights))
  adapters = []
  for path, variable in flat.items():
    for suffix in (_A, _B):
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
      a, b = (read.get(path[:-1] + (path[-1] + suffix,)) for suffix in (_A, _B))
      if a is not None:
        out[path] = with_delta(value, a, b, scale)
    return out

  merged = merge({path: v.get_value() for path, v in flat.items()},
                 {path: v.get_value() for path, v in read.items()})
  logs.note(f"finetune.base={origin!r} is a LoRA run: its adapters (rank {config['rank']}, "
            f"alpha {config['alpha']:g}) are merged into its base ({where}) as it loads")
  return nnx.from_flat_state([(path, flat[path].replace(merged[path])) for path in flat])
