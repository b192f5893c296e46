"""The decoder families (Qwen2, Qwen3, Mistral, Gemma 2, Gemma 3, Mixtral, Qwen3-MoE, OLMo 2,
OLMo 3, SmolLM3, Phi-3, Qwen2-MoE, GPT-OSS) against transformers' outputs.

The reference files in tests/references/hf/ were written by
scripts/make_hf_references.py with transformers (which CI does not install):
tiny random checkpoints whose configs turn on every switch of their family,
their float32 logits on fixed tokens (longer than each sliding window) and
their greedy continuation of a prompt.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_ai_stack.errors import ModelFileError
from jax_ai_stack.recipes.models import hf, layer_stack
from jax_ai_stack.recipes.models.configs import DecoderConfig
from jax_ai_stack.recipes.models.decoding import generate
from jax_ai_stack.recipes.models.decoder import Decoder
from multidevice import run_on_devices

REFERENCES = pathlib.Path(__file__).parent / "references" / "hf"
FAMILIES = ["qwen2", "qwen3", "mistral", "gemma2", "gemma3", "gemma3-conditional", "mixtral",
            "qwen3_moe", "olmo2", "olmo3", "smollm3", "phi3", "qwen2_moe", "gpt_oss", "olmo3-yarn",
            "llama4", "deepseek_v3", "deepseek_v3-moe", "qwen3_next"]
CAUSAL = [name for name in FAMILIES if name != "gemma3-conditional"]
ATOL = 1e-4
"""float32 logits of about 5 in magnitude, summed in another order than torch's."""


def _reference(name: str) -> dict[str, np.ndarray]:
  return dict(np.load(REFERENCES / name / "reference.npz"))


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
  name = request.param
  return name, hf.load_model(REFERENCES / name), _reference(name)


def test_logits_and_greedy_tokens_equal_transformers(family):
  name, model, ref = family
  logits = np.asarray(model(jnp.asarray(ref["tokens"])))
  np.testing.assert_allclose(logits, ref["logits"], atol=ATOL, rtol=0, err_msg=name)
  new = ref["greedy"].shape[1] - ref["prompt"].shape[1]
  greedy = generate(model, jnp.asarray(ref["prompt"]), new, temperature=0, rng=jax.random.key(0))
  np.testing.assert_array_equal(np.asarray(greedy), ref["greedy"], err_msg=name)


def test_each_reference_exercises_its_family_s_switches():
  """The references would tell a missing switch apart: each is on in some config."""
  configs = {name: hf.load_model(REFERENCES / name).config for name in CAUSAL}
  seq_len = _reference("qwen2")["tokens"].shape[1]
  assert configs["qwen2"].qkv_bias and set(configs["qwen2"].layer_types) == {"full", "sliding"}
  assert configs["qwen3"].qk_norm and configs["qwen3"].head_dim == 12
  assert configs["mistral"].resolved_layer_types == ("sliding",) * 2
  gemma2, gemma3 = configs["gemma2"], configs["gemma3"]
  assert gemma2.attn_logit_softcap and gemma2.final_logit_softcap and gemma2.post_norms
  assert gemma2.query_pre_attn_scalar != gemma2.resolved_head_dim
  assert gemma3.qk_norm and gemma3.local_rope_theta != gemma3.rope_theta
  assert gemma3.rope_scaling.kind == "linear" and gemma3.layer_types.count("full") == 1
  assert all(c.sliding_window < seq_len for c in configs.values() if c.sliding_window)
  mixtral, qwen3_moe = configs["mixtral"], configs["qwen3_moe"]
  assert mixtral.moe.norm_topk_prob and all(mixtral.moe_layers) and mixtral.sliding_window
  assert not qwen3_moe.moe.norm_topk_prob and qwen3_moe.moe_layers == (True, False, True)
  assert qwen3_moe.expert_mlp_dim != qwen3_moe.mlp_dim and qwen3_moe.qk_norm
  for olmo in (configs["olmo2"], configs["olmo3"]):
    assert not olmo.pre_norms and olmo.post_norms and olmo.qk_norm_scope == "projection"
  olmo3 = configs["olmo3"]
  assert olmo3.layer_types.count("full") == 1 and olmo3.local_rope_theta != olmo3.rope_theta
  assert olmo3.rope_scaling.kind == "linear"
  smollm3 = configs["smollm3"]
  assert smollm3.nope_layers == (1,) and smollm3.layer_types[1] == "sliding"
  phi3 = configs["phi3"]
  scaling = phi3.rope_scaling
  assert scaling.kind == "longrope" and scaling.short_factor != scaling.long_factor
  assert scaling.attention_factor > 1 and phi3.sliding_window and phi3.rotary_dim == 6
  # The logits' tokens reach past Phi-3's original context (long factors), the greedy
  # continuation does not (short factors).
  assert _reference("phi3")["greedy"].shape[1] <= scaling.original_max_position_embeddings < (
      seq_len)
  qwen2_moe = configs["qwen2_moe"]
  assert qwen2_moe.moe.shared_expert_dim not in (None, qwen2_moe.mlp_dim, qwen2_moe.expert_mlp_dim)
  assert qwen2_moe.moe.shared_expert_gate and qwen2_moe.qkv_bias and qwen2_moe.moe.norm_topk_prob
  assert qwen2_moe.moe_layers == (True, False, True) and "sliding" in qwen2_moe.layer_types
  gpt_oss = configs["gpt_oss"]
  assert gpt_oss.attention_sinks and gpt_oss.qkv_bias and gpt_oss.o_proj_bias
  assert gpt_oss.layer_types == ("sliding", "full") and gpt_oss.rope_scaling.kind == "yarn"
  assert not gpt_oss.rope_scaling.truncate
  moe = gpt_oss.moe
  assert moe.router_bias and moe.expert_bias and moe.interleaved_gate_up
  assert moe.expert_activation == "clamped_swiglu" and moe.swiglu_limit == 0.5
  llama4 = configs["llama4"]
  assert llama4.layer_types == ("chunked", "chunked", "full", "chunked")
  assert llama4.attention_chunk_size < seq_len and llama4.nope_layers == (2,)
  assert llama4.qk_l2_norm and llama4.nope_temperature == (4.0, 0.5)
  assert llama4.rope_scaling.kind == "llama3" and llama4.moe_layers == (False, True) * 2
  moe = llama4.moe
  assert moe.router_score == "sigmoid" and moe.weight_inputs
  assert moe.num_experts_per_tok == 1 and moe.shared_expert_dim == llama4.expert_mlp_dim
  assert llama4.expert_mlp_dim != llama4.mlp_dim
  qwen3_next = configs["qwen3_next"]
  assert qwen3_next.layer_types == ("linear", "full", "linear")
  assert qwen3_next.attention_output_gate and qwen3_next.norm_offset == 1.0
  assert qwen3_next.rotary_dim == qwen3_next.resolved_head_dim // 4
  assert qwen3_next.moe_layers == (True, True, False) and qwen3_next.moe.shared_expert_gate
  assert qwen3_next.linear_attention.num_value_heads > qwen3_next.linear_attention.num_key_heads


