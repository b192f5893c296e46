"""A model of one's own (`tasks.CustomTask`, `model.kind: custom`) through the trainer."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import grain
import jax
import numpy as np
import pytest
from flax import nnx

from jax_ai_stack.errors import ConfigError, UsageError
from jax_ai_stack.recipes import checkpoint, config, data, tasks, train

# The module a user writes: an MLP, its loss and a Grain dataset, and the function
# that makes the Task (what `model.task` names for the commands).
MY_MODEL = textwrap.dedent('''
    import grain, numpy as np, optax
    from flax import nnx
    from jax_ai_stack.recipes import tasks

    class MLP(nnx.Module):
      def __init__(self, width, *, rngs):
        self.hidden, self.out = nnx.Linear(2, width, rngs=rngs), nnx.Linear(width, 2, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)

      def __call__(self, x):
        return self.out(self.dropout(nnx.relu(self.hidden(x))))

    def loss(model, batch):
      logits = model(batch["x"])
      accuracy = (logits.argmax(-1) == batch["y"]).mean()
      return (optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(),
              {"accuracy": accuracy})

    def dataset(split, seed):
      rng = np.random.default_rng(0 if split == "train" else 1)
      points = rng.normal(size=(256, 2)).astype(np.float32)
      data = grain.MapDataset.source([{"x": p, "y": int(p[0] * p[1] > 0)} for p in points])
      if split == "train":
        data = data.shuffle(seed=seed).repeat()
      return data.batch(16, drop_remainder=True)

    def task(config):
      width = config.model.settings["width"]
      return tasks.CustomTask(config, model=lambda rngs: MLP(width, rngs=rngs), loss=loss,
                              dataset=dataset)
''')

SETTINGS = ["model.kind=custom", "model.settings.width=16", "data.source=custom",
            "data.batch_size=16", "train.steps=12", "train.eval_every=6", "train.eval_batches=2",
            "checkpoint.save_every=4", "optim.warmup_steps=2", "train.progress=false"]


@pytest.fixture(scope="module")
def my_model(tmp_path_factory):
  folder = tmp_path_factory.mktemp("user")
  (folder / "my_model.py").write_text(MY_MODEL)
  sys.path.insert(0, str(folder))
  try:
    import my_model  # pylint: disable=import-outside-toplevel

    yield folder, my_model
  finally:
    sys.path.remove(str(folder))
    sys.modules.pop("my_model", None)


def _config(*extra):
  return config.load("none", overrides=[*SETTINGS, *extra])


def _leaves(trainer):
  return [np.asarray(x) for x in jax.tree.leaves(trainer.state)]


@pytest.mark.slow
def test_a_model_of_ones_own_resumes_bitwise_and_reopens_read_only(my_model, tmp_path, capsys):
  _, module = my_model
  straight = train.Trainer.open(_config(), tmp_path / "straight", task=module.task)
  straight.fit()
  straight.close()

  first = train.Trainer.open(_config(), tmp_path / "stopped", task=module.task)
  assert first.fit(stop_after=4)["stopped_by"] == "stop_after=4"
  first.close()
  capsys.readouterr()
  second = train.Trainer.open(_config(), tmp_path / "stopped", task=module.task)
  assert second.fit()["step"] == 12
  second.close()
  assert "resumed from step 4" in capsys.readouterr().out  # fit says so itself.
  assert (tmp_path / "stopped" / train.PLOT_FILE).exists()  # fit leaves the plot.

  done = train.Trainer.open_finished(tmp_path / "stopped", task=module.task, validation=True,
                                     optimizer_state=True)
  reference = train.Trainer.open_finished(tmp_path / "straight", task=module.task,
                                          optimizer_state=True)
  try:
    assert done.step == reference.step == 12
    assert checkpoint.tree_equal(done.state, reference.state)  # Dropout included.
    assert set(done.evaluate()) == {"eval_loss", "eval_accuracy"}
  finally:
    done.close()
    reference.close()
  stopped_log = [r for r in train.read_metrics(tmp_path / "stopped") if r["split"] == "train"]
  straight_log = [r for r in train.read_metrics(tmp_path / "straight") if r["split"] == "train"]
  assert [r["loss"] for r in stopped_log] == [r["loss"] for r in straight_log]


def test_the_saved_config_is_the_runs_own(my_model, tmp_path):
  _, module = my_model
  trainer = train.Trainer.open(_config("train.steps=2", "train.eval_every=0"), tmp_path,
                               task=module.task)
  trainer.fit()
  trainer.close()
  saved = checkpoint.read_metadata(checkpoint.build_manager(
      tmp_path / train.CHECKPOINT_DIR, checkpoint.CheckpointConfig(), read_only=True))["config"]
  assert saved["model"] == {"kind": "custom", "task": None, "settings": {"width": 16}}
  assert saved["data"]["source"] == "custom"
  # Without model.task, only Python can rebuild the Task: the error says how.
  with pytest.raises(UsageError, match=r"model\.kind=custom.*task=\.\.\..*model\.task="):
    train.Trainer.open_finished(tmp_path)


def _cli(folder, *args):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-m", "jax_ai_stack.cli", *args], cwd=folder,
                        capture_output=True, text=True, env=env, check=False)


@pytest.mark.slow
def test_the_commands_import_the_task_that_model_task_names(my_model):
  folder, _ = my_model
  (folder / "mine.yaml").write_text(textwrap.dedent("""
      preset: none
      name: quadrants
      model: {kind: custom, task: "my_model:task", settings: {width: 16}}
      data: {source: custom, batch_size: 16}
      train: {steps: 4, eval_every: 4, eval_batches: 2, progress: false}
  """))
  trained = _cli(folder, "train", "--config", "mine.yaml", "--workdir", "runs/q")
  assert trained.returncode == 0, trained.stderr
  assert "recipe quadrants:" in trained.stdout and "eval_accuracy" in trained.stdout
  evaluated = _cli(folder, "eval", "--workdir", "runs/q")
  assert evaluated.returncode == 0, evaluated.stderr
  assert '"eval_accuracy"' in evaluated.stdout
  refused = _cli(folder, "generate", "--workdir", "runs/q", "--prompt", "x")
  assert refused.returncode == 2
  assert refused.stderr.strip() == ("jax-ai-stack generate: error: model.kind='custom' "
                                    "does not generate text")
  missing = _cli(folder, "train", "--config", "mine.yaml", "--workdir", "runs/missing",
                 "model.task=not_there:task")
  assert missing.returncode == 2
  assert "model.task='not_there:task' does not import (ModuleNotFoundError" in missing.stderr
  assert not (folder / "runs" / "missing").exists()


def _task(cfg, **changes):
  parts = dict(model=lambda rngs: nnx.Linear(2, 1, rngs=rngs),
               loss=lambda model, batch: (model(batch["x"]) ** 2).mean(),
               dataset=lambda split, seed: grain.MapDataset.source(
                   [{"x": np.ones(2, np.float32)}] * 8).repeat().batch(4))
  return tasks.CustomTask(cfg, **{**parts, **changes})


def test_a_bare_scalar_loss_and_the_defaults(tmp_path):
  cfg = _config("train.steps=2", "train.eval_every=0", "data.batch_size=4")
  task = _task(cfg)
  assert task.items_per_step == 4 and task.batch_axes() == {}
  loss, metrics = task.loss(task.build_model(0), {"x": np.ones((4, 2), np.float32)})
  assert loss.shape == () and metrics == {}
  assert train.run(cfg, tmp_path, task=task)["step"] == 2


def test_a_dataset_that_is_not_grain_is_refused_by_name():
  task = _task(_config(), dataset=lambda split, seed: [{"x": np.ones((4, 2))}])
  with pytest.raises(ConfigError, match=r"dataset\('train', seed\) returned a list: it must "
                                        r"return a grain\.MapDataset or grain\.IterDataset"):
    task.dataset("train", 0)


def test_model_task_must_return_a_task():
  with pytest.raises(ConfigError, match=r"model\.task='builtins:str' returned a str, not a "
                                        r"jax_ai_stack\.recipes\.tasks\.Task"):
    tasks.for_config(_config("model.task=builtins:str"))


def test_custom_data_goes_only_with_a_model_of_ones_own():
  with pytest.raises(ConfigError, match=r"model\.kind='llama' does not go with "
                                        r"data\.source='custom'"):
    config.load("lm-tiny", overrides=["data.source=custom"])
  with pytest.raises(ConfigError, match=r"model\.kind='cnn' does not go with data\.source="):
    config.load("digits-cnn", overrides=["data.source=custom"])
  with pytest.raises(ConfigError, match=r"data\.source='custom' has no data here"):
    data.build_dataset(_config().data, split="train", seed=0)
