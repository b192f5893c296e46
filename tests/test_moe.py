"""Mixture-of-experts layers: routing, the grouped matmul against its dense reference, the
layer against a per-token loop, mixed dense and MoE layers, the router losses in training,
and expert parallelism on 8 simulated devices against one device (moe-tiny trained, killed
and resumed, on one device and on the mesh: test_kill_and_resume.py)."""

from __future__ import annotations

import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_ai_stack import cli, kernels
from jax_ai_stack.recipes import config as config_lib
from jax_ai_stack.recipes import train
from jax_ai_stack.recipes.models import hf, layer_stack, moe
from jax_ai_stack.recipes.models.configs import DecoderConfig, MoeConfig
from jax_ai_stack.recipes.models.decoder import Decoder
from jax_ai_stack.recipes.tasks.objectives import lm_loss
from multidevice import run_on_devices

REFERENCES = pathlib.Path(__file__).parent / "references" / "hf"

RNG = np.random.default_rng(0)


def _config(**moe_fields) -> DecoderConfig:
  fields = dict(num_experts=4, num_experts_per_tok=2) | moe_fields
  return DecoderConfig(kind="mixtral", num_layers=2, d_model=16, num_heads=2, num_kv_heads=1,
                       mlp_dim=24, max_seq_len=32, moe=MoeConfig(**fields))


def test_routing_takes_the_top_k_and_a_tie_goes_to_the_lower_index():
  logits = jnp.array([[0.0, 2.0, 2.0, 1.0], [3.0, 0.0, 0.0, 0.0]])
  routing = moe.route(logits, 2, normalize=True)
  assert routing.experts.tolist() == [[1, 2], [0, 1]]  # Tied 2.0s: 1 first; tied 0.0s: 1.
  np.testing.assert_allclose(routing.weights.sum(-1), 1.0, rtol=1e-6)
  raw = moe.route(logits, 2, normalize=False).weights
  probs = jax.nn.softmax(logits)
  np.testing.assert_allclose(raw[1], [probs[1, 0], probs[1, 1]], rtol=1e-6)


def _numpy_deepseek_routing(logits, correction, k, groups, keep, scale):
  """DeepSeek-V3's router as transformers writes it, one token at a time in NumPy."""
  experts_out, weights_out = [], []
  for row in logits.astype(np.float64):
    scores = 1 / (1 + np.exp(-row))
    choice = scores + correction
    grouped = choice.reshape(groups, -1)
    group_scores = np.sort(grouped, axis=-1)[:, -2:].sum(-1)
    best = np.argsort(-group_scores, kind="stable")[:keep]
    allowed = np.full_like(grouped, -np.inf)
    allowed[best] = grouped[best]
    top = np.argsort(-allowed.reshape(-1), kind="stable")[:k]
    weights = scores[top] / scores[top].sum()
    experts_out.append(top)
    weights_out.append(weights * scale)
  return np.array(experts_out), np.array(weights_out)


def test_deepseek_s_grouped_sigmoid_routing_equals_numpy():
  """Corrected sigmoid scores choose within each token's best groups (a group scored by its
  two best), the uncorrected scores weight, renormalised, times the routed scale."""
  logits = RNG.normal(size=(64, 8)).astype(np.float32)
  correction = (0.3 * RNG.normal(size=8)).astype(np.float32)
  routing = moe.route(jnp.asarray(logits), 2, True, score="sigmoid",
                      correction=jnp.asarray(correction), groups=4, topk_groups=2, scale=2.5)
  experts, weights = _numpy_deepseek_routing(logits, correction, 2, 4, 2, 2.5)
  np.testing.assert_array_equal(np.sort(routing.experts, -1), np.sort(experts, -1))
  order = np.argsort(routing.experts, -1)
  np.testing.assert_allclose(np.take_along_axis(np.asarray(routing.weights), order, -1),
                             np.take_along_axis(weights, np.argsort(experts, -1), -1), rtol=1e-5)
  ungrouped = moe.route(jnp.asarray(logits), 2, True, score="sigmoid",
                        correction=jnp.asarray(correction), groups=4, topk_groups=4)
  assert (np.asarray(ungrouped.experts) != np.asarray(routing.experts)).any()  # Groups matter.


def test_deepseek_s_correction_bias_gets_no_gradient_and_no_decay():
  """The choice-only bias moves which experts are chosen, never a weight: its gradient is
  zero, and its name keeps it out of weight decay (optim.no_decay's "bias")."""
  config = _config(num_experts=8, router_score="sigmoid", score_correction=True,
                   router_groups=4, router_topk_groups=2, routed_scale=2.5)
  layer = moe.MoE(config, rngs=nnx.Rngs(0))
  layer.correction_bias[...] = jnp.asarray(RNG.normal(size=8), jnp.float32)
  x = jnp.asarray(RNG.normal(size=(2, 5, 16)), jnp.float32)
  grads = nnx.grad(lambda m: m(x)[0].sum())(layer)
  assert float(jnp.abs(grads["correction_bias"][...]).max()) == 0.0
  assert float(jnp.abs(grads["router"]["kernel"][...]).max()) > 0.0


