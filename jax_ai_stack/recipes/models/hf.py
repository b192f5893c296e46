"""Hugging Face Llama checkpoints in and out of the NNX `Llama`: config.json + safetensors.

A Hugging Face directory holds `config.json` and the weights, either one
`model.safetensors` or shards `model-0000i-of-0000n.safetensors` listed in
`model.safetensors.index.json`. `read_config` maps config.json onto a
`LlamaConfig` (refusing, by field name, what this model cannot represent),
`load_params` reads the weights into the model's parameters and `save` writes
them back in the same layout, with a config.json that
`transformers.LlamaForCausalLM.from_pretrained` loads.

The layouts differ in three ways, all handled by `TENSORS`:

* torch's `Linear.weight` is [out, in]; our kernels are [in, out], and the
  attention projections keep heads as their own axes ([D, N, H], [N, H, D]).
* The names: `model.layers.3.self_attn.q_proj.weight` is
  `layers/3/attention/q_proj/kernel`.
* RoPE needs none: Hugging Face stores q and k for the "rotate half"
  convention (Meta's conversion script permutes them into it), pairing
  features (i, i + H/2) with inv_freq = 1 / theta^(2i / H), which is exactly
  `llama.apply_rope`. tests/test_hf.py checks it against a NumPy forward pass
  written from Hugging Face's code, and that the permuted (interleaved) layout
  fails that check. Llama 3.1 / 3.2's `rope_scaling` ("llama3") maps onto
  `LlamaConfig.rope_scaling`; the other RoPE types are refused.

Loading is lazy: one tensor at a time is read from disk (`safe_open`), cast to
the parameter dtype and placed straight onto its sharding, so no full host
copy of the model ever exists; each process reads only the tensors, and hands
each device only its part.

Example:
  >>> fields = llama_fields({"architectures": ["LlamaForCausalLM"], "hidden_size": 64,
  ...     "intermediate_size": 128, "num_attention_heads": 4, "num_hidden_layers": 2,
  ...     "vocab_size": 300})
  >>> LlamaConfig(**fields).num_kv_heads, fields["norm_eps"]
  (4, 1e-06)
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
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
from jax_ai_stack.errors import ConfigError, MissingExtraError, ModelFileError, UsageError
from jax_ai_stack.recipes import configlib
from jax_ai_stack.recipes.models.configs import LlamaConfig

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILE = "tokenizer.json"
_MODEL_TYPE = "llama"
"""config.json's `model_type` of the one architecture this module reads and writes."""
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
"""Hugging Face's default `max_shard_size` ("5GB")."""
PROGRESS_MIN_BYTES = 2**30
"""Checkpoints at least this large show a progress bar while loading."""

_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}
_FLOAT_FORMATS = {"F64", "F32", "F16", "BF16"}
_IGNORED = ("rotary_emb.inv_freq",)
"""Tensors some older checkpoints carry that are recomputed, not learned."""


def _safetensors():
  try:
    import safetensors  # pylint: disable=g-import-not-at-top
    import safetensors.numpy  # noqa: F401 pylint: disable=g-import-not-at-top
  except ImportError:
    raise MissingExtraError("the 'safetensors' package is not installed; install the extra: "
                            "pip install 'jax-ai-stack[hf]'") from None
  return safetensors


# ---- config.json <-> LlamaConfig ------------------------------------------------


def _refuse(source: str, field: str, value: Any, why: str) -> ModelFileError:
  return ModelFileError(f"{source}: {field}={value!r} is not supported: {why}")


