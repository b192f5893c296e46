"""Distillation from a teacher: the divergences and their gradients against NumPy, the loss
over chunks of positions equal to the whole sequence's, a teacher run frozen beside the
student, never saved, read again on resume (bitwise), and the teachers refused in one line."""

from __future__ import annotations

import json
import math
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_ai_stack.errors import ConfigError
from jax_ai_stack.recipes import config as config_lib
from jax_ai_stack.recipes import tasks, train
from jax_ai_stack.recipes.finetune import base_run
from jax_ai_stack.recipes.models.configs import DecoderConfig
from jax_ai_stack.recipes.models.decoder import Decoder
from jax_ai_stack.recipes.tasks import distillation

RNG = np.random.default_rng(0)
SMALL = ["train.steps=4", "train.eval_every=4", "checkpoint.save_every=2", "train.sample_tokens=0",
         "train.progress=false", "data.batch_size=4", "data.seq_len=32", "train.eval_batches=1"]
STUDENT = ["model.d_model=64", "model.mlp_dim=128", "model.num_layers=2"]


def _log_softmax(z):
  z = z - z.max(-1, keepdims=True)
  return z - np.log(np.exp(z).sum(-1, keepdims=True))


def _numpy_divergence(student, teacher, loss, beta, temperature):
  """The module's formulas in float64 NumPy, written apart from it."""
  s, t = _log_softmax(student / temperature), _log_softmax(teacher / temperature)
  kl = lambda a, b: (np.exp(a) * (a - b)).sum(-1)
  if loss == "forward_kl":
    value = kl(t, s)
  elif loss == "reverse_kl":
    value = kl(s, t)
  else:
    m = np.log(beta * np.exp(t) + (1 - beta) * np.exp(s))
    value = beta * kl(t, m) + (1 - beta) * kl(s, m)
  return value * temperature**2


@pytest.mark.parametrize("loss, beta, temperature", [
    ("forward_kl", 0.5, 1.0), ("reverse_kl", 0.5, 2.0), ("jsd", 0.3, 1.5), ("jsd", 0.9, 1.0)])
def test_each_divergence_and_its_gradient_equal_numpy(loss, beta, temperature):
  student, teacher = RNG.normal(size=(3, 11)) * 2, RNG.normal(size=(3, 11)) * 2
  ours = distillation.divergence(jnp.asarray(student, jnp.float32), jnp.asarray(teacher),
                                 loss, beta=beta, temperature=temperature)
  np.testing.assert_allclose(ours, _numpy_divergence(student, teacher, loss, beta, temperature),
                             rtol=1e-5, atol=1e-6)
  assert (np.asarray(ours) > 0).all()
  grad = jax.grad(lambda s: distillation.divergence(s, jnp.asarray(teacher, jnp.float32), loss,
                                                    beta=beta, temperature=temperature).sum())(
                                                        jnp.asarray(student, jnp.float32))
  eps, numeric = 1e-6, np.zeros_like(student)
  for index in np.ndindex(student.shape):
    up, down = student.copy(), student.copy()
    up[index] += eps
    down[index] -= eps
    numeric[index] = (_numpy_divergence(up, teacher, loss, beta, temperature).sum()
                      - _numpy_divergence(down, teacher, loss, beta, temperature).sum()) / (2 * eps)
  np.testing.assert_allclose(grad, numeric, rtol=1e-4, atol=1e-5)


def test_a_student_equal_to_its_teacher_diverges_by_nothing_and_an_unknown_loss_is_named():
  logits = jnp.asarray(RNG.normal(size=(2, 7)), jnp.float32)
  for loss in distillation.LOSSES:
    np.testing.assert_allclose(distillation.divergence(logits, logits, loss), 0.0, atol=1e-6)
  with pytest.raises(ValueError, match="unknown distillation loss 'kl'; losses: forward_kl"):
    distillation.divergence(logits, logits, "kl")