def test_the_balancing_pull_is_the_load_above_balance_and_nothing_else():
  """With `pull`, the stats' `balancing` is zero, and its gradient for the choice bias is
  each expert's share of the assignments less 1/E; the weights' gradients are untouched."""
  logits = jnp.asarray(RNG.normal(size=(12, 4)), jnp.float32)
  bias = jnp.asarray([1.0, 0.0, 0.0, -1.0], jnp.float32)  # Expert 0 overloaded.

  def balancing(correction, logits):
    routing = moe.route(logits, 2, True, score="sigmoid", correction=correction, pull=True)
    return routing.stats.balancing + 0.0 * routing.weights.sum(), routing.stats.share

  (value, share), (pull, logit_grads) = jax.value_and_grad(
      balancing, argnums=(0, 1), has_aux=True)(bias, logits)
  assert float(value) == 0.0 and float(jnp.abs(logit_grads).max()) == 0.0
  np.testing.assert_allclose(pull, share - 0.25, atol=1e-7)
  assert float(pull[0]) > 0 > float(pull[3])


def test_the_bias_update_moves_each_expert_s_bias_toward_balance_and_nothing_else():
  """One AdamW update of a DeepSeek-style MoE: with moe.correction_update=0.01 each layer's
  choice bias moves by 0.01 against its expert's load above balance in that layer
  (DeepSeek-V3's update), and every other parameter is bitwise what it is without."""
  from jax_ai_stack.recipes import optim
  from jax_ai_stack.recipes.optim_config import OptimConfig

  tokens = jnp.asarray(RNG.integers(0, 259, (2, 16)), jnp.int32)
  batch = {"inputs": tokens, "targets": jnp.roll(tokens, -1, 1)}
  after = {}
  for speed in (0.0, 0.01):
    config = _config(router_score="sigmoid", score_correction=True, correction_update=speed)
    model = Decoder(config, rngs=nnx.Rngs(0))
    optimizer = optim.build_optimizer(OptimConfig(warmup_steps=0), model, train_steps=10)
    grads = nnx.grad(lambda model: lm_loss(model, batch)[0])(model)
    optimizer.update(model, grads)
    after[speed] = (nnx.state(model, nnx.Param), grads)
  moved, grads = after[0.01]
  for path, value in nnx.to_flat_state(moved):
    before = nnx.to_flat_state(after[0.0][0])
    still = dict(before)[path][...]
    if path[-1] == "correction_bias":
      pull = dict(nnx.to_flat_state(grads))[path][...]
      np.testing.assert_array_equal(value[...], -0.01 * np.sign(pull))
      assert np.count_nonzero(pull) > 0 and float(jnp.abs(still).max()) == 0.0
    else:
      np.testing.assert_array_equal(value[...], still, err_msg=str(path))


def test_a_bias_update_without_the_bias_is_refused():
  with pytest.raises(ValueError, match="moe.correction_update=0.001 moves the choice's bias: "
                                       "it needs moe.score_correction=true"):
    MoeConfig(num_experts=4, router_score="sigmoid", correction_update=0.001)


@pytest.mark.parametrize("fields, message", [
    (dict(score_correction=True), "set moe.router_score=sigmoid"),
    (dict(router_score="sigmoid", router_groups=3), "moe.router_groups=3 must split "
     "moe.num_experts=4 into equal groups of at least 2"),
    (dict(router_score="sigmoid", router_groups=2, router_topk_groups=3),
     "moe.router_topk_groups=3 be at most that many"),
    (dict(router_score="sigmoid", num_experts=8, num_experts_per_tok=3, router_groups=4),
     "moe.router_topk_groups=1 groups of 2 experts hold fewer than moe.num_experts_per_tok=3"),
])
def test_a_routing_the_groups_cannot_give_is_refused(fields, message):
  with pytest.raises(ValueError, match=message):
    MoeConfig(**{"num_experts": 4, **fields})


