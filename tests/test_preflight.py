"""`preflight`: what a config names is imported before a run builds or writes anything."""

from __future__ import annotations

import pytest

from jax_ai_stack.errors import ConfigError, WorkdirError
from jax_ai_stack.recipes import config as config_lib
from jax_ai_stack.recipes import preflight, train

from training_helpers import TINY


def test_a_run_on_prompts_names_its_rewards_and_a_custom_model_its_task():
  grpo = config_lib.load("lm-tiny-grpo", overrides=["rl.rewards=[a:one,b.c:two]", "rl.reward_weights=null"])
  assert preflight.references(grpo) == [("rl.rewards", "a:one"), ("rl.rewards", "b.c:two")]
  assert preflight.references(config_lib.load("lm-tiny")) == []  # Rewards of no run on prompts.


@pytest.mark.parametrize("ref, message", [
    ("my_rewardz:parity", r"rl.rewards='my_rewardz:parity' does not import \(ModuleNotFoundError: "
                          r"No module named 'my_rewardz'\)"),
    ("jax_ai_stack.recipes.rl.rewards:nope", r"rl.rewards=.*rewards:nope' does not import"),
    ("jax_ai_stack.recipes.rl.rewards:_WORD", r"rl.rewards: .*_WORD' is a Pattern, not a function"),
])
def test_a_reward_that_does_not_import_is_named_with_its_field(ref, message):
  with pytest.raises(ConfigError, match=message):
    preflight.check_references(config_lib.load("lm-tiny-grpo", overrides=[f"rl.rewards=[{ref}]", "rl.reward_weights=null"]))


def test_a_bad_reward_stops_the_run_before_the_workdir_exists(tmp_path, capsys):
  """It was reported after the model was built and compiled, leaving config.yaml,
  record.json, an empty metrics.jsonl and checkpoints/ behind."""
  cfg = config_lib.load("lm-tiny-grpo", overrides=[*TINY, "rl.rewards=[my_rewardz:parity]", "rl.reward_weights=null"])
  with pytest.raises(ConfigError, match=r"rl.rewards='my_rewardz:parity'.*my_rewardz"):
    train.run(cfg, tmp_path / "run")
  assert not (tmp_path / "run").exists()
  assert "compiling" not in capsys.readouterr().out


def test_a_notebooks_trainer_open_checks_them_too(tmp_path):
  cfg = config_lib.load("lm-tiny-grpo", overrides=[*TINY, "rl.rewards=[my_rewardz:parity]", "rl.reward_weights=null"])
  with pytest.raises(ConfigError, match="rl.rewards"):
    train.Trainer.open(cfg, tmp_path / "run")
  assert not (tmp_path / "run").exists()


def test_harness_tasks_on_a_model_with_no_language_model_are_refused_before_the_workdir(tmp_path):
  cfg = config_lib.load("digits-cnn", overrides=["train.eval_tasks=[stdlib]", "train.steps=2"])
  with pytest.raises(ConfigError, match="train.eval_tasks: ImageClassification has no language "
                                        "model"):
    train.run(cfg, tmp_path / "run")
  assert not (tmp_path / "run").exists()


def test_a_fresh_runs_missing_base_is_named_before_the_data_is_read_or_the_workdir_made(
    tmp_path, capsys):
  """It was named after the data was read and the model built, leaving an empty
  checkpoints/ behind."""
  cfg = config_lib.load("lm-tiny-sft", overrides=[*TINY, f"finetune.base={tmp_path / 'nope'}"])
  with pytest.raises(WorkdirError, match=r"finetune.base=.*nope': no trained run there"):
    train.run(cfg, tmp_path / "run")
  assert not (tmp_path / "run").exists()
  assert "note: train split" not in capsys.readouterr().err


def test_a_resumed_run_reads_the_base_its_checkpoint_points_to_not_the_configs(tmp_path):
  (tmp_path / "run" / "checkpoints" / "5").mkdir(parents=True)
  cfg = config_lib.load("lm-tiny-sft", overrides=[*TINY, "finetune.base=moved/away"])
  preflight.check_base(cfg, tmp_path / "run")  # No error: the pointer decides.
  with pytest.raises(WorkdirError, match="no trained run there"):
    preflight.check_base(cfg, tmp_path / "fresh")
