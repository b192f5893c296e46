"""Tasks: the registry, and a third model family that the unchanged trainer trains.

The regression family below lives in this file only: its model, config, data
and loss. If the trainer or the config had a branch on the model kind, it
could not train, checkpoint and resume it.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import sys
from typing import Literal

import grain
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_ai_stack.recipes import checkpoint, config, tasks, train
from jax_ai_stack.recipes.checkpoint import CheckpointConfig
from jax_ai_stack.recipes.config import TrainConfig
from jax_ai_stack.recipes.configlib import config_dataclass
from jax_ai_stack.recipes.optim import OptimConfig
from jax_ai_stack.recipes.sharding import MeshConfig

PACKAGE = pathlib.Path(tasks.__file__).resolve().parent.parent.parent  # jax_ai_stack/


@config_dataclass
class MLPConfig:
  kind: Literal["mlp"] = "mlp"
  features: int = 4
  hidden: int = 16


@config_dataclass
class RegressionRecipe:
  name: str = "regression"
  model: MLPConfig = dataclasses.field(default_factory=MLPConfig)
  optim: OptimConfig = dataclasses.field(
      default_factory=lambda: OptimConfig(learning_rate=1e-2, warmup_steps=0))
  checkpoint: CheckpointConfig = dataclasses.field(
      default_factory=lambda: CheckpointConfig(save_every=4))
  train: TrainConfig = dataclasses.field(
      default_factory=lambda: TrainConfig(steps=12, eval_every=6, eval_batches=2, progress=False))
  mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)


class MLP(nnx.Module):
  def __init__(self, config: MLPConfig, rngs: nnx.Rngs):
    self.hidden = nnx.Linear(config.features, config.hidden, rngs=rngs)
    self.out = nnx.Linear(config.hidden, 1, rngs=rngs)

  def __call__(self, x):
    return self.out(nnx.relu(self.hidden(x)))[:, 0]


class SyntheticBatches:
  """Step s -> a batch of y = sum(x) + noise, a pure function of (seed, s)."""

  def __init__(self, features: int, seed: int):
    self.features, self.seed = features, seed

  def __call__(self, step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng([self.seed, int(step)])
    x = rng.normal(size=(8, self.features)).astype(np.float32)
    return {"x": x, "y": x.sum(-1) + 0.01 * rng.normal(size=8).astype(np.float32)}


class Regression(tasks.Task):
  model_config = MLPConfig

  def build_model(self, seed, attention=None, layout=None):
    return MLP(self.config.model, nnx.Rngs(seed))

  def loss(self, model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2), {}

  def dataset(self, split, seed):
    steps = sys.maxsize if split == "train" else 4
    salt = seed if split == "train" else seed + 10_000
    return grain.MapDataset.range(steps).map(
        SyntheticBatches(self.config.model.features, salt)).to_iter_dataset()

  @property
  def items_per_step(self):
    return 8

  def batch_axes(self):
    return {"x": ("batch", None), "y": ("batch",)}


def test_a_third_family_trains_checkpoints_and_resumes_bitwise(tmp_path):
  recipe = RegressionRecipe()
  whole = train.run(recipe, tmp_path / "whole", task=Regression(recipe))
  assert whole["step"] == 12 and whole["stopped_by"] is None
  losses = [r["loss"] for r in train.read_metrics(tmp_path / "whole") if r["split"] == "train"]
  assert np.mean(losses[-3:]) < np.mean(losses[:3])
  assert [r["step"] for r in train.read_metrics(tmp_path / "whole") if r["split"] == "eval"] == [6, 12]

  stopped = train.run(recipe, tmp_path / "resumed", task=Regression(recipe), stop_after=5)
  assert stopped["step"] == 5 and stopped["stopped_by"] == "stop_after=5"
  resumed = train.run(recipe, tmp_path / "resumed", task=Regression(recipe))
  assert resumed["step"] == 12

  def final_state(workdir):
    trainer = train.Trainer.open(recipe, workdir, task=Regression(recipe))
    trainer.close()
    return trainer.state

  assert checkpoint.tree_equal(final_state(tmp_path / "whole"), final_state(tmp_path / "resumed"))
  assert (tmp_path / "resumed" / train.PLOT_FILE).exists()


def test_the_default_task_generates_no_text(tmp_path):
  recipe = RegressionRecipe()
  task = Regression(recipe)
  with pytest.raises(Exception, match="does not generate text") as info:
    task.generate(task.build_model(0), "x", 4, 0.0, 0)
  from jax_ai_stack.errors import UserError

  assert isinstance(info.value, UserError)


@pytest.mark.parametrize("preset, family", [("lm-tiny", tasks.LanguageModel),
                                            ("digits-cnn", tasks.ImageClassification)])
def test_each_preset_names_its_family(preset, family):
  assert isinstance(tasks.for_config(config.load(preset)), family)


def test_the_config_validates_through_the_family():
  with pytest.raises(Exception, match="does not go with data.source='digits'"):
    config.load("lm-tiny", overrides=["data.source=digits"])
  with pytest.raises(Exception, match="cnn reads the digits images"):
    config.load("digits-cnn", overrides=["data.source=stdlib"])


def _kind_switches(path: pathlib.Path) -> list[str]:
  """`isinstance(..., <model config>)` calls and comparisons with a model kind."""
  model_configs = {family.model_config.__name__ for family in tasks.FAMILIES}
  kinds = {family.model_config().kind for family in tasks.FAMILIES}
  found = []
  for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
    if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance":
      names = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
      if names & model_configs:
        found.append(f"{path.name}:{node.lineno} isinstance with {names & model_configs}")
    if isinstance(node, ast.Compare):
      constants = {n.value for n in ast.walk(node) if isinstance(n, ast.Constant)}
      if constants & kinds:
        found.append(f"{path.name}:{node.lineno} compares with kind {constants & kinds}")
  return found


def test_no_model_kind_switch_outside_the_task_modules():
  outside = [p for p in PACKAGE.rglob("*.py") if "tasks" not in p.parts]
  assert outside
  switches = [s for path in outside for s in _kind_switches(path)]
  assert not switches, switches


def test_the_kind_switch_detector_finds_one(tmp_path):
  assert not _kind_switches(PACKAGE / "recipes" / "tasks" / "classification.py")
  bad = tmp_path / "sample.py"
  bad.write_text("if isinstance(m, LlamaConfig) or m.kind == 'cnn':\n  pass\n")
  assert len(_kind_switches(bad)) == 2