def test_the_balance_loss_and_shares_equal_numpy():
  logits = RNG.normal(size=(64, 8)).astype(np.float32)
  stats = moe.route(jnp.asarray(logits), 2, normalize=True).stats
  probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
  top = np.argsort(-probs, axis=-1, kind="stable")[:, :2]
  share = np.bincount(top.ravel(), minlength=8) / top.size
  np.testing.assert_allclose(stats.share, share, rtol=1e-6)
  np.testing.assert_allclose(stats.balance_loss, 8 * np.sum(share * probs.mean(0)), rtol=1e-5)
  z = np.log(np.exp(logits).sum(-1))
  np.testing.assert_allclose(stats.z_loss, np.mean(z ** 2), rtol=1e-5)
  balanced = moe.route(jnp.zeros((8, 4)), 1, normalize=True).stats  # Uniform router.
  assert float(balanced.balance_loss) == pytest.approx(1.0)


def test_the_router_statistics_leave_out_padding():
  """Padding (segment id 0) is routed, but the balance loss, the z-loss and the shares
  are those of the batch without it."""
  layer = moe.MoE(_config(), rngs=nnx.Rngs(0))
  x = jnp.asarray(RNG.normal(size=(2, 6, 16)), jnp.float32)
  segment_ids = jnp.array([[1, 1, 1, 1, 0, 0], [1, 1, 2, 2, 2, 2]])
  y, stats = layer(x, segment_ids)
  kept = jnp.concatenate([x[0, :4], x[1]])[None]
  y_kept, expected = layer(kept)
  for ours, theirs in zip(stats, expected):
    np.testing.assert_allclose(ours, theirs, rtol=1e-6)
  np.testing.assert_allclose(y[0, :4], y_kept[0, :4], rtol=1e-6)  # Outputs: as before.
  assert not np.allclose(layer(x)[1].share, stats.share)  # Counting padding would differ.


@pytest.mark.parametrize("implementation", ["tokamax", "xla", "blocked"])
def test_the_grouped_matmul_equals_its_dense_reference_with_its_gradients(implementation):
  lhs = jnp.asarray(RNG.normal(size=(20, 6)), jnp.float32)
  rhs = jnp.asarray(RNG.normal(size=(4, 6, 5)), jnp.float32)
  sizes = jnp.array([7, 0, 9, 2], jnp.int32)  # An empty group; rows 18, 19 in none.

  def run(name):
    f = lambda l, r: (kernels.grouped_matmul(l, r, sizes, implementation=name) ** 2).sum()
    return kernels.grouped_matmul(lhs, rhs, sizes, implementation=name), jax.grad(
        f, argnums=(0, 1))(lhs, rhs)

  (out, grads), (reference, reference_grads) = run(implementation), run("dense")
  np.testing.assert_allclose(out, reference, rtol=1e-5, atol=1e-5)
  assert not np.asarray(out[18:]).any()
  for ours, theirs in zip(grads, reference_grads):
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)


def test_auto_takes_the_blocked_matmul_on_cpu_and_tokamax_elsewhere():
  assert kernels.choose_grouped_matmul("auto", "cpu")[0] == "blocked"
  assert kernels.choose_grouped_matmul("auto", "gpu")[0] == "tokamax"
  assert kernels.choose_grouped_matmul("xla", "cpu") == ("xla", "requested: jax.lax.ragged_dot")
  # A TPU model's step traced for this host (the memory plan measures it here when it does
  # not fit one chip): the TPU's kernel gives way to the host's choice, saying why.
  name, why = kernels.choose_grouped_matmul("tokamax_mosaic_tpu", "cpu")
  assert name == "blocked" and "runs on TPUs only, not cpu: auto on cpu" in why


@pytest.mark.skipif(importlib.util.find_spec("tokamax") is None, reason="tokamax is not installed")
def test_a_layer_built_for_a_tpu_before_v5_takes_xla_s_ragged_dot():
  """The chip the model is compiled for, not only its platform, picks the grouped matmul:
  tokamax's Mosaic TPU kernel needs a v5 or newer."""
  config, rngs = _config(), nnx.Rngs(0)
  built = lambda kind: moe.MoE(config, rngs=rngs, platform="tpu", device_kind=kind)
  assert built("TPU v4").implementation == "xla"
  assert built("TPU v5 lite").implementation == "tokamax_mosaic_tpu"


@pytest.mark.parametrize("rows, groups, block", [(8192, 8, 128), (2048, 8, 64), (20, 4, 8)])
def test_blocks_are_a_power_of_two_near_a_quarter_of_a_group(rows, groups, block):
  from jax_ai_stack.kernels import experts

  assert experts.block_rows(rows, groups) == block


def test_an_unknown_grouped_matmul_is_named():
  with pytest.raises(ValueError, match="unknown grouped matmul 'cuda'; choose auto or one of"):
    kernels.choose_grouped_matmul("cuda")


@pytest.mark.parametrize("normalize, shared", [(True, None), (False, None),
                                               (False, "gated"), (True, "ungated")])
