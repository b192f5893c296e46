"""Qwix quantization of the recipe models: named schemes, QAT and PTQ models.

A scheme (`SCHEMES`: w8, w8a8, w4) is a short list of `qwix.QuantizationRule`s
whose module paths fit the recipe models (`rules`). The same rules serve
quantization-aware training (`qat`: Qwix's `QtProvider` fakes the quantization
in the forward pass, gradients pass straight through) and post-training
quantization (`ptq`: Qwix's `PtqProvider` replaces each matched weight by an
int8 or int4 `QArray` with a float32 scale per output channel), so a model
trained for a scheme converts to exactly that scheme for serving.

Which layers each model quantizes is its config's (`models.adapting.QUANT_LAYERS`: the
feed-forward weights, the other matmul weights, and convolutions, which only
w8a8 quantizes: Qwix's PTQ convolution needs quantized activations too,
`act_qtype == weight_qtype`). What stays float, and why:

- a token embedding that is also the output head (`tie_embeddings`): the
  lookup (`jnp.take`) cannot read a quantized table, and under tracing Qwix
  would quantize the table when `Embed.attend` uses it. An untied `lm_head`
  stays float too, so both layouts quantize alike;
- norms and biases (no matmul);
- convolutions in the weight-only schemes;
- a mixture of experts' router.

A mixture of experts' experts are the stacked weights of one grouped matmul, which Qwix
does not intercept: the MoE layer quantizes them itself, in Qwix's form and with the
feed-forward weights' type (`models.expert_quant`), weights only: w8a8 is refused there.

Activations (w8a8) are quantized per token at run time (dynamic range), so
no calibration data is needed and nothing is added to the model state: a QAT
model has the same parameters, optimizer state and checkpoint as a float one.

Example:
  >>> [r.module_path for r in rules("w4", "cnn")]
  ['hidden', 'classifier']
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import qwix
from flax import nnx

from jax_ai_stack.errors import ConfigError
from jax_ai_stack.recipes.finetune.config import (
    SCHEMES, QuantConfig, SchemeError, check_scheme, describe_schemes, experts_refuse)
from jax_ai_stack.recipes.models import adapting, expert_quant
from jax_ai_stack.recipes.models.moe import MoE
from jax_ai_stack.recipes.transforms import ModelTransform

__all__ = [
    "SCHEMES", "Qat", "QuantConfig", "SchemeError", "check_scheme", "describe_schemes",
    "param_bytes", "ptq", "qat", "quantize_experts", "rules",
]


@dataclasses.dataclass(frozen=True)
class _Scheme:
  mlp_weights: Any
  other_weights: Any
  activations: Any = None


_SCHEMES = {
    "w8": _Scheme(jnp.int8, jnp.int8),
    "w8a8": _Scheme(jnp.int8, jnp.int8, activations=jnp.int8),
    "w4": _Scheme(jnp.int4, jnp.int8),
}
assert _SCHEMES.keys() == SCHEMES.keys()


def rules(scheme: str, model_kind: str) -> list[qwix.QuantizationRule]:
  """The Qwix rules of `scheme` for a model of `model_kind` (a family's `model.kind`).

  The module paths are the model's (`models.adapting.quant_layers`).

  Raises:
    SchemeError: `scheme` is not one of `SCHEMES` (the message lists them).
    ConfigError: the family of `model_kind` names no layers to quantize.
  """
  spec = _SCHEMES[check_scheme(scheme)]
  layers = adapting.quant_layers(model_kind)
  if layers is None:
    raise ConfigError(f"quantization has no rules for model.kind={model_kind!r}; "
                      f"kinds: {', '.join(adapting.quantized_kinds())}")
  refused = experts_refuse(scheme, model_kind)
  if refused:
    raise ConfigError(refused)
  out = [
      qwix.QuantizationRule(module_path=layers.mlp, weight_qtype=spec.mlp_weights,
                            act_qtype=spec.activations),
      qwix.QuantizationRule(module_path=layers.other, weight_qtype=spec.other_weights,
                            act_qtype=spec.activations),
  ]
  if layers.convs and spec.activations is not None:
    out.append(qwix.QuantizationRule(module_path=layers.convs, weight_qtype=spec.activations,
                                     act_qtype=spec.activations))
  return out


def qat(model: nnx.Module, config: Any) -> nnx.Module:
  """`model` trained through `config.quant.qat`'s fake quantization; as it is when None.

  `config`: a recipe config (its `quant` and `model` sections; a config with no
  `quant` section trains in float). Called inside the trainer's `create()`, so
  it runs under `nnx.eval_shape` and `jax.jit`.
  """
  scheme = getattr(getattr(config, "quant", None), "qat", None)
  if scheme is None:
    return model
  _refuse_scanned(config.model, "quant.qat")
  quantized = _quantize(model, qwix.QtProvider(rules(scheme, config.model.kind)),
                        adapting.example_inputs(config.model), kind=config.model.kind)
  for moe in _moe_layers(quantized):  # The experts rounded to the scheme's grid as well.
    moe.fake_quant = _SCHEMES[scheme].mlp_weights
  return quantized


class Qat(ModelTransform):
  """`quant.qat` as a run's model transform: the model trains through the fake quantization
  (nothing else changes: the same parameters, optimizer state and checkpoints)."""

  def __init__(self, config: Any):
    self.config = config
    self.scheme = getattr(getattr(config, "quant", None), "qat", None)
    self.qwix_provider = "QtProvider" if self.scheme else None

  @property
  def label(self) -> str:
    return f"quant.qat={self.scheme}"

  def apply(self, model: nnx.Module) -> nnx.Module:
    return qat(model, self.config)

  def exported_model(self, model, plain):
    if self.scheme is None:
      return model, []
    return model, [f"QAT run: exported its float weights; the {self.scheme} fake quantization "
                   f"it trained through is not applied (jax-ai-stack quantize makes the "
                   f"{self.scheme} model)"]


def ptq(model: nnx.Module, scheme: str, model_config: Any, *,
        method: str = "__call__") -> nnx.Module:
  """A copy of `model` whose matched weights are quantized (int8/int4 + scales).

  `model` (float, or a QAT model) is not changed. Only `method` of the copy
  runs quantized ops (Qwix intercepts one method): "__call__" to evaluate,
  "decode" to generate (`inference.Engine`, `decoding.generate`). A model that is
  already quantized keeps its quantized weights, so the same PTQ model can be
  given another `method`.
  """
  _refuse_scanned(model_config, "post-training quantization")
  provider = qwix.PtqProvider(rules(scheme, model_config.kind))
  inputs = adapting.example_inputs(model_config, method)

  def quantize(m):
    return quantize_experts(_quantize(m, provider, inputs, method, kind=model_config.kind),
                            scheme)

  graphdef, state = nnx.split(model)
  # Traced once for the structure, then once compiled for the values: eagerly,
  # each small op of the model would compile on its own (seconds each on a CPU).
  quantized_graphdef = nnx.graphdef(nnx.eval_shape(lambda: quantize(model)))
  quantized_state = jax.jit(lambda s: nnx.state(quantize(nnx.merge(graphdef, s))))(state)
  return nnx.merge(quantized_graphdef, quantized_state)


def _refuse_scanned(model_config: Any, what: str) -> None:
  """The rules name `layers/N/...` paths; a scanned model has none."""
  from jax_ai_stack.recipes.models import layer_stack

  layer_stack.refuse_scanned(model_config, what, "its Qwix rules match per-layer module paths "
                             "(layers/N/...); train with model.scan_layers=false")


def quantize_experts(model: nnx.Module, scheme: str) -> nnx.Module:
  """`model` with its MoE layers' experts stored in `scheme`'s feed-forward type, in place
  (`models.expert_quant`; Qwix's PTQ leaves these stacked weights float)."""
  for moe in _moe_layers(model):
    expert_quant.quantize(moe, (*moe.in_names, "down_proj"), _SCHEMES[scheme].mlp_weights)
  return model


def _moe_layers(model: nnx.Module) -> list[MoE]:
  return [module for _, module in nnx.iter_modules(model) if isinstance(module, MoE)]


def _quantize(model, provider, inputs, method="__call__", *, kind=None):
  quantized = qwix.quantize_model(model, provider, *inputs, methods=(method,))
  layers = adapting.quant_layers(kind) if kind is not None else None
  unused = [rule for rule in provider.get_unused_rules()  # A MoE model may have no dense MLP.
            if not (layers and layers.experts and rule.module_path == layers.mlp)]
  if unused:  # The patterns no longer fit the model: a bug, not bad input.
    raise RuntimeError(f"quantization rules matched no layer of {type(model).__name__}: "
                       + ", ".join(r.module_path for r in unused))
  return quantized


def param_bytes(model_or_state: Any) -> int:
  """Bytes of the parameters (`nnx.Param`), counting int4 as half a byte.

  JAX stores int4 in a byte per value on CPU; packed (on TPU/GPU, and what
  a serving format stores) it is half that, which is what this counts.
  """
  state = model_or_state
  if isinstance(state, nnx.Module):
    state = nnx.state(state, nnx.Param)
  return sum(x.size * _bits(x.dtype) for x in jax.tree.leaves(state)) // 8


def _bits(dtype) -> int:
  dtype = np.dtype(dtype)
  if dtype.kind in "iu" or dtype in (np.dtype(ml_dtypes.int4), np.dtype(ml_dtypes.uint4)):
    return ml_dtypes.iinfo(dtype).bits
  return dtype.itemsize * 8