def _with(config: DecoderConfig, **changes) -> DecoderConfig:
  """`config` with switches changed past the kind's checks (a model no checkpoint has)."""
  changed = copy.copy(config)
  for name, value in changes.items():
    object.__setattr__(changed, name, value)
  return changed


@pytest.mark.parametrize("name, changes", [
    ("qwen2", dict(layer_types=None, sliding_window=None)),
    ("mistral", dict(sliding_window=None)),
    ("gemma2", dict(attn_logit_softcap=None)),
    ("gemma2", dict(final_logit_softcap=None)),
    ("gemma2", dict(query_pre_attn_scalar=None)),
    ("gemma2", dict(norm_offset=0.0)),
    ("gemma2", dict(embed_scale=False)),
    ("gemma2", dict(mlp_activation="silu")),
    ("gemma3", dict(local_rope_theta=None)),
    ("gemma3", dict(rope_scaling=None)),
    ("olmo3", dict(local_rope_theta=None)),
    ("smollm3", dict(nope_layers=())),
    ("phi3", dict(rope_scaling=None)),
    ("phi3", dict(sliding_window=None)),
    ("gpt_oss", dict(rope_scaling=None)),
    ("llama4", dict(attention_chunk_size=None, layer_types=None)),
    ("llama4", dict(qk_l2_norm=False)),
    ("llama4", dict(nope_temperature=None)),
    ("llama4", dict(rope_scaling=None)),
    ("qwen3_next", dict(rotary_dim=None)),
    ("qwen3_next", dict(norm_offset=0.0)),
])
def test_turning_a_switch_off_moves_the_logits_far_past_the_tolerance(name, changes):
  model = hf.load_model(REFERENCES / name)
  other = nnx.eval_shape(lambda: Decoder(_with(model.config, **changes), rngs=nnx.Rngs(0)))
  nnx.update(other, nnx.state(model))
  tokens = jnp.asarray(_reference(name)["tokens"])
  assert float(jnp.abs(other(tokens) - model(tokens)).max()) > 100 * ATOL


@pytest.mark.parametrize("change", ["correction", "groups", "scale", "mscale", "mscale_all_dim"])
def test_deepseek_s_routing_and_yarn_mscale_each_move_the_logits(change):
  """The DeepSeek-V3 MoE reference routes within groups by corrected sigmoid scores, scales
  the routed weights and uses YaRN's two mscales: each, undone, moves the logits."""
  model = hf.load_model(REFERENCES / "deepseek_v3-moe")
  config = model.config
  moe, rope = config.moe, config.rope_scaling
  changes = {"correction": {}, "scale": dict(moe=dataclasses.replace(moe, routed_scale=1.0)),
             "groups": dict(moe=dataclasses.replace(moe, router_groups=1, router_topk_groups=1)),
             "mscale": dict(rope_scaling=dataclasses.replace(rope, mscale=None)),
             "mscale_all_dim": dict(rope_scaling=dataclasses.replace(rope, mscale_all_dim=None))}
  other = nnx.eval_shape(lambda: Decoder(_with(config, **changes[change]), rngs=nnx.Rngs(0)))
  nnx.update(other, nnx.state(model))
  if change == "correction":
    for layer in (1, 2):
      assert float(jnp.abs(other.layers[layer].mlp.correction_bias[...]).max()) > 0
      other.layers[layer].mlp.correction_bias[...] = jnp.zeros(moe.num_experts)
  tokens = jnp.asarray(_reference("deepseek_v3-moe")["tokens"])
  assert float(jnp.abs(other(tokens) - model(tokens)).max()) > 100 * ATOL


