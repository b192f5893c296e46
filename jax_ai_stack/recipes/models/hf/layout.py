"""What a Hugging Face Llama directory holds: its file names, and each tensor's name and layout.

The one mapping both directions use: `tensors(config)` lists every parameter
of a `Llama(config)` in Hugging Face's order, each a `Tensor` that converts
between torch's [out, in] layout and our kernels'.

Example:
  >>> from jax_ai_stack.recipes.models.configs import LlamaConfig
  >>> q = tensors(LlamaConfig.tiny())[1]
  >>> q.name, q.path
  ('model.layers.0.self_attn.q_proj.weight', ('layers', 0, 'attention', 'q_proj', 'kernel'))
  >>> q.hf_shape((128, 4, 32)), q.to_hf(np.zeros((128, 4, 32))).shape  # [D, N, H] -> [out, in]
  ((128, 128), (128, 128))
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from flax import nnx, traverse_util

from jax_ai_stack.errors import MissingExtraError
from jax_ai_stack.recipes.models.configs import LlamaConfig

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILE = "tokenizer.json"


def _safetensors():
  try:
    import safetensors  # pylint: disable=g-import-not-at-top
    import safetensors.numpy  # noqa: F401 pylint: disable=g-import-not-at-top
  except ImportError:
    raise MissingExtraError("the 'safetensors' package is not installed; install the extra: "
                            "pip install 'jax-ai-stack[hf]'") from None
  return safetensors


@dataclasses.dataclass(frozen=True)
class Tensor:
  """One parameter: its Hugging Face name, its path in the model, its layout.

  `in_axes`: 0 for a tensor stored as is (embedding, norms); otherwise our
  kernel's first `in_axes` axes are torch's `in` dimension and the rest its
  `out` dimension: torch holds `kernel.reshape(in, out).T`.
  """

  name: str
  path: tuple[str | int, ...]
  in_axes: int = 0

  def hf_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
    if not self.in_axes:
      return tuple(shape)
    return (math.prod(shape[self.in_axes:]), math.prod(shape[:self.in_axes]))

  def to_model(self, array: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    return array if not self.in_axes else array.T.reshape(shape)

  def to_hf(self, array: np.ndarray) -> np.ndarray:
    if not self.in_axes:
      return np.ascontiguousarray(array)
    return np.ascontiguousarray(array.reshape(math.prod(array.shape[:self.in_axes]), -1).T)


def tensors(config: LlamaConfig) -> list[Tensor]:
  """Every parameter of a `Llama(config)`, in Hugging Face's order.

  Raises:
    ConfigError: `config.scan_layers`: the names are per layer (`load_model`
      and `save` convert; reading into a scanned model's state does not).
  """
  from jax_ai_stack.recipes.models import layer_stack

  layer_stack.refuse_scanned(config, "Hugging Face weight import into a model state",
                             "import with model.scan_layers=false, or load with "
                             "hf.load_model(directory, scan_layers=True)")
  out = [Tensor("model.embed_tokens.weight", ("embed", "embedding"))]
  for i in range(config.num_layers):
    hf, ours = f"model.layers.{i}.", ("layers", i)
    out += [
        Tensor(hf + "self_attn.q_proj.weight", (*ours, "attention", "q_proj", "kernel"), 1),
        Tensor(hf + "self_attn.k_proj.weight", (*ours, "attention", "k_proj", "kernel"), 1),
        Tensor(hf + "self_attn.v_proj.weight", (*ours, "attention", "v_proj", "kernel"), 1),
        Tensor(hf + "self_attn.o_proj.weight", (*ours, "attention", "o_proj", "kernel"), 2),
        Tensor(hf + "mlp.gate_proj.weight", (*ours, "mlp", "gate_proj", "kernel"), 1),
        Tensor(hf + "mlp.up_proj.weight", (*ours, "mlp", "up_proj", "kernel"), 1),
        Tensor(hf + "mlp.down_proj.weight", (*ours, "mlp", "down_proj", "kernel"), 1),
        Tensor(hf + "input_layernorm.weight", (*ours, "attention_norm", "scale")),
        Tensor(hf + "post_attention_layernorm.weight", (*ours, "mlp_norm", "scale")),
    ]
  out.append(Tensor("model.norm.weight", ("final_norm", "scale")))
  if not config.tie_embeddings:
    out.append(Tensor("lm_head.weight", ("lm_head", "kernel"), 1))
  return out


def _model_shapes(config: LlamaConfig) -> dict[tuple, tuple[int, ...]]:
  """Each parameter path's shape, from an abstract model (nothing allocated)."""
  from jax_ai_stack.recipes.models.llama import Llama

  model = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
  flat = traverse_util.flatten_dict(nnx.to_pure_dict(nnx.state(model)))
  return {path: tuple(leaf.shape) for path, leaf in flat.items()}
