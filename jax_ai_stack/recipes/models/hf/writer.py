"""Writing a `Decoder` as a Hugging Face directory: config.json, safetensors (sharded when large).

Example:
  >>> import json
  >>> from flax import nnx
  >>> from jax_ai_stack.recipes.models.decoder import Decoder, DecoderConfig
  >>> model = Decoder(DecoderConfig.tiny(), rngs=nnx.Rngs(0))
  >>> save(model, "tiny")
  ['config.json', 'model.safetensors']
  >>> save(model, "sharded", max_shard_bytes=2**20)[:2]  # Shards of at most 1 MiB, and an index.
  ['config.json', 'model-00001-of-00004.safetensors']
  >>> json.load(open("tiny/config.json"))["architectures"]
  ['LlamaForCausalLM']
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import tempfile
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx, traverse_util

from jax_ai_stack import atomic
from jax_ai_stack.errors import UsageError
from jax_ai_stack.recipes.models.hf.config_json import hf_config
from jax_ai_stack.recipes.models.hf.layout import (
    CONFIG_FILE, INDEX_FILE, WEIGHTS_FILE, Tensor, _safetensors, copy_tokenizer, tensors)
from jax_ai_stack.recipes.models.hf.special_tokens import GENERATION_FILE

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
"""Hugging Face's default `max_shard_size` ("5GB")."""


def writes(model: nnx.Module) -> bool:
  """Whether `save` can write `model`: a `Decoder` (the decoder whose layouts the families
  hold; `export-hf` refuses the others)."""
  from jax_ai_stack.recipes.models.decoder import Decoder

  return isinstance(model, Decoder)


def save(model: nnx.Module, out: str | os.PathLike, *,
         max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
         tokenizer: str | os.PathLike | None = None,
         token_ids: Mapping[str, Any] | None = None,
         generation_config: Mapping[str, Any] | None = None) -> list[str]:
  """Writes `model` (a `Decoder`) as a Hugging Face directory `out`; returns its file names.

  One `model.safetensors`, or above `max_shard_bytes` shards plus their index
  (a tensor larger than the limit gets a shard of its own). `tokenizer`: a
  tokenizer.json to copy in (with its chat template files); `token_ids`: e.g. bos_token_id for
  config.json; `generation_config`: generation_config.json's contents.
  The directory appears complete or not at all: it is written beside `out`
  and renamed into place.

  Raises:
    UsageError: `out` exists and is not an empty directory (nothing is written).
  """
  from jax_ai_stack.recipes.models import layer_stack

  st = _safetensors()
  model = layer_stack.unrolled(model)  # The files name each layer.
  out = pathlib.Path(out)
  if out.exists() and not (out.is_dir() and not any(out.iterdir())):
    raise UsageError(f"{out} already exists and is not an empty directory; choose a new one")
  config = model.config
  params = traverse_util.flatten_dict(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
  shards = _plan_shards(tensors(config), params, max_shard_bytes)
  out.parent.mkdir(parents=True, exist_ok=True)
  staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
  try:
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
      file = (WEIGHTS_FILE if len(shards) == 1
              else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors")
      host = {t.name: _to_hf(t, params) for t in shard}
      st.numpy.save_file(host, str(staging / file), metadata={"format": "pt"})
      weight_map.update({name: file for name in host})
      total += sum(array.nbytes for array in host.values())
      del host
    if len(shards) > 1:
      index = {"metadata": {"total_size": int(total)},
               "weight_map": dict(sorted(weight_map.items()))}
      (staging / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    (staging / CONFIG_FILE).write_text(
        json.dumps(hf_config(config, **dict(token_ids or {})), indent=2) + "\n", encoding="utf-8")
    if tokenizer is not None:
      copy_tokenizer(tokenizer, staging)
    if generation_config is not None:
      (staging / GENERATION_FILE).write_text(json.dumps(dict(generation_config), indent=2) + "\n",
                                             encoding="utf-8")
    for file in staging.iterdir():  # Shareable as a directory made by hand would be.
      os.chmod(file, atomic.new_file_mode())
    os.chmod(staging, atomic.new_directory_mode())
    if out.exists():
      out.rmdir()
    staging.rename(out)
  except BaseException:
    shutil.rmtree(staging, ignore_errors=True)
    raise
  return sorted(p.name for p in out.iterdir())


def _to_hf(tensor: Tensor, params: Mapping[tuple, jax.Array]) -> np.ndarray:
  """`tensor` as Hugging Face stores it: a fused tensor's parts concatenated."""
  pieces = [part.to_hf(np.asarray(jax.device_get(_piece(params[part.path], part))))
            for part in tensor.leaves()]
  return pieces[0] if len(pieces) == 1 else np.concatenate(pieces, axis=tensor.fuse_axis)


def _piece(array: jax.Array, tensor: Tensor) -> jax.Array:
  """What `tensor` holds of the parameter `array`: one expert's slice, or all of it."""
  return array if tensor.expert is None else array[tensor.expert]


def _plan_shards(needed: list[Tensor], params: Mapping[tuple, jax.Array],
                 max_bytes: int) -> list[list[Tensor]]:
  """Tensors in order, cut into consecutive groups of at most `max_bytes`."""
  shards: list[list[Tensor]] = [[]]
  size = 0
  for tensor in needed:
    nbytes = sum(_piece(params[part.path], part).nbytes for part in tensor.leaves())
    if shards[-1] and size + nbytes > max_bytes:
      shards.append([])
      size = 0
    shards[-1].append(tensor)
    size += nbytes
  return shards
