"""`train.eval_tasks`: harness tasks at a run's evaluations, logged with the held-out metrics
(once each across a kill and a resume: test_kill_and_resume.py); a bad task name stops the run before its first step."""

from __future__ import annotations

import pytest

from jax_ai_stack.errors import ConfigError
from jax_ai_stack.recipes import config as config_lib
from jax_ai_stack.recipes import train
from jax_ai_stack.recipes.evaluation import in_training
from test_evaluation_harness import write_tasks
from training_helpers import TINY

HARNESS = ("eval_harness_tiny_sums_acc", "eval_harness_tiny_calls_exact_match")


def _run(tmp_path, *overrides: str) -> list[str]:
  tasks = write_tasks(tmp_path / "tasks")
  return [*TINY, "train.steps=8", "train.eval_every=4", "checkpoint.save_every=2",
          f"train.eval_tasks=[{tasks}]", "train.eval_tasks_limit=3", *overrides]


def _evals(workdir) -> list[dict]:
  return [r for r in train.read_metrics(workdir) if r["split"] == "eval"]


@pytest.mark.slow
def test_the_tasks_run_at_their_evaluations_and_are_logged_with_its_metrics(tmp_path):
  """Every 8 steps (and at the end), among evaluations every 4."""
  overrides = _run(tmp_path, "train.steps=12", "train.eval_tasks_every=8")
  train.run(config_lib.load("lm-tiny", overrides=overrides), tmp_path / "run")
  evals = _evals(tmp_path / "run")
  assert [r["step"] for r in evals] == [4, 8, 12]
  assert [r["step"] for r in evals if HARNESS[0] in r] == [8, 12]
  for record in evals[1:]:
    assert "eval_loss" in record and all(0 <= record[name] <= 1 for name in HARNESS)
  assert (tmp_path / "run" / "loss.png").stat().st_size > 0


@pytest.mark.slow  # The harness indexes its tasks (about 15 s).
@pytest.mark.parametrize("overrides, message", [
    (["train.eval_tasks=[nope_not_a_task]"], "train.eval_tasks: no task 'nope_not_a_task'"),
    (["train.eval_tasks=[./no/such/dir]"], "train.eval_tasks ./no/such/dir: no such file or directory"),
])
def test_a_bad_task_stops_the_run_before_its_first_step(tmp_path, overrides, message):
  config = config_lib.load("lm-tiny", overrides=[*TINY, "train.steps=2", *overrides])
  with pytest.raises(ConfigError, match=message):
    train.run(config, tmp_path / "run")
  assert not (tmp_path / "run").exists()  # Resolved before the workdir is made.


@pytest.mark.parametrize("overrides, message", [
    (["train.eval_tasks=[stdlib]", "train.eval_every=0"], "set train.eval_every"),
    (["train.eval_tasks=[stdlib]", "train.eval_tasks_every=15"],
     "train.eval_tasks_every=15 must be a multiple of train.eval_every=10"),
    (["train.eval_tasks_limit=0"], "train.eval_tasks_limit must be >= 1"),
])
def test_settings_that_do_not_fit_name_the_field(overrides, message):
  with pytest.raises(ConfigError, match=message):
    config_lib.load("lm-tiny", overrides=[*TINY, *overrides])


def test_the_harness_s_results_become_one_metric_each():
  results = {"results": {"sums": {"alias": "sums", "acc,none": 0.5, "acc_stderr,none": 0.1},
                         "calls": {"exact_match,strict-match": 1.0, "exact_match_stderr,"
                                   "strict-match": "N/A"}}}
  assert in_training.metric_names(results) == {
      "eval_harness_sums_acc": 0.5, "eval_harness_calls_exact_match_strict-match": 1.0}