def test_the_layer_equals_a_loop_over_tokens_and_their_experts(normalize, shared):
  """Routed experts and a shared expert (with or without its sigmoid gate) against NumPy."""
  shared_fields = {} if shared is None else dict(shared_expert_dim=12,
                                                 shared_expert_gate=shared == "gated")
  config = _config(norm_topk_prob=normalize, **shared_fields)
  layer = moe.MoE(config, rngs=nnx.Rngs(1))
  x = jnp.asarray(RNG.normal(size=(2, 5, 16)), jnp.float32)
  y, _ = layer(x)
  router = np.asarray(layer.router.kernel[...])
  gate, up, down = (np.asarray(w[...], np.float64) for w in
                    (layer.gate_proj, layer.up_proj, layer.down_proj))
  expected = np.zeros((10, 16))
  for n, token in enumerate(np.asarray(x, np.float64).reshape(10, 16)):
    probs = np.exp(token @ router) / np.exp(token @ router).sum()
    picked = np.argsort(-probs, kind="stable")[:2]
    weights = probs[picked] / (probs[picked].sum() if normalize else 1.0)
    for e, w in zip(picked, weights):
      hidden = token @ gate[e]
      expected[n] += w * ((hidden / (1 + np.exp(-hidden)) * (token @ up[e])) @ down[e])
  if shared is not None:
    mlp = layer.shared_expert
    s_gate, s_up, s_down = (np.asarray(m.kernel[...], np.float64)
                            for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
    tokens = np.asarray(x, np.float64).reshape(10, 16)
    hidden = tokens @ s_gate
    out = (hidden / (1 + np.exp(-hidden)) * (tokens @ s_up)) @ s_down
    if shared == "gated":
      out *= 1 / (1 + np.exp(-(tokens @ np.asarray(layer.shared_expert_gate.kernel[...]))))
    else:
      assert layer.shared_expert_gate is None
    expected += out
  np.testing.assert_allclose(np.asarray(y).reshape(10, 16), expected, rtol=1e-4, atol=1e-5)


def test_gpt_oss_s_experts_equal_a_loop_over_tokens():
  """Router bias; gate and up interleaved in one weight, with biases; the clamped SwiGLU
  (a clamp the activations reach); a down bias per expert: NumPy, as transformers'
  GptOssExperts computes them."""
  config = _config(router_bias=True, expert_bias=True, interleaved_gate_up=True,
                   expert_activation="clamped_swiglu", swiglu_alpha=1.5, swiglu_limit=0.8)
  layer = moe.MoE(config, rngs=nnx.Rngs(1))
  for param in (layer.router.bias, layer.gate_up_proj_bias, layer.down_proj_bias):
    param[...] = jnp.asarray(RNG.normal(size=param.shape), jnp.float32)
  x = jnp.asarray(RNG.normal(size=(2, 5, 16)), jnp.float32)
  y, _ = layer(x)
  router, router_bias = (np.asarray(p[...], np.float64)
                         for p in (layer.router.kernel, layer.router.bias))
  gate_up, gate_up_bias, down, down_bias = (np.asarray(p[...], np.float64) for p in (
      layer.gate_up_proj, layer.gate_up_proj_bias, layer.down_proj, layer.down_proj_bias))
  expected, clamped = np.zeros((10, 16)), 0
  for n, token in enumerate(np.asarray(x, np.float64).reshape(10, 16)):
    logits = token @ router + router_bias
    picked = np.argsort(-logits, kind="stable")[:2]
    weights = np.exp(logits[picked] - logits[picked].max())
    for e, w in zip(picked, weights / weights.sum()):
      both = token @ gate_up[e] + gate_up_bias[e]
      gate, up = both[::2], both[1::2]
      clamped += np.sum(gate > 0.8) + np.sum(np.abs(up) > 0.8)
      gate, up = np.minimum(gate, 0.8), np.clip(up, -0.8, 0.8)
      hidden = (up + 1) * gate / (1 + np.exp(-1.5 * gate))
      expected[n] += w * (hidden @ down[e] + down_bias[e])
  assert clamped > 0
  np.testing.assert_allclose(np.asarray(y).reshape(10, 16), expected, rtol=1e-4, atol=1e-5)


def test_dense_and_moe_layers_mix_as_the_config_says():
  config = DecoderConfig(kind="qwen3_moe", num_layers=4, d_model=16, num_heads=2,
                         num_kv_heads=1, mlp_dim=24, moe=MoeConfig(
                             num_experts=4, expert_mlp_dim=8, sparse_step=2, dense_layers=(3,)))
  assert config.moe_layers == (False, True, False, False)
  model = Decoder(config, rngs=nnx.Rngs(0))
  assert [type(block.mlp).__name__ for block in model.layers] == ["MLP", "MoE", "MLP", "MLP"]
  assert model.layers[1].mlp.gate_proj.shape == (4, 16, 8)
  assert config.num_params() == sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  _, losses = model(jnp.zeros((1, 8), jnp.int32), with_moe_losses=True)
  assert losses["moe_loss"] == pytest.approx(0.01 * float(losses["router_aux_loss"]))
  assert sum(float(losses[f"expert_share_{e}"]) for e in range(4)) == pytest.approx(1.0)


def test_scanned_experts_compute_what_unrolled_ones_do():
  model = Decoder(_config(), rngs=nnx.Rngs(0))
  scanned = layer_stack.convert(model, scan_layers=True)
  tokens = jnp.asarray(RNG.integers(0, 259, (2, 12)), jnp.int32)
  batch = {"inputs": tokens, "targets": jnp.roll(tokens, -1, 1)}
  (loss, metrics), (scan_loss, scan_metrics) = lm_loss(model, batch), lm_loss(scanned, batch)
  np.testing.assert_allclose(scan_loss, loss, rtol=1e-5)
  for name in ("lm_loss", "router_aux_loss", "router_z_loss", "expert_share_3"):
    np.testing.assert_allclose(scan_metrics[name], metrics[name], rtol=1e-5)
  assert float(loss) > float(metrics["lm_loss"])  # The router's loss is in what trains.


@pytest.mark.parametrize("overrides, message", [
    (["model.moe.num_experts_per_tok=9"], "moe.num_experts_per_tok=9 is above moe.num_experts=8"),
    (["model.moe=null"], "kind='mixtral' is a mixture of experts: set model.moe"),
    (["model.moe.dense_layers=[4]"], "moe.dense_layers names layer 4; the layers are 0..3"),
    (["model.moe.shared_expert_gate=true"], "moe.shared_expert_gate=true needs a shared expert"),
    (["mesh.expert=3"], "mesh.expert=3 does not divide model.moe.num_experts=8"),
])
def test_a_bad_moe_config_is_one_line_and_exit_2(overrides, message, capsys, tmp_path):
  assert cli.main(["train", "moe-tiny", "--workdir", str(tmp_path), *overrides]) == 2
  err = capsys.readouterr().err
  assert message in err and len(err.strip().splitlines()) == 1
  assert not any(tmp_path.iterdir())


def test_a_dense_kind_refuses_experts():
  with pytest.raises(config_lib.ConfigError, match="kind='llama' has dense MLPs"):
    config_lib.load("lm-tiny", overrides=["model.moe={num_experts: 4}"])


SMALL = ["model.num_layers=2", "model.d_model=32", "model.num_heads=2", "model.num_kv_heads=1",
         "model.mlp_dim=32", "model.max_seq_len=32", "model.moe.num_experts=4",
         "data.seq_len=32", "data.batch_size=4", "data.max_documents=30",
         "data.validation_fraction=0.2", "train.eval_batches=1", "train.progress=false",
         "train.sample_tokens=0", "optim.warmup_steps=1", "train.steps=8", "train.eval_every=4",
         "checkpoint.save_every=4"]


def test_the_memory_plan_of_a_moe_model_is_measured():
  from jax_ai_stack.recipes import memory

  plan = memory.estimate_memory(config_lib.load("moe-tiny", overrides=SMALL), 1)
  assert plan.activations_from.startswith("measured") and plan.activations_per_row > 0


@pytest.mark.parametrize("preset", ["qwen2_moe-tiny", "gpt_oss-tiny", "llama4-tiny",
                                    "deepseek_v3-tiny", "qwen3_next-tiny"])
def test_the_memory_plan_counts_a_family_s_expert_weights(preset):
  """Shared experts and their gates (and every other weight a family adds) are counted: the
  plan's parameter bytes are the config's count, which equals the built model's."""
  from jax_ai_stack.recipes import memory

  config = config_lib.load(preset, overrides=[*MOE_PRESET_SIZE, *FAMILY_PRESETS[preset]])
  model = nnx.eval_shape(lambda: Decoder(config.model, rngs=nnx.Rngs(0)))
  built = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  plan = memory.estimate_memory(config, 1)
  assert plan.parameters == 4 * config.model.num_params() == 4 * built


@pytest.mark.slow
def test_a_moe_model_lora_adapts_quantizes_trains_through_qat_and_takes_a_qlora_base(
    tmp_path, capsys):
  """LoRA adapts a MoE model's attention (exported merged, the run's logits); PTQ stores the
  experts in the scheme's type beside the quantized attention; QAT trains through them; a
  QLoRA run adapts the quantized base; w8a8, which quantizes activations, is refused."""
  from jax_ai_stack.recipes.finetune import adapters, ptq
  from jax_ai_stack.recipes.models import expert_quant

  train.run(config_lib.load("moe-tiny", overrides=[*SMALL, "train.steps=2"]), tmp_path / "base")
  tuned = config_lib.load("moe-tiny", overrides=[
      *SMALL, "train.steps=2", f"finetune.base={tmp_path / 'base'}", "finetune.lora.rank=4"])
  train.run(tuned, tmp_path / "lora")
  run = train.Trainer.open_finished(tmp_path / "lora")
  tokens = jnp.arange(16, dtype=jnp.int32)[None]
  try:
    adapted = adapters.adapter_pairs(run.model)
    logits = np.asarray(nnx.jit(lambda m, t: m(t))(run.model, tokens))
  finally:
    run.close()
  assert adapted and all("/attention/" in name for name in adapted), sorted(adapted)
  # Exported, the adapters are merged: the Mixtral directory computes what the run does.
  assert cli.main(["export-hf", "--workdir", str(tmp_path / "lora"), str(tmp_path / "hf")]) == 0
  np.testing.assert_allclose(np.asarray(hf.load_model(tmp_path / "hf")(tokens)), logits,
                             atol=1e-5, rtol=1e-5)

  report = ptq.quantize_run(tmp_path / "base", "w4")
  assert abs(report.quantized_metrics["eval_loss"] - report.metrics["eval_loss"]) < 0.5
  quantized = ptq.open_quantized(tmp_path / "base", "w4", method="decode")
  try:
    layer = quantized.model.layers[0]
    experts = [getattr(layer.mlp, name) for name in ("gate_proj", "up_proj", "down_proj")]
    assert all(expert_quant.is_quantized(w) and w.array.qtype == jnp.int4 for w in experts)
    assert expert_quant.is_quantized(layer.attention.q_proj.kernel)
    assert not expert_quant.is_quantized(layer.mlp.router.kernel)  # Routing stays float.
    assert len(quantized.generate("def ", 6, 0.0)) > len("def ")
  finally:
    quantized.close()

  qat = train.run(config_lib.load("moe-tiny", overrides=[*SMALL, "train.steps=2",
                                                         "quant.qat=w8"]), tmp_path / "qat")
  assert np.isfinite(qat["eval_loss"])
  qlora = train.run(config_lib.load("moe-tiny", overrides=[
      *SMALL, "train.steps=2", f"finetune.base={tmp_path / 'base'}", "finetune.lora.rank=4",
      "finetune.lora.quantize_base=w8"]), tmp_path / "qlora")
  assert qlora["step"] == 2 and np.isfinite(qlora["eval_loss"])
  run = train.Trainer.open_finished(tmp_path / "qlora")
  try:
    assert expert_quant.is_quantized(run.model.layers[1].mlp.down_proj)
    assert adapters.adapter_pairs(run.model)
  finally:
    run.close()

  assert cli.main(["train", "moe-tiny", "--workdir", str(tmp_path / "a8"), *SMALL,
                   "quant.qat=w8a8"]) == 2
  assert ("quantization scheme 'w8a8' quantizes activations, which the experts of a "
          "mixture-of-experts model (model.kind='mixtral') do not take") in capsys.readouterr().err
  assert not (tmp_path / "a8").exists()


MOE_REFERENCES = ["mixtral", "qwen3_moe", "qwen2_moe", "gpt_oss", "llama4", "deepseek_v3-moe",
                  "qwen3_next"]


@pytest.mark.parametrize("name", MOE_REFERENCES)
def test_each_moe_family_quantizes_its_experts_attention_and_dense_mlps_not_its_router(name):
  """w4: the experts (stacked, the layer's own quantization) and dense or shared MLPs in int4,
  every attention projection (grouped, latent or linear) in int8; the router, a shared
  expert's gate and the embedding stay float. The experts alone, quantized in int8, move
  the logits of transformers' tiny model by under 5% (measured 0.8% to 2.1%)."""
  from flax import traverse_util

  from jax_ai_stack.recipes.finetune import quant

  model = hf.load_model(REFERENCES / name)
  quantized = nnx.eval_shape(lambda: quant.ptq(model, "w4", model.config))
  flat = traverse_util.flatten_dict(nnx.to_pure_dict(nnx.state(quantized, nnx.Param)))
  bits = {"/".join(map(str, path[:-2])).removesuffix("/kernel"): quant._bits(leaf.dtype)
          for path, leaf in flat.items() if path[-1] == "qvalue"}
  for number, layer in enumerate(model.layers):
    prefix = f"layers/{number}/"
    attention = {p: b for p, b in bits.items() if p.startswith(prefix + "attention/")}
    assert attention and set(attention.values()) == {8}, (name, number, attention)
    if isinstance(layer.mlp, moe.MoE):
      for expert in (*layer.mlp.in_names, "down_proj"):
        assert bits[f"{prefix}mlp/{expert}"] == 4, (name, number, expert)
    mlp = {p: b for p, b in bits.items() if p.startswith(prefix + "mlp/")}
    assert mlp and set(mlp.values()) == {4}, (name, number, mlp)
  assert not [p for p in bits if "router" in p or "shared_expert_gate" in p or "embed" in p]

  tokens = jnp.asarray(np.load(REFERENCES / name / "reference.npz")["tokens"])
  logits = np.asarray(model(tokens))
  experts = np.asarray(quant.quantize_experts(nnx.clone(model), "w8")(tokens))
  assert np.linalg.norm(experts - logits) < 0.05 * np.linalg.norm(logits)


@pytest.mark.slow
def test_the_memory_plan_keeps_experts_split_over_the_expert_axis():
  """Under expert parallelism each device holds 1/8 of the experts and gathers none of
  them (tokens travel instead); the other weights are replicated, as under `dp`."""
  from jax_ai_stack.recipes import memory

  def plan(*mesh):
    return memory.estimate_memory(config_lib.load("moe-tiny", overrides=[*SMALL, *mesh,
                                                                         "data.batch_size=8"]), 8)

  experts, replicated = plan("model.moe.num_experts=8", "mesh.data=1", "mesh.expert=8"), plan(
      "model.moe.num_experts=8", "mesh.data=8")
  eight = config_lib.load("moe-tiny", overrides=[*SMALL, "model.moe.num_experts=8"]).model
  model = nnx.eval_shape(lambda: Decoder(eight, rngs=nnx.Rngs(0)))
  stacked = sum(x.size * x.dtype.itemsize for path, x in
                jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param))
                if "mlp" in jax.tree_util.keystr(path) and x.ndim == 3)
  assert stacked and replicated.parameters - experts.parameters == stacked - stacked // 8
  assert experts.gathered == 0 and experts.mesh["expert"] == 8
  with pytest.raises(config_lib.ConfigError, match=r"\('experts', size 4\) does not divide by "
                                                   "mesh axes expert of size 8"):
    plan("mesh.data=1", "mesh.expert=-1")  # 4 experts; the rest of the devices is 8.


