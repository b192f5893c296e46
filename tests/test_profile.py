"""`train.profile`: a trace of a range of steps that XProf opens, and the memory profile."""

from __future__ import annotations

import pytest

from jax_ai_stack.errors import ConfigError
from jax_ai_stack.recipes import profile, train
from training_helpers import tiny_config, train_losses


@pytest.mark.slow
def test_the_profiled_steps_are_traced_and_annotated_and_nothing_else_changes(tmp_path, capsys):
  cfg = tiny_config("train.steps=6", "train.eval_every=0", "train.profile=2:4")
  train.run(cfg, tmp_path / "profiled")
  out = capsys.readouterr().out
  directory = tmp_path / "profiled" / profile.PROFILE_DIR
  assert (f"profile of steps 2-3 in {directory}: open it with `xprof --logdir {directory}` "
          "(pip install 'jax-ai-stack[profile]')") in out
  traces = list(directory.glob("plugins/profile/*/*.xplane.pb"))
  assert len(traces) == 1
  assert profile.STEP_NAME.encode() in traces[0].read_bytes()  # Each step's annotation.
  assert (directory / profile.MEMORY_FILE).stat().st_size > 0
  train.run(tiny_config("train.steps=6", "train.eval_every=0"), tmp_path / "plain")
  assert train_losses(tmp_path / "profiled") == train_losses(tmp_path / "plain")


def test_a_run_stopped_inside_the_range_ends_its_trace(tmp_path, capsys):
  train.run(tiny_config("train.steps=6", "train.eval_every=0", "train.profile=2:5"), tmp_path,
            stop_after=3)
  assert "profile of steps 2-4 in" in capsys.readouterr().out
  assert list((tmp_path / profile.PROFILE_DIR).glob("plugins/profile/*/*.xplane.pb"))


@pytest.mark.parametrize("setting", ["4:2", "0:3", "a:b", "3:3", "3-5"])
def test_a_bad_range_is_refused_by_name(setting):
  with pytest.raises(ConfigError, match=rf"train\.profile='{setting}': give START:STOP with "
                                        r"1 <= START < STOP"):
    tiny_config(f"train.profile={setting}")
  with pytest.raises(ConfigError, match=r"field 'train\.profile': Input should be a valid string"):
    tiny_config("train.profile=3")
