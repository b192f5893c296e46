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
import typing
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


@pytest.mark.parametrize("preset", ["lm-tiny", "digits-cnn"])
def test_each_family_answers_the_hooks_of_the_generic_modules(preset):
  from jax_ai_stack.recipes.finetune import quant
  from jax_ai_stack.recipes.models import hf

  recipe = config.load(preset)
  task = tasks.for_config(recipe)
  model = nnx.eval_shape(lambda: task.build_model(0))
  assert all(callable(getattr(model, method, None)) for method in task.methods)
  assert hf.writes(model) == (recipe.model.kind == "llama")
  paths = [rule.module_path for rule in quant.rules("w8a8", recipe.model.kind)]
  assert paths[:2] == [task.quant_layers.mlp, task.quant_layers.other]


def test_a_family_without_quant_layers_is_not_quantized():
  from jax_ai_stack.recipes.finetune import quant
  from jax_ai_stack.recipes.finetune.config import DEFAULT_MODULES

  assert Regression.quant_layers is None and Regression.methods == ("__call__",)
  with pytest.raises(Exception, match="no rules for model.kind=.mlp.; kinds: llama, qwen2, qwen3, "
                     "mistral, gemma2, gemma3, mixtral, qwen3_moe, olmo2, olmo3, smollm3, phi3, "
                     "qwen2_moe, gpt_oss, llama4, deepseek_v3, qwen3_next, cnn"):
    quant.rules("w8", "mlp")
  assert DEFAULT_MODULES == tasks.REGISTRY[0].lora_modules


def _family_knowledge() -> dict[str, set[str]]:
  """What names a model family, from the registry: its kinds, its model and model config
  classes, and the modules of its Task and its model."""
  kinds, classes, modules = set(), set(), set()
  for entry in tasks.REGISTRY:
    kinds.update(typing.get_args(typing.get_type_hints(entry.model_config)["kind"]))
    classes.add(entry.model_config.__name__)
    task_class = entry.task_class()
    modules.add(task_class.__module__)
    model_module = sys.modules[typing.get_type_hints(task_class.build_model)["return"].__module__]
    if not model_module.__name__.startswith("jax_ai_stack."):
      continue  # A model of one's own: any nnx.Module (flax's own module is no family's).
    modules.add(model_module.__name__)
    classes.update(name for name, value in vars(model_module).items()
                   if isinstance(value, type) and issubclass(value, nnx.Module)
                   and value.__module__ == model_module.__name__)
    classes.update(name for name, value in vars(model_module).items()  # DecoderConfig too.
                   if value is entry.model_config)
  return {"kinds": kinds, "classes": classes, "modules": modules}


def _last_name(node: ast.AST) -> str:
  """`model` of `model`, `trainer.model`; '' for anything else."""
  return getattr(node, "id", None) or getattr(node, "attr", None) or ""


def _kind_switches(path: pathlib.Path) -> list[str]:
  """Where a module decides by model family instead of asking its Task.

  (a) dict literals (or `dict(...)` calls) keyed by a model kind;
  (b) `isinstance(x, <model or model config class>)`, `hasattr(<a model>, ...)`;
  (c) comparisons with a model kind;
  (d) imports of a family's Task module or model module.
  """
  known = _family_knowledge()
  kinds, classes, modules = known["kinds"], known["classes"], known["modules"]
  found = []

  def flag(node, what):
    found.append(f"{path.name}:{node.lineno} {what}")

  for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
    if isinstance(node, ast.Dict):
      keys = {k.value for k in node.keys if isinstance(k, ast.Constant)} & kinds
      if keys:
        flag(node, f"dict keyed by kind {keys}")
    if isinstance(node, ast.Call) and _last_name(node.func) == "dict":
      keys = {k.arg for k in node.keywords} & kinds
      if keys:
        flag(node, f"dict keyed by kind {keys}")
    if isinstance(node, ast.Call) and _last_name(node.func) == "isinstance" and len(node.args) == 2:
      names = {_last_name(n) for n in ast.walk(node.args[1])} & classes
      if names:
        flag(node, f"isinstance with {names}")
    if (isinstance(node, ast.Call) and _last_name(node.func) == "hasattr" and node.args
        and "model" in _last_name(node.args[0]).lower()):
      flag(node, f"hasattr on a model ({_last_name(node.args[0])})")
    if isinstance(node, ast.Compare):
      constants = {n.value for n in ast.walk(node) if isinstance(n, ast.Constant)} & kinds
      if constants:
        flag(node, f"compares with kind {constants}")
    if isinstance(node, ast.Import):
      imported = {alias.name for alias in node.names} & modules
      if imported:
        flag(node, f"imports {imported}")
    if isinstance(node, ast.ImportFrom) and node.module:
      imported = ({node.module} | {f"{node.module}.{alias.name}" for alias in node.names}) & modules
      if imported:
        flag(node, f"imports {imported}")
  return found