def test_the_loss_over_chunks_of_positions_equals_the_whole_sequence_s():
  """Chunks of 8 positions (each chunk's logits made again in the backward pass) give the
  loss and the gradient of one chunk of all 24, with a mask, for every divergence."""
  student = Decoder(DecoderConfig.tiny(vocab_size=40, d_model=16), rngs=nnx.Rngs(0))
  teacher = Decoder(DecoderConfig.tiny(vocab_size=40, d_model=32), rngs=nnx.Rngs(1))
  tokens = jnp.asarray(RNG.integers(0, 40, size=(2, 25)), jnp.int32)
  mask = jnp.asarray(RNG.random((2, 24)) > 0.3, jnp.float32)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "loss_mask": mask}

  def value_and_grad(objective):
    loss = lambda model: objective.loss(model, batch, teacher)
    return nnx.value_and_grad(loss, has_aux=True)(student)

  for loss in distillation.LOSSES:
    whole = distillation.LogitDistillation(loss, beta=0.4, temperature=1.5,
                                           next_token_weight=0.25, chunk_tokens=24)
    (value, metrics), grads = value_and_grad(whole)
    (chunked, chunked_metrics), chunked_grads = value_and_grad(
        distillation.LogitDistillation(loss, 0.4, 1.5, 0.25, chunk_tokens=8))
    np.testing.assert_allclose(chunked, value, rtol=1e-5)
    assert float(metrics["tokens"]) == float(mask.sum())
    np.testing.assert_allclose(value, 0.75 * metrics["divergence"] + 0.25 * metrics["lm_loss"],
                               rtol=1e-6)
    for ours, theirs in zip(jax.tree.leaves(chunked_grads), jax.tree.leaves(grads)):
      np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-6)


@pytest.fixture(scope="module")
def teacher_run(tmp_path_factory):
  """A trained lm-tiny (4 steps): the teacher."""
  workdir = tmp_path_factory.mktemp("teacher")
  train.run(config_lib.load("lm-tiny", overrides=SMALL), workdir)
  return workdir


def _student(teacher, *overrides):
  return config_lib.load("lm-tiny", overrides=[*SMALL, *STUDENT,
                                               f"finetune.distill.teacher={teacher}", *overrides])


def test_a_student_learns_from_a_frozen_teacher_that_is_never_saved(teacher_run, tmp_path):
  """(Killed and resumed, it is bitwise the run that never stopped: test_kill_and_resume.py.)"""
  config = _student(teacher_run, "finetune.distill.loss=reverse_kl")
  whole = train.run(config, tmp_path / "whole")
  assert math.isfinite(whole["divergence"]) and whole["eval_divergence"] >= 0

  run = train.Trainer.open_finished(tmp_path / "whole")
  try:
    teacher_weights = nnx.state(run.model.teacher)
    saved = json.loads((tmp_path / "whole" / "checkpoints" / "4" / "state" / "_METADATA"
                        ).read_text())["tree_metadata"]  # Orbax's: the arrays a step holds.
    assert "('0', 'embed', 'embedding')" in saved  # The student's ...
    assert not [key for key in saved if "teacher" in key]  # ... alone.
    theirs = train.Trainer.open_finished(teacher_run)
    try:
      for ours, original in zip(jax.tree.leaves(teacher_weights),
                                jax.tree.leaves(nnx.state(theirs.model, nnx.Param))):
        np.testing.assert_array_equal(ours, original)  # Frozen: as the teacher run saved it.
    finally:
      theirs.close()
    assert run.generate("def ", 4, 0.0).startswith("def ")  # The student decodes alone.
  finally:
    run.close()


def test_a_lora_student_adapts_while_its_teacher_is_the_reference(teacher_run, tmp_path):
  config = config_lib.load("lm-tiny", overrides=[
      *SMALL, f"finetune.base={teacher_run}", "finetune.lora.rank=4",
      f"finetune.distill.teacher={teacher_run}"])
  result = train.run(config, tmp_path / "lora")
  # The adapters start at zero: the student is its teacher, and drifts only as they train.
  assert 0 <= result["divergence"] < 0.05 and math.isfinite(result["eval_loss"])


def test_a_changed_teacher_is_refused_on_resume_naming_it(teacher_run, tmp_path, monkeypatch):
  config = _student(teacher_run)
  train.run(config, tmp_path / "s", stop_after=2)
  real = base_run.checksum
  monkeypatch.setattr(base_run, "checksum", lambda tree: real(tree) + 1)
  with pytest.raises(base_run.BaseCheckpointError, match="the teacher .* has changed since "
                                                         "this run started"):
    train.run(config, tmp_path / "s")


def test_a_teacher_of_other_tokens_or_none_or_on_pairs_is_one_line(teacher_run, tmp_path):
  with pytest.raises(ConfigError, match=r"speaks other tokens than this run \(tokenizer byte, "
                                        r"vocab_size 259; this run: tokenizer byte, vocab_size 300"):
    train.run(_student(teacher_run, "model.vocab_size=300"), tmp_path / "a")
  assert not (tmp_path / "a").exists()  # Refused before the workdir is made.
  with pytest.raises(base_run.BaseCheckpointError, match="no trained run there"):
    train.run(_student(tmp_path / "nothing"), tmp_path / "b")
  assert not (tmp_path / "b").exists()
  with pytest.raises(ConfigError, match="distillation learns on text, chats or prompts, not "
                                        "data.source="):
    config_lib.load("lm-tiny-dpo", overrides=[f"finetune.distill.teacher={teacher_run}"])
  with pytest.raises(ConfigError, match=r"finetune.distill.beta must be in \(0, 1\) for loss jsd"):
    _student(teacher_run, "finetune.distill.loss=jsd", "finetune.distill.beta=1.0")