def llama_fields(hf: Mapping[str, Any], source: str = CONFIG_FILE) -> dict[str, Any]:
  """The `LlamaConfig` fields a Hugging Face Llama config.json describes.

  Missing optional fields take `transformers.LlamaConfig`'s defaults; the
  compute and parameter dtypes both become `torch_dtype` (float32 if absent).

  Raises:
    ModelFileError: naming the config.json field this model cannot represent.
  """
  architectures = hf.get("architectures") or ["LlamaForCausalLM"]
  if list(architectures) != ["LlamaForCausalLM"]:
    raise _refuse(source, "architectures", architectures, "only LlamaForCausalLM is")
  if hf.get("model_type", _MODEL_TYPE) != _MODEL_TYPE:
    raise _refuse(source, "model_type", hf["model_type"], f"only {_MODEL_TYPE!r} is")
  act = hf.get("hidden_act", "silu")
  if act != "silu":
    raise _refuse(source, "hidden_act", act, "the MLP is SwiGLU (silu)")
  rope_field, rope = _rope_parameters(hf, source)
  for field in ("attention_bias", "mlp_bias"):
    if hf.get(field):
      raise _refuse(source, field, hf[field], "the model has no biases")
  if hf.get("sliding_window") is not None:
    raise _refuse(source, "sliding_window", hf["sliding_window"], "attention is full causal")
  if hf.get("attention_dropout", 0.0):
    raise _refuse(source, "attention_dropout", hf["attention_dropout"], "the model has no dropout")
  dtype_field = "torch_dtype" if "torch_dtype" in hf else "dtype"  # transformers 5: "dtype".
  dtype = hf.get(dtype_field) or "float32"
  if dtype not in _DTYPES:
    raise _refuse(source, dtype_field, dtype, f"use one of {', '.join(_DTYPES)}")
  required = ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers",
              "vocab_size")
  missing = [field for field in required if field not in hf]
  if missing:
    raise ModelFileError(f"{source}: missing {', '.join(missing)}")
  heads = hf["num_attention_heads"]
  head_dim = hf.get("head_dim")
  return dict(
      kind="llama",
      vocab_size=hf["vocab_size"],
      num_layers=hf["num_hidden_layers"],
      d_model=hf["hidden_size"],
      num_heads=heads,
      num_kv_heads=hf.get("num_key_value_heads") or heads,
      head_dim=None if head_dim in (None, hf["hidden_size"] // heads) else head_dim,
      mlp_dim=hf["intermediate_size"],
      rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10_000.0))),
      rope_scaling=_rope_scaling(hf, rope_field, rope, source),
      max_seq_len=hf.get("max_position_embeddings", 2048),
      norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      dtype=_DTYPES[dtype],
      param_dtype=_DTYPES[dtype],
  )


_ROPE_TYPES = ("default", "llama3")
_LLAMA3_FIELDS = ("factor", "low_freq_factor", "high_freq_factor")


def _rope_parameters(hf: Mapping[str, Any], source: str) -> tuple[str, Mapping[str, Any]]:
  """The config.json field that holds the RoPE parameters, and its value.

  transformers 4 writes `rope_scaling` (beside a top-level rope_theta),
  transformers 5 `rope_parameters` (rope_theta inside); like transformers 5,
  a non-empty `rope_scaling` wins.
  """
  field = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
  rope = hf.get(field) or {}
  if not isinstance(rope, Mapping):
    raise _refuse(source, field, rope, "expected an object")
  kind = rope.get("rope_type", rope.get("type", "default"))
  if kind not in _ROPE_TYPES:
    raise _refuse(source, field, dict(rope), f"of the RoPE types only {' and '.join(_ROPE_TYPES)} "
                  "are implemented")
  return field, rope


def _rope_scaling(hf: Mapping[str, Any], field: str, rope: Mapping[str, Any],
                  source: str) -> dict[str, Any] | None:
  """`LlamaConfig.rope_scaling` of a "llama3" rope; None for plain RoPE.

  A missing original_max_position_embeddings is max_position_embeddings, as
  in transformers.
  """
  if rope.get("rope_type", rope.get("type", "default")) == "default":
    return None
  missing = [name for name in _LLAMA3_FIELDS if rope.get(name) is None]
  if missing:
    raise ModelFileError(f"{source}: {field} of rope_type 'llama3' has no {', '.join(missing)}")
  original = rope.get("original_max_position_embeddings") or hf.get("max_position_embeddings", 2048)
  return dict(kind="llama3", **{name: rope[name] for name in _LLAMA3_FIELDS},
              original_max_position_embeddings=original)


def read_config(directory: str | os.PathLike) -> dict[str, Any]:
  """`llama_fields` of `directory`'s config.json; ModelFileError if unreadable."""
  path = pathlib.Path(directory) / CONFIG_FILE
  if not pathlib.Path(directory).is_dir():
    raise ModelFileError(f"{directory}: not a directory (a Hugging Face model directory)")
  if not path.is_file():
    raise ModelFileError(f"{directory}: no {CONFIG_FILE}; not a Hugging Face model directory")
  try:
    hf = json.loads(path.read_text(encoding="utf-8"))
  except (OSError, ValueError) as e:
    raise ModelFileError(f"{path}: not readable JSON: {e}") from None
  if not isinstance(hf, dict):
    raise ModelFileError(f"{path}: the top level must be an object")
  fields = llama_fields(hf, str(path))
  try:  # configlib's message is one line naming the field.
    configlib.from_dict(LlamaConfig, fields, source=f"{path}: does not describe a valid model")
  except ConfigError as e:
    raise ModelFileError(str(e)) from None
  return fields