def test_a_deepseek_model_its_layout_cannot_hold_is_refused_at_export(tmp_path):
  """DeepSeek's config.json states its dense layers as a count of the first ones and its shared
  experts as a count of routed experts' widths: other models are refused, naming why."""
  from jax_ai_stack.errors import ConfigError

  model = hf.load_model(REFERENCES / "deepseek_v3-moe")
  moe = model.config.moe
  for change in (dict(dense_layers=(1,)), dict(shared_expert_dim=24)):
    config = dataclasses.replace(model.config, moe=dataclasses.replace(moe, **change))
    with pytest.raises(ConfigError, match="DeepSeek-V3's layout has its dense layers first"):
      hf.hf_config(config)


def test_deepseek_s_multi_token_prediction_layers_are_left_out_and_said(tmp_path, capsys):
  """DeepSeek-V3's release holds its MTP layer as `layers.{num_hidden_layers}.*`: import reads
  the decoder's layers, names what it leaves, and refuses the same tensor in another family."""
  import safetensors.numpy
  import tokenizers

  from jax_ai_stack import cli

  directory = _copy_reference("deepseek_v3-moe", tmp_path, num_nextn_predict_layers=1)
  weights = safetensors.numpy.load_file(str(directory / "model.safetensors"))
  weights["model.layers.3.eh_proj.weight"] = np.ones((32, 64), np.float32)
  weights["model.layers.3.enorm.weight"] = np.ones(32, np.float32)
  safetensors.numpy.save_file(weights, str(directory / "model.safetensors"))
  logits = hf.load_model(directory)(jnp.asarray(_reference("deepseek_v3-moe")["tokens"]))
  np.testing.assert_allclose(logits, _reference("deepseek_v3-moe")["logits"], atol=ATOL, rtol=0)
  words = ["<unk>", "def", "return", "(", ")", ":", "x"]
  tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(
      {w: i for i, w in enumerate(words)}, unk_token="<unk>"))
  tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  tokenizer.save(str(directory / "tokenizer.json"))
  capsys.readouterr()
  assert cli.main(["import-hf", str(directory), "--workdir", str(tmp_path / "run"),
                   "data.seq_len=16", "data.max_documents=20", "data.batch_size=2",
                   "train.progress=false"]) == 0
  assert ("2 tensors of multi-token prediction layers (from 'model.layers.3.eh_proj.weight') "
          "are not read") in capsys.readouterr().err
  other = _copy_reference("qwen3_moe", tmp_path)
  weights = safetensors.numpy.load_file(str(other / "model.safetensors"))
  weights["model.layers.3.enorm.weight"] = np.ones(32, np.float32)
  safetensors.numpy.save_file(weights, str(other / "model.safetensors"))
  with pytest.raises(ModelFileError, match="unexpected tensor.*model.layers.3.enorm.weight"):
    hf.load_model(other)


def test_qwen2_moe_s_shared_expert_and_its_gate_move_the_logits():
  model = hf.load_model(REFERENCES / "qwen2_moe")
  tokens = jnp.asarray(_reference("qwen2_moe")["tokens"])
  before = model(tokens)
  gate = model.layers[0].mlp.shared_expert_gate.kernel
  gate[...] = jnp.full_like(gate[...], 100.0)  # sigmoid -> 1: the ungated shared expert.
  ungated = model(tokens)
  down = model.layers[0].mlp.shared_expert.down_proj.kernel
  down[...] = jnp.zeros_like(down[...])  # No shared expert.
  assert float(jnp.abs(ungated - before).max()) > 100 * ATOL
  assert float(jnp.abs(model(tokens) - ungated).max()) > 100 * ATOL


@pytest.mark.parametrize("change", ["sinks", "o_proj bias", "clamp", "expert biases",
                                    "router bias"])
def test_gpt_oss_s_sinks_biases_and_clamp_move_the_logits(change):
  """Each of GPT-OSS's switches shows in the reference's logits: sinks at -1e9 (no sink),
  a zero bias, or a clamp out of reach."""
  model = hf.load_model(REFERENCES / "gpt_oss")
  tokens = jnp.asarray(_reference("gpt_oss")["tokens"])
  before = model(tokens)
  for block in model.layers:
    attention, moe = block.attention, block.mlp
    params = {"sinks": [attention.sinks], "o_proj bias": [attention.o_proj.bias],
              "expert biases": [moe.gate_up_proj_bias, moe.down_proj_bias],
              "router bias": [moe.router.bias], "clamp": []}[change]
    for param in params:
      param[...] = jnp.full_like(param[...], -1e9 if change == "sinks" else 0.0)
    if change == "clamp":
      moe.swiglu = (moe.swiglu[0], 1e9)
  assert float(jnp.abs(model(tokens) - before).max()) > 100 * ATOL


