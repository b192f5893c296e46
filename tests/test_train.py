"""The trainer end to end at tiny size: outputs, bitwise resume in one process (after a
SIGKILL: test_kill_and_resume.py), preemption, and the bad-input paths that must lose nothing already saved."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from jax_ai_stack import cli
from jax_ai_stack.errors import ConfigError
from jax_ai_stack.recipes import checkpoint, config, phases, train
from jax_ai_stack.recipes import run as run_lib
from jax_ai_stack.recipes import workdir as workdir_lib
from jax_ai_stack.recipes import trainer as trainer_lib
from jax_ai_stack.recipes.tasks.lm import SAMPLE_FILE

from training_helpers import STEPS, TINY, tiny_config, train_losses


def final_state(workdir):
  trainer = train.Trainer.open_finished(workdir, optimizer_state=True)
  trainer.close()
  return trainer.step, trainer.state


def test_run_writes_metrics_plot_sample_and_checkpoints(reference):
  workdir, result = reference
  assert result["step"] == STEPS and result["stopped_by"] is None
  losses = [loss for _, loss in train_losses(workdir)]
  assert [s for s, _ in train_losses(workdir)] == list(range(1, STEPS + 1))
  assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5  # The loss falls.
  evals = [r for r in train.read_metrics(workdir) if r["split"] == "eval"]
  assert [r["step"] for r in evals] == [10, 20, 30]
  assert all(r["eval_perplexity"] > 1 for r in evals)
  assert (workdir / train.PLOT_FILE).read_bytes()[:4] == b"\x89PNG"
  assert (workdir / SAMPLE_FILE).read_text(encoding="utf-8").startswith("def ")
  assert list((workdir / "tensorboard").glob("events.out.tfevents.*"))
  manager = checkpoint.build_manager(workdir / train.CHECKPOINT_DIR, checkpoint.CheckpointConfig())
  assert manager.latest_step() == STEPS
  metadata = checkpoint.read_metadata(manager)
  assert metadata["step"] == STEPS and metadata["config"]["train"]["steps"] == STEPS
  manager.close()
  # The resolved config, whole: `train --config W/config.yaml` runs it again.
  assert config.load(None, config_file=workdir / workdir_lib.CONFIG_FILE) == tiny_config()


@pytest.mark.slow
def test_in_process_stop_and_resume_is_bitwise_identical(reference, tmp_path):
  ref_dir, _ = reference
  stopped = train.run(tiny_config(), tmp_path, stop_after=7)  # Not a multiple of save_every.
  assert stopped["step"] == 7 and stopped["stopped_by"]
  assert (tmp_path / train.PLOT_FILE).exists()  # The steps so far; the sample waits for the end.
  assert not (tmp_path / SAMPLE_FILE).exists()
  with open(tmp_path / train.METRICS_FILE, "a") as f:
    f.write('{"step": 8, "split": "tr')  # A line torn by a kill mid-write.
  resumed = train.run(tiny_config(), tmp_path)
  assert resumed["step"] == STEPS
  assert train_losses(tmp_path) == train_losses(ref_dir)
  step_a, state_a = final_state(ref_dir)
  step_b, state_b = final_state(tmp_path)
  assert step_a == step_b == STEPS
  assert checkpoint.tree_equal(state_a, state_b)


def test_a_finished_run_is_read_without_its_optimizer_state_unless_asked(reference):
  # AdamW's moments are twice the parameters: generate, serve, eval and export need none.
  workdir, _ = reference
  step, whole = final_state(workdir)
  trainer = train.Trainer.open_finished(workdir, validation=True)
  try:
    assert list(trainer.state) == [0] and list(whole) == [0, 1]
    assert checkpoint.tree_equal(trainer.state[0], whole[0])  # The model, bitwise.
    assert not [x for x in jax.tree.leaves(nnx.state(trainer.optimizer))
                if isinstance(x, jax.Array)]  # Left abstract: nothing read or allocated.
    assert trainer.step == step and np.isfinite(trainer.evaluate()["eval_loss"])
    assert trainer.generate("def ", 4, 0.0).startswith("def ")
  finally:
    trainer.close()


def test_finished_run_resumes_instantly(reference, capsys):
  ref_dir, _ = reference
  before = train_losses(ref_dir)
  result = train.run(tiny_config(), ref_dir)
  out = capsys.readouterr().out
  assert "nothing to do" in out
  model = tiny_config().model  # 259 byte ids in 384 rows (model.vocab_multiple=128), tied.
  rows = model.padded_vocab_size - model.vocab_size
  assert model.tie_embeddings and rows == 125
  assert (f"{model.num_params():,} parameters, of which {rows * model.d_model:,} in 125 rows of "
          "vocabulary padding (259 -> 384, model.vocab_multiple=128)") in out
  assert result["step"] == STEPS
  assert train_losses(ref_dir) == before


def test_nan_loss_stops_with_the_step_and_keeps_the_last_good_checkpoint(tmp_path):
  diverging = tiny_config("optim.name=sgd", "optim.learning_rate=1e30", "optim.grad_clip_norm=null",
                          "optim.warmup_steps=0", "optim.schedule=constant",
                          "checkpoint.save_every=1")
  with pytest.raises(train.TrainingError, match=r"step \d+: .*not finite") as info:
    train.run(diverging, tmp_path)
  bad_step = int(str(info.value).split()[1].rstrip(":"))
  step, state = final_state(tmp_path)
  assert step == bad_step - 1
  import jax
  import numpy as np

  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state)
             if np.issubdtype(np.asarray(x).dtype, np.floating))


def test_a_nan_found_at_a_later_fetch_names_its_own_step_and_nothing_after_it_is_saved(tmp_path):
  diverging = ["optim.name=sgd", "optim.learning_rate=1e30", "optim.grad_clip_norm=null",
               "optim.warmup_steps=0", "optim.schedule=constant", "train.eval_every=0"]
  with pytest.raises(train.TrainingError) as every_step:
    train.run(tiny_config(*diverging, "train.log_every=1", "checkpoint.save_every=1"),
              tmp_path / "each")
  with pytest.raises(train.TrainingError) as deferred:
    train.run(tiny_config(*diverging, "train.log_every=25", "checkpoint.save_every=25"),
              tmp_path / "deferred")
  bad_step = int(str(every_step.value).split()[1].rstrip(":"))
  assert str(deferred.value).startswith(f"step {bad_step}: ")
  step, state = final_state(tmp_path / "deferred")
  assert step < bad_step
  import jax
  import numpy as np

  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state)
             if np.issubdtype(np.asarray(x).dtype, np.floating))


def test_metrics_are_fetched_once_per_log_interval_and_every_step_is_logged(tmp_path, monkeypatch):
  fetched = []
  fetch = train.Trainer.fetch
  monkeypatch.setattr(train.Trainer, "fetch", lambda self, pending, elapsed: (
      fetched.append([n for n, _ in pending]), fetch(self, pending, elapsed))[1])
  train.run(tiny_config("train.steps=12", "train.log_every=5", "train.eval_every=6",
                        "train.sample_tokens=0", "checkpoint.save_every=100"), tmp_path)
  # The first step (start-up line), every 5th, before the evaluations at 6 and 12.
  assert fetched == [[1], [2, 3, 4, 5], [6], [7, 8, 9, 10], [11, 12]]
  records = [r for r in train.read_metrics(tmp_path) if r["split"] == "train"]
  assert [r["step"] for r in records] == list(range(1, 13))
  assert all(r["step_time"] > 0 and r["throughput"] > 0 for r in records)
  assert records[1]["step_time"] == records[4]["step_time"]  # Shared out over the interval.


def test_a_step_that_does_not_save_builds_no_checkpoint_metadata(tmp_path, monkeypatch):
  # Built per call it cost 8.5 ms a step on an H100, more than a small model's step.
  built = []
  metadata = train.Trainer.checkpoint_metadata
  monkeypatch.setattr(train.Trainer, "checkpoint_metadata",
                      lambda self: (built.append(self.step), metadata(self))[1])
  train.run(tiny_config("train.steps=7", "train.sample_tokens=0", "train.eval_every=0",
                        "checkpoint.save_every=3"), tmp_path)
  assert built == [1, 3, 6, 7]  # The first save into an empty directory, every 3rd, the last.


def test_checkpoint_that_does_not_fit_names_the_parameter_and_changes_nothing(reference, tmp_path):
  ref_dir, _ = reference
  ckpt = ref_dir / train.CHECKPOINT_DIR
  before = {p: p.stat().st_mtime_ns for p in ckpt.rglob("*")}
  with pytest.raises(ConfigError, match=(
      rf"model.d_model: 32 in the run, 64 now: a run in {ref_dir} keeps its model, tokenizer")):
    train.run(tiny_config("model.d_model=64"), ref_dir)
  assert {p: p.stat().st_mtime_ns for p in ckpt.rglob("*")} == before


def test_corrupt_newest_checkpoint_falls_back_and_keeps_good_ones(tmp_path, capsys):
  train.run(tiny_config("train.steps=10", "train.sample_tokens=0"), tmp_path)
  ckpt = tmp_path / train.CHECKPOINT_DIR
  steps_before = sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit())
  assert steps_before[-1] == 10
  for path in (ckpt / "10" / "state").rglob("*"):
    if path.is_file():
      path.write_bytes(b"garbage")
  trainer = train.Trainer.open(tiny_config("train.steps=10"), tmp_path)
  trainer.close()
  assert trainer.step == 5
  assert "checkpoint step 10 is unreadable" in capsys.readouterr().err  # Printed: one clean line.
  assert (ckpt / "10.corrupt").is_dir()  # Moved aside, not deleted.
  assert (ckpt / "5").is_dir()


def test_cli_keeps_a_corrupt_steps_library_output_off_the_terminal(tmp_path):
  # The command line asks build_run to capture fd 2 while a damaged step is read; a fresh
  # interpreter, where asyncio's "Event loop is closed" tracebacks reach stderr.
  train.run(tiny_config("train.steps=10", "train.sample_tokens=0"), tmp_path)
  for path in (tmp_path / train.CHECKPOINT_DIR / "10" / "state").rglob("*"):
    if path.is_file() and path.parent.name == "d":  # Array data: TensorStore's threads print.
      path.write_bytes(b"garbage")
  result = subprocess.run([sys.executable, "-m", "jax_ai_stack.cli", "eval", "--workdir",
                           str(tmp_path)], capture_output=True, text=True, timeout=300,
                          check=False)
  assert result.returncode == 0, result.stderr
  waits = re.compile(r".* \.\.\.( \d+ s)?")  # A phase over 5 s on a loaded machine says so.
  assert [line for line in result.stderr.splitlines() if not waits.fullmatch(line)] == [
      "warning: checkpoint step 10 is unreadable (state: truncated); skipped, using step 5"]


def test_the_commands_ask_build_run_to_capture_a_damaged_steps_output(reference, tmp_path,
                                                                       monkeypatch, capsys):
  # The wiring behind the test above, which can pass by luck: TensorStore's threads print
  # only when they lose a race.
  ref_dir = _copy_run(reference[0], tmp_path)  # The train command below must not touch it.
  asked = []

  def recording(*args, **kwargs):
    asked.append(kwargs.get("capture_stderr"))
    return real(*args, **kwargs)

  real = run_lib.build_run
  monkeypatch.setattr(run_lib, "build_run", recording)
  monkeypatch.setattr(train, "build_run", recording)
  monkeypatch.setattr(trainer_lib, "build_run", recording)  # Trainer.open_finished's.
  assert cli.main(["eval", "--workdir", str(ref_dir)]) == 0
  assert cli.main(["generate", "--workdir", str(ref_dir), "--prompt", "a",
                   "--max-new-tokens", "1"]) == 0
  assert cli.main(["train", "lm-tiny", "--workdir", str(ref_dir), *TINY,
                   f"train.steps={STEPS}"]) == 0  # Finished: nothing trains.
  assert asked == [True, True, True]
  train.Trainer.open_finished(ref_dir).close()  # A library call: the process's stderr stays.
  assert asked[-1] is None
  capsys.readouterr()


def test_resume_never_refuses_a_used_workdir(reference):
  ref_dir, _ = reference
  with pytest.raises(train.WorkdirError, match="already has checkpoints"):
    train.run(tiny_config(), ref_dir, resume="never")


def test_unwritable_workdir_is_named(tmp_path):
  blocker = tmp_path / "a-file"
  blocker.write_text("")
  with pytest.raises(train.WorkdirError, match="a-file/run is not writable"):
    train.run(tiny_config(), blocker / "run")


@pytest.mark.slow
def test_cli_train_eval_generate(tmp_path, capsys):
  workdir = str(tmp_path / "run")
  assert cli.main(["train", "lm-tiny", "--workdir", workdir, *TINY, "train.steps=4"]) == 0
  out = capsys.readouterr().out
  assert "done: step 4" in out and "loss.png" in out
  assert cli.main(["eval", "--workdir", workdir]) == 0
  report = json.loads(capsys.readouterr().out)
  assert report["step"] == 4 and report["eval_loss"] > 0
  assert cli.main(["generate", "--workdir", workdir, "--prompt", "import ", "--max-new-tokens", "5"]) == 0
  assert capsys.readouterr().out.startswith("import ")


def test_generate_input_gives_one_json_line_per_request_equal_to_generate_alone(
    reference, tmp_path, capsys):
  ref_dir, _ = reference
  prompts = ["def ", "x", "import os"]
  path = tmp_path / "in.jsonl"
  path.write_text("".join(json.dumps({"prompt": p}) + "\n\n" for p in prompts))
  assert cli.main(["generate", "--workdir", str(ref_dir), "--input", str(path),
                   "--max-new-tokens", "6", "--temperature", "0.7", "--seed", "3"]) == 0
  results = {r["index"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
  assert sorted(results) == [0, 1, 2]
  trainer = train.Trainer.open_finished(ref_dir)
  try:  # Decoded together, each as it comes alone (the engine is batch-invariant).
    for index, prompt in enumerate(prompts):
      assert results[index]["text"] == trainer.generate(prompt, 6, 0.7, seed=3)
      assert results[index]["tokens"] == 6 and results[index]["finish_reason"] == "length"
  finally:
    trainer.close()
  assert cli.main(["generate", "--workdir", str(ref_dir), "--input", str(path),
                   "--top-k", "1000"]) == 2
  assert "request 0: top_k must be in [1, 259]; got 1000" in capsys.readouterr().err
  path.write_text('{"prompt": "a"}\n{"nope": 1}\n')
  assert cli.main(["generate", "--workdir", str(ref_dir), "--input", str(path)]) == 2
  assert f"{path}:2: a line holds" in capsys.readouterr().err


def test_generate_input_follows_each_line_s_response_format(reference, tmp_path, capsys):
  """An empty prompt's continuation at temperature 1 is JSON its line's schema accepts (the
  run's context is 32 tokens: no room for a conversation), beside a free prompt; a malformed
  response_format is named by its line."""
  jsonschema = pytest.importorskip("jsonschema")
  schema = {"type": "object", "properties": {"n": {"enum": [1, 2, 3]}}, "required": ["n"],
            "additionalProperties": False}
  path = tmp_path / "in.jsonl"
  ruled = {"prompt": "", "response_format": {
      "type": "json_schema", "json_schema": {"name": "n", "schema": schema}}}
  path.write_text(json.dumps(ruled) + "\n" + json.dumps({"prompt": "def "}) + "\n")
  assert cli.main(["generate", "--workdir", str(ref_dir := reference[0]), "--input", str(path),
                   "--max-new-tokens", "40", "--temperature", "1", "--seed", "0"]) == 0
  results = {r["index"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
  jsonschema.validate(json.loads(results[0]["text"]), schema)
  assert results[0]["finish_reason"] == "stop" and results[1]["text"].startswith("def ")
  path.write_text(json.dumps({**ruled, "response_format": {"type": "yaml"}}) + "\n")
  assert cli.main(["generate", "--workdir", str(ref_dir), "--input", str(path)]) == 2
  assert f"{path}:1: response_format must be" in capsys.readouterr().err


def test_generate_speculate_prints_the_same_text_and_the_share_kept(reference, tmp_path,
                                                                     capsys):
  """--speculate: stdout bit for bit the text without it (greedy, and seeded sampling), the
  summary the guessed tokens kept; a K under 1 is named."""
  ref_dir, _ = reference
  path = tmp_path / "in.jsonl"
  path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("def def def ", "x")))
  for sampling in (["--temperature", "0"], ["--temperature", "1", "--seed", "4"]):
    command = ["generate", "--workdir", str(ref_dir), "--input", str(path),
               "--max-new-tokens", "12", *sampling]
    assert cli.main(command) == 0
    plain = sorted(capsys.readouterr().out.splitlines())
    assert cli.main([*command, "--speculate", "3"]) == 0
    out, err = capsys.readouterr()
    assert sorted(out.splitlines()) == plain
    assert re.search(r"; \d+ of \d+ guessed tokens kept \(\d+%\)$", err.strip())
  assert cli.main(["generate", "--workdir", str(ref_dir), "--speculate", "0"]) == 2
  assert "--speculate must be at least 1" in capsys.readouterr().err


@pytest.mark.slow
def test_generate_draft_guesses_with_another_run_of_the_same_tokens(reference, tmp_path,
                                                                    capsys):
  """--draft: the run itself drafts (its guesses all kept, greedy), the text unchanged; a
  run of another vocabulary is refused in one line."""
  ref_dir, _ = reference
  command = ["generate", "--workdir", str(ref_dir), "--prompt", "def f(x):", "--temperature",
             "0", "--max-new-tokens", "12"]
  assert cli.main(command) == 0
  plain = capsys.readouterr().out
  assert cli.main([*command, "--draft", str(ref_dir), "--speculate", "2"]) == 0
  out, err = capsys.readouterr()
  assert out == plain
  kept = re.search(r"; (\d+) of (\d+) guessed tokens kept", err)
  assert kept and kept[1] == kept[2] != "0", err
  other = tmp_path / "other"
  train.run(tiny_config("model.vocab_size=300", "train.steps=1", "train.sample_tokens=0"), other)
  assert cli.main([*command, "--draft", str(other)]) == 2
  assert (f"--draft {other}: tokenizer byte, vocab_size 300; the run it drafts for: tokenizer "
          "byte, vocab_size 259: a draft model needs the same tokenizer and vocabulary"
          ) in capsys.readouterr().err


def test_generate_input_stops_a_request_at_its_stop_strings(reference, tmp_path, capsys):
  """The text ends before the first stop string of the reply (not of the prompt), and the
  engine stops decoding there."""
  ref_dir, _ = reference
  path = tmp_path / "in.jsonl"
  path.write_text(json.dumps({"prompt": "def "}) + "\n")
  assert cli.main(["generate", "--workdir", str(ref_dir), "--input", str(path),
                   "--max-new-tokens", "12", "--temperature", "0"]) == 0
  free = json.loads(capsys.readouterr().out)["text"]
  stop = free[6:8]  # Two characters the greedy reply makes after its first two.
  path.write_text(json.dumps({"prompt": "def ", "stop": [stop, "def"]}) + "\n")
  assert cli.main(["generate", "--workdir", str(ref_dir), "--input", str(path),
                   "--max-new-tokens", "12", "--temperature", "0"]) == 0
  stopped = json.loads(capsys.readouterr().out)
  assert stopped["text"] == free[:free.index(stop, 4)]
  assert stopped["finish_reason"] == "stop" and stopped["tokens"] < 12
  path.write_text(json.dumps({"prompt": "def ", "stop": [""]}) + "\n")
  assert cli.main(["generate", "--workdir", str(ref_dir), "--input", str(path)]) == 2
  assert f'{path}:1: "stop" must be a string or a list of non-empty strings' in (
      capsys.readouterr().err)


@pytest.mark.parametrize(
    "args, message",
    [
        (["train", "nope"], "unknown preset 'nope'"),
        (["train", "model.num_layer=1"], "did you mean 'model.num_layers'"),
        (["eval", "--workdir", "/nonexistent/run"], "no checkpoints in /nonexistent/run"),
    ],
)
def test_cli_usage_errors_exit_2_with_one_line(args, message, capsys):
  assert cli.main(args) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and message in err[0]


def test_cli_mismatched_workdir_exits_2(reference, capsys):
  ref_dir, _ = reference
  assert cli.main(["train", "--workdir", str(ref_dir), *TINY, f"train.steps={STEPS}",
                   "model.mlp_dim=128"]) == 2
  err = capsys.readouterr().err
  assert "model.mlp_dim: 64 in the run, 128 now: a run in" in err and len(err.splitlines()) == 1


def test_attention_choice_is_saved_in_checkpoint_metadata(reference):
  from jax_ai_stack import kernels

  ref_dir, _ = reference
  manager = checkpoint.build_manager(ref_dir / train.CHECKPOINT_DIR, checkpoint.CheckpointConfig())
  attention = checkpoint.read_metadata(manager)["attention"]
  manager.close()
  assert attention["implementation"] in kernels.IMPLEMENTATIONS
  assert attention["deterministic"] is True


def test_autotuned_attention_is_pinned_on_resume(tmp_path, capsys):
  from jax_ai_stack import kernels

  tuned = tiny_config("train.autotune_attention=true", "train.sample_tokens=0")
  reason = kernels.autotune_unsupported_reason()
  if reason:  # This row's tokamax cannot autotune: a clear error, nothing written.
    with pytest.raises(kernels.AutotuneError, match="tokamax"):
      train.run(tuned, tmp_path, stop_after=3)
    assert not (tmp_path / kernels.AUTOTUNE_FILENAME).exists()
    return
  train.run(tuned, tmp_path, stop_after=3)
  path = tmp_path / kernels.AUTOTUNE_FILENAME
  tuned_at = path.stat().st_mtime_ns
  train.run(tuned, tmp_path)
  assert path.stat().st_mtime_ns == tuned_at  # Loaded on resume, not tuned again.
  out = capsys.readouterr().out
  assert out.count("pinned by autotune file") == 2


@pytest.mark.slow
def test_digits_preset_reaches_95_percent_validation_accuracy(tmp_path):
  result = train.run(config.load("digits-cnn", overrides=["train.progress=false"]), tmp_path)
  assert result["eval_accuracy"] > 0.95


def test_cli_names_the_extra_when_scikit_learn_is_missing(tmp_path, capsys, monkeypatch):
  for name in [m for m in sys.modules if m == "sklearn" or m.startswith("sklearn.")]:
    monkeypatch.delitem(sys.modules, name)
  monkeypatch.setitem(sys.modules, "sklearn", None)  # `import sklearn` now fails.
  assert cli.main(["train", "digits-cnn", "--workdir", str(tmp_path)]) == 2
  assert "jax-ai-stack[digits]" in capsys.readouterr().err


def test_eval_and_generate_run_the_kernel_the_training_run_used(tmp_path, monkeypatch):
  from jax_ai_stack import kernels

  monkeypatch.setenv(kernels.ENV_VAR, "xla")  # Not what "auto" picks on CPU.
  train.run(tiny_config("train.steps=2", "train.sample_tokens=0", "train.eval_every=0"), tmp_path)
  monkeypatch.delenv(kernels.ENV_VAR)
  trainer = train.Trainer.open_finished(tmp_path)
  trainer.close()
  assert trainer.attention_choice.name == "xla"
  request = trainer.task.attention_request()
  assert trainer.attention.select(request).name == "xla"
  assert kernels.resolve_plan("auto", environ={}).select(request).name != "xla"
  layer_plans = {block.attention.attention_plan for block in trainer.model.layers}
  assert layer_plans == {trainer.attention}  # The model runs under the saved plan.
  manager = checkpoint.build_manager(tmp_path / train.CHECKPOINT_DIR, checkpoint.CheckpointConfig())
  saved = checkpoint.read_metadata(manager)["attention"]
  manager.close()
  assert saved["implementation"] == "xla" and kernels.ENV_VAR in saved["source"]


def test_a_section_newer_than_the_checkpoint_starts_no_phase():
  saved = {"step": 3, "config": {"train": {"steps": 3}}}  # Written before `quant` existed.
  assert phases.resume(saved, {"train": {"steps": 3}, "quant": {"qat": None}}, "w").started == []
  assert phases.resume(saved, {"train": {"steps": 4}}, "w").started == [("train.steps", 3, 4)]


def test_a_resumed_run_keeps_the_kernel_it_was_trained_with_unless_one_is_named(
    tmp_path, monkeypatch):
  # Trained on xla; `auto` prefers another kernel now (as after an upgrade of the table).
  monkeypatch.setenv("JAX_AI_STACK_ATTENTION", "xla")
  train.run(tiny_config("train.steps=2", "train.eval_every=0"), tmp_path)
  monkeypatch.delenv("JAX_AI_STACK_ATTENTION")
  fresh = train.Trainer.open(tiny_config(), tmp_path / "other")
  try:
    assert fresh.attention_choice.name != "xla"
  finally:
    fresh.close()
  resumed = train.Trainer.open(tiny_config(), tmp_path)
  try:
    assert resumed.step == 2 and resumed.attention_choice.name == "xla"
  finally:
    resumed.close()
  named = train.Trainer.open(tiny_config(f"model.attention_impl={fresh.attention_choice.name}"),
                             tmp_path)
  try:
    assert named.attention_choice.name == fresh.attention_choice.name
  finally:
    named.close()


# ---- restore fails closed -----------------------------------------------------


@pytest.fixture(scope="module")
def ten_steps(tmp_path_factory):
  """A finished 10-step run: checkpoints at steps 1, 5 and 10."""
  workdir = tmp_path_factory.mktemp("ten-steps")
  train.run(tiny_config("train.steps=10", "train.sample_tokens=0"), workdir)
  return workdir


def _copy_run(source, tmp_path):
  workdir = tmp_path / "run"
  shutil.copytree(source, workdir)
  return workdir


def _steps_and_metrics(workdir):
  return (sorted(p.name for p in (workdir / train.CHECKPOINT_DIR).iterdir()),
          (workdir / train.METRICS_FILE).read_bytes())


def _garble_metadata(workdir, step):
  (workdir / train.CHECKPOINT_DIR / str(step) / "meta" / "metadata").write_text('{"step": 1')


def test_out_of_memory_while_restoring_stops_the_run_and_changes_nothing(
    ten_steps, tmp_path, monkeypatch):
  workdir = _copy_run(ten_steps, tmp_path)
  before = _steps_and_metrics(workdir)
  real = checkpoint.Manager.restore

  def out_of_memory(self, step, *args, **kwargs):
    if "state" in kwargs.get("args", {}).keys():
      raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 68719476736 bytes.")
    return real(self, step, *args, **kwargs)

  monkeypatch.setattr(checkpoint.Manager, "restore", out_of_memory)
  with pytest.raises(jax.errors.JaxRuntimeError, match="RESOURCE_EXHAUSTED"):
    train.run(tiny_config("train.steps=12", "train.sample_tokens=0"), workdir)
  assert _steps_and_metrics(workdir) == before  # No step moved aside, no metrics cut.


def test_no_readable_step_is_exit_2_naming_each_and_changes_nothing(ten_steps, tmp_path, capsys):
  workdir = _copy_run(ten_steps, tmp_path)
  for step in (1, 5, 10):
    _garble_metadata(workdir, step)
  before = _steps_and_metrics(workdir)
  code = cli.main(["train", "lm-tiny", "--workdir", str(workdir), *TINY, "train.steps=12",
                   "train.sample_tokens=0"])
  assert code == 2
  [line] = [x for x in capsys.readouterr().err.splitlines() if "error:" in x]
  assert ("is readable (step 10: meta/metadata: not valid JSON; step 5: meta/metadata: not valid "
          "JSON; step 1: meta/metadata: not valid JSON); nothing was moved") in line
  assert cli.main(["eval", "--workdir", str(workdir)]) == 2
  assert _steps_and_metrics(workdir) == before


@pytest.mark.slow
def test_read_only_commands_skip_a_garbled_newest_step_and_move_nothing(
    ten_steps, tmp_path, capsys):
  workdir = _copy_run(ten_steps, tmp_path)
  _garble_metadata(workdir, 10)
  before = _steps_and_metrics(workdir)
  warning = ("warning: checkpoint step 10 is unreadable (meta/metadata: not valid JSON); "
             "skipped, using step 5")
  for command in (["eval"], ["generate", "--max-new-tokens", "4"], ["quantize", "--scheme", "w8"],
                  ["export-hf", str(tmp_path / "hf")]):
    assert cli.main([*command, "--workdir", str(workdir)]) == 0, command
    err = capsys.readouterr().err
    assert err.count(warning) == 1 and "Traceback" not in err, (command, err)
    assert _steps_and_metrics(workdir) == before, command
  trainer = train.Trainer.open(tiny_config("train.steps=10"), workdir)  # Writable: moved aside.
  trainer.close()
  assert trainer.step == 5
  assert ("warning: checkpoint step 10 is unreadable (meta/metadata: not valid JSON); moved aside "
          "to 10.corrupt, resuming from step 5") in capsys.readouterr().err
  assert _steps_and_metrics(workdir)[0] == ["1", "10.corrupt", "5"]


@pytest.mark.parametrize("corpus", ["missing/*.txt", "empty/*.txt"])
def test_refused_data_leaves_no_workdir_behind(tmp_path, capsys, corpus):
  (tmp_path / "empty").mkdir()
  (tmp_path / "empty" / "a.txt").write_text("")
  workdir = tmp_path / "runs" / "new"
  assert cli.main(["train", "--workdir", str(workdir), *TINY, "data.source=text",
                   f"data.paths=[{tmp_path / corpus}]"]) == 2
  assert "data" in capsys.readouterr().err
  assert not workdir.exists()
  existing = tmp_path / "existing"  # A workdir that was there before stays.
  existing.mkdir()
  assert cli.main(["train", "--workdir", str(existing), *TINY, "data.source=text",
                   f"data.paths=[{tmp_path / corpus}]"]) == 2
  assert existing.is_dir()