WORDS = ["<unk>", "<s>", "</s>", "<pad>", "def", "return", "import", "self", "(", ")", ":", "=",
         "if", "else", "for", "in", "x", "y"]


def _hugging_face_teacher(directory, tokenizer, seed):
  """A Qwen3 of 32 ids written as transformers would, with its tokenizer.json."""
  from jax_ai_stack.recipes.models import hf

  model = Decoder(DecoderConfig(kind="qwen3", vocab_size=32, num_layers=2, d_model=48,
                                num_heads=2, num_kv_heads=1, head_dim=24, mlp_dim=96),
                  rngs=nnx.Rngs(seed))
  hf.save(model, directory, tokenizer=tokenizer)


def test_a_hugging_face_directory_teaches_and_a_changed_one_is_refused_on_resume(tmp_path):
  import tokenizers
  from tokenizers import models, pre_tokenizers

  words = tokenizers.Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)},
                                                unk_token="<unk>"))
  words.pre_tokenizer = pre_tokenizers.Whitespace()
  words.save(str(tmp_path / "tokenizer.json"))
  _hugging_face_teacher(tmp_path / "Teacher-1B", tmp_path / "tokenizer.json", seed=1)
  student = ["model.kind=qwen3", "model.vocab_size=32", "data.tokenizer=huggingface",
             f"data.tokenizer_path={tmp_path / 'tokenizer.json'}",
             f"finetune.distill.teacher={tmp_path / 'Teacher-1B'}"]
  config = config_lib.load("lm-tiny", overrides=[*SMALL, *STUDENT, *student])
  stopped = train.run(config, tmp_path / "s", stop_after=2)
  assert math.isfinite(stopped["divergence"]) and stopped["divergence"] > 0
  shutil.rmtree(tmp_path / "Teacher-1B")  # The directory, saved again from other weights.
  _hugging_face_teacher(tmp_path / "Teacher-1B", tmp_path / "tokenizer.json", seed=2)
  with pytest.raises(base_run.BaseCheckpointError, match="the teacher .*Teacher-1B has changed"):
    train.run(config, tmp_path / "s")
  other = tmp_path / "other.json"
  other.write_text((tmp_path / "tokenizer.json").read_text().replace('"self"', '"this"'))
  with pytest.raises(ConfigError, match=r"speaks other tokens than this run \(tokenizer "
                                        r"huggingface \(another file\), vocab_size 32"):
    train.run(config_lib.load("lm-tiny", overrides=[*SMALL, *STUDENT, *student,
                                                    f"data.tokenizer_path={other}"]),
              tmp_path / "o")


def test_on_prompts_the_student_learns_the_teacher_s_distribution_on_its_own_completions(
    teacher_run, tmp_path):
  """On-policy distillation (GKD at lambda 1): the student samples through the engine, as
  GRPO's rollouts do, and the teacher scores each sampled token; no reward is needed (the
  rewards given are logged)."""
  rl = ["finetune.base=null", "data.batch_size=2", "rl.num_generations=2",
        "rl.max_completion_tokens=6", "train.steps=2", "train.eval_every=2",
        "train.eval_batches=1", "checkpoint.save_every=2", "train.sample_tokens=0",
        "train.progress=false", *STUDENT, f"finetune.distill.teacher={teacher_run}"]
  config = config_lib.load("lm-tiny-grpo", overrides=[*rl, "rl.rewards=[]",
                                                      "rl.reward_weights=null"])
  assert isinstance(tasks.for_config(config).objective, distillation.LogitDistillation)
  result = train.run(config, tmp_path / "on-policy")
  assert result["divergence"] > 0 and 0 < result["completion_tokens"] <= 6
  assert "reward" not in result and result["eval_completion_tokens"] > 0
  rewarded = train.run(config_lib.load("lm-tiny-grpo", overrides=rl), tmp_path / "rewarded")
  assert 0 <= rewarded["reward_exact_answer"] <= 1 and "eval_reward" in rewarded
  with pytest.raises(ConfigError, match="rl.dynamic_sampling drops groups"):
    config_lib.load("lm-tiny-grpo", overrides=[*rl, "rl.dynamic_sampling=true"])