def test_a_bfloat16_gpt_oss_checkpoint_imports(tmp_path):
  """GPT-OSS's own release dtype: the reference's tensors in bfloat16 load as a bfloat16
  model whose logits are the float32 reference's, within bfloat16's precision."""
  import ml_dtypes
  import safetensors.numpy

  directory = _copy_reference("gpt_oss", tmp_path, dtype="bfloat16")
  weights = safetensors.numpy.load_file(str(directory / "model.safetensors"))
  safetensors.numpy.save_file({name: array.astype(ml_dtypes.bfloat16)
                               for name, array in weights.items()},
                              str(directory / "model.safetensors"))
  model = hf.load_model(directory)
  assert model.config.param_dtype == model.config.dtype == "bfloat16"
  assert model.layers[0].mlp.gate_up_proj[...].dtype == jnp.bfloat16
  ref = _reference("gpt_oss")
  logits = np.asarray(model(jnp.asarray(ref["tokens"])))
  assert np.abs(logits - ref["logits"]).max() < 0.25, np.abs(logits - ref["logits"]).max()


def test_zero_biases_move_qwen2_s_logits():
  model = hf.load_model(REFERENCES / "qwen2")
  tokens = jnp.asarray(_reference("qwen2")["tokens"])
  before = model(tokens)
  for projection in ("q_proj", "k_proj", "v_proj"):
    for block in model.layers:
      bias = getattr(block.attention, projection).bias
      bias[...] = jnp.zeros_like(bias[...])
  assert float(jnp.abs(model(tokens) - before).max()) > 100 * ATOL


def test_kv_cache_decoding_equals_the_full_forward_pass(family):
  """Prefill, then one token at a time past every sliding window: the full pass's logits."""
  name, model, ref = family
  tokens = jnp.asarray(ref["tokens"])
  if (scaling := model.config.rope_scaling) is not None and scaling.kind == "longrope":
    # LongRoPE's factors follow the longest position of a call: the cache's keys of the
    # first positions were rotated by the short ones, a full pass's by the long ones.
    tokens = tokens[:, :scaling.original_max_position_embeddings]
  cache = model.init_cache(tokens.shape[0], model.config.max_seq_len)
  logits, cache = model.decode(tokens[:, :4], cache)
  steps = [logits]
  for i in range(4, tokens.shape[1]):
    logits, cache = model.decode(tokens[:, i:i + 1], cache)
    steps.append(logits)
  # A gated DeltaNet's full pass runs in chunks (a triangular solve), its decoding token by
  # token: the same sums in another order, each layer's output then RMS-normed.
  atol = ATOL if "linear" in model.config.resolved_layer_types else 1e-5
  np.testing.assert_allclose(np.concatenate(steps, axis=1), np.asarray(model(tokens)),
                             atol=atol, rtol=0, err_msg=name)


def test_the_safetensors_round_trip_is_exact(family, tmp_path):
  name, model, _ = family
  hf.save(model, tmp_path / "out")
  again = hf.load_model(tmp_path / "out")
  assert again.config == model.config
  for (path, a), (_, b) in zip(jax.tree_util.tree_leaves_with_path(nnx.state(model)),
                               jax.tree_util.tree_leaves_with_path(nnx.state(again))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"{name} {path}")
  written = json.loads((tmp_path / "out" / "config.json").read_text())
  family_ = hf.families.for_kind(model.config.kind)
  assert written["architectures"] == [family_.architecture]
  assert written["model_type"] == family_.model_type
  # The text tensors keep their names and values (a conditional checkpoint's text model
  # is written as the causal LM).
  original = hf.read_index(REFERENCES / name)
  exported = hf.read_index(tmp_path / "out")
  prefix = hf.layout.text_prefix(original)
  import safetensors.numpy
  theirs = safetensors.numpy.load_file(str(REFERENCES / name / "model.safetensors"))
  ours = safetensors.numpy.load_file(str(tmp_path / "out" / "model.safetensors"))
  for tensor in hf.tensors(model.config):
    source = prefix + tensor.name[len("model."):] if tensor.name.startswith("model.") else (
        hf.layout.head_name(prefix))
    assert exported[tensor.name].shape == original[source].shape
    np.testing.assert_array_equal(ours[tensor.name], theirs[source], err_msg=tensor.name)


@pytest.mark.slow
def test_every_family_on_8_devices_under_fsdp_tp_equals_one_device():
  """Each reference checkpoint read straight onto 8 fake devices (each tensor placed
  by the rule set, as a fine-tuning run's import does): its logits and the
  gradient of a next-token loss equal the one-device model's, and q_proj is split.
  Every family under fsdp_tp (data x fsdp x tensor, so both of its splits); the first
  under fsdp too (test_sharding trains under each rule set).

  Not bitwise: a sharded matmul sums in another order (partial sums, then an
  all-reduce), so float32 results differ in the last bits. And XLA never replicates
  an array to split it again ("Involuntary full rematerialization"): it did with the
  embedding's rows under data x fsdp x tensor (looked up in a table split along
  d_model) and with a MoE layer's tokens (sorted by expert across the devices).
  """
  results, stderr = run_on_devices("families_on_mesh", CAUSAL, REFERENCES, with_stderr=True)
  assert "Involuntary full rematerialization" not in stderr, stderr
  assert len(results) == len(CAUSAL) + 1
  for name, result in results.items():
    assert result["devices"] == 8, name
    # Qwen3-Next's DeltaNet carries a state over the 96 tokens, so the last bits of a sharded
    # matmul travel on in it: 2.3e-5 here (its one-device logits are transformers' to 2e-5).
    assert result["logits"] < (5e-5 if name.startswith("qwen3_next") else 1e-5), (name, result)
    assert result["grads"] < 1e-4, (name, result)
    expected = ["fsdp", "tensor"] if name.endswith("fsdp_tp") else ["fsdp"]
    spec = result["q_proj"]
    while spec and spec[-1] is None:  # PartitionSpec may or may not keep trailing Nones.
      spec = spec[:-1]
    assert spec == expected, name


