"""Tunix, Google's post-training library (the `tunix` extra), works on the pinned stack.

MaxText and others run their RL through Tunix, so a user who installs
`jax-ai-stack[tunix]` must get a Tunix that trains on the rows' jax, flax, optax,
orbax, grain and qwix. These tests run Tunix's own GRPO learner end to end on its
toy model, and its SFT trainer on this project's decoder.
"""

from __future__ import annotations

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from grain import python as grain

pytestmark = pytest.mark.integration

FLAX_SHARDS_VARIABLES = flax.config.flax_always_shard_variable
"""Tunix's model modules turn this off for the whole process when imported
(`tunix.utils.env_utils.setup_sharding_environment`); the other test modules of a worker
expect a decoder's parameters sharded at creation, so it is set back after each import."""

tunix = pytest.importorskip("tunix", reason="the `tunix` extra is not installed")
from tunix.rl import rl_cluster  # noqa: E402
from tunix.rl.grpo import grpo_learner  # noqa: E402
from tunix.rl.rollout import base_rollout  # noqa: E402
from tunix.sft import peft_trainer  # noqa: E402
from tunix.tests import test_common  # noqa: E402

flax.config.update("flax_always_shard_variable", FLAX_SHARDS_VARIABLES)

from jax_ai_stack.recipes.finetune import adapters  # noqa: E402
from jax_ai_stack.recipes.finetune.config import LoraConfig  # noqa: E402
from jax_ai_stack.recipes.models.decoder import Decoder, DecoderConfig  # noqa: E402
from jax_ai_stack.recipes.tasks import objectives  # noqa: E402


@pytest.fixture(autouse=True)
def tunix_flax_settings():
  """Each test runs as Tunix sets flax (its toy model's annotations need no mesh), and the
  setting is put back after it (FLAX_SHARDS_VARIABLES)."""
  flax.config.update("flax_always_shard_variable", False)
  yield
  flax.config.update("flax_always_shard_variable", FLAX_SHARDS_VARIABLES)


PROMPTS = ["input string", "hello world", "My name", "hello there"]
"""Words of Tunix's MockVocab, so the toy tokenizer knows them."""


def _one_device_mesh() -> jax.sharding.Mesh:
  """Auto axes, as Tunix's own tests build (its toy model does not annotate explicit ones)."""
  return jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))


def _params(model: nnx.Module) -> list[np.ndarray]:
  return [np.asarray(leaf) for leaf in jax.tree.leaves(nnx.state(model, nnx.Param))]


def _length_reward(prompts, completions, **columns):
  """Longer completions score higher: any learner step moves the policy."""
  del prompts, columns
  return [float(len(text)) for text in completions]


def test_tunix_grpo_learner_trains_its_toy_model():
  vocab = test_common.MockVocab()
  config = test_common.ModelConfig(vocab_size=vocab.GetPieceSize())
  actor = test_common.ToyTransformer(config=config, rngs=nnx.Rngs(0))
  reference = test_common.ToyTransformer(config=config, rngs=nnx.Rngs(0))
  before, reference_before = _params(actor), _params(reference)
  mesh = _one_device_mesh()
  cluster = rl_cluster.RLCluster(
      actor=actor, reference=reference, tokenizer=vocab,
      cluster_config=rl_cluster.ClusterConfig(
          role_to_mesh={role: mesh for role in (rl_cluster.Role.ACTOR, rl_cluster.Role.REFERENCE,
                                                rl_cluster.Role.ROLLOUT)},
          rollout_engine="vanilla", offload_to_cpu=False,
          training_config=rl_cluster.RLTrainingConfig(
              actor_optimizer=optax.sgd(1e-2), eval_every_n_steps=10, max_steps=2),
          rollout_config=base_rollout.RolloutConfig(
              max_tokens_to_generate=6, max_prompt_length=8, kv_cache_size=64)))
  learner = grpo_learner.GRPOLearner(
      rl_cluster=cluster, reward_fns=_length_reward,
      algo_config=grpo_learner.GRPOConfig(num_generations=2, num_iterations=1, beta=0.04))
  data = grain.MapDataset.source(PROMPTS).batch(2).map(lambda p: {"prompts": p})
  learner.train(data)
  after = _params(cluster.actor_trainer.model)
  assert cluster.actor_trainer.train_steps == 2
  assert any(not np.array_equal(a, b) for a, b in zip(before, after))
  assert all(np.isfinite(a).all() for a in after)
  assert all(np.array_equal(a, b) for a, b in zip(reference_before, _params(reference)))


def _lora_decoder() -> nnx.Module:
  config = DecoderConfig.tiny(num_layers=1)
  return adapters.add_adapters(Decoder(config, rngs=nnx.Rngs(0)),
                               LoraConfig(rank=2, modules="up_proj"), config, seed=1)


def test_tunix_sft_trainer_steps_our_lora_decoder_as_our_own_step_does():
  """Tunix's PeftTrainer sees the Qwix adapters as LoRA (only they train) and, with this
  project's next-token objective as its loss, lands on the adapters a plain NNX loop does."""
  rng = np.random.default_rng(0)
  tokens = rng.integers(1, 256, (3, 2, 17))
  batches = [{"inputs": t[:, :-1], "targets": t[:, 1:]} for t in tokens]

  def loss(model, inputs, targets):
    return objectives.lm_loss(model, {"inputs": inputs, "targets": targets})[0]

  theirs = _lora_decoder()
  base = jax.tree.map(np.asarray, nnx.state(theirs, nnx.Not(nnx.LoRAParam)))
  trainer = peft_trainer.PeftTrainer(
      theirs, optax.adam(1e-2),
      peft_trainer.TrainingConfig(eval_every_n_steps=100, max_steps=len(batches),
                                  checkpoint_root_directory=None, pbar_description=None))
  trainer.with_loss_fn(loss)
  trainer.train(batches)

  ours = _lora_decoder()
  optimizer = nnx.Optimizer(ours, optax.adam(1e-2), wrt=nnx.LoRAParam)
  grad = nnx.value_and_grad(loss, argnums=nnx.DiffState(0, nnx.LoRAParam))
  for batch in batches:
    _, grads = grad(ours, **{k: jnp.asarray(v) for k, v in batch.items()})
    optimizer.update(ours, grads)

  assert trainer.train_steps == len(batches)
  theirs_lora = jax.tree.leaves(nnx.state(theirs, nnx.LoRAParam))
  ours_lora = jax.tree.leaves(nnx.state(ours, nnx.LoRAParam))
  first = jax.tree.leaves(nnx.state(_lora_decoder(), nnx.LoRAParam))
  assert any(not np.allclose(a, b) for a, b in zip(theirs_lora, first))
  for a, b in zip(theirs_lora, ours_lora):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
  jax.tree.map(np.testing.assert_array_equal, base,
               jax.tree.map(np.asarray, nnx.state(theirs, nnx.Not(nnx.LoRAParam))))
