"""Reading a Hugging Face decoder directory: the safetensors headers checked, the weights loaded.

Loading is lazy: one tensor at a time is read from disk (`safe_open`), cast to
the parameter dtype and placed straight onto its sharding, so no full host
copy of the model ever exists.

Example:
  >>> from flax import nnx
  >>> from jax_ai_stack.recipes.models import hf
  >>> from jax_ai_stack.recipes.models.decoder import Decoder, DecoderConfig
  >>> _ = hf.save(Decoder(DecoderConfig.tiny(), rngs=nnx.Rngs(0)), "tiny")
  >>> read_index("tiny")["model.norm.weight"].shape
  (128,)
  >>> model = load_model("tiny")
  >>> model.config.num_layers, model.final_norm.scale.shape
  (4, (128,))
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import pathlib
import re
from typing import Any

import jax
import numpy as np
from flax import nnx, traverse_util

from jax_ai_stack.errors import ModelFileError
from jax_ai_stack.recipes import progress as progress_lib
from jax_ai_stack.recipes.models.configs import DecoderConfig
from jax_ai_stack.recipes.models.hf.config_json import read_config
from jax_ai_stack.recipes.models.hf.layout import (
    INDEX_FILE, OTHER_TOWERS, TEXT_PREFIX, WEIGHTS_FILE, _model_shapes, _safetensors, head_name,
    tensors, text_prefix)

PROGRESS_MIN_BYTES = 2**30
"""Checkpoints at least this large show a progress bar while loading."""

_FLOAT_FORMATS = {"F64", "F32", "F16", "BF16"}
_IGNORED = ("rotary_emb.inv_freq",)
"""Tensors some older checkpoints carry that are recomputed, not learned."""


@dataclasses.dataclass(frozen=True)
class Stored:
  """Where a tensor is and what its header says."""

  file: pathlib.Path
  shape: tuple[int, ...]
  dtype: str


def read_index(directory: str | os.PathLike) -> dict[str, Stored]:
  """{tensor name: Stored} of a directory's safetensors, from the headers alone.

  Raises:
    ModelFileError: no weights, a broken index, a shard it names missing or
      without the tensor, or a header that does not parse (naming the file).
  """
  st = _safetensors()
  directory = pathlib.Path(directory)
  index_path, single = directory / INDEX_FILE, directory / WEIGHTS_FILE
  if index_path.is_file():
    try:
      weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
      files = {name: directory / file for name, file in weight_map.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
      raise ModelFileError(f"{index_path}: not a safetensors index (no weight_map): {e}") from None
  elif single.is_file():
    files = None
  else:
    others = sorted(p.name for pattern in ("*.bin", "*.safetensors") for p in directory.glob(pattern))
    found = (f"; found {', '.join(others)} (only {WEIGHTS_FILE} or a sharded {INDEX_FILE} "
             "are read)") if others else ""
    raise ModelFileError(f"{directory}: no {WEIGHTS_FILE} and no {INDEX_FILE}{found}")
  stored: dict[str, Stored] = {}
  for path in sorted(set(files.values())) if files is not None else [single]:
    if not path.is_file():
      raise ModelFileError(f"{index_path}: names {path.name}, which does not exist")
    try:
      with st.safe_open(str(path), framework="numpy") as f:
        for name in f.keys():
          header = f.get_slice(name)
          stored[name] = Stored(path, tuple(header.get_shape()), header.get_dtype())
    except Exception as e:  # noqa: BLE001 - safetensors raises its own SafetensorError.
      raise ModelFileError(f"{path}: not a readable safetensors file: {e}") from None
  if files is not None:
    for name, path in files.items():
      if name not in stored or stored[name].file != path:
        raise ModelFileError(f"{index_path}: tensor {name!r} is not in {path.name}")
    stored = {name: stored[name] for name in files}
  return stored


def check_weights(directory: str | os.PathLike, config: DecoderConfig) -> dict[str, Stored]:
  """`read_index`, checked against the tensors a `Decoder(config)` needs.

  Raises:
    ModelFileError: naming a missing or unexpected tensor, a shape mismatch
      (expected and found), or a tensor that is not floating point.
  """
  stored = read_index(directory)
  shapes = _model_shapes(config)
  prefix = text_prefix(stored)
  needed = tensors(config, prefix)
  for tensor in needed:
    if tensor.name not in stored:
      raise ModelFileError(f"{directory}: tensor {tensor.name!r} is missing")
    found, expected = stored[tensor.name], tensor.stored_shape(shapes)
    if found.shape != expected:
      raise ModelFileError(f"{found.file}: tensor {tensor.name!r} has shape {found.shape}, "
                           f"expected {expected} from the model config")
    if found.dtype not in _FLOAT_FORMATS:
      raise ModelFileError(f"{found.file}: tensor {tensor.name!r} has dtype {found.dtype}; "
                           f"expected one of {', '.join(sorted(_FLOAT_FORMATS))}")
  known = {t.name for t in needed}
  if config.tie_embeddings:
    known.add(head_name(prefix))  # Some tied checkpoints store the copy; it is the embedding.
  others = OTHER_TOWERS if prefix != TEXT_PREFIX else ()
  unread = set(unread_layers(stored, config))
  extra = sorted(name for name in stored if name not in known and not name.endswith(_IGNORED)
                 and not name.startswith(others) and name not in unread)
  if extra:
    shown = ", ".join(repr(n) for n in extra[:5])
    shown += f" and {len(extra) - 5} more" if len(extra) > 5 else ""
    raise ModelFileError(f"{directory}: unexpected tensor(s) {shown}: the config.json does not "
                         "describe these weights")
  return stored


def unread_layers(names, config: DecoderConfig) -> list[str]:
  """The tensors among `names` of layers past the decoder's (`layers.{i}.` with i >=
  num_layers) where its family's checkpoints hold multi-token prediction layers there
  (`HFFamily.prediction_layers`, DeepSeek-V3's): not read. Empty for other families."""
  from jax_ai_stack.recipes.models.hf import families

  if not families.for_kind(config.kind).prediction_layers:
    return []
  layer = re.compile(rf"{re.escape(text_prefix(names))}layers\.(\d+)\.")
  return sorted(name for name in names
                if (found := layer.match(name)) and int(found[1]) >= config.num_layers)


def load_params(directory: str | os.PathLike, config: DecoderConfig,
                target: nnx.State) -> nnx.State:
  """The parameters of `Decoder(config)` read from `directory`, laid out as `target`.

  `target`: the model's (abstract) parameter state, e.g.
  `nnx.state(nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0))))`. A
  leaf that carries a `sharding` (a `jax.ShapeDtypeStruct(..., sharding=s)`)
  is placed on it, each device receiving only its part; others go to the
  default device. Each tensor is cast to the leaf's dtype.
  """
  st = _safetensors()
  stored = check_weights(directory, config)
  leaves = traverse_util.flatten_dict(nnx.to_pure_dict(target))
  needed = tensors(config, text_prefix(stored))
  shapes = {path: tuple(leaf.shape) for path, leaf in leaves.items()}
  if set(leaves) != {part.path for t in needed for part in t.leaves()}:
    raise ValueError(f"target is not the parameter state of Decoder(config): {sorted(leaves)}")
  total = sum(math.prod(stored[t.name].shape) * _itemsize(stored[t.name].dtype) for t in needed)
  values: dict[tuple, jax.Array] = {}
  experts: dict[tuple, list[np.ndarray]] = {}  # A stacked parameter's slices read so far.
  handles: dict[pathlib.Path, Any] = {}
  with contextlib.ExitStack() as files, progress_lib.bar(
      "load", unit="B", total=total, tenths=True, unit_scale=True,
      disable=total < PROGRESS_MIN_BYTES) as progress:
    for tensor in needed:
      entry = stored[tensor.name]
      if entry.file not in handles:
        handles[entry.file] = files.enter_context(st.safe_open(str(entry.file), framework="numpy"))
      try:
        array = handles[entry.file].get_tensor(tensor.name)
      except Exception as e:  # noqa: BLE001 - SafetensorError: truncated data, say.
        raise ModelFileError(f"{entry.file}: tensor {tensor.name!r} is not readable: {e}") from None
      pieces = tensor.split(array, shapes) if tensor.parts else [array]
      del array
      for part, piece in zip(tensor.leaves(), pieces):
        leaf = leaves[part.path]
        piece = part.to_model(piece, part.piece(leaf.shape)).astype(leaf.dtype, copy=False)
        if part.expert is not None:  # One expert's slice: placed when all are read.
          experts.setdefault(part.path, []).append(piece)
          if len(experts[part.path]) < leaf.shape[0]:
            continue
          piece = np.stack(experts.pop(part.path))
        values[part.path] = _place(piece, getattr(leaf, "sharding", None))
      del pieces, piece  # One tensor (or one stacked parameter) on the host at a time.
      progress.update(math.prod(entry.shape) * _itemsize(entry.dtype))
  filled = jax.tree.map(lambda x: x, target)
  nnx.replace_by_pure_dict(filled, traverse_util.unflatten_dict(values))
  return filled


def _place(array: np.ndarray, sharding: jax.sharding.Sharding | None) -> jax.Array:
  if sharding is None:
    return jax.device_put(array)
  return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


def _itemsize(dtype: str) -> int:
  return {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}.get(dtype, 1)


def load_model(directory: str | os.PathLike, **overrides: Any):
  """A `Decoder` with the config and weights of a Hugging Face directory (one device).

  `overrides`: `DecoderConfig` fields to change, e.g. `attention_impl="xla"` or
  `param_dtype="float32"`.
  """
  from jax_ai_stack.recipes.models.decoder import Decoder

  from jax_ai_stack.recipes.models import layer_stack

  config = DecoderConfig(**{**read_config(directory), **overrides})
  unrolled = dataclasses.replace(config, scan_layers=False)  # The files name each layer.
  model = nnx.eval_shape(lambda: Decoder(unrolled, rngs=nnx.Rngs(0)))
  nnx.update(model, load_params(directory, unrolled, nnx.state(model)))
  return layer_stack.convert(model, scan_layers=config.scan_layers)
