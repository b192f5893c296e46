"""The run record (record.json) and `train --replay`: a three-phase run re-run bitwise."""

from __future__ import annotations

import json
import pathlib

import pytest

from jax_ai_stack import cli
from jax_ai_stack.recipes import checkpoint, configlib, record, train
from training_helpers import STEPS, TINY, tiny_config, train_losses

COMPONENTS = "{logs: {paths: ['logging/*']}, js: {paths: ['json/*']}}"
SHORT = ["train.eval_every=4", "checkpoint.save_every=2", "train.sample_tokens=0"]


def _phase(steps, weights, *extra):
  return tiny_config(*SHORT, f"train.steps={steps}", *extra,
                     f"data.mixture={{components: {COMPONENTS}, stages: [{{step: 0, "
                     f"weights: {weights}}}]}}")


PHASES = [_phase(4, "{logs: 1}"), _phase(8, "{logs: 1, js: 1}"),
          _phase(12, "{js: 1}", "optim.learning_rate=1e-3")]  # A cooldown mix, a lower rate.


@pytest.fixture(scope="module")
def three_phases(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("phased")
  for config in PHASES:
    train.run(config, workdir)
  return workdir


@pytest.mark.slow
def test_the_record_lists_each_phase_and_what_it_ran_on(three_phases):
  recorded = json.loads((three_phases / record.RECORD_FILE).read_text())
  assert [p["step"] for p in recorded["phases"]] == [0, 4, 8]
  last = recorded["phases"][-1]
  assert last["config"]["optim"]["learning_rate"] == 1e-3
  assert last["backend"] == "cpu" and last["devices"] >= 1 and last["processes"] == 1
  assert last["versions"]["packages"]["jax"] and last["attention"]
  files = {"/".join(e["path"].split("/")[-2:]) for e in last["data_files"]}  # folder/file
  assert "logging/__init__.py" in files and "json/decoder.py" in files
  assert all(len(e["blake2b"]) == 32 for e in last["data_files"])


def test_a_replay_ends_with_the_same_bits(three_phases, tmp_path, capsys):
  replayed = tmp_path / "replayed"
  assert cli.main(["train", "--replay", str(three_phases / record.RECORD_FILE),
                   "--workdir", str(replayed)]) == 0
  out, err = capsys.readouterr()
  assert "note:" not in out + err  # Same machine, same versions, same files.
  assert "phase 2 from step 4" in out and "phase 3 from step 8" in out
  assert "replay: phase 1 of 3 ended at step 4; phase 2 begins" in out
  assert "Run the same command again" not in out  # Between phases nothing stopped.
  assert train_losses(replayed) == train_losses(three_phases)
  done, original = (train.Trainer.open_finished(replayed, optimizer_state=True),
                    train.Trainer.open_finished(three_phases, optimizer_state=True))
  try:
    assert done.step == original.step == 12
    assert checkpoint.tree_equal(done.state, original.state)
  finally:
    done.close()
    original.close()


def test_an_interrupted_replay_run_again_goes_on_from_its_phase(three_phases, tmp_path, capsys):
  replayed = tmp_path / "replayed"
  train.run(PHASES[0], replayed)
  train.run(PHASES[1], replayed, stop_after=6)  # As if killed in phase 2, saved at step 6.
  capsys.readouterr()
  assert cli.main(["train", "--replay", str(three_phases / record.RECORD_FILE),
                   "--workdir", str(replayed)]) == 0
  out = capsys.readouterr().out
  assert "phase 1 of 3 ended" not in out and "resumed from step 6" in out
  assert "replay: phase 2 of 3 ended at step 8; phase 3 begins" in out
  phases = json.loads((replayed / record.RECORD_FILE).read_text())["phases"]
  assert [p["step"] for p in phases] == [0, 4, 8]  # No phase of phase 1's config at step 6.
  assert train_losses(replayed) == train_losses(three_phases)


def test_a_changed_data_file_is_named_before_the_replay(tmp_path, capsys):
  corpus = tmp_path / "notes"
  corpus.mkdir()
  for i in range(4):
    (corpus / f"{i}.txt").write_text("".join(f"note {i} line {j}: grain orbax\n" for j in range(80)))
  config = tiny_config(*SHORT, "train.steps=2", "train.eval_every=0", "data.source=text",
                       f"data.paths=['{corpus}/*.txt']")
  train.run(config, tmp_path / "run")
  (corpus / "1.txt").write_text("changed\n" * 100)
  assert cli.main(["train", "--replay", str(tmp_path / "run" / record.RECORD_FILE),
                   "--workdir", str(tmp_path / "again")]) == 0
  err = capsys.readouterr().err  # Notes go to stderr, each on a line of its own.
  assert f"note: phase 1 (from step 0): data file {corpus / '1.txt'} changed\n" in err
  assert "note: the replay runs, but cannot promise the recorded bits\n" in err


@pytest.mark.parametrize("args,error", [
    (["--replay", "missing.json", "--workdir", "w"], "missing.json: not a run record"),
    (["--replay", "r.json"], "--replay needs --workdir"),
    (["--replay", "r.json", "--workdir", "w", "train.steps=3"], "no preset, --config or overrides"),
])
def test_bad_replays_are_one_line_and_exit_2(tmp_path, monkeypatch, capsys, args, error):
  monkeypatch.chdir(tmp_path)
  assert cli.main(["train", *args]) == 2
  assert error in capsys.readouterr().err


def _record(*phases) -> dict:
  return {"format": record.FORMAT, "phases": [
      {"step": step, "config": configlib.to_dict(tiny_config(*extra))} for step, *extra in phases]}


def _without(phase: dict, dotted: str) -> dict:
  section, _, field = dotted.partition(".")
  config = {**phase["config"]}
  if field:
    config[section] = {k: v for k, v in config[section].items() if k != field}
  else:
    del config[section]
  return {**phase, "config": config}


@pytest.mark.parametrize("damage, error", [
    (lambda r: {**r, "phases": [r["phases"][0], {"config": r["phases"][1]["config"]}]},
     'r.json: phase 2 has no "step"'),
    (lambda r: {**r, "phases": r["phases"][::-1]},
     "r.json: phase 1 begins at step 4: a run's first phase begins at step 0"),
    (lambda r: {**r, "phases": [r["phases"][0], r["phases"][1], {**r["phases"][1], "step": 2}]},
     "r.json: phase 3 begins at step 2, not after phase 2 (step 4)"),
    (lambda r: {**r, "phases": [r["phases"][0], _without(r["phases"][1], "optim")]},
     "r.json: phase 2 (from step 4): its config has no optim;"),
    (lambda r: {**r, "phases": [_without(r["phases"][0], "train.steps"), r["phases"][1]]},
     "r.json: phase 1 (from step 0): its config has no train.steps;"),
    (lambda r: {**r, "phases": [r["phases"][0], {"step": 4, "config": {
        **r["phases"][1]["config"], "train": {**r["phases"][1]["config"]["train"], "steps": 0}}}]},
     "r.json: phase 2 (from step 4)"),
], ids=["no-step", "first-not-0", "out-of-order", "section-removed", "field-removed", "invalid"])
def test_a_damaged_record_is_refused_before_anything_runs(tmp_path, monkeypatch, capsys, damage,
                                                         error):
  monkeypatch.chdir(tmp_path)
  whole = _record((0, "train.steps=4"), (4, "train.steps=8", "optim.learning_rate=1e-3"))
  pathlib.Path("r.json").write_text(json.dumps(damage(whole)))
  assert cli.main(["train", "--replay", "r.json", "--workdir", "w"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and error in err[0], err
  assert not pathlib.Path("w").exists()  # Nothing written.


def test_stop_after_ends_a_phase_at_a_planned_step_and_keeps_the_schedule(reference, tmp_path,
                                                                           capsys):
  """`--stop-after` saves and exits 0 without touching train.steps: the run resumed from
  there ends with the bits of the run that never stopped (the schedule kept its horizon)."""
  command = ["train", "lm-tiny", "--workdir", str(tmp_path), *TINY, f"train.steps={STEPS}"]
  assert cli.main([*command, "--stop-after", "10"]) == 0
  out = capsys.readouterr().out
  assert "stopped at step 10 (stop_after=10); checkpoint saved." in out
  assert "Run the same command again" not in out
  assert cli.main([*command, "--stop-after", "10"]) == 0  # Already there: nothing to do.
  assert "already at stop_after=10: nothing to do" in capsys.readouterr().out
  assert cli.main(command) == 0
  assert train_losses(tmp_path) == train_losses(reference[0])


def test_the_files_of_prompts_and_preference_pairs_are_recorded(tmp_path):
  from jax_ai_stack.recipes import config as config_lib  # pylint: disable=g-import-not-at-top
  prompts = tmp_path / "prompts.jsonl"
  prompts.write_text('{"prompt": "2 + 2 =", "answer": "4"}\n')
  data = config_lib.load("lm-tiny-grpo", overrides=["data.source=prompts",
                                                    f"data.paths=['{prompts}']"]).data
  [entry] = record.data_files(data)
  assert entry["path"] == str(prompts) and entry["size"] == prompts.stat().st_size
  assert record.data_files(config_lib.load("lm-tiny-grpo").data) == []  # Made on the fly.
  pairs = config_lib.load("lm-tiny-dpo").data
  assert pairs.is_preference and record.data_files(pairs)  # The standard library's files.