@pytest.mark.parametrize("name", [
    # On every row: the shard_map and its collectives are what changes with jax.
    pytest.param("mixtral", marks=pytest.mark.every_row),
    pytest.param("qwen3_moe", marks=pytest.mark.slow),
    pytest.param("qwen2_moe", marks=pytest.mark.slow),
    pytest.param("gpt_oss", marks=pytest.mark.slow),
    pytest.param("deepseek_v3-moe", marks=pytest.mark.slow)])
def test_experts_split_over_the_expert_axis_compute_what_one_device_does(name):
  """The Mixtral and Qwen3-MoE reference checkpoints on 8 simulated devices with their
  experts split over `expert` (alone with `data`; with fsdp and tensor under fsdp_tp):
  logits and gradients equal one device's, for a batch split over the expert axis and
  for one row (replicated: no token exchange, the experts' outputs summed), and the
  step exchanges tokens inside a shard_map."""
  results = run_on_devices("experts_on_mesh", REFERENCES / name)
  assert len(results) == 2
  for mesh_name, result in results.items():
    for rows in ("batch", "one row"):
      assert result[rows]["logits"] < 1e-5, (mesh_name, rows, result)
      assert result[rows]["grads"] < 1e-4, (mesh_name, rows, result)
    assert result["experts"] == "expert" and result["exchange"], (mesh_name, result)


