"""Hugging Face Llama directories in and out: against a NumPy forward pass written
from Hugging Face's code, bitwise round trips, every refused field and bad file,
8 simulated devices, and the import-hf -> eval/generate/train -> export-hf commands."""

from __future__ import annotations

import json
import os
import pathlib

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from jax_ai_stack import cli
from jax_ai_stack.errors import ModelFileError, UsageError
from jax_ai_stack.recipes import checkpoint, train
from jax_ai_stack.recipes import config as recipe_config
from jax_ai_stack.recipes.inference import Engine, Request
from jax_ai_stack.recipes.models import hf
from jax_ai_stack.recipes.models.decoder import Decoder, DecoderConfig, RopeScaling
from jax_ai_stack.recipes.tasks.lm import LanguageModel

from multidevice import run_on_devices

# Grouped-query attention (4 query heads share 2 key/value heads) and a head_dim
# that is not hidden_size // heads, so that every reshape is exercised.
TINY_HF = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 40,
    "hidden_size": 24, "intermediate_size": 40, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
    "hidden_act": "silu", "max_position_embeddings": 64, "rms_norm_eps": 1e-5,
    "rope_theta": 500.0, "rope_scaling": None, "attention_bias": False, "mlp_bias": False,
    "tie_word_embeddings": False, "torch_dtype": "float32",
}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}
"""Llama 3.1's RoPE scaling, shrunk to the tiny model: of its wavelengths (theta 500, head_dim
8) 2 pi stays, 30 is blended, 140 and 660 are divided by 8."""
TINY_LLAMA3 = {**TINY_HF, "rope_scaling": LLAMA3}
TOLERANCE = 2e-4
"""Largest absolute logit difference from the float64 reference (float32 model, 2 layers)."""


def hf_weights(c: dict, seed: int = 0) -> dict[str, np.ndarray]:
  """Random weights with the shapes transformers' LlamaForCausalLM gives them."""
  rng = np.random.default_rng(seed)
  d, f, h = c["hidden_size"], c["intermediate_size"], c["head_dim"]
  n, k, v = c["num_attention_heads"], c["num_key_value_heads"], c["vocab_size"]
  normal = lambda *shape: (0.3 * rng.standard_normal(shape)).astype(np.float32)  # noqa: E731
  w = {"model.embed_tokens.weight": normal(v, d), "model.norm.weight": 1 + normal(d)}
  for i in range(c["num_hidden_layers"]):
    p = f"model.layers.{i}."
    w |= {p + "self_attn.q_proj.weight": normal(n * h, d), p + "self_attn.k_proj.weight": normal(k * h, d),
          p + "self_attn.v_proj.weight": normal(k * h, d), p + "self_attn.o_proj.weight": normal(d, n * h),
          p + "mlp.gate_proj.weight": normal(f, d), p + "mlp.up_proj.weight": normal(f, d),
          p + "mlp.down_proj.weight": normal(d, f), p + "input_layernorm.weight": 1 + normal(d),
          p + "post_attention_layernorm.weight": 1 + normal(d)}
  if not c["tie_word_embeddings"]:
    w["lm_head.weight"] = normal(v, d)
  return w