def hf_config(config: LlamaConfig, **token_ids: int) -> dict[str, Any]:
  """The config.json of `config` (`LlamaForCausalLM`), plus e.g. bos_token_id=..."""
  return {
      "architectures": ["LlamaForCausalLM"],
      "model_type": _MODEL_TYPE,
      "vocab_size": config.vocab_size,
      "hidden_size": config.d_model,
      "intermediate_size": config.mlp_dim,
      "num_hidden_layers": config.num_layers,
      "num_attention_heads": config.num_heads,
      "num_key_value_heads": config.num_kv_heads,
      "head_dim": config.resolved_head_dim,
      "hidden_act": "silu",
      "max_position_embeddings": config.max_seq_len,
      "rms_norm_eps": config.norm_eps,
      "rope_theta": config.rope_theta,
      "rope_scaling": _hf_rope_scaling(config),
      "attention_bias": False,
      "attention_dropout": 0.0,
      "mlp_bias": False,
      "tie_word_embeddings": config.tie_embeddings,
      "torch_dtype": config.param_dtype,
      "initializer_range": 0.02,
      "pretraining_tp": 1,
      "use_cache": True,
      **token_ids,
  }


def _hf_rope_scaling(config: LlamaConfig) -> dict[str, Any] | None:
  """config.json's `rope_scaling`, as Meta's Llama 3.1 / 3.2 files write it."""
  scaling = config.rope_scaling
  if scaling is None:
    return None
  return {
      "rope_type": scaling.kind,
      "factor": scaling.factor,
      "low_freq_factor": scaling.low_freq_factor,
      "high_freq_factor": scaling.high_freq_factor,
      "original_max_position_embeddings": scaling.original_max_position_embeddings,
  }


# ---- parameter names and layouts ------------------------------------------------


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


# ---- reading ----------------------------------------------------------------------


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


def check_weights(directory: str | os.PathLike, config: LlamaConfig) -> dict[str, Stored]:
  """`read_index`, checked against the tensors a `Llama(config)` needs.

  Raises:
    ModelFileError: naming a missing or unexpected tensor, a shape mismatch
      (expected and found), or a tensor that is not floating point.
  """
  stored = read_index(directory)
  shapes = _model_shapes(config)
  needed = tensors(config)
  for tensor in needed:
    if tensor.name not in stored:
      raise ModelFileError(f"{directory}: tensor {tensor.name!r} is missing")
    found, expected = stored[tensor.name], tensor.hf_shape(shapes[tensor.path])
    if found.shape != expected:
      raise ModelFileError(f"{found.file}: tensor {tensor.name!r} has shape {found.shape}, "
                           f"expected {expected} from the model config")
    if found.dtype not in _FLOAT_FORMATS:
      raise ModelFileError(f"{found.file}: tensor {tensor.name!r} has dtype {found.dtype}; "
                           f"expected one of {', '.join(sorted(_FLOAT_FORMATS))}")
  known = {t.name for t in needed}
  if config.tie_embeddings:
    known.add("lm_head.weight")  # Some tied checkpoints store the copy; it is the embedding.
  extra = sorted(name for name in stored if name not in known and not name.endswith(_IGNORED))
  if extra:
    shown = ", ".join(repr(n) for n in extra[:5])
    shown += f" and {len(extra) - 5} more" if len(extra) > 5 else ""
    raise ModelFileError(f"{directory}: unexpected tensor(s) {shown}: the config.json does not "
                         "describe these weights")
  return stored


