"""Phases: a run resumed with other settings goes on under them, bitwise where planned."""

from __future__ import annotations

import pytest

from jax_ai_stack.errors import ConfigError
from jax_ai_stack.recipes import checkpoint, phases, train
from training_helpers import tiny_config, train_losses

COMPONENTS = "{logs: {paths: ['logging/*']}, js: {paths: ['json/*']}}"
FIRST = "{step: 0, weights: {logs: 3, js: 1}}"
SECOND = "{step: 0, weights: {js: 1}}"
GROWN = "data.batch_schedule=[{step: 6, batch_size: 8}]"  # From 4 rows per step to 8.
PLANNED = [f"data.mixture={{components: {COMPONENTS}, stages: [{FIRST}, {{step: 6, weights: {{js: 1}}}}]}}",
           GROWN]
SHORT = ["train.steps=12", "train.eval_every=6", "checkpoint.save_every=3", "train.sample_tokens=0"]


def _config(*extra):
  return tiny_config(*SHORT, *extra)


def _metadata(workdir):
  manager = checkpoint.build_manager(workdir / train.CHECKPOINT_DIR, checkpoint.CheckpointConfig(),
                                     read_only=True)
  try:
    return checkpoint.read_metadata(manager)
  finally:
    manager.close()


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
  """Both stages and the batch size planned from the start, never stopped."""
  workdir = tmp_path_factory.mktemp("planned")
  train.run(_config(*PLANNED), workdir)
  return workdir


@pytest.mark.slow
def test_a_run_resumed_at_the_stage_boundary_with_the_next_settings_equals_the_planned_one(
    planned, tmp_path, capsys):
  first = f"data.mixture={{components: {COMPONENTS}, stages: [{FIRST}]}}"
  second = [f"data.mixture={{components: {COMPONENTS}, stages: [{SECOND}]}}", GROWN]
  train.run(_config(first), tmp_path, stop_after=6)  # Stopped at the stage boundary.
  capsys.readouterr()
  train.run(_config(*second), tmp_path)
  out = capsys.readouterr().out
  assert "phase 2 from step 6: data.batch_schedule changed, data.mixture changed" in out
  assert train_losses(tmp_path) == train_losses(planned)
  assert checkpoint.tree_equal(train.Trainer.open_finished(tmp_path, optimizer_state=True).state,
                               train.Trainer.open_finished(planned, optimizer_state=True).state)
  metadata = _metadata(tmp_path)
  assert [p["step"] for p in metadata["phases"]] == [0, 6]
  stages = metadata["config"]["data"]["mixture"]["stages"]  # Composed: the run's own.
  assert stages == [{"step": 0, "weights": {"logs": 3.0, "js": 1.0}},
                    {"step": 6, "weights": {"js": 1.0}}]
  assert metadata["config"]["data"]["batch_schedule"] == [{"step": 6, "batch_size": 8}]
  capsys.readouterr()
  train.run(_config(*second), tmp_path)  # The same settings again: no new phase.
  assert "phase" not in capsys.readouterr().out


@pytest.mark.parametrize("change,field", [
    ("train.seed=1", "train.seed: 0 in the run, 1 now"),
    ("model.num_layers=2", "model.num_layers: 1 in the run, 2 now"),
    ("data.seq_len=8", "data.seq_len: 16 in the run, 8 now"),
    ("data.batch_size=8", "data.batch_size: 4 in the run, 8 now"),
])
def test_a_change_a_resumed_run_keeps_is_refused_by_field_and_nothing_is_touched(
    planned, change, field):
  files = {p: p.stat().st_mtime_ns for p in planned.rglob("*") if p.is_file()}
  with pytest.raises(ConfigError, match=rf"^{field}: a run in {planned} keeps its model"):
    train.run(_config(*PLANNED, change, "train.steps=20"), planned)
  assert {p: p.stat().st_mtime_ns for p in planned.rglob("*") if p.is_file()} == files


def test_how_the_model_runs_may_change_in_a_phase():
  saved = {"step": 4, "config": {"model": {"remat": "none", "num_layers": 1}}}
  resumed = phases.resume(saved, {"model": {"remat": "full", "num_layers": 1}}, "w")
  assert resumed.started == [("model.remat", "none", "full")] and len(resumed.phases) == 2


def test_a_phase_changed_again_at_its_first_step_replaces_it():
  saved = {"step": 4, "config": {"train": {"steps": 8}},
           "phases": [{"step": 0, "config": {"train": {"steps": 4}}},
                      {"step": 4, "config": {"train": {"steps": 8}}}]}
  resumed = phases.resume(saved, {"train": {"steps": 10}}, "w")
  assert [(p["step"], p["config"]["train"]["steps"]) for p in resumed.phases] == [(0, 4), (4, 10)]


def test_stages_compose_across_phases_and_components_keep_their_names():
  a = {"components": {"x": {}}, "stages": [{"step": 0, "weights": {"x": 1}}]}
  b = {"components": {"y": {}}, "stages": [{"step": 0, "weights": {"y": 1}},
                                          {"step": 20, "weights": {"y": 1, "x": 0}}]}
  history = [{"step": 0, "config": {"data": {"mixture": a}}}]
  mixed = phases.effective({"data": {"mixture": b}}, history, 10)["data"]["mixture"]
  assert list(mixed["components"]) == ["x", "y"]
  assert [s["step"] for s in mixed["stages"]] == [0, 10, 20]  # x's rows up to 10 stay dealt.
  assert mixed["stages"][1]["weights"] == {"y": 1}


def test_a_mixture_after_a_single_corpus_counts_its_stages_from_step_0():
  single = {"data": {"mixture": None}}
  mixture = {"components": {"x": {}}, "stages": [{"step": 0, "weights": {"x": 1}}]}
  composed = phases.effective({"data": {"mixture": mixture}}, [{"step": 0, "config": single}], 10)
  assert composed["data"]["mixture"]["stages"] == [{"step": 0, "weights": {"x": 1}}]


def test_a_batch_schedule_composes_across_phases():
  first = {"data": {"batch_size": 4, "batch_schedule": [{"step": 10, "batch_size": 8}]}}
  now = {"data": {"batch_size": 4, "batch_schedule": [{"step": 30, "batch_size": 16}]}}
  composed = phases.effective(now, [{"step": 0, "config": first}], 20)["data"]["batch_schedule"]
  # Steps 10-19 ran with 8 rows, as the first phase planned; 4 again from 20, then 16.
  assert composed == [{"step": 10, "batch_size": 8}, {"step": 20, "batch_size": 4},
                      {"step": 30, "batch_size": 16}]
  assert phases.effective(first, [], 0) == first