def test_a_scanned_stack_of_identical_sliding_layers_equals_the_unrolled_one():
  model = hf.load_model(REFERENCES / "mistral")
  scanned = hf.load_model(REFERENCES / "mistral", scan_layers=True)
  tokens = jnp.asarray(_reference("mistral")["tokens"])
  np.testing.assert_allclose(np.asarray(scanned(tokens)), np.asarray(model(tokens)), atol=1e-5)
  assert layer_stack.unrolled(scanned).config == model.config


def test_mixed_layer_types_refuse_a_scanned_stack():
  with pytest.raises(ModelFileError, match="scan_layers needs identical blocks"):
    try:
      hf.load_model(REFERENCES / "gemma2", scan_layers=True)
    except ValueError as e:  # pydantic's ValidationError, one line of it.
      raise ModelFileError(str(e)) from None


def _copy_reference(name: str, tmp_path: pathlib.Path, **config_changes) -> pathlib.Path:
  directory = tmp_path / name
  directory.mkdir()
  for file in ("model.safetensors",):
    (directory / file).write_bytes((REFERENCES / name / file).read_bytes())
  config = json.loads((REFERENCES / name / "config.json").read_text())
  (directory / "config.json").write_text(json.dumps({**config, **config_changes}))
  return directory


@pytest.mark.parametrize("name, changes, message", [
    ("qwen3", {"architectures": ["MambaForCausalLM"]},
     r"architectures=\['MambaForCausalLM'\] is not supported: supported: LlamaForCausalLM, "
     r"Qwen2ForCausalLM"),
    ("deepseek_v3", {"rope_interleave": False}, "rope_interleave=False is not supported"),
    ("deepseek_v3", {"attention_bias": True}, "attention_bias=True is not supported"),
    ("deepseek_v3-moe", {"scoring_func": "softmax"}, "scoring_func='softmax' is not supported: "
     "DeepSeek-V3's routing \\(scoring_func='sigmoid'\\) is the one implemented"),
    ("deepseek_v3-moe", {"quantization_config": {"quant_method": "fp8"}},
     r"quantization_config.quant_method='fp8' is not supported: its weights are FP8 blocks.*"
     r"FineGrainedFP8Config\(dequantize=True\)"),
    ("deepseek_v3-moe", {"topk_method": "greedy"}, "topk_method='greedy' is not supported"),
    ("deepseek_v3-moe", {"n_shared_experts": 0}, "n_shared_experts=0 is not supported"),
    ("deepseek_v3-moe", {"n_group": 3}, "moe.router_groups=3 must split moe.num_experts=8 into "
     "equal groups"),
    ("mixtral", {"router_jitter_noise": 0.1},
     "router_jitter_noise=0.1 is not supported: the router here adds no noise"),
    ("qwen3_moe", {"num_experts_per_tok": 5}, "moe.num_experts_per_tok=5 is above moe.num_experts=4"),
    ("qwen3", {"rope_parameters": {"rope_type": "dynamic", "factor": 4.0}},
     "rope_parameters=.* is not supported: of the RoPE types only default, llama3, linear, "
     "longrope, yarn"),
    ("gpt_oss", {"quantization_config": {"quant_method": "mxfp4"}},
     r"quantization_config.quant_method='mxfp4' is not supported: its expert weights are MXFP4 "
     r"blocks.*Mxfp4Config\(dequantize=True\)"),
    ("gemma2", {"hidden_activation": "gelu"}, "hidden_activation='gelu' is not supported"),
    ("qwen2_moe", {"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ("gemma2", {"use_bidirectional_attention": True},
     "use_bidirectional_attention=True is not supported: the decoder is causal"),
    ("gemma2", {"layer_types": ["full_attention", "chunked_attention"] * 2},
     "layer_types=.* is not supported: expected one of full_attention or sliding_attention"),
    ("mistral", {"sliding_window_size": 7},
     "sliding_window_size=7 is not supported: MistralForCausalLM's reader does not know this "
     "key"),
    ("gemma3-conditional", {"audio_config": {}},
     "audio_config=.* is not supported: not a key of Gemma3ForConditionalGeneration"),
    ("olmo2", {"attention_bias": True}, "attention_bias=True is not supported: the model has no "
     "biases"),
    ("olmo3", {"rope_parameters": {"full_attention": {"rope_type": "dynamic", "factor": 8.0},
                                   "sliding_attention": {"rope_type": "default"}}},
     r"rope_parameters.full_attention=\{'rope_type': 'dynamic'.* is not supported: of the RoPE "
     "types only default, llama3, linear, longrope, yarn"),
    ("smollm3", {"no_rope_layers": [1, 2, 1, 1]},
     r"no_rope_layers=\[1, 2, 1, 1\] is not supported: expected a 1 \(RoPE\) or 0 \(NoPE\)"),
    ("qwen3", {"rope_parameters": {"rope_theta": 10_000.0, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor=0.5 is not supported: Qwen3ForCausalLM turns every feature"),
    ("phi3", {"resid_pdrop": 0.1}, "resid_pdrop=0.1 is not supported: the model has no dropout"),
    ("llama4", {"attention_bias": True}, "attention_bias=True is not supported: Llama 4's text "
     "model has neither"),
    ("llama4", {"router_jitter_noise": 0.1}, "router_jitter_noise=0.1 is not supported"),
    ("llama4", {"layer_types": ["sliding_attention"] * 4}, "layer_types=.* is not supported: "
     "expected full_attention or chunked_attention"),
])
def test_bad_config_keys_and_values_are_named_in_one_line(tmp_path, name, changes, message):
  directory = _copy_reference(name, tmp_path, **changes)
  with pytest.raises(ModelFileError, match=message) as error:
    hf.read_config(directory)
  assert "\n" not in str(error.value) and str(directory / "config.json") in str(error.value)


def test_llama4_s_text_and_vision_checkpoint_reads_its_text_model(tmp_path):
  """Llama4ForConditionalGeneration as transformers 5.24 saves it (config.json's text_config;
  `language_model.model.*`, `language_model.lm_head`, `vision_model.*`, `multi_modal_projector.*`),
  made here from the Llama 4 reference: the text model's logits are the reference's."""
  import safetensors.numpy

  text = json.loads((REFERENCES / "llama4" / "config.json").read_text())
  config = {"architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4",
            "text_config": text, "vision_config": {"hidden_size": 16}, "boi_token_index": 90,
            "eoi_token_index": 91, "image_token_index": 92, "tie_word_embeddings": False}
  (tmp_path / "config.json").write_text(json.dumps(config))
  weights = safetensors.numpy.load_file(str(REFERENCES / "llama4" / "model.safetensors"))
  weights = {"language_model." + name: array for name, array in weights.items()}
  weights["vision_model.class_embedding"] = np.zeros(16, np.float32)
  weights["multi_modal_projector.linear_1.weight"] = np.zeros((32, 16), np.float32)
  safetensors.numpy.save_file(weights, str(tmp_path / "model.safetensors"))
  model, ref = hf.load_model(tmp_path), _reference("llama4")
  np.testing.assert_allclose(np.asarray(model(jnp.asarray(ref["tokens"]))), ref["logits"],
                             atol=ATOL, rtol=0)


def test_a_tensor_of_the_wrong_shape_names_itself_and_both_shapes(tmp_path):
  directory = _copy_reference("qwen2", tmp_path, intermediate_size=48)
  with pytest.raises(ModelFileError, match=r"tensor 'model.layers.0.mlp.gate_proj.weight' has "
                     r"shape \(64, 32\), expected \(48, 32\)"):
    hf.load_model(directory)


@pytest.mark.parametrize("kind, fields, message", [
    ("llama", dict(qk_norm=True), "qk_norm=True does not go with kind='llama'.* qwen3, gemma3, qwen3_moe"),
    ("gemma2", dict(norm_offset=0.0), "norm_offset=0.0 does not go with kind='gemma2'"),
    ("mistral", dict(layer_types=("full",) * 4), "layer_types=.* does not go with kind='mistral'"),
    ("gemma3", dict(layer_types=("sliding", "full")), "layer_types has 2 entries; num_layers=4"),
    ("qwen2", dict(layer_types=("full", "sliding") * 2), "sliding_window is not set"),
    ("llama", dict(attention_chunk_size=8), "attention_chunk_size=8 does not go with kind="
     "'llama'.* llama4"),
    ("qwen2", dict(layer_types=("full", "chunked") * 2), "attention_chunk_size is not set"),
    ("qwen3", dict(qk_l2_norm=True), "qk_l2_norm=True does not go with kind='qwen3'"),
])
def test_a_switch_the_kind_cannot_express_is_refused(kind, fields, message):
  with pytest.raises(ValueError, match=message):
    DecoderConfig(kind=kind, **fields)


def test_a_kind_alone_brings_its_architecture_s_switches():
  gemma = DecoderConfig(kind="gemma3")
  assert (gemma.norm_offset, gemma.post_norms, gemma.embed_scale, gemma.qk_norm,
          gemma.mlp_activation) == (1.0, True, True, True, "gelu_tanh")
  assert DecoderConfig(kind="qwen2").qkv_bias and DecoderConfig(kind="qwen3").qk_norm
  assert dataclasses.replace(DecoderConfig(), kind="llama") == DecoderConfig()


def test_the_export_loads_in_transformers_with_equal_logits(family, tmp_path):
  """Where torch and transformers are installed (not in CI): export-hf's directory is
  what the installed transformers reads, and its logits are the references'."""
  torch = pytest.importorskip("torch", reason="torch is not installed (CI compares files)")
  transformers = pytest.importorskip("transformers", reason="transformers is not installed")
  written = json.loads((REFERENCES / "versions.json").read_text())["transformers"]
  if transformers.__version__ != written:  # Our dev extras pin lm-eval's older transformers.
    pytest.skip(f"transformers {transformers.__version__} is installed; the references are "
                f"{written}'s (5.12 ignores GPT-OSS's swiglu_limit and OLMo 3's per-layer RoPE)")
  name, model, ref = family
  hf.save(model, tmp_path / "out")
  # Eager attention: the plain math (torch's sdpa cannot soft-cap Gemma 2's logits).
  theirs = transformers.AutoModelForCausalLM.from_pretrained(
      tmp_path / "out", attn_implementation="eager").eval()
  with torch.no_grad():
    logits = theirs(torch.from_numpy(ref["tokens"]).long()).logits.float().numpy()
  np.testing.assert_allclose(logits, ref["logits"], atol=ATOL, rtol=0, err_msg=name)


# The presets' model at a size that trains in seconds; each family keeps its switches. Two
# layers: one sliding (a window shorter than data.seq_len), one full.
PRESET_SIZE = ["model.num_layers=2", "model.layer_types=[sliding,full]", "model.sliding_window=8",
               "model.d_model=32", "model.num_heads=2", "model.num_kv_heads=1", "model.head_dim=16",
               "model.mlp_dim=64", "model.max_seq_len=64", "data.seq_len=32", "data.batch_size=4",
               "data.max_documents=30", "data.validation_fraction=0.2", "train.eval_batches=1",
               "train.sample_tokens=4", "train.progress=false", "optim.warmup_steps=1"]


PRESET_LAYERS = {
    "olmo2-tiny": ["model.layer_types=null", "model.sliding_window=null"],
    "smollm3-tiny": ["model.nope_layers=[0]"],
    "deepseek_v3-tiny": ["model.layer_types=null", "model.sliding_window=null",
                         "model.num_kv_heads=2", "model.latent_attention={kv_lora_rank: 16, "
                         "q_lora_rank: 12, qk_nope_head_dim: 8, qk_rope_head_dim: 8, "
                         "v_head_dim: 8}"],
    "phi3-tiny": ["model.layer_types=null", *(
        f"model.rope_scaling.{name}_factor=[{', '.join(['1.5'] * 8)}]"
        for name in ("short", "long")),
        "model.rope_scaling.original_max_position_embeddings=16"],
}
"""Where a preset's layers differ from PRESET_SIZE's: OLMo 2 has no sliding layers; SmolLM3's
sliding layer is its NoPE one; Phi-3 has a window on every layer or none, and LongRoPE factors
for head_dim 16 (the long ones in training's 32-token rows)."""


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["qwen2-tiny", "gemma3-tiny", "olmo2-tiny", "olmo3-tiny",
                                    "smollm3-tiny", "phi3-tiny"])
def test_a_family_preset_trains_quantizes_and_fine_tunes(preset, tmp_path):
  """The whole journey, training from scratch, PTQ, QAT, then LoRA on a QLoRA (w8) base, each
  evaluated and sampled (KV cache) with finite numbers, on the families with the most switches:

  - qwen2: biases and sliding layers when set;
  - gemma3: four norms, q/k norms, soft caps, local and global layers;
  - olmo2: norms after the sublayers only, q/k norms over the whole projection;
  - olmo3: olmo2's block with sliding layers of their own RoPE base;
  - smollm3: a NoPE layer (the sliding one);
  - phi3: LongRoPE (the long factors in training's rows, the short ones sampling).

  (The mixtures of experts' quantization is test_moe's.)
  """
  import math

  from jax_ai_stack.recipes import config, train
  from jax_ai_stack.recipes.finetune import ptq

  steps = ["train.steps=3", "train.eval_every=3", "checkpoint.save_every=3",
           *PRESET_LAYERS.get(preset, [])]
  base = tmp_path / "base"
  result = train.run(config.load(preset, overrides=[*PRESET_SIZE, *steps]), base)
  assert result["step"] == 3 and math.isfinite(result["eval_loss"])

  report = ptq.quantize_run(base, "w8")
  assert math.isfinite(report.quantized_metrics["eval_loss"])
  assert abs(report.quantized_metrics["eval_loss"] - report.metrics["eval_loss"]) < 0.5
  quantized = ptq.open_quantized(base, "w8", method="decode")
  try:
    assert quantized.generate("def ", 6, 0.0).startswith("def ")
  finally:
    quantized.close()

  qat = train.run(config.load(preset, overrides=[*PRESET_SIZE, *steps,
                                                  "quant.qat=w8a8"]), tmp_path / "qat")
  assert math.isfinite(qat["eval_loss"])

  lora = train.run(config.load(preset, overrides=[
      *PRESET_SIZE, *steps, f"finetune.base={base}", "finetune.lora.rank=4",
      "finetune.lora.quantize_base=w8", "data.paths=[logging/*]"]), tmp_path / "lora")
  assert lora["step"] == 3 and math.isfinite(lora["eval_loss"])
  run = train.Trainer.open_finished(tmp_path / "lora", validation=True)
  try:
    assert run.config.model.kind == preset.removesuffix("-tiny")
    assert math.isfinite(run.evaluate()["eval_loss"])
    assert run.generate("def ", 6, 0.0).startswith("def ")
  finally:
    run.close()


def test_each_kind_is_declared_by_its_family_file_alone():
  """A family is one file of models/hf/families: the config's tables come from those files,
  and no other module of the package names a kind (the decoder's default kind and the
  `llama` module's name aside)."""
  import ast
  import typing

  from jax_ai_stack.recipes.models import configs
  from jax_ai_stack.recipes.models.hf import families

  every = families.every_family()
  assert typing.get_args(configs.DecoderKind) == families.KINDS == tuple(f.kind for f in every)
  for family in every:
    assert configs.KIND_FREE[family.kind] == family.free
    assert configs.KIND_DEFAULTS.get(family.kind, {}) == dict(family.switches)
    assert (family.kind in configs.MOE_KINDS) == (family.experts is not None)
    assert (family.kind in configs.LATENT_KINDS) == family.latent_attention
  package = pathlib.Path(configs.__file__).parents[3] / "jax_ai_stack"
  named = set()
  for path in package.rglob("*.py"):
    if path.parent.name == "families" and path.parent.parent.name == "hf":
      continue
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)}
    named |= {(path.relative_to(package).as_posix(), node.value) for node in ast.walk(tree)
              if isinstance(node, ast.Constant) and node.value in families.KINDS
              and id(node) not in docstrings}
  assert named == {("recipes/models/configs.py", "llama"), ("recipes/models/__init__.py", "llama")}


@pytest.mark.parametrize("preset", ["olmo2-tiny", "olmo3-tiny", "smollm3-tiny", "phi3-tiny",
                                    "deepseek_v3-tiny"])
def test_the_memory_plan_counts_each_family_s_parameters(preset):
  """The plan's parameter bytes are the built model's (OLMo's post-norms and projection-wide
  q/k norms included), and `num_params` counts them from the config alone."""
  from jax_ai_stack.recipes import config, memory

  recipe = config.load(preset, overrides=PRESET_SIZE + PRESET_LAYERS.get(preset, []))
  model = nnx.eval_shape(lambda: Decoder(recipe.model, rngs=nnx.Rngs(0)))
  count = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  assert count == recipe.model.num_params()
  plan = memory.estimate_memory(recipe, 1, attention="xla")
  assert plan.parameters == 4 * count and plan.activations > 0


GPT_OSS_20B = {  # openai/gpt-oss-20b's config.json, layer_types aside (the default pattern).
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
    "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu",
    "hidden_size": 2880, "initial_context_length": 4096, "initializer_range": 0.02,
    "intermediate_size": 2880, "max_position_embeddings": 131072, "model_type": "gpt_oss",
    "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
    "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False,
    "pad_token_id": 199999, "rms_norm_eps": 1e-05, "rope_theta": 150000,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "rope_type": "yarn",
                     "original_max_position_embeddings": 4096, "truncate": False},
    "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "use_cache": True, "vocab_size": 201088,
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn"],
                            "quant_method": "mxfp4"}}