def test_the_grouped_matmul_is_chosen_for_the_devices_the_model_is_compiled_for():
  """A decoder built with a plan for a TPU slice's devices (`train --dry-run --topology`)
  calls what a TPU runs, not what this CPU would."""
  config = DecoderConfig.tiny(kind="mixtral", num_layers=1, moe=MoeConfig(num_experts=4))
  assert moe.MoE(config, rngs=nnx.Rngs(0)).implementation == "blocked"  # This host: CPU.
  assert moe.MoE(config, rngs=nnx.Rngs(0), platform="tpu").implementation == "tokamax_mosaic_tpu"
  tpu = kernels.Backend("tpu", "TPU v5 lite")
  plan = kernels.AttentionPlan(("xla",), "a test", backend=tpu)
  from jax_ai_stack.recipes.models.decoder import Decoder

  decoder = Decoder(config, rngs=nnx.Rngs(0), attention=plan)
  kinds = {m.implementation for _, m in nnx.iter_graph(decoder) if isinstance(m, moe.MoE)}
  assert kinds == {"tokamax_mosaic_tpu"}


# A family preset's model at a size that trains in seconds, its switches kept (the Qwen2-MoE
# preset's dense layer 2 is dropped with the layers past 1).
MOE_PRESET_SIZE = ["model.num_layers=2", "model.d_model=32", "model.num_heads=2",
                   "model.num_kv_heads=1", "model.head_dim=16", "model.mlp_dim=32",
                   "model.max_seq_len=32", "model.moe.num_experts=4", "data.seq_len=32",
                   "data.batch_size=4", "data.max_documents=30", "data.validation_fraction=0.2",
                   "train.eval_batches=1", "train.progress=false", "train.sample_tokens=0",
                   "optim.warmup_steps=1", "train.steps=2", "train.eval_every=2",
                   "checkpoint.save_every=2"]
