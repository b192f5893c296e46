"""`workdir`: the checks of a run's directory and what its newest checkpoint says."""

from __future__ import annotations

import pytest

from jax_ai_stack.errors import WorkdirError
from jax_ai_stack.recipes import config, workdir


def test_a_file_is_no_workdir(tmp_path):
  (tmp_path / "run").write_text("")
  with pytest.raises(WorkdirError, match="workdir .*run is a file, not a directory"):
    workdir.prepare_workdir(tmp_path / "run", read_only=False)


def test_to_train_the_workdir_is_created_and_to_read_it_must_have_checkpoints(tmp_path):
  workdir.prepare_workdir(tmp_path / "a" / "run", read_only=False)
  assert (tmp_path / "a" / "run").is_dir() and not any((tmp_path / "a" / "run").iterdir())
  with pytest.raises(WorkdirError, match="no checkpoints in .*run: train there first"):
    workdir.prepare_workdir(tmp_path / "a" / "run", read_only=True)


def test_a_fresh_workdir_has_no_metadata_and_starts_its_first_phase(tmp_path):
  assert workdir.newest_metadata(tmp_path, capture_stderr=True) is None
  given = config.load("lm-tiny")
  resumed_config, resumed = workdir.resume_phases(given, None, tmp_path)
  assert resumed_config == given and len(resumed.phases) == 1


def test_the_written_config_loads_back_as_the_same_config(tmp_path):
  given = config.load("lm-tiny", overrides=["train.steps=3"])
  workdir.write_config(tmp_path, given)
  assert config.load(None, config_file=tmp_path / workdir.CONFIG_FILE) == given
