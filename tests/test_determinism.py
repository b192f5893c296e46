"""`train.deterministic`: the XLA flag set before the backend starts, said at start-up,
kept in the checkpoint, and a resume with another value begins a phase."""

from __future__ import annotations

import jax
import pytest

from jax_ai_stack import determinism
from jax_ai_stack.errors import ConfigError
from jax_ai_stack.recipes import checkpoint, config, train

from training_helpers import tiny_config


def test_configure_adds_the_gpu_flag_once_and_keeps_the_user_s_flags():
  environ = {"XLA_FLAGS": "--xla_dump_to=/tmp/x"}
  determinism.configure(True, environ=environ, started=False)
  determinism.configure(True, environ=environ, started=False)
  assert environ["XLA_FLAGS"] == "--xla_dump_to=/tmp/x " + determinism.GPU_FLAG


def test_configure_false_leaves_the_environment_alone():
  environ = {}
  determinism.configure(False, environ=environ, started=False)
  assert environ == {}


def test_the_last_mention_of_the_flag_wins_as_in_xla():
  off_last = {"XLA_FLAGS": f"{determinism.GPU_FLAG} --xla_gpu_deterministic_ops=false"}
  assert not determinism.gpu_flag_set(off_last)
  assert determinism.step_nondeterminism("gpu", off_last) is not None
  assert determinism.gpu_flag_set({"XLA_FLAGS": "--xla_gpu_deterministic_ops"})


def test_too_late_on_a_gpu_is_an_error_naming_both_ways_out(monkeypatch):
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  with pytest.raises(ConfigError, match="XLA_FLAGS=--xla_gpu_deterministic_ops=true.*"
                     "train.deterministic=false"):
    determinism.configure(True, environ={}, started=True)
  environ = {}
  determinism.configure(False, environ=environ, started=True)  # Nothing asked: no error.
  monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
  determinism.configure(True, environ=environ, started=True)  # The CPU needs no flag.
  assert environ == {}


def test_describe_names_the_setting_how_and_the_cost():
  on_gpu = determinism.describe(True, "gpu", {"XLA_FLAGS": determinism.GPU_FLAG})
  assert on_gpu.startswith("determinism: on") and "0.82x" in on_gpu
  assert "not bitwise" in determinism.describe(False, "gpu", {})
  assert determinism.describe(True, "cpu", {}) == (
      "determinism: on: XLA's CPU ops are deterministic, no cost")
  assert "changes nothing here" in determinism.describe(False, "tpu", {})


def test_the_run_says_it_stores_it_and_a_resume_with_another_value_is_a_new_phase(
    tmp_path, capsys):
  train.run(tiny_config("train.steps=2", "train.eval_every=0", "train.sample_tokens=0"), tmp_path)
  assert "determinism: on: XLA's CPU ops are deterministic" in capsys.readouterr().out
  manager = checkpoint.build_manager(tmp_path / train.CHECKPOINT_DIR, config.CheckpointConfig())
  saved = checkpoint.read_metadata(manager)["config"]
  manager.close()
  assert saved["train"]["deterministic"] is True
  longer = tiny_config("train.steps=3", "train.eval_every=0", "train.sample_tokens=0",
                       "train.deterministic=false")
  train.run(longer, tmp_path)  # A new phase: the steps after it run without the flag.
  assert "phase 2 from step 2: train.deterministic True -> False" in capsys.readouterr().out