def load_params(directory: str | os.PathLike, config: LlamaConfig, target: nnx.State) -> nnx.State:
  """The parameters of `Llama(config)` read from `directory`, laid out as `target`.

  `target`: the model's (abstract) parameter state, e.g.
  `nnx.state(nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0))))`. A
  leaf that carries a `sharding` (a `jax.ShapeDtypeStruct(..., sharding=s)`)
  is placed on it, each device receiving only its part; others go to the
  default device. Each tensor is cast to the leaf's dtype.
  """
  st = _safetensors()
  stored = check_weights(directory, config)
  leaves = traverse_util.flatten_dict(nnx.to_pure_dict(target))
  needed = tensors(config)
  if set(leaves) != {t.path for t in needed}:
    raise ValueError(f"target is not the parameter state of Llama(config): {sorted(leaves)}")
  total = sum(math.prod(stored[t.name].shape) * _itemsize(stored[t.name].dtype) for t in needed)
  values: dict[tuple, jax.Array] = {}
  handles: dict[pathlib.Path, Any] = {}
  from tqdm import tqdm

  with contextlib.ExitStack() as files, tqdm(
      total=total, unit="B", unit_scale=True, desc="load", dynamic_ncols=True,
      disable=total < PROGRESS_MIN_BYTES) as progress:
    for tensor in needed:
      entry, leaf = stored[tensor.name], leaves[tensor.path]
      if entry.file not in handles:
        handles[entry.file] = files.enter_context(st.safe_open(str(entry.file), framework="numpy"))
      try:
        array = handles[entry.file].get_tensor(tensor.name)
      except Exception as e:  # noqa: BLE001 - SafetensorError: truncated data, say.
        raise ModelFileError(f"{entry.file}: tensor {tensor.name!r} is not readable: {e}") from None
      array = tensor.to_model(array, tuple(leaf.shape)).astype(leaf.dtype, copy=False)
      values[tensor.path] = _place(array, getattr(leaf, "sharding", None))
      del array  # One tensor on the host at a time.
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
  """A `Llama` with the config and weights of a Hugging Face directory (one device).

  `overrides`: `LlamaConfig` fields to change, e.g. `attention_impl="xla"` or
  `param_dtype="float32"`.
  """
  from jax_ai_stack.recipes.models.llama import Llama

  from jax_ai_stack.recipes.models import layer_stack

  config = LlamaConfig(**{**read_config(directory), **overrides})
  unrolled = dataclasses.replace(config, scan_layers=False)  # The files name each layer.
  model = nnx.eval_shape(lambda: Llama(unrolled, rngs=nnx.Rngs(0)))
  nnx.update(model, load_params(directory, unrolled, nnx.state(model)))
  return layer_stack.convert(model, scan_layers=config.scan_layers)


# ---- writing ----------------------------------------------------------------------


def writes(model: nnx.Module) -> bool:
  """Whether `save` can write `model`: a `Llama` (the one model Hugging Face's Llama
  layout holds; `export-hf` refuses the others)."""
  from jax_ai_stack.recipes.models.llama import Llama

  return isinstance(model, Llama)


def save(model: nnx.Module, out: str | os.PathLike, *,
         max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
         tokenizer: str | os.PathLike | None = None,
         token_ids: Mapping[str, int] | None = None) -> list[str]:
  """Writes `model` (a `Llama`) as a Hugging Face directory `out`; returns its file names.

  One `model.safetensors`, or above `max_shard_bytes` shards plus their index
  (a tensor larger than the limit gets a shard of its own). `tokenizer`: a
  tokenizer.json to copy in; `token_ids`: e.g. bos_token_id for config.json.
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
    weight_map = {}
    for i, shard in enumerate(shards):
      file = (WEIGHTS_FILE if len(shards) == 1
              else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors")
      host = {t.name: t.to_hf(np.asarray(jax.device_get(params[t.path]))) for t in shard}
      st.numpy.save_file(host, str(staging / file), metadata={"format": "pt"})
      weight_map.update({name: file for name in host})
      del host
    if len(shards) > 1:
      total = sum(params[t.path].nbytes for shard in shards for t in shard)
      index = {"metadata": {"total_size": int(total)},
               "weight_map": dict(sorted(weight_map.items()))}
      (staging / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    (staging / CONFIG_FILE).write_text(
        json.dumps(hf_config(config, **dict(token_ids or {})), indent=2) + "\n", encoding="utf-8")
    if tokenizer is not None:
      shutil.copyfile(tokenizer, staging / TOKENIZER_FILE)
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


def _plan_shards(needed: list[Tensor], params: Mapping[tuple, jax.Array],
                 max_bytes: int) -> list[list[Tensor]]:
  """Tensors in order, cut into consecutive groups of at most `max_bytes`."""
  shards: list[list[Tensor]] = [[]]
  size = 0
  for tensor in needed:
    nbytes = params[tensor.path].nbytes
    if shards[-1] and size + nbytes > max_bytes:
      shards.append([])
      size = 0
    shards[-1].append(tensor)
    size += nbytes
  return shards