def write_hf(directory: pathlib.Path, c: dict, weights: dict, *, shards: int = 1) -> pathlib.Path:
  """A Hugging Face directory as save_pretrained leaves it (sharded when shards > 1)."""
  directory.mkdir(parents=True, exist_ok=True)
  (directory / "config.json").write_text(json.dumps(c))
  if shards == 1:
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory
  names = list(weights)
  weight_map = {}
  for i, part in enumerate(np.array_split(np.arange(len(names)), shards)):
    file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
    save_file({names[j]: weights[names[j]] for j in part}, str(directory / file))
    weight_map |= {names[j]: file for j in part}
  (directory / "model.safetensors.index.json").write_text(
      json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
  return directory


def reference_logits(w: dict, c: dict, tokens: np.ndarray) -> np.ndarray:
  """transformers' LlamaForCausalLM forward pass, in float64 NumPy, for one sequence."""
  w = {name: value.astype(np.float64) for name, value in w.items()}
  h, eps = c["head_dim"], c["rms_norm_eps"]
  n, k = c["num_attention_heads"], c["num_key_value_heads"]
  t = len(tokens)
  inv_freq = 1.0 / c["rope_theta"] ** (np.arange(0, h, 2) / h)  # LlamaRotaryEmbedding
  if c.get("rope_scaling"):  # _compute_llama3_parameters
    r = c["rope_scaling"]
    old, low, high, factor = (r["original_max_position_embeddings"], r["low_freq_factor"],
                              r["high_freq_factor"], r["factor"])
    wavelen = 2 * np.pi / inv_freq
    scaled = np.where(wavelen > old / low, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    inv_freq = np.where(~(wavelen < old / high) & ~(wavelen > old / low), smoothed, scaled)
  emb = np.concatenate([np.outer(np.arange(t), inv_freq)] * 2, axis=-1)  # [T, H]
  cos, sin = np.cos(emb), np.sin(emb)

  def rotate_half(x):
    return np.concatenate([-x[..., h // 2:], x[..., :h // 2]], axis=-1)

  def rms_norm(x, weight):
    return weight * (x / np.sqrt((x**2).mean(-1, keepdims=True) + eps))

  def heads(x, count):  # [T, count * H] -> [count, T, H]
    return x.reshape(t, count, h).transpose(1, 0, 2)

  x = w["model.embed_tokens.weight"][tokens]
  causal = np.triu(np.full((t, t), -np.inf), 1)
  for i in range(c["num_hidden_layers"]):
    p = f"model.layers.{i}."
    y = rms_norm(x, w[p + "input_layernorm.weight"])
    q = heads(y @ w[p + "self_attn.q_proj.weight"].T, n)
    key = heads(y @ w[p + "self_attn.k_proj.weight"].T, k)
    value = heads(y @ w[p + "self_attn.v_proj.weight"].T, k)
    q, key = q * cos + rotate_half(q) * sin, key * cos + rotate_half(key) * sin
    key, value = np.repeat(key, n // k, axis=0), np.repeat(value, n // k, axis=0)  # repeat_kv
    scores = q @ key.transpose(0, 2, 1) / np.sqrt(h) + causal
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    attended = (probs @ value).transpose(1, 0, 2).reshape(t, n * h)
    x = x + attended @ w[p + "self_attn.o_proj.weight"].T
    y = rms_norm(x, w[p + "post_attention_layernorm.weight"])
    gate = y @ w[p + "mlp.gate_proj.weight"].T
    x = x + (gate / (1 + np.exp(-gate)) * (y @ w[p + "mlp.up_proj.weight"].T)) @ w[
        p + "mlp.down_proj.weight"].T
  x = rms_norm(x, w["model.norm.weight"])
  head = w["model.embed_tokens.weight"] if c["tie_word_embeddings"] else w["lm_head.weight"]
  return x @ head.T


TOKENS = np.array([3, 17, 0, 39, 8, 8, 21, 5, 30, 12, 1, 2], dtype=np.int32)
LONG = np.random.default_rng(1).integers(0, 40, 48).astype(np.int32)
"""Longer than LLAMA3's original_max_position_embeddings, where the scaling shows most."""


@pytest.mark.parametrize("tied", [False, True])
def test_logits_match_a_numpy_forward_pass_of_transformers_llama(tmp_path, tied):
  c = {**TINY_HF, "tie_word_embeddings": tied}
  weights = hf_weights(c)
  model = hf.load_model(write_hf(tmp_path, c, weights))
  assert model.config.tie_embeddings is tied and model.config.resolved_head_dim == 8
  logits = np.asarray(model(TOKENS[None]))[0]
  expected = reference_logits(weights, c, TOKENS)
  assert np.abs(logits - expected).max() < TOLERANCE, np.abs(logits - expected).max()


def test_llama3_rope_scaling_imports_with_the_reference_logits(tmp_path):
  weights = hf_weights(TINY_LLAMA3)
  model = hf.load_model(write_hf(tmp_path, TINY_LLAMA3, weights))
  assert model.config.rope_scaling == RopeScaling(factor=8.0, original_max_position_embeddings=32)
  logits = np.asarray(model(LONG[None]))[0]
  expected = reference_logits(weights, TINY_LLAMA3, LONG)
  assert np.abs(logits - expected).max() < TOLERANCE, np.abs(logits - expected).max()
  # Without the scaling the same weights give other logits: the check above can fail.
  assert np.abs(reference_logits(weights, TINY_HF, LONG) - expected).max() > 100 * TOLERANCE


def test_the_reference_tells_the_rope_layouts_apart(tmp_path):
  """Meta's original (interleaved-pair) q/k layout must fail the check above.

  Hugging Face's weights are Meta's permuted by `permute` in
  convert_llama_weights_to_hf.py; undoing it gives what an interleaved RoPE
  would need. Loading that without converting must change the logits.
  """
  c, weights = TINY_HF, hf_weights(TINY_HF)
  h = c["head_dim"]

  def unpermute(w, count):  # The inverse of view(n, h/2, 2, d).transpose(1, 2).
    return w.reshape(count, 2, h // 2, -1).transpose(0, 2, 1, 3).reshape(count * h, -1)

  meta = dict(weights)
  for i in range(c["num_hidden_layers"]):
    for proj, count in (("q", c["num_attention_heads"]), ("k", c["num_key_value_heads"])):
      name = f"model.layers.{i}.self_attn.{proj}_proj.weight"
      meta[name] = np.ascontiguousarray(unpermute(weights[name], count))
  model = hf.load_model(write_hf(tmp_path, c, meta))
  error = np.abs(np.asarray(model(TOKENS[None]))[0] - reference_logits(weights, c, TOKENS)).max()
  assert error > 100 * TOLERANCE


def test_sharded_and_single_file_directories_load_the_same_bits(tmp_path):
  weights = hf_weights(TINY_HF)
  single = hf.load_model(write_hf(tmp_path / "single", TINY_HF, weights))
  sharded = hf.load_model(write_hf(tmp_path / "sharded", TINY_HF, weights, shards=3))
  assert checkpoint.tree_equal(nnx.state(single), nnx.state(sharded))


def test_off_a_terminal_the_load_s_byte_bar_is_plain_lines(tmp_path, monkeypatch, capsys):
  """Into a log file (pytest's stderr is no terminal): a line at each tenth, no \\r frames."""
  monkeypatch.setattr(hf.reader, "PROGRESS_MIN_BYTES", 0)  # The tiny model gets its bar.
  hf.load_model(write_hf(tmp_path, TINY_HF, hf_weights(TINY_HF)))
  err = capsys.readouterr().err
  lines = [line for line in err.splitlines() if line.startswith("load ")]
  assert "\r" not in err and 2 <= len(lines) <= 10, err
  assert lines[-1].startswith("load ") and "(100%)" in lines[-1] and "kB/" in lines[-1], err


@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_export_then_import_is_bitwise(tmp_path, param_dtype):
  config = DecoderConfig(vocab_size=40, num_layers=2, d_model=24, num_heads=4, num_kv_heads=2,
                       head_dim=8, mlp_dim=40, tie_embeddings=False, rope_theta=500.0,
                       rope_scaling=RopeScaling(factor=32.0, original_max_position_embeddings=16),
                       dtype=param_dtype, param_dtype=param_dtype)
  model = Decoder(config, rngs=nnx.Rngs(3))
  files = hf.save(model, tmp_path / "out", max_shard_bytes=4000, token_ids={"bos_token_id": 1})
  shards = [f for f in files if f.endswith(".safetensors")]
  assert "model.safetensors.index.json" in files and len(shards) > 1
  assert shards[-1] == f"model-{len(shards):05d}-of-{len(shards):05d}.safetensors"
  umask = os.umask(0o22)
  os.umask(umask)
  assert (tmp_path / "out").stat().st_mode & 0o777 == 0o777 & ~umask  # Not mkdtemp's 0700.
  assert {(tmp_path / "out" / f).stat().st_mode & 0o777 for f in files} == {0o666 & ~umask}
  for shard in shards:  # Each within the limit, or one tensor alone.
    tensors = load_file(str(tmp_path / "out" / shard)).values()
    assert sum(t.nbytes for t in tensors) <= 4000 or len(tensors) == 1
  index = json.loads((tmp_path / "out/model.safetensors.index.json").read_text())
  assert set(index["weight_map"]) == {t.name for t in hf.tensors(config)}
  exported = json.loads((tmp_path / "out/config.json").read_text())
  assert exported["architectures"] == ["LlamaForCausalLM"] and exported["model_type"] == "llama"
  assert exported["torch_dtype"] == param_dtype and exported["bos_token_id"] == 1
  assert DecoderConfig(**hf.read_config(tmp_path / "out")) == config
  loaded = hf.load_model(tmp_path / "out")
  assert checkpoint.tree_equal(nnx.state(model), nnx.state(loaded))
  # And one file below the limit, the tensors in transformers' shapes.
  hf.save(model, tmp_path / "one")
  assert sorted(p.name for p in (tmp_path / "one").iterdir()) == ["config.json", "model.safetensors"]
  stored = load_file(str(tmp_path / "one/model.safetensors"))
  assert stored["model.layers.1.self_attn.k_proj.weight"].shape == (16, 24)
  assert stored["model.layers.1.self_attn.o_proj.weight"].shape == (24, 32)
  assert stored["lm_head.weight"].shape == (40, 24)


def test_bfloat16_tensors_are_cast_to_the_parameter_dtype(tmp_path):
  c = {**TINY_HF, "torch_dtype": "bfloat16"}
  weights = {k: v.astype(ml_dtypes.bfloat16) for k, v in hf_weights(c).items()}
  write_hf(tmp_path, c, weights)
  assert hf.load_model(tmp_path).embed.embedding.get_value().dtype == jax.numpy.bfloat16
  model = hf.load_model(tmp_path, param_dtype="float32", dtype="float32")
  embedding = np.asarray(model.embed.embedding.get_value())
  assert embedding.dtype == np.float32
  vocab = c["vocab_size"]
  assert np.array_equal(embedding[:vocab], weights["model.embed_tokens.weight"].astype(np.float32))
  assert not embedding[vocab:].any()  # The padded rows (vocab_multiple) are zero.


@pytest.mark.parametrize("field, value", [
    ("architectures", ["MambaForCausalLM"]),
    ("model_type", "mistral"),
    ("hidden_act", "gelu"),
    ("rope_scaling", {"rope_type": "ntk", "factor": 8.0}),
    ("rope_scaling", {"type": "dynamic", "factor": 2.0}),
    ("rope_parameters", {"rope_type": "dynamic", "rope_theta": 10000.0}),
    ("rope_parameters", "llama3"),
    ("attention_bias", True),
    ("mlp_bias", True),
    ("sliding_window", 4096),
    ("attention_dropout", 0.1),
    ("torch_dtype", "int8"),
])
def test_what_the_model_cannot_represent_is_refused_by_field(tmp_path, field, value):
  write_hf(tmp_path, {**TINY_HF, field: value}, hf_weights(TINY_HF))
  with pytest.raises(ModelFileError, match=f"config.json: {field}=.* is not supported"):
    hf.read_config(tmp_path)


def test_default_rope_and_transformers_5_fields_are_accepted():
  fields = hf.llama_fields({**TINY_HF, "rope_parameters": {"rope_type": "default", "rope_theta": 7.0}})
  assert fields["rope_theta"] == 7.0 and fields["rope_scaling"] is None
  # Both: a non-empty rope_scaling wins and rope_theta stays beside it (transformers 5.23.0 too).
  fields = hf.llama_fields({**TINY_HF, "rope_scaling": {"rope_type": "default"},
                            "rope_parameters": {"rope_type": "default", "rope_theta": 7.0}})
  assert fields["rope_theta"] == 500.0 and fields["rope_scaling"] is None
  bare = {k: TINY_HF[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                  "num_hidden_layers", "vocab_size")}
  fields = hf.llama_fields({**bare, "dtype": "bfloat16"})
  assert (fields["num_kv_heads"], fields["norm_eps"], fields["tie_embeddings"], fields["param_dtype"]) == (
      4, 1e-6, False, "bfloat16")
  with pytest.raises(ModelFileError, match="missing hidden_size"):
    hf.llama_fields({k: v for k, v in bare.items() if k != "hidden_size"})


def test_llama3_rope_is_read_from_every_transformers_layout():
  fields = hf.llama_fields(TINY_LLAMA3)  # transformers 4: rope_scaling beside rope_theta.
  assert fields["rope_theta"] == 500.0
  assert fields["rope_scaling"] == {"kind": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
  v5 = {k: v for k, v in TINY_HF.items() if k not in ("rope_theta", "rope_scaling")}
  assert hf.llama_fields({**v5, "rope_parameters": {**LLAMA3, "rope_theta": 500.0}}) == fields
  old_key = {"type": "llama3", **{k: v for k, v in LLAMA3.items() if k != "rope_type"}}
  assert hf.llama_fields({**TINY_HF, "rope_scaling": old_key}) == fields
  # No original_max_position_embeddings: max_position_embeddings, as transformers does.
  short = {k: v for k, v in LLAMA3.items() if k != "original_max_position_embeddings"}
  scaling = hf.llama_fields({**TINY_HF, "rope_scaling": short})["rope_scaling"]
  assert scaling["original_max_position_embeddings"] == TINY_HF["max_position_embeddings"]


def test_llama3_rope_scaling_round_trips_through_config_json(tmp_path):
  for layout, c in (("v4", TINY_LLAMA3), ("v5", {**TINY_HF, "rope_scaling": None,
                                                 "rope_parameters": {**LLAMA3, "rope_theta": 500.0}})):
    write_hf(tmp_path / layout, c, hf_weights(TINY_HF))
    config = DecoderConfig(**hf.read_config(tmp_path / layout))
    written = hf.hf_config(config)
    assert written["rope_scaling"] == LLAMA3 and written["rope_theta"] == 500.0, layout
    assert hf.llama_fields(written) == hf.read_config(tmp_path / layout)
  assert hf.hf_config(DecoderConfig())["rope_scaling"] is None


@pytest.mark.parametrize("rope, message", [
    ({"rope_type": "llama3", "factor": 8.0},
     "rope_scaling of rope_type 'llama3' has no low_freq_factor, high_freq_factor"),
    ({**LLAMA3, "high_freq_factor": 1.0}, "does not describe a valid model: field 'rope_scaling'"
     ".*high_freq_factor=1.0 must be greater than low_freq_factor=1.0"),
    ({**LLAMA3, "factor": -2.0}, r"does not describe a valid model: field 'rope_scaling.factor'"),
])
def test_a_bad_llama3_rope_scaling_is_named_in_one_line(tmp_path, rope, message):
  write_hf(tmp_path, {**TINY_HF, "rope_scaling": rope}, hf_weights(TINY_HF))
  with pytest.raises(ModelFileError, match=message) as raised:
    hf.read_config(tmp_path)
  assert "\n" not in str(raised.value)


def _corrupt(directory: pathlib.Path) -> None:
  (directory / "model.safetensors").write_bytes(b"\xff" * 8 + b"not a header")


def _renamed(directory: pathlib.Path) -> None:
  weights = load_file(str(directory / "model.safetensors"))
  weights["model.layers.1.mlp.gate_proj.weightt"] = weights.pop("model.layers.1.mlp.gate_proj.weight")
  save_file(weights, str(directory / "model.safetensors"))


def _reshaped(directory: pathlib.Path) -> None:
  weights = load_file(str(directory / "model.safetensors"))
  weights["model.layers.0.self_attn.k_proj.weight"] = np.zeros((24, 24), np.float32)
  save_file(weights, str(directory / "model.safetensors"))


def _extra(directory: pathlib.Path) -> None:
  weights = load_file(str(directory / "model.safetensors"))
  weights["model.layers.0.self_attn.q_proj.bias"] = np.zeros(32, np.float32)
  save_file(weights, str(directory / "model.safetensors"))


def _no_weights(directory: pathlib.Path) -> None:
  (directory / "model.safetensors").rename(directory / "pytorch_model.bin")


def _index_names_a_missing_shard(directory: pathlib.Path) -> None:
  (directory / "model.safetensors.index.json").write_text(
      json.dumps({"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}))


@pytest.mark.parametrize("damage, message", [
    (_corrupt, r"model.safetensors: not a readable safetensors file"),
    (_renamed, r"tensor 'model.layers.1.mlp.gate_proj.weight' is missing"),
    (_reshaped, r"tensor 'model.layers.0.self_attn.k_proj.weight' has shape \(24, 24\), "
                r"expected \(16, 24\)"),
    (_extra, r"unexpected tensor\(s\) 'model.layers.0.self_attn.q_proj.bias'"),
    (_no_weights, r"no model.safetensors and no model.safetensors.index.json; found pytorch_model.bin"),
    (_index_names_a_missing_shard, r"names model-00002-of-00002.safetensors, which does not exist"),
])
def test_bad_weights_are_named(tmp_path, damage, message):
  write_hf(tmp_path, TINY_HF, hf_weights(TINY_HF))
  damage(tmp_path)
  with pytest.raises(ModelFileError, match=message):
    hf.load_model(tmp_path)


def test_a_directory_without_config_is_named(tmp_path):
  with pytest.raises(ModelFileError, match="no config.json"):
    hf.read_config(tmp_path)
  with pytest.raises(ModelFileError, match="not a directory"):
    hf.read_config(tmp_path / "missing")


def test_save_refuses_a_non_empty_directory_and_leaves_it(tmp_path):
  model = Decoder(DecoderConfig(num_layers=1, d_model=16, num_heads=2, num_kv_heads=1, mlp_dim=16),
                rngs=nnx.Rngs(0))
  (tmp_path / "out").mkdir()
  (tmp_path / "out/keep.txt").write_text("mine")
  with pytest.raises(UsageError, match="already exists and is not an empty directory"):
    hf.save(model, tmp_path / "out")
  assert [p.name for p in (tmp_path / "out").iterdir()] == ["keep.txt"]
  assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # No staging left behind.


def test_loaded_parameters_have_their_target_sharding_on_8_devices(tmp_path):
  directory = write_hf(tmp_path, TINY_HF, hf_weights(TINY_HF), shards=2)
  result = run_on_devices("hf_load_onto_mesh", directory)
  assert result["same"] and result["equal"] and result["leaves"] == 21
  assert result["split"] == 21 - 5  # fsdp_tp splits all but the 5 norm scales ("norm").
  assert result["q_spec"] == ["fsdp", "tensor", None]


# ---- the commands --------------------------------------------------------------------

RUN = ["data.seq_len=16", "data.batch_size=2", "data.max_documents=20",
       "data.validation_fraction=0.2", "train.eval_batches=1", "train.progress=false",
       "train.sample_tokens=4", "optim.warmup_steps=1"]


WORDS = ["<unk>", "<s>", "</s>", "<pad>", "def", "return", "import", "self", "(", ")", ":", "=",
         "if", "else", "for", "in", "x", "y"]


def _tokenizer_file(path: pathlib.Path, words=tuple(WORDS)) -> None:
  """A small word-level tokenizer.json (BOS, EOS, PAD by default), as the tokenizers library writes."""
  import tokenizers
  from tokenizers import models, pre_tokenizers

  tok = tokenizers.Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.save(str(path))


def main(capsys, *args: str) -> tuple[int, str, str]:
  code = cli.main(list(args))
  out, err = capsys.readouterr()
  return code, out, err


def tree(path: pathlib.Path) -> dict:
  return {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in path.rglob("*")}


WORD_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} "
                 "{% if m['role'] == 'assistant' %}{{ eos_token }} {% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}assistant : {% endif %}")


@pytest.mark.slow
def test_an_imported_model_is_chat_tuned_with_its_tokenizer_s_own_template(tmp_path, capsys):
  """tokenizer_config.json's chat_template travels with tokenizer.json into the workdir,
  renders the chat data there, and goes out again with export-hf."""
  source = write_hf(tmp_path / "hf", TINY_HF, hf_weights(TINY_HF))
  _tokenizer_file(source / "tokenizer.json")
  (source / "tokenizer_config.json").write_text(json.dumps({"chat_template": WORD_TEMPLATE}))
  workdir = tmp_path / "run"
  code, _, err = main(capsys, "import-hf", str(source), "--workdir", str(workdir), *RUN)
  assert code == 0, err
  chats = tmp_path / "chats.jsonl"
  chats.write_text("".join(json.dumps({"prompt": f"def {'x' if i % 2 else 'y'} ( )",
                                       "completion": "return self"}) + "\n" for i in range(40)))
  code, out, err = main(capsys, "train", "--config", str(workdir / "config.yaml"), "--workdir",
                        str(workdir), "train.steps=2", "train.eval_every=2", "data.source=chat",
                        f"data.paths=[{chats}]", "train.sample_prompt=def x")
  assert code == 0, err
  assert (workdir / "tokenizer_config.json").is_file()
  assert f"note: chat template: {workdir / 'tokenizer_config.json'}'s chat_template" in err
  assert "sample:\nuser: def x" in out  # The end-of-run sample is a reply, in the template.
  code, out, err = main(capsys, "generate", "--workdir", str(workdir), "--chat", "--prompt",
                        "def y ( )", "--max-new-tokens", "3", "--temperature", "0")
  assert code == 0, err
  back = tmp_path / "back"
  assert main(capsys, "export-hf", "--workdir", str(workdir), str(back))[0] == 0
  assert json.loads((back / "tokenizer_config.json").read_text())["chat_template"] == WORD_TEMPLATE


QWEN_WORDS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>", *WORDS[4:]]
GEMMA_WORDS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", *WORDS[4:]]


QWEN_IDS = {"bos_token_id": None, "eos_token_id": 2, "pad_token_id": 0}


@pytest.mark.parametrize("words, ids, generation, exported_eos", [
    # Qwen3: EOS <|im_end|>, no BOS, PAD <|endoftext|>, which our tokenizer takes for its EOS
    # by name: the source's generation_config.json stops at 2 alone, and so does the export.
    (QWEN_WORDS, QWEN_IDS,
     {"bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 0, "top_k": 20}, 2),
    (QWEN_WORDS, QWEN_IDS,
     {"bos_token_id": 0, "eos_token_id": [2, 0], "pad_token_id": 0, "top_k": 20}, [2, 0]),
    # No generation_config.json: config.json's EOS, then the tokenizer's EOS and turn ends.
    (QWEN_WORDS, QWEN_IDS, None, [2, 0]),
    # Gemma 3: two EOS ids in config.json, no generation_config.json: ours lists the stops.
    (GEMMA_WORDS, {"bos_token_id": 2, "eos_token_id": [1, 5], "pad_token_id": 0}, None, [1, 5]),
], ids=["qwen", "qwen-two-stops", "qwen-without-generation-config", "gemma"])
def test_the_tokenizer_s_ids_travel_through_import_and_export_unchanged(
    tmp_path, capsys, words, ids, generation, exported_eos):
  """The export's generation_config.json is the source's, byte for byte in its values; and
  `generate` stops at the ids it lists (`end_ids`)."""
  source = write_hf(tmp_path / "hf", {**TINY_HF, **ids}, hf_weights(TINY_HF))
  _tokenizer_file(source / "tokenizer.json", words)
  if generation is not None:
    (source / "generation_config.json").write_text(json.dumps(generation))
  code, _, err = main(capsys, "import-hf", str(source), "--workdir", str(tmp_path / "run"), *RUN)
  assert code == 0, err
  code, _, err = main(capsys, "export-hf", "--workdir", str(tmp_path / "run"), str(tmp_path / "out"))
  assert code == 0, err
  config = json.loads((tmp_path / "out" / "config.json").read_text())
  assert {key: config[key] for key in ids} == ids
  exported = json.loads((tmp_path / "out" / "generation_config.json").read_text())
  assert exported == {**(generation or {key: v for key, v in ids.items() if v is not None}),
                      "eos_token_id": exported_eos}
  run_config = recipe_config.load(config_file=tmp_path / "run" / "config.yaml")
  stops = exported_eos if isinstance(exported_eos, list) else [exported_eos]
  assert LanguageModel(run_config).end_ids() == tuple(stops)


@pytest.mark.slow
def test_generate_stops_at_the_generation_config_s_eos_unless_told_to_ignore_it(
    tmp_path, capsys):
  """The imported run's generation_config.json names as EOS a token greedy decoding reaches
  at its k-th step: `generate --prompt` and `--input` stop there (its text left out), and
  with `--ignore-eos` go on to --max-new-tokens."""
  source = write_hf(tmp_path / "hf", TINY_HF, hf_weights(TINY_HF))
  _tokenizer_file(source / "tokenizer.json")
  workdir = tmp_path / "run"
  assert main(capsys, "import-hf", str(source), "--workdir", str(workdir), *RUN)[0] == 0
  trainer = train.Trainer.open_finished(workdir)
  try:
    tokenizer, (prompt, _) = trainer.task.tokenizer(), trainer.task.prompt_encoder()(
        {"prompt": "def x"})
    greedy = Engine(trainer.inference_model(), max_slots=1).run(
        [Request(tuple(int(t) for t in prompt), 8, temperature=0)])[0].tokens
  finally:
    trainer.close()
  k = next((i for i in range(1, 8) if greedy[i] not in greedy[:i]), 0)
  (workdir / "generation_config.json").write_text(json.dumps({"eos_token_id": greedy[k]}))
  flags = ["--workdir", str(workdir), "--max-new-tokens", "8", "--temperature", "0"]
  code, out, err = main(capsys, "generate", "--prompt", "def x", *flags)
  assert code == 0, err
  assert out == tokenizer.decode([*prompt, *greedy[:k]]) + "\n"
  requests = tmp_path / "requests.jsonl"
  requests.write_text(json.dumps({"prompt": "def x"}) + "\n")
  for ignore, (tokens, reason) in (([], (k + 1, "stop")), (["--ignore-eos"], (8, "length"))):
    code, out, err = main(capsys, "generate", "--input", str(requests), *flags, *ignore)
    assert code == 0, err
    result = json.loads(out)
    assert (result["tokens"], result["finish_reason"]) == (tokens, reason)
  code, out, err = main(capsys, "generate", "--prompt", "def x", "--ignore-eos", *flags)
  assert code == 0, err
  assert out == tokenizer.decode([*prompt, *greedy]) + "\n"


def test_a_tokenizer_without_source_ids_exports_its_own_and_its_turn_stops(tmp_path, capsys):
  source = write_hf(tmp_path / "hf", TINY_HF, hf_weights(TINY_HF))
  _tokenizer_file(source / "tokenizer.json", QWEN_WORDS)  # <|endoftext|> is EOS by its name.
  assert main(capsys, "import-hf", str(source), "--workdir", str(tmp_path / "run"), *RUN)[0] == 0
  assert main(capsys, "export-hf", "--workdir", str(tmp_path / "run"), str(tmp_path / "out"))[0] == 0
  config = json.loads((tmp_path / "out" / "config.json").read_text())
  assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (0, 0, 0)
  generation = json.loads((tmp_path / "out" / "generation_config.json").read_text())
  assert generation["eos_token_id"] == [0, 2]  # EOS, then <|im_end|>: where --chat stops.


def test_import_eval_generate_train_export_round_trip(tmp_path, capsys):
  source = write_hf(tmp_path / "hf", TINY_HF, hf_weights(TINY_HF), shards=2)
  _tokenizer_file(source / "tokenizer.json")
  workdir = tmp_path / "run"
  code, out, err = main(capsys, "import-hf", str(source), "--workdir", str(workdir), *RUN)
  assert code == 0, err
  assert "as step 0" in out and (workdir / "tokenizer.json").is_file()
  # Why the count is 4,224 over the source's (transformers'): as `train` says it.
  assert ("parameters, of which 4,224 in 88 rows of vocabulary padding (40 -> 128, "
          "model.vocab_multiple=128).") in out
  trainer = train.Trainer.open_finished(workdir)
  try:
    assert trainer.step == 0
    assert trainer.config.data.tokenizer_path == str(workdir / "tokenizer.json")
    logits = np.asarray(trainer.model(TOKENS[None]))[0]
  finally:
    trainer.close()
  assert np.abs(logits - reference_logits(hf_weights(TINY_HF), TINY_HF, TOKENS)).max() < TOLERANCE

  code, out, err = main(capsys, "eval", "--workdir", str(workdir))
  assert code == 0, err
  assert json.loads(out)["step"] == 0 and json.loads(out)["eval_loss"] > 0
  code, out, err = main(capsys, "generate", "--workdir", str(workdir), "--prompt", "def x",
                        "--max-new-tokens", "3", "--temperature", "0")
  assert code == 0, err
  assert out.startswith("def x")

  code, out, err = main(capsys, "export-hf", "--workdir", str(workdir), str(tmp_path / "back"),
                        "--max-shard-size", "5KB")
  assert code == 0, err
  back = tmp_path / "back"
  assert (back / "tokenizer.json").read_bytes() == (source / "tokenizer.json").read_bytes()
  exported = {}
  for file in back.glob("*.safetensors"):
    exported |= load_file(str(file))
  original = hf_weights(TINY_HF)
  assert exported.keys() == original.keys()
  assert all(np.array_equal(exported[k], original[k]) for k in original)
  assert json.loads((back / "config.json").read_text())["bos_token_id"] == 1

  # Fine-tuning continues from step 0 with the saved recipe.
  code, out, err = main(capsys, "train", "--config", str(workdir / "config.yaml"), "--workdir",
                        str(workdir), "train.steps=2", "train.eval_every=0")
  assert code == 0, err
  assert [r["step"] for r in train.read_metrics(workdir) if r["split"] == "train"] == [1, 2]


def _no_config(source):
  (source / "config.json").unlink()


def _bad_shape(source):
  _reshaped(source)


def _refused(source):
  (source / "config.json").write_text(json.dumps({**TINY_HF, "rope_scaling": {"rope_type": "dynamic"}}))


def _bad_llama3(source):
  (source / "config.json").write_text(json.dumps(
      {**TINY_HF, "rope_scaling": {**LLAMA3, "low_freq_factor": 5.0}}))


def _bad_tokenizer(source):
  (source / "tokenizer.json").write_text("{not json")


def _llama_style_tokenizer(source):
  """40 tokens (the model's vocabulary), BOS and EOS but no PAD, as Llama's and SmolLM's files."""
  _tokenizer_file(source / "tokenizer.json", ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(37)])


def _tokenizer_without_eos(source):
  """40 tokens and no EOS (so no PAD to reuse it for): the recipe would append ids 40 and 41."""
  _tokenizer_file(source / "tokenizer.json", ["<unk>", "<s>"] + [f"w{i}" for i in range(38)])


@pytest.mark.parametrize("damage, message", [
    (_no_config, "no config.json"),
    (_bad_shape, "'model.layers.0.self_attn.k_proj.weight' has shape"),
    (_refused, "rope_scaling="),
    (_bad_llama3, "high_freq_factor=4.0 must be greater than low_freq_factor=5.0"),
    (_corrupt, "not a readable safetensors file"),
    (_bad_tokenizer, "not a huggingface tokenizer file"),
    (_tokenizer_without_eos, "tokenizer.json needs 42 ids but "),
    (_tokenizer_without_eos, "config.json has vocab_size=40, which cannot embed ids 40 and up: "
                             "it defines no EOS/PAD"),
])
def test_import_of_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, capsys, damage, message):
  source = write_hf(tmp_path / "hf", TINY_HF, hf_weights(TINY_HF))
  _tokenizer_file(source / "tokenizer.json")
  damage(source)
  code, _, err = main(capsys, "import-hf", str(source), "--workdir", str(tmp_path / "run"), *RUN)
  assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
  assert not (tmp_path / "run").exists()


def test_import_of_a_tokenizer_without_pad_reuses_its_eos(tmp_path, capsys):
  source = write_hf(tmp_path / "hf", TINY_HF, hf_weights(TINY_HF))
  _llama_style_tokenizer(source)
  code, _, err = main(capsys, "import-hf", str(source), "--workdir", str(tmp_path / "run"), *RUN)
  assert code == 0, err


def test_import_refuses_a_used_workdir_and_export_a_used_out(tmp_path, capsys):
  source = write_hf(tmp_path / "hf", TINY_HF, hf_weights(TINY_HF))
  workdir = tmp_path / "run"
  workdir.mkdir()
  (workdir / "notes.txt").write_text("mine")
  code, _, err = main(capsys, "import-hf", str(source), "--workdir", str(workdir), *RUN)
  assert code == 2 and "is not empty" in err
  assert [p.name for p in workdir.iterdir()] == ["notes.txt"]

  code, _, err = main(capsys, "export-hf", "--workdir", str(tmp_path / "none"), str(workdir))
  assert code == 2 and "already exists and is not empty" in err
  assert [p.name for p in workdir.iterdir()] == ["notes.txt"]
  code, _, err = main(capsys, "export-hf", "--workdir", str(tmp_path / "none"), str(tmp_path / "o"),
                      "--max-shard-size", "big")
  assert code == 2 and "--max-shard-size 'big' is not a size" in err


def test_an_import_that_fails_after_creating_the_workdir_removes_it(tmp_path, capsys):
  """A corpus that is missing is found only when the run opens, after W was made."""
  source = write_hf(tmp_path / "hf", TINY_HF, hf_weights(TINY_HF))
  _tokenizer_file(source / "tokenizer.json")
  workdir = tmp_path / "run"
  code, _, err = main(capsys, "import-hf", str(source), "--workdir", str(workdir), *RUN,
                      "data.source=text", f"data.paths=[{tmp_path / 'missing.txt'}]")
  assert code == 2 and "missing.txt" in err, err
  assert not workdir.exists()


def test_an_import_without_tokenizer_json_needs_room_for_the_byte_tokenizer(tmp_path, capsys):
  source = write_hf(tmp_path / "hf", TINY_HF, hf_weights(TINY_HF))  # vocab_size 40 < 259 bytes.
  code, _, err = main(capsys, "import-hf", str(source), "--workdir", str(tmp_path / "run"), *RUN)
  assert code == 2 and (f"ByteTokenizer needs 259 ids but {source / 'config.json'} has "
                        "vocab_size=40, which cannot embed ids 40 and up") in err, err
  assert "has no tokenizer.json" in err and not (tmp_path / "run").exists()


def test_import_notes_a_tokenizer_smaller_than_the_model_once_in_one_line(tmp_path, capsys):
  """18 ids on 40 rows (the issue: 1,000 on Qwen's 151,936): the rest is only padding."""
  source = write_hf(tmp_path / "hf", TINY_HF, hf_weights(TINY_HF))
  _tokenizer_file(source / "tokenizer.json")
  code, _, err = main(capsys, "import-hf", str(source), "--workdir", str(tmp_path / "run"), *RUN)
  notes = [line for line in err.splitlines() if line.startswith("note: ")]
  assert code == 0 and notes == [
      f"note: {source / 'tokenizer.json'} has 18 ids and {source / 'config.json'} has "
      "vocab_size=40: the model's 22 rows beyond them are only padding (an id generated there "
      "decodes to no text)"], err
  _tokenizer_file(source / "tokenizer.json", WORDS + [f"w{i}" for i in range(22)])  # 40 ids.
  code, _, err = main(capsys, "import-hf", str(source), "--workdir", str(tmp_path / "other"), *RUN)
  assert code == 0 and "only padding" not in err, err


def test_import_refuses_a_finetune_base(tmp_path, capsys):
  source = write_hf(tmp_path / "hf", TINY_HF, hf_weights(TINY_HF))
  _tokenizer_file(source / "tokenizer.json")
  code, _, err = main(capsys, "import-hf", str(source), "--workdir", str(tmp_path / "run"), *RUN,
                      f"finetune.base={tmp_path}")
  assert code == 2 and "not from finetune.base" in err, err
  assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("tied, scaled", [(False, False), (True, False), (False, True)])
def test_a_model_made_by_transformers_imports_and_exports_with_its_logits(tmp_path, tied, scaled):
  """Against transformers itself, where it is installed (not a dependency: it needs torch).

  Checked by hand with transformers 5.23.0 and torch 2.13.0+cpu: 2e-7 on import, 0 on export.
  `scaled`: Llama 3.1's RoPE scaling, which transformers 5 saves as `rope_parameters` and
  our export writes as `rope_scaling` (the layout of Meta's files), on a sequence past
  original_max_position_embeddings.
  """
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  rope = {"rope_parameters": {**LLAMA3, "rope_theta": 500.0}} if scaled else {}
  config = transformers.DecoderConfig(
      vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
      tie_word_embeddings=tied, **rope)
  torch.manual_seed(0)
  made = transformers.LlamaForCausalLM(config).eval()
  with torch.no_grad():
    for parameter in made.parameters():
      parameter.normal_(0, 0.2)  # Not the tiny init: logits of a visible size.
  made.save_pretrained(tmp_path / "made", safe_serialization=True)
  tokens = (LONG if scaled else TOKENS)[None] % 64
  with torch.no_grad():
    expected = made(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
  model = hf.load_model(tmp_path / "made")
  assert np.abs(np.asarray(model(tokens)) - expected).max() < TOLERANCE
  if scaled:  # Without the scaling, the check above fails (by 0.012 with these weights).
    assert model.config.rope_scaling == RopeScaling(original_max_position_embeddings=32)
    plain = hf.load_model(tmp_path / "made", rope_scaling=None)
    assert np.abs(np.asarray(plain(tokens)) - expected).max() > 30 * TOLERANCE
  hf.save(model, tmp_path / "back")
  back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "back").eval()
  with torch.no_grad():
    again = back(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
  assert np.abs(again - expected).max() < TOLERANCE


def test_generate_encodes_a_prompt_with_the_bos_its_tokenizer_adds(tmp_path, monkeypatch):
  """Gemma's tokenizer.json adds <bos> in its post-processor: transformers' prompt ids."""
  import tokenizers
  from tokenizers import processors

  from jax_ai_stack.recipes import config as config_lib
  from jax_ai_stack.recipes import tasks

  path = tmp_path / "tokenizer.json"
  _tokenizer_file(path, GEMMA_WORDS)
  tok = tokenizers.Tokenizer.from_file(str(path))
  tok.post_processor = processors.TemplateProcessing(single="<bos> $A",
                                                     special_tokens=[("<bos>", 2)])
  tok.save(str(path))
  task = tasks.for_config(config_lib.load("lm-tiny", overrides=[
      "data.tokenizer=huggingface", f"data.tokenizer_path={path}", "model.vocab_size=40"]))
  seen = []

  class Seen(Exception):
    """The prompt's ids are all this test reads: it stops before the engine."""

  def requests(prompts, *args):
    seen.extend(prompts)
    raise Seen

  monkeypatch.setattr(task, "_requests", requests)
  with pytest.raises(Seen):
    task.generate(None, "def x", 1, 0.0, 0)
  assert seen[0].tolist() == [2, GEMMA_WORDS.index("def"), GEMMA_WORDS.index("x")]