BENCHMARKS = PACKAGE.parent / "benchmarks"

# Modules outside recipes/tasks/ and recipes/models/ that may name a model family,
# each with the reason it is family-specific by nature (paths from the repository
# root). recipes/models/ keeps its own knowledge (hf.py reads and writes Hugging Face
# checkpoints; layer_stack.py moves Llama layers between layouts), and the package's
# generic modules need no exemption: hf_cli asks `hf.writes` which models it exports.
ALLOWED: dict[str, str] = {
    # Benchmarks of one model, against hand-written JAX or PyTorch versions of it.
    "benchmarks/accelerator.py": "times the Llama train step at the 0.76B size of issue #23",
    "benchmarks/compile_depth.py": "compile time of the Llama step, unrolled vs scan_layers",
    "benchmarks/engine.py": "the generation engine against the decoder's own decoding loop",
    "benchmarks/harness.py": "the harness adapter on a decoder: shared contexts, packed, one per row",
    "benchmarks/lora.py": "LoRA and QLoRA steps of a Llama against its full fine-tuning",
    "benchmarks/moe.py": "the decoder's MoE layer against its dense MLP of the same active size",
    "benchmarks/mechanisms.py": "each 2026 family's attention in the decoder against the plain one",
    "benchmarks/quant.py": "a Llama's QAT/PTQ step times; refuses a run of another kind",
    "benchmarks/train_step.py": "the Llama step against a hand-written JAX/PyTorch Llama",
    "benchmarks/real_size.py": "writes a decoder of Qwen3-0.6B's shapes with hf.save",
    "benchmarks/rl.py": "writes a Qwen3 with hf.save, for TRL's GRPOTrainer beside ours",
    "benchmarks/structured.py": "structured output on a Decoder of engine.py's sizes",
    "benchmarks/speculative.py": "a Decoder of engine.py's sizes taught to copy, then decoded",
    # To move behind the Task (next stop): the frozen reference's and the teacher's model.
    "jax_ai_stack/recipes/finetune/reference.py": "the frozen copy of a model's parameters",
    "jax_ai_stack/recipes/finetune/teacher.py": "a teacher read from a run or an HF directory",
}


def _generic_modules() -> list[pathlib.Path]:
  """Every module of the package and the benchmarks but the Task and model modules and
  the allow-list."""
  family_dirs = {PACKAGE / "recipes" / "tasks", PACKAGE / "recipes" / "models"}
  paths = [*PACKAGE.rglob("*.py"), *BENCHMARKS.glob("*.py")]
  return [p for p in sorted(paths)
          if not family_dirs & set(p.parents)
          and p.relative_to(PACKAGE.parent).as_posix() not in ALLOWED]


def test_no_model_family_knowledge_outside_the_task_and_model_modules():
  outside = _generic_modules()
  assert len(outside) > 40
  switches = [s for path in outside for s in _kind_switches(path)]
  assert not switches, switches


def test_the_allow_list_names_modules_that_still_need_it():
  for name in ALLOWED:
    path = PACKAGE.parent / name
    assert not path.exists() or _kind_switches(path), f"{name} needs no exemption any more"


def test_the_kind_switch_detector_finds_each_kind(tmp_path):
  assert not _kind_switches(PACKAGE / "recipes" / "finetune" / "quant.py")
  bad = tmp_path / "sample.py"
  bad.write_text(
      "from jax_ai_stack.recipes.models import decoder\n"
      "import jax_ai_stack.recipes.tasks.lm\n"
      "from jax_ai_stack.recipes.models.cnn import CNN\n"
      "LAYERS = {'llama': 1, 'cnn': 2}\n"
      "OTHER = dict(cnn=3)\n"
      "if (isinstance(m, DecoderConfig) or m.kind == 'cnn'\n"
      "    or isinstance(trainer.model, decoder.Decoder)):\n"
      "  pass\n"
      "if hasattr(trainer.model, 'decode') and not hasattr(iterator, 'close'):\n"
      "  pass\n")
  found = [s.split(" ", 1)[1].split(" {")[0].split(" (")[0] for s in _kind_switches(bad)]
  expected = (["imports"] * 3 + ["dict keyed by kind"] * 2 + ["isinstance with"] * 2
              + ["compares with kind", "hasattr on a model"])
  assert sorted(found) == sorted(expected)


def test_the_registrys_first_names_still_import_with_a_deprecation_warning():
  with pytest.warns(DeprecationWarning, match="tasks.FAMILIES is deprecated: use .*REGISTRY"):
    assert tasks.FAMILIES is tasks.REGISTRY
  with pytest.warns(DeprecationWarning, match="tasks.family is deprecated"):
    assert tasks.family(config.load("lm-tiny").model) is tasks.REGISTRY[0]
  assert "Family" not in tasks.__all__
