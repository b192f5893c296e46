"""What a Hugging Face Llama directory holds: its file names, and each tensor's name and layout.

The one mapping both directions use: `tensors(config)` lists every parameter
of a `Decoder(config)` in Hugging Face's order, each a `Tensor` that converts
between torch's [out, in] layout and our kernels'.

Example:
  >>> from jax_ai_stack.recipes.models.configs import DecoderConfig
  >>> q = tensors(DecoderConfig.tiny())[1]
  >>> q.name, q.path
  ('model.layers.0.self_attn.q_proj.weight', ('layers', 0, 'attention', 'q_proj', 'kernel'))
  >>> q.hf_shape((128, 4, 32)), q.to_hf(np.zeros((128, 4, 32))).shape  # [D, N, H] -> [out, in]
  ((128, 128), (128, 128))
"""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib
import shutil

import numpy as np
from flax import nnx, traverse_util

from jax_ai_stack.errors import MissingExtraError
from jax_ai_stack.recipes.models.configs import DecoderConfig

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_COMPANIONS = ("tokenizer_config.json", "chat_template.jinja")
"""Files beside tokenizer.json that travel with it (import, export): they hold the chat
template that chat data is rendered with (`data.chat_template`)."""


def copy_tokenizer(tokenizer: str | os.PathLike, directory: str | os.PathLike) -> None:
  """Copies a tokenizer.json, and its `TOKENIZER_COMPANIONS` where they exist, into
  `directory` (as tokenizer.json: the chat template is found beside it)."""
  tokenizer, directory = pathlib.Path(tokenizer), pathlib.Path(directory)
  shutil.copyfile(tokenizer, directory / TOKENIZER_FILE)
  for name in TOKENIZER_COMPANIONS:
    if (tokenizer.parent / name).is_file():
      shutil.copyfile(tokenizer.parent / name, directory / name)


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

  `in_axes`: 0 for a tensor stored as is (embedding, norms; flattened when
  `flat`: q/k/v biases [N, H] are torch's [N * H]); otherwise our kernel's
  first `in_axes` axes are torch's `in` dimension and the rest its `out`
  dimension: torch holds `kernel.reshape(in, out).T`.
  """

  name: str
  path: tuple[str | int, ...]
  in_axes: int = 0
  flat: bool = False
  vocab: tuple[int, int] | None = None
  """(axis, vocab_size) of the embedding and head: our array has padded rows on
  that axis (`padded_vocab_size`), Hugging Face's exactly vocab_size."""
  expert: int | None = None
  """The expert whose slice [expert] of a parameter stacked [E, ...] this tensor holds
  (the shapes below are then the slice's); None: the whole parameter."""

  def piece(self, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of what this tensor holds of a parameter of `shape`."""
    return tuple(shape[1:]) if self.expert is not None else tuple(shape)

  def hf_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
    shape = self._unpadded(shape)
    if not self.in_axes:
      return (math.prod(shape),) if self.flat else tuple(shape)
    return (math.prod(shape[self.in_axes:]), math.prod(shape[:self.in_axes]))

  def to_model(self, array: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    unpadded = self._unpadded(shape)
    if not self.in_axes:
      array = array.reshape(unpadded) if self.flat else array
    else:
      array = array.T.reshape(unpadded)
    if unpadded == tuple(shape):
      return array
    # Zero rows: no token reads them, no logit is kept.
    return np.pad(array, [(0, size - kept) for size, kept in zip(shape, unpadded)])

  def to_hf(self, array: np.ndarray) -> np.ndarray:
    if self.vocab is not None:
      axis, size = self.vocab
      array = array[(slice(None),) * axis + (slice(0, size),)]
    if not self.in_axes:
      return np.ascontiguousarray(array.reshape(-1) if self.flat else array)
    return np.ascontiguousarray(array.reshape(math.prod(array.shape[:self.in_axes]), -1).T)

  def _unpadded(self, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Our `shape` with the vocabulary axis at its real size."""
    shape = tuple(shape)
    if self.vocab is None:
      return shape
    axis, size = self.vocab
    return (*shape[:axis], size, *shape[axis + 1:])


TEXT_PREFIX = "model."
"""Where a causal LM's decoder tensors sit; a text + vision checkpoint's elsewhere
(`text_prefix`)."""


def tensors(config: DecoderConfig, prefix: str = TEXT_PREFIX) -> list[Tensor]:
  """Every parameter of a `Decoder(config)`, in Hugging Face's order.

  The names follow the config's kind (`families`): its norms' names, q/k/v
  biases and q/k norms where its switches have them. `prefix`: where the
  decoder sits (`model.`; `language_model.model.` in a Gemma 3 text + vision
  checkpoint, whose head is then `language_model.lm_head.weight`).

  Raises:
    ConfigError: `config.scan_layers`: the names are per layer (`load_model`
      and `save` convert; reading into a scanned model's state does not).
  """
  from jax_ai_stack.recipes.models import layer_stack
  from jax_ai_stack.recipes.models.hf import families

  layer_stack.refuse_scanned(config, "Hugging Face weight import into a model state",
                             "import with model.scan_layers=false, or load with "
                             "hf.load_model(directory, scan_layers=True)")
  norms = families.for_kind(config.kind).norms
  out = [Tensor(prefix + "embed_tokens.weight", ("embed", "embedding"),
                vocab=(0, config.vocab_size))]
  for i in range(config.num_layers):
    hf, ours = f"{prefix}layers.{i}.", ("layers", i)
    attention = (*ours, "attention")
    out += [Tensor(hf + f"self_attn.{x}_proj.weight", (*attention, f"{x}_proj", "kernel"), 1)
            for x in "qkv"]
    if config.qkv_bias:
      out += [Tensor(hf + f"self_attn.{x}_proj.bias", (*attention, f"{x}_proj", "bias"), flat=True)
              for x in "qkv"]
    out.append(Tensor(hf + "self_attn.o_proj.weight", (*attention, "o_proj", "kernel"), 2))
    if config.qk_norm:
      out += [Tensor(hf + f"self_attn.{x}_norm.weight", (*attention, f"{x}_norm", "scale"))
              for x in "qk"]
    out += _mlp_tensors(config, i, hf, ours)
    out += [Tensor(hf + f"{theirs}.weight", (*ours, norm, "scale"))
            for norm, theirs in norms.items()]
  out.append(Tensor(prefix + "norm.weight", ("final_norm", "scale")))
  if not config.tie_embeddings:
    out.append(Tensor(head_name(prefix), ("lm_head", "kernel"), 1, vocab=(1, config.vocab_size)))
  return out


def _mlp_tensors(config: DecoderConfig, layer: int, hf: str, ours: tuple) -> list[Tensor]:
  """Layer `layer`'s feed-forward: a dense MLP, or a router and each expert's weights."""
  from jax_ai_stack.recipes.models.hf import families

  if not config.moe_layers[layer]:
    return [Tensor(hf + f"mlp.{x}_proj.weight", (*ours, "mlp", f"{x}_proj", "kernel"), 1)
            for x in ("gate", "up", "down")]
  experts = families.for_kind(config.kind).experts
  block = hf + experts.block + "."
  out = [Tensor(block + f"{experts.router}.weight", (*ours, "mlp", "router", "kernel"), 1)]
  for j in range(config.moe.num_experts):
    out += [Tensor(block + f"experts.{j}.{theirs}.weight", (*ours, "mlp", weight), 1, expert=j)
            for weight, theirs in experts.weights.items()]
  return out


def head_name(prefix: str = TEXT_PREFIX) -> str:
  """The untied output head's tensor name beside a decoder at `prefix`."""
  return "language_model.lm_head.weight" if prefix == "language_model.model." else "lm_head.weight"


def text_prefix(names) -> str:
  """Where the decoder's tensors sit among `names`: `model.`, or a Gemma 3 text +
  vision checkpoint's `language_model.model.` (as saved) / `model.language_model.`."""
  for prefix in ("language_model.model.", "model.language_model."):
    if any(name.startswith(prefix) for name in names):
      return prefix
  return TEXT_PREFIX


OTHER_TOWERS = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                "model.multi_modal_projector.")
"""Tensors of a text + vision checkpoint that are not the decoder's (not read)."""


def _model_shapes(config: DecoderConfig) -> dict[tuple, tuple[int, ...]]:
  """Each parameter path's shape, from an abstract model (nothing allocated)."""
  from jax_ai_stack.recipes.models.decoder import Decoder

  model = nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0)))
  flat = traverse_util.flatten_dict(nnx.to_pure_dict(nnx.state(model)))
  return {path: tuple(leaf.shape) for path, leaf in flat.items()}
