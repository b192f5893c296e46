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
  rope_pairs: bool = False
  """q_proj's or k_proj's kernel [D, N, H] of a model whose RoPE pairs features (2i, 2i + 1)
  (`HFFamily.interleaved_rope`): each head's out rows are Hugging Face's even ones, then its
  odd ones, so that our RoPE's pairs (i, i + H/2) are theirs."""
  rope_from: int = 0
  """With `rope_pairs`: the out features before it are not turned by RoPE and keep their
  order (latent attention's q_b_proj and kv_a_proj, whose RoPE features come last)."""
  parts: tuple[Tensor, ...] = ()
  """A fused tensor's pieces (`HFFamily.fused`): Hugging Face's tensor is theirs, concatenated
  along its first (out) axis, or `fuse_axis`; `path` is then () and `split`/`fuse` convert."""
  fuse_axis: int = 0
  """The axis of Hugging Face's tensor its `parts` are concatenated along (`Experts.fused`'s
  stacked experts: the last)."""

  def stored_shape(self, shapes: dict[tuple, tuple[int, ...]]) -> tuple[int, ...]:
    """Hugging Face's shape of this tensor, from each parameter path's shape (`shapes`)."""
    if not self.parts:
      return self.hf_shape(self.piece(shapes[self.path]))
    pieces = [list(part.stored_shape(shapes)) for part in self.parts]
    pieces[0][self.fuse_axis] = sum(piece[self.fuse_axis] for piece in pieces)
    return tuple(pieces[0])

  def split(self, array: np.ndarray, shapes: dict[tuple, tuple[int, ...]]) -> list[np.ndarray]:
    """A fused tensor as its parts' Hugging Face tensors."""
    sizes = [part.stored_shape(shapes)[self.fuse_axis] for part in self.parts]
    return np.split(array, np.cumsum(sizes)[:-1], axis=self.fuse_axis)

  def leaves(self) -> tuple[Tensor, ...]:
    """The tensors that map onto one parameter each: itself, or a fused tensor's parts."""
    return self.parts or (self,)

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
    if self.rope_pairs:
      array = array[..., _pairs(array.shape[-1], self.rope_from)]
    if unpadded == tuple(shape):
      return array
    # Zero rows: no token reads them, no logit is kept.
    return np.pad(array, [(0, size - kept) for size, kept in zip(shape, unpadded)])

  def to_hf(self, array: np.ndarray) -> np.ndarray:
    if self.vocab is not None:
      axis, size = self.vocab
      array = array[(slice(None),) * axis + (slice(0, size),)]
    if self.rope_pairs:
      array = array[..., np.argsort(_pairs(array.shape[-1], self.rope_from))]
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


def _pairs(features: int, start: int = 0) -> np.ndarray:
  """Our feature order in torch's interleaved one: the first `start` as they are, then of the
  rest the even ones, then the odd."""
  return np.concatenate([np.arange(start), np.arange(start, features, 2),
                         np.arange(start + 1, features, 2)])


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
  family = families.for_kind(config.kind)
  out = [Tensor(prefix + "embed_tokens.weight", ("embed", "embedding"),
                vocab=(0, config.vocab_size))]
  for i in range(config.num_layers):
    hf, ours = f"{prefix}layers.{i}.", ("layers", i)
    attention = (*ours, "attention")
    if config.resolved_layer_types[i] == "linear":
      block = _linear_tensors(hf, attention)
    elif config.latent_attention is not None:
      block = _latent_tensors(config, family, hf, attention)
    else:
      block = _attention_tensors(config, family, hf, attention)
    block += _mlp_tensors(config, i, hf, ours)
    block += [Tensor(hf + f"{theirs}.weight", (*ours, norm, "scale"))
              for norm, theirs in family.norms.items()]
    out += _fuse(block, hf, family.fused)
  out.append(Tensor(prefix + "norm.weight", ("final_norm", "scale")))
  if not config.tie_embeddings:
    out.append(Tensor(head_name(prefix), ("lm_head", "kernel"), 1, vocab=(1, config.vocab_size)))
  return out


