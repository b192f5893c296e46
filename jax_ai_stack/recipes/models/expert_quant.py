"""The experts of a mixture-of-experts layer quantized with Qwix: stored, or faked in training.

Qwix quantizes a layer by intercepting its matmul (`dot_general`, `einsum`); a MoE
layer's experts are stacked weights [E, in, out] of one grouped matmul, which Qwix's
post-training provider does not intercept, and which may be a kernel of its own
(tokamax, megablox). So the layer quantizes them itself, in Qwix's own form:

- stored (`quantize`: PTQ, a QLoRA base): each weight becomes Qwix's quantized array,
  int8 or int4 with a float32 scale per expert and output channel, held as Qwix holds
  the weights it quantizes (a `WithAux` of `nnx.Param`s), so `qwix.quantize_params`
  quantizes a float checkpoint into it as it does the other layers. The layer
  dequantizes it before the grouped matmul, as QLoRA computes over its frozen base:
  memory is the quantized weights', the matmul the kernel's in the model's dtype.
- faked (`fake_quantize`: QAT): the weight rounded to the same grid in the forward
  pass, the gradient passed straight through, as Qwix's `QtProvider` does for a matmul.

Weights only: an activation scheme (w8a8) is refused for a MoE model (`finetune.quant`).

Example:
  >>> import jax.numpy as jnp
  >>> import qwix
  >>> w = jnp.linspace(-1.0, 1.0, 2 * 3 * 4).reshape(2, 3, 4)
  >>> q = quantize_array(w, jnp.int8)
  >>> q.qvalue.dtype, q.scale.shape, bool(jnp.abs(qwix.dequantize(q) - w).max() < 1 / 127)
  (dtype('int8'), (2, 1, 4), True)
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import qwix
from flax import nnx
from qwix._src.core import qarray
from qwix._src.providers import ptq as qwix_ptq
from qwix._src.utils import flax_util

__all__ = ["fake_quantize", "is_quantized", "quantize", "quantize_array", "stored"]


def _how(qtype: Any) -> qarray.HowToQuantize:
  """A scale per expert (axis 0) and output channel (axis 2) of a stacked [E, in, out]."""
  return qarray.HowToQuantize(qtype=qtype, channelwise_axes=(0, 2))


def quantize_array(weight: jax.Array, qtype: Any) -> qwix.QArray:
  """`weight` [E, in, out] as Qwix's quantized array (float32 scales)."""
  return qarray.quantize(weight.astype(jnp.float32), _how(qtype))


def is_quantized(value: Any) -> bool:
  """Whether a layer's attribute is a stored quantized weight (`quantize`)."""
  return isinstance(value, qwix_ptq.WithAux)


def quantize(moe: nnx.Module, names: tuple[str, ...], qtype: Any) -> None:
  """Replaces `moe`'s stacked weights `names` by their quantization, as Qwix's PTQ replaces
  a matmul's weight (`WithAux`: the array and how it was quantized; each leaf an
  `nnx.Param` with the weight's sharding, a scale's size-1 axis unsplit)."""
  for name in names:
    param = getattr(moe, name)
    if is_quantized(param):  # Already (a PTQ model given another method).
      continue
    unboxed = qwix_ptq.WithAux(quantize_array(param[...], qtype), _how(qtype))
    setattr(moe, name, jax.tree.map(lambda v, p=param: flax_util.update_boxed(p, value=v),
                                    unboxed))


def fake_quantize(weight: jax.Array, qtype: Any) -> jax.Array:
  """`weight` rounded to `qtype`'s grid in the forward pass; its gradient is the identity
  (the straight-through estimator)."""
  rounded = qwix.dequantize(quantize_array(weight, qtype)).astype(weight.dtype)
  return weight + jax.lax.stop_gradient(rounded - weight)


def stored(value: Any, dtype: Any, fake: Any = None) -> jax.Array:
  """A stacked weight as the grouped matmul takes it, in `dtype`: a float `nnx.Param`
  (through `fake_quantize` to `fake` where that is set), or a quantized one dequantized."""
  if is_quantized(value):
    array = jax.tree.map(lambda v: v[...], value.array,
                         is_leaf=lambda v: isinstance(v, nnx.Variable))
    return qwix.dequantize(array).astype(dtype)
  weight = value[...]
  if fake is not None:
    weight = fake_quantize(weight, fake)
  return weight.astype(dtype)