def test_gpt_oss_20b_s_config_is_refused_naming_the_route_and_its_dequantized_save_reads():
  """The MXFP4 release is refused in one line naming transformers' dequantized save; the
  config that save writes (without quantization_config) describes 20.9B parameters."""
  with pytest.raises(ModelFileError, match=r"quant_method='mxfp4' is not supported: .*"
                     r"Mxfp4Config\(dequantize=True\).*save_pretrained"):
    hf.config_json.decoder_fields(GPT_OSS_20B)
  saved = {k: v for k, v in GPT_OSS_20B.items() if k != "quantization_config"}
  config = DecoderConfig(**hf.config_json.decoder_fields(saved))
  assert round(config.num_params() / 1e9, 1) == 20.9 and config.attention_sinks
  assert config.layer_types[:2] == ("sliding", "full") and config.rope_scaling.factor == 32
  assert config.moe.num_experts == 32 and config.moe.num_experts_per_tok == 4


def test_the_engine_decodes_latent_attention_from_its_cache_of_latents_as_transformers():
  """DeepSeek-V3's decoding through the engine's pages, which hold each token's latent and
  RoPE key alone (kv_b absorbed into the queries), gives transformers' greedy tokens."""
  from jax_ai_stack.recipes import inference

  ref = _reference("deepseek_v3")
  model = hf.load_model(REFERENCES / "deepseek_v3")
  assert all(set(spec) == {"latent"} for spec in model.cache_specs())
  engine = inference.Engine(model, max_slots=2, max_len=32)
  prompt = tuple(int(t) for t in ref["prompt"][0])
  [done] = engine.run([inference.Request(prompt, max_tokens=ref["greedy"].shape[1] - len(prompt),
                                         temperature=0.0)])
  assert list(done.tokens) == ref["greedy"][0, len(prompt):].tolist()