def _attention_tensors(config: DecoderConfig, family, hf: str, attention: tuple) -> list[Tensor]:
  """A layer's grouped-query attention: q/k/v/o, and their biases, sinks and q/k norms where
  the config has them."""
  block = [Tensor(hf + f"self_attn.{x}_proj.weight", (*attention, f"{x}_proj", "kernel"), 1,
                  rope_pairs=family.interleaved_rope and x != "v") for x in "qkv"]
  if config.qkv_bias:
    block += [Tensor(hf + f"self_attn.{x}_proj.bias", (*attention, f"{x}_proj", "bias"),
                     flat=True) for x in "qkv"]
  block.append(Tensor(hf + "self_attn.o_proj.weight", (*attention, "o_proj", "kernel"), 2))
  if config.o_proj_bias:
    block.append(Tensor(hf + "self_attn.o_proj.bias", (*attention, "o_proj", "bias")))
  if config.attention_sinks:
    block.append(Tensor(hf + "self_attn.sinks", (*attention, "sinks")))
  if config.qk_norm:
    block += [Tensor(hf + f"self_attn.{x}_norm.weight", (*attention, f"{x}_norm", "scale"))
              for x in "qk"]
  return block


def _latent_tensors(config: DecoderConfig, family, hf: str, attention: tuple) -> list[Tensor]:
  """A layer's multi-head latent attention (DeepSeek-V3's names), its RoPE features' pairs
  reordered as `HFFamily.interleaved_rope` says (the shared key's and the queries' last)."""
  latent = config.latent_attention
  ours = lambda name, *rest: (*attention, name, *rest)
  theirs = lambda name: f"{hf}self_attn.{name}.weight"
  pairs = dict(rope_pairs=family.interleaved_rope, rope_from=latent.qk_nope_head_dim)
  if latent.q_lora_rank is None:
    queries = [Tensor(theirs("q_proj"), ours("q_proj", "kernel"), 1, **pairs)]
  else:
    queries = [Tensor(theirs("q_a_proj"), ours("q_a_proj", "kernel"), 1),
               Tensor(theirs("q_a_layernorm"), ours("q_norm", "scale")),
               Tensor(theirs("q_b_proj"), ours("q_b_proj", "kernel"), 1, **pairs)]
  return [*queries,
          Tensor(theirs("kv_a_proj_with_mqa"), ours("kv_a_proj", "kernel"), 1,
                 rope_pairs=family.interleaved_rope, rope_from=latent.kv_lora_rank),
          Tensor(theirs("kv_a_layernorm"), ours("kv_norm", "scale")),
          Tensor(theirs("kv_b_proj"), ours("kv_b_proj", "kernel"), 1),
          Tensor(theirs("o_proj"), ours("o_proj", "kernel"), 2)]


def _linear_tensors(hf: str, attention: tuple) -> list[Tensor]:
  """A gated DeltaNet layer (Qwen3-Next's `linear_attn.*`), its projections laid out by
  key-head group as transformers stores them; the rest as they are."""
  theirs = f"{hf}linear_attn."
  return [Tensor(theirs + "in_proj_qkvz.weight", (*attention, "in_proj_qkvz", "kernel"), 1),
          Tensor(theirs + "in_proj_ba.weight", (*attention, "in_proj_ba", "kernel"), 1),
          Tensor(theirs + "conv1d.weight", (*attention, "conv1d")),
          Tensor(theirs + "dt_bias", (*attention, "dt_bias")),
          Tensor(theirs + "A_log", (*attention, "A_log")),
          Tensor(theirs + "norm.weight", (*attention, "norm")),
          Tensor(theirs + "out_proj.weight", (*attention, "out_proj", "kernel"), 2)]


def _fuse(block: list[Tensor], hf: str, fused) -> list[Tensor]:
  """A layer's tensors with each of `fused`'s groups (`HFFamily.fused`) as one tensor, where
  its first part was."""
  for name, parts in fused.items():
    names = [f"{hf}{part}.weight" for part in parts]
    pieces = [t for t in block if t.name in names]
    pieces.sort(key=lambda t: names.index(t.name))
    first = min(block.index(t) for t in pieces)
    block = [t for t in block if t not in pieces]
    block.insert(first, Tensor(f"{hf}{name}.weight", (), parts=tuple(pieces)))
  return block