FAMILY_PRESETS = {"qwen2_moe-tiny": ["model.moe.dense_layers=[]", "model.moe.expert_mlp_dim=16",
                                     "model.moe.shared_expert_dim=24"],
                  "gpt_oss-tiny": ["model.layer_types=[sliding,full]", "model.sliding_window=8"],
                  "llama4-tiny": ["model.layer_types=[chunked,full]", "model.nope_layers=[1]",
                                  "model.attention_chunk_size=8", "model.moe.dense_layers=[0]",
                                  "model.moe.expert_mlp_dim=16", "model.moe.shared_expert_dim=16",
                                  "model.nope_temperature=[4.0,0.5]"],
                  "deepseek_v3-tiny": ["model.num_kv_heads=2", "model.moe.dense_layers=[0]",
                                       "model.moe.expert_mlp_dim=16",
                                       "model.moe.shared_expert_dim=32",
                                       "model.moe.router_groups=2", "model.moe.router_topk_groups=1",
                                       "model.latent_attention={kv_lora_rank: 16, q_lora_rank: 12, "
                                       "qk_nope_head_dim: 8, qk_rope_head_dim: 8, v_head_dim: 8}"],
                  "qwen3_next-tiny": ["model.layer_types=[linear,full]", "model.rotary_dim=4",
                                      "model.moe.expert_mlp_dim=16",
                                      "model.moe.shared_expert_dim=24",
                                      "model.linear_attention={num_key_heads: 1, "
                                      "num_value_heads: 2, key_head_dim: 8, value_head_dim: 8}"]}


