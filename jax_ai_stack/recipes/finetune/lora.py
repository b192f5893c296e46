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
directory, step and a checksum of the weights (at the param_dtype the run
started with, so opening it at another dtype is no alarm). Restoring reads the base again
from there, so a run stays small on disk; a base that vanished or changed
(another checksum) is a `BaseCheckpointError`, never a silent mix.

The adapters themselves (Qwix's rules, merging them for decoding and export)
are `finetune.adapters`'; reading the base and checking it, `finetune.base_run`.

Example:
  >>> from jax_ai_stack.recipes import config
  >>> cfg = config.load("lm-tiny-lora")
  >>> cfg.finetune.base, cfg.finetune.lora.rank
  ('runs/lm-tiny', 8)
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_ai_stack.recipes.finetune import base_run, reference
from jax_ai_stack.recipes.finetune.adapters import add_adapters, adapters_off, merged_model
from jax_ai_stack.recipes.finetune.base_run import BaseCheckpointError
from jax_ai_stack.recipes.finetune.config import FinetuneConfig, LoraConfig
from jax_ai_stack.recipes.transforms import Frozen, ModelTransform

__all__ = ["BaseCheckpointError", "Finetune", "FinetuneConfig", "LoraConfig", "merged_model"]


def _is_base_weight(path, variable) -> bool:
  """The model's (path[0] == 0) weights other than the adapters: what a LoRA run freezes."""
  return (path[0] == 0 and isinstance(variable, nnx.Param)
          and not isinstance(variable, nnx.LoRAParam))


def _is_model_param(path, variable) -> bool:
  return path[0] == 0 and isinstance(variable, nnx.Param)


class Finetune(ModelTransform):
  """What `finetune` does to a run: the model, what trains, what is saved, the base.

  Inactive (`finetune.base` None) it changes nothing. `base` holds the
  pointer to the loaded base once `load` ran (saved in the metadata). A full
  fine-tuning run on preference data (DPO) keeps a frozen copy of the base as
  its reference (`reference.add_frozen_copy`); a LoRA run's reference is its
  base with the adapters off.
  """

  def __init__(self, config: FinetuneConfig, model_config: Any, seed: int, *,
               compares: bool = False):
    """`compares`: the run's objective compares with the base (DPO, RL with a KL penalty)."""
    self.config, self.model_config, self.seed = config, model_config, seed
    self.compares = config.active and compares
    self.keeps_reference = self.compares and config.lora is None
    self.base: dict | None = None

  @classmethod
  def of(cls, recipe: Any) -> Finetune:
    """The recipe's `finetune` section."""
    config = getattr(recipe, "finetune", None) or FinetuneConfig()
    data = getattr(recipe, "data", None)
    compares = getattr(data, "is_preference", False) or (  # DPO, or RL with a KL penalty.
        getattr(data, "is_prompts", False) and recipe.rl.beta > 0
        and config.distill.teacher is None)  # (A distillation compares with its teacher.)
    return cls(config, recipe.model, recipe.train.seed, compares=compares)

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
    """Where the objective compares with the base (a distillation run's teacher is another
    transform's)."""
    return self.compares

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

  def initialised(self, state: nnx.State) -> nnx.State:
    """A fresh full fine-tune starts from the base's weights: its own are not initialised
    (LoRA's base is not in `saved`'s part to begin with)."""
    if self.config.active and self.lora is None:
      return nnx.filter_state(state, nnx.Not(_is_model_param))
    return state

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
    dtype = self.model_config.param_dtype
    quantized = self.lora is not None and self.lora.quantize_base is not None
    read = base_run.float_target(target, dtype) if quantized else target
    if pointer:  # Read at the dtype its checksum was taken at (a dtype override: cast after).
      directory, checked = pathlib.Path(pointer["base"]), base_run.start_dtype(pointer, metadata)
      weights, step, found = base_run.read_checked(pointer, checked or dtype, read,
                                                   self.config.base, then=dtype)
      if found != pointer["checksum"]:
        raise BaseCheckpointError(
            f"the base run {directory} step {step} has changed since this run started (checksum "
            f"{found} != {pointer['checksum']}): restore it, or fine-tune again in a new "
            "--workdir")
    else:
      directory, step = base_run.resolve_base(self.config.base)
      weights, step = base_run.read_base(directory, step, read, self.config.base,
                                         param_dtype=dtype)
      found, checked = np.asarray(base_run.checksum(nnx.to_pure_dict(weights))).tolist(), dtype
    self.base = {"base": str(directory), "step": step, "checksum": found,
                 "dtype": checked or dtype}
    if quantized:
      weights = base_run.quantized(weights, target, model)
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
    dtype = self.model_config.param_dtype
    floats = base_run.float_target(target, dtype)
    weights, where = base_run.read_pointed(pointer, base_run.start_dtype(pointer, None) or dtype,
                                           floats, self.config.base, then=dtype)
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
