"""GRPO runs end to end (killed and resumed, and what a whole run logs:
test_kill_and_resume.py): a KL penalty against the base with LoRA adapters off; a reward that fails
stops the run with one line and loses nothing."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from jax_ai_stack.recipes import config as config_lib
from jax_ai_stack.recipes import train
from training_helpers import checkpoint_paths, records

BASE = ["model.num_layers=1", "model.d_model=32", "model.num_heads=2", "model.num_kv_heads=1",
        "model.mlp_dim=64", "train.progress=false", "train.sample_tokens=0"]
RL = [*BASE, "data.max_documents=200", "data.validation_fraction=0.1", "data.batch_size=2",
      "rl.num_generations=4", "rl.max_completion_tokens=6", "train.eval_every=3",
      "train.eval_batches=1", "checkpoint.save_every=1", "train.log_every=1",
      "optim.learning_rate=0.01"]
STEPS = 6
VARIED = "rl.rewards=[test_rl_rewards:distinct_characters]"
"""A reward an untrained model's completions differ in: each group has a signal."""


@pytest.fixture(autouse=True)
def tests_importable(monkeypatch):
  """The test modules importable in the `jax-ai-stack train` children (for `VARIED`)."""
  here = str(pathlib.Path(__file__).parent)
  monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [here, os.environ.get(
      "PYTHONPATH")])))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
  """A 2-step lm-tiny base."""
  workdir = tmp_path_factory.mktemp("rl") / "base"
  train.run(config_lib.load("lm-tiny", overrides=[*BASE, "data.max_documents=30",
                                                  "train.steps=2", "train.eval_every=0"]),
            workdir)
  return workdir


@pytest.mark.slow
def test_a_stop_inside_a_rollout_waits_for_its_last_update(base, tmp_path):
  overrides = [*RL, f"finetune.base={base}", "train.steps=6", VARIED, "rl.reward_weights=null",
               "rl.updates_per_rollout=3", "checkpoint.save_every=3", "train.eval_every=3"]
  result = train.run(config_lib.load("lm-tiny-grpo", overrides=overrides), tmp_path / "run",
                     stop_after=1)
  assert result["step"] == 3 and result["stopped_by"] == "stop_after=1"


@pytest.mark.slow
def test_a_kl_penalty_compares_with_the_base_through_lora_adapters_switched_off(base, tmp_path):
  overrides = [*RL, f"finetune.base={base}", "train.steps=3", "finetune.lora={rank: 4}",
               "rl.beta=0.5", "train.eval_every=0", "optim.learning_rate=0.05", VARIED,
               "rl.reward_weights=null"]
  train.run(config_lib.load("lm-tiny-grpo", overrides=overrides), tmp_path / "lora")
  steps = records(tmp_path / "lora", "train")
  assert steps[0]["kl"] == 0.0  # Step 1: the adapters' B is zero, the policy is the base.
  assert any(r["kl"] > 0 for r in steps[1:]) and all(r["kl"] >= 0 for r in steps)
  assert not [p for p in checkpoint_paths(tmp_path / "lora") if "reference" in p]


@pytest.mark.slow
def test_a_reward_that_fails_stops_the_run_with_one_line_and_loses_nothing(base, tmp_path):
  (tmp_path / "my_rewards.py").write_text(
      "def fine(prompts, completions, **columns):\n"
      "  return [0.5] * len(completions)\n"
      "def broken(prompts, completions, answer, **columns):\n"
      "  return [float(len(a) / 0) for a in answer]\n")
  workdir = tmp_path / "run"
  common = [*RL, f"finetune.base={base}", "train.eval_every=0", "rl.reward_weights=null"]

  def cli(*extra):
    return subprocess.run(
        [sys.executable, "-m", "jax_ai_stack.cli", "train", "lm-tiny-grpo", "--workdir",
         str(workdir), *common, *extra], capture_output=True, text=True, cwd=tmp_path,
        env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=300)

  assert cli("train.steps=2", "rl.rewards=[my_rewards:fine]").returncode == 0
  saved = checkpoint_paths(workdir)
  result = cli("train.steps=4", "rl.rewards=[my_rewards:broken]")
  assert result.returncode == 2, result.stderr
  lines = [line for line in result.stderr.splitlines() if line.strip()]
  assert lines[-1] == ("jax-ai-stack train: error: rl.rewards: my_rewards:broken raised "
                       "ZeroDivisionError: division by zero"), result.stderr
  assert checkpoint_paths(workdir) == saved


@pytest.mark.slow
def test_the_progress_lines_and_the_last_line_show_the_reward_and_its_parts(base, tmp_path,
                                                                            capsys):
  """They showed `loss 0.000` alone: a group-relative loss says nothing of what is learnt."""
  overrides = [*RL, f"finetune.base={base}", "train.steps=2", "train.eval_every=0",
               "train.progress=true", VARIED, "rl.reward_weights=null"]
  train.run(config_lib.load("lm-tiny-grpo", overrides=overrides), tmp_path / "run")
  out, err = capsys.readouterr()
  progress = [line for line in err.splitlines() if line.startswith("step ")]
  assert progress and all(", reward " in line and ", reward_distinct_characters " in line
                          for line in progress), err
  [done] = [line for line in out.splitlines() if line.startswith("done:")]
  assert ", reward " in done and "reward_distinct_characters" in done, out