def _mlp_tensors(config: DecoderConfig, layer: int, hf: str, ours: tuple) -> list[Tensor]:
  """Layer `layer`'s feed-forward: a dense MLP, or a router and each expert's weights."""
  from jax_ai_stack.recipes.models.hf import families

  family = families.for_kind(config.kind)
  if not config.moe_layers[layer]:
    return [Tensor(hf + f"{family.mlp}.{x}_proj.weight", (*ours, "mlp", f"{x}_proj", "kernel"),
                   1) for x in ("gate", "up", "down")]
  experts = family.experts
  if (config.moe.shared_expert_dim is not None) != (experts.shared_expert is not None) or (
      config.moe.shared_expert_gate != (experts.shared_expert_gate is not None)):
    from jax_ai_stack.errors import ConfigError

    raise ConfigError(
        f"kind={config.kind!r}'s layout has " + (
            f"a shared expert{' with' if experts.shared_expert_gate else ' without'} its gate"
            if experts.shared_expert else "no shared expert")
        + f": moe.shared_expert_dim={config.moe.shared_expert_dim}, moe.shared_expert_gate="
        f"{config.moe.shared_expert_gate} cannot be written as it")
  fixed = {name: value for name, value in {**families.MOE_LAYOUT, **experts.moe}.items()
           if name not in experts.routing}
  if wrong := [name for name, value in fixed.items() if getattr(config.moe, name) != value]:
    from jax_ai_stack.errors import ConfigError

    raise ConfigError(f"kind={config.kind!r}'s layout has moe.{wrong[0]}={fixed[wrong[0]]!r}: "
                      f"this model's {getattr(config.moe, wrong[0])!r} cannot be written as it")
  block = hf + experts.block + "."
  out = [Tensor(block + f"{experts.router}.weight", (*ours, "mlp", "router", "kernel"), 1)]
  if config.moe.router_bias:
    out.append(Tensor(block + f"{experts.router}.bias", (*ours, "mlp", "router", "bias")))
  if config.moe.score_correction:
    out.append(Tensor(block + f"{experts.router}.{experts.correction_bias}",
                      (*ours, "mlp", "correction_bias")))
  if experts.stacked:
    stacked = {weight: Tensor(block + f"experts.{theirs}", (*ours, "mlp", weight))
               for weight, theirs in experts.weights.items()}
    for name, parts in experts.fused.items():  # One tensor of several, first.
      stacked = {name: Tensor(block + f"experts.{name}", (), fuse_axis=-1, parts=tuple(
          stacked.pop(part) for part in parts)), **stacked}
    out += list(stacked.values())
  else:
    for j in range(config.moe.num_experts):
      out += [Tensor(block + f"experts.{j}.{theirs}.weight", (*ours, "mlp", weight), 1, expert=j)
              for weight, theirs in experts.weights.items()]
  if config.moe.shared_expert_dim is not None:
    shared = block + experts.shared_expert + "."
    out += [Tensor(shared + f"{x}_proj.weight", (*ours, "mlp", "shared_expert", f"{x}_proj",
                                                 "kernel"), 1) for x in ("gate", "up", "down")]
  if config.moe.shared_expert_gate:
    out.append(Tensor(block + f"{experts.shared_expert_gate}.weight",
                      (*ours, "mlp", "shared_expert_gate", "kernel"), 1))
  return out


def head_name(prefix: str = TEXT_PREFIX) -> str:
  """The untied output head's tensor name beside a decoder at `prefix`."""
  return "language_model.lm_head.weight" if prefix == "language_model.model." else "lm_head.weight"


def text_prefix(names) -> str:
  """Where the decoder's tensors sit among `names`: `model.`, or a Gemma 3 (or Llama 4) text
  + vision checkpoint's `language_model.model.` (as saved) / `model.language_model.`."""
  for prefix in ("language_model.model.", "model.language_model."):
    if any(name.startswith(prefix) for name in names):
      return prefix
  return TEXT_PREFIX


OTHER_TOWERS = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                "model.multi_modal_projector.", "vision_model.")
"""Tensors of a text + vision checkpoint that are not the decoder's (not read)."""


def _model_shapes(config: DecoderConfig) -> dict[tuple, tuple[int, ...]]:
  """Each parameter path's shape, from an abstract model (nothing allocated)."""
  from jax_ai_stack.recipes.models.decoder import Decoder

  model = nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0)))
  flat = traverse_util.flatten_dict(nnx.to_pure_dict(nnx.state(model)))
  return {path: tuple(leaf.shape) for path, leaf in flat.items()}
