"""Qwix LoRA adapters on a model: adding them, reading them, switching them off, merging them.

Qwix's `LoraProvider` gives each layer the rules match a pair of `nnx.LoRAParam`
adapters (A [in, r], B [r, out], B zero at first, so the adapted model starts as
the base). Qwix adds them inside the model's `__call__` only, so what decodes
(generation, `finetune.merge`, export) uses `merged_model`: W + (alpha / r) A B
in a plain model. What a fine-tuning run does with them is `lora.Finetune`'s.

Example:
  >>> adapter_delta(jnp.ones((2, 1)), jnp.ones((1, 2)), 2.0, (2, 2)).tolist()
  [[2.0, 2.0], [2.0, 2.0]]
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jax_ai_stack.errors import ConfigError
from jax_ai_stack.recipes.finetune.config import LoraConfig
from jax_ai_stack.recipes.models import adapting

A_SUFFIX, B_SUFFIX = "_lora_a", "_lora_b"
"""What Qwix appends to an adapted weight's name for its A and B factors."""


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
  if config.quantize_base is not None:  # A MoE's experts: quantized by the layer itself.
    from jax_ai_stack.recipes.finetune import quant

    quant.quantize_experts(model, config.quantize_base)
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
  flat = {"/".join(map(str, path)): v
          for path, v in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam))}
  weights = [name[:-len(A_SUFFIX)] for name in flat if name.endswith(A_SUFFIX)]
  return {w: (flat[w + A_SUFFIX].get_value(), flat[w + B_SUFFIX].get_value()) for w in weights}


def adapters_off(model: nnx.Module) -> nnx.Module:
  """`model` as its base computes it: a copy whose adapters' B factors are zero, so each
  adapted layer adds exactly nothing (DPO's reference, without a second copy of the weights).

  Pure: `model` is not changed, and inside a traced step the copy costs one forward pass.
  """
  graphdef, state = nnx.split(model)
  off = jax.tree_util.tree_map_with_path(
      lambda path, x: jnp.zeros_like(x) if any(
          str(getattr(key, "key", "")).endswith(B_SUFFIX) for key in path) else x, state)
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
