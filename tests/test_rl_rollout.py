"""The rollout: a group of completions per prompt from the engine, seeded by step and prompt,
scored and laid out as rows whose mask is the completion; the held-out evaluation."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from flax import nnx

from jax_ai_stack.errors import DataError
from jax_ai_stack.recipes import config as config_lib
from jax_ai_stack.recipes import tasks
from jax_ai_stack.recipes.rl import rollout
from jax_ai_stack.recipes.tasks import grpo

SMALL = ["model.num_layers=1", "model.d_model=32", "model.num_heads=2", "model.num_kv_heads=1",
         "model.mlp_dim=64", "data.max_documents=200", "data.validation_fraction=0.1",
         "rl.num_generations=4", "rl.max_completion_tokens=6", "rl.advantage=dr_grpo"]


@pytest.fixture(scope="module")
def task_and_model():
  task = tasks.for_config(config_lib.load("lm-tiny-grpo", overrides=SMALL))
  return task, task.build_model(0)


def test_a_batch_holds_each_prompt_s_group_as_rows_masked_on_the_completion(task_and_model):
  task, model = task_and_model
  rollouts = task.rollouts
  batch, metrics = rollouts.batch(model, lambda: {"prompt_index": np.array([3, 1])}, step=5)
  samples = rollouts.sample(model, "train", [3, 1], 4, rollouts.rl.temperature, step=5)
  rows = rollout.row_length(max(s.prompt_ids.size + len(s.tokens) for s in samples) - 1, 64)
  assert batch["inputs"].shape == batch["sampler_logps"].shape == (8, rows)
  assert batch["advantages"].shape == (8,)
  np.testing.assert_allclose(batch["advantages"].reshape(2, 4).sum(axis=1), 0.0, atol=1e-6)
  for row, sample in enumerate(samples):
    prompt = sample.prompt_ids.size
    completion = batch["targets"][row][batch["loss_mask"][row] > 0]
    assert completion.tolist() == sample.tokens  # The mask: the completion, its stop token too.
    assert batch["inputs"][row, :prompt].tolist() == sample.prompt_ids.tolist()
    np.testing.assert_array_equal(batch["sampler_logps"][row][batch["loss_mask"][row] > 0],
                                  np.float32(sample.logprobs))
  assert set(metrics) >= {"reward", "reward_std", "reward_exact_answer", "reward_answer_format",
                          "completion_tokens", "completions_cut", "groups_without_signal"}
  # What a step is compiled for ahead of time (Task.batch_spec: 2 prompts, 4 completions
  # each) is this batch's every field and dtype, its rows data.seq_len long: the longest.
  spec = task.batch_spec(2)
  assert {k: v.dtype for k, v in batch.items()} == {k: s.dtype for k, s in spec.items()}
  assert all(v.shape[0] == spec[k].shape[0] and v.shape[1:] <= spec[k].shape[1:]
             for k, v in batch.items())
  assert spec["inputs"].shape == (8, 64)


def test_samples_depend_on_the_step_and_the_prompt_not_on_the_batch(task_and_model):
  task, model = task_and_model
  rollouts = task.rollouts
  alone = rollouts.sample(model, "train", [7], 4, 1.0, step=2)
  among = rollouts.sample(model, "train", [0, 7, 9], 4, 1.0, step=2)[4:8]
  assert [s.tokens for s in alone] == [s.tokens for s in among]
  later = rollouts.sample(model, "train", [7], 4, 1.0, step=3)
  assert [s.tokens for s in later] != [s.tokens for s in alone]
  assert len({tuple(s.tokens) for s in alone}) > 1  # A group holds different completions.


def test_the_evaluation_measures_greedy_and_sampled_rewards_the_same_each_time(task_and_model):
  task, model = task_and_model
  batches = [{"prompt_index": np.array([0, 1, 2, 3])}] * 3
  first = task.rollouts.evaluate(model, iter(batches), max_batches=1)
  assert set(first) == {"eval_reward", "eval_reward_exact_answer", "eval_reward_answer_format",
                        "eval_sampled_reward", "eval_completion_tokens"}
  assert first == task.rollouts.evaluate(model, iter(batches), max_batches=1)


def test_a_prompt_that_leaves_no_room_for_a_completion_is_named(task_and_model, tmp_path):
  path = tmp_path / "p.jsonl"
  path.write_text("".join(f'{{"prompt": "{i}{"x" * 80}", "answer": "1"}}\n' for i in range(20)))
  task = tasks.for_config(config_lib.load("lm-tiny-grpo", overrides=[
      *SMALL, "data.source=prompts", f"data.paths=[{path}]", "data.validation_fraction=0.0"]))
  with pytest.raises(DataError, match=r"prompt 0 of the train split is \d+ tokens and leaves "
                                      r"no room for a completion in data.seq_len \+ 1 = 65"):
    task.rollouts.sample(task_and_model[1], "train", [0], 2, 1.0, step=0)


def parity_or_text(prompts, completions, answer, **columns):
  """All equal for an answer of even length (no signal); for an odd one, a number drawn
  from the text (different completions: different rewards)."""
  del prompts, columns
  return [0.0 if len(a) % 2 == 0 else float(zlib.crc32(c.encode()) % 1000)
          for a, c in zip(answer, completions)]


def test_dynamic_sampling_drops_groups_without_signal_and_draws_more_prompts(task_and_model):
  task = tasks.for_config(config_lib.load("lm-tiny-grpo", overrides=[
      *SMALL, f"rl.rewards=[{__name__}:parity_or_text]", "rl.reward_weights=null",
      "rl.dynamic_sampling=true", "rl.max_draws=4"]))
  records = task.rollouts.splits["train"].records
  odd = [i for i, r in enumerate(records[:40]) if len(r["answer"]) % 2]
  draws = iter([{"prompt_index": np.arange(start, start + 4)} for start in range(0, 40, 4)])
  batch, metrics = task.rollouts.batch(task_and_model[1], lambda: next(draws), step=0)
  drawn = int(metrics["prompt_batches_drawn"])
  expected = [i for i in odd if i < 4 * drawn][:4]
  assert len(expected) == 4 and drawn < 4  # Enough odd answers among the first draws.
  kept = [len(records[i]["answer"]) % 2 for i in expected]
  assert kept == [1, 1, 1, 1] and metrics["groups_without_signal"] == 0.0
  assert metrics["groups_dropped"] == (4 * drawn - len([i for i in odd if i < 4 * drawn])) / (
      4 * drawn)
  assert batch["inputs"].shape[0] == 16
  assert next(draws)["prompt_index"][0] == 4 * drawn  # Exactly `drawn` batches were taken.


def test_the_overlong_penalty_falls_linearly_over_the_buffer(task_and_model):
  task = tasks.for_config(config_lib.load("lm-tiny-grpo", overrides=[
      *SMALL, "rl.overlong_buffer=2", "rl.overlong_penalty=0.5"]))
  samples = [rollout.Sample(np.zeros(1, np.int32), [0] * n, [0.0] * n, "stop", "")
             for n in (3, 4, 5, 6)]
  np.testing.assert_allclose(task.rollouts._overlong(samples), [0.0, 0.0, -0.25, -0.5])


def test_a_gap_between_engine_and_trainer_is_said_once_with_its_correction(task_and_model):
  task, _ = task_and_model
  rollouts = rollout.Rollouts(task.config, task.tokenizer(), task.prompt_encoder())
  assert rollouts.notice({"sampler_logp_gap": 2e-5, "loss": 1.0}) is None  # CPU's arithmetic.
  line = rollouts.notice({"sampler_logp_gap": 2e-3})
  assert line == ("the engine's log-probabilities differ from the trainer's by up to 2.0e-03 "
                  "(cpu kernels): truncated importance sampling weighs each token by "
                  "min(p_trainer / p_engine, rl.importance_cap=3)")
  assert rollouts.notice({"sampler_logp_gap": 5e-3}) is None  # Once.


def test_a_rollout_slot_holds_a_prompt_and_its_completion_not_the_model_s_context(
    engine_lengths):
  task = tasks.for_config(config_lib.load("lm-tiny-grpo",
                                          overrides=[*SMALL, "model.max_seq_len=1024"]))
  samples = task.rollouts.sample(task.build_model(0), "train", [0, 1], 2, 1.0, step=0)
  assert len(samples) == 4
  assert engine_lengths == [task.config.data.seq_len + 1] < [1024]  # One length a run.


def test_rows_are_as_long_as_the_longest_sequence_rounded_up_not_data_seq_len(task_and_model):
  """The update costs what the rows hold: with data.seq_len=127 the same rollout lays its rows
  out in as many positions as data.seq_len=64 does (its longest rounded up: `row_length`),
  the first columns of what 127 would hold, the rest of which is padding only."""
  task, model = task_and_model
  long_rows = tasks.for_config(config_lib.load("lm-tiny-grpo", overrides=[
      *SMALL, "data.seq_len=127"]))  # The model's context: 128.
  draw = lambda: {"prompt_index": np.array([3, 1])}  # noqa: E731
  batch, _ = task.rollouts.batch(model, draw, step=5)
  longer, _ = long_rows.rollouts.batch(model, draw, step=5)
  samples = task.rollouts.sample(model, "train", [3, 1], 4, task.rollouts.rl.temperature, step=5)
  longest = max(s.prompt_ids.size + len(s.tokens) for s in samples) - 1
  rows = rollout.row_length(longest, 127)
  assert 32 < longest <= rows <= 64 and rows == rollout.row_length(longest, 64)
  assert batch["inputs"].shape == longer["inputs"].shape == (8, rows)
  for key, value in batch.items():
    np.testing.assert_array_equal(value, longer[key], err_msg=key)
  padded = rollout.examples.one_per_row(
      [(np.concatenate([s.prompt_ids, s.tokens]), np.ones(s.prompt_ids.size + len(s.tokens)))
       for s in samples], seq_len=127, pad_id=task.tokenizer().pad_id)
  assert not padded["segment_ids"][:, rows:].any()  # What 127 positions add: padding alone.