@pytest.mark.slow
@pytest.mark.parametrize("preset", sorted(FAMILY_PRESETS))
def test_a_moe_family_preset_trains_lora_adapts_and_exports(preset, tmp_path):
  """A MoE family's tiny preset trains from scratch; LoRA adapts it (its dense layers: the
  attention and a shared expert's MLP; quantization: the tests above), and export-hf writes
  the family's layout, which computes what the run does. (The engine's greedy tokens are
  transformers': tests/test_engine.py.)"""
  from jax_ai_stack.recipes.finetune import adapters

  size = [*MOE_PRESET_SIZE, *FAMILY_PRESETS[preset]]
  base = train.run(config_lib.load(preset, overrides=size), tmp_path / "base")
  assert base["step"] == 2 and np.isfinite(base["eval_loss"])
  lora = train.run(config_lib.load(preset, overrides=[
      *size, f"finetune.base={tmp_path / 'base'}", "finetune.lora.rank=4"]), tmp_path / "lora")
  assert lora["step"] == 2 and np.isfinite(lora["eval_loss"])
  run = train.Trainer.open_finished(tmp_path / "lora")
  tokens = jnp.arange(16, dtype=jnp.int32)[None]
  try:
    assert run.config.model.kind == preset.removesuffix("-tiny")
    adapted = adapters.adapter_pairs(run.model)
    assert adapted
    if preset == "qwen3_next-tiny":  # The gated DeltaNet's projections too.
      assert {"layers/0/attention/in_proj_qkvz/kernel",
              "layers/0/attention/out_proj/kernel"} <= set(adapted)
    if preset == "deepseek_v3-tiny":  # The base's choice bias moved, 0.001 an update.
      bias = np.abs(np.asarray(run.model.layers[1].mlp.correction_bias[...]))
      steps = bias / 1e-3  # 0, 1 or 2 steps of 0.001 (2 updates).
      assert 0 < steps.max() and np.allclose(steps, np.clip(np.round(steps), 0, 2), atol=1e-3)
    logits = np.asarray(nnx.jit(lambda m, t: m(t))(run.model, tokens))
  finally:
    run.close()
  assert cli.main(["export-hf", "--workdir", str(tmp_path / "lora"), str(tmp_path / "hf")]) == 0
  exported = hf.load_model(tmp_path / "hf")
  assert exported.config.kind == preset.removesuffix("-tiny")
  np.testing.assert_allclose(np.asarray(exported(tokens)), logits, atol=1e-5, rtol=1e-5)
