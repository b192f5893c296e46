"""The recipe config: one frozen tree of every setting a training job needs.

A recipe is a YAML preset (`presets/<name>.yaml`, listed by
`jax-ai-stack train --list`), optionally merged with a user YAML file, then
dotted overrides (`model.num_layers=6` or `--model.num_layers 6`). The result is
validated into `RecipeConfig`; errors name the field, the value and the source.

Example:
  >>> config = load("lm-tiny", overrides=["train.steps=10"])
  >>> config.train.steps, config.model.kind
  (10, 'llama')
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import pathlib
import re
from typing import Annotated, Literal, Union

import pydantic

# Only the section configs, never their builders: loading, validating and
# printing a config imports no jax, flax, optax, grain or orbax.
from jax_ai_stack.recipes import configlib
from jax_ai_stack.recipes.checkpoint_config import CheckpointConfig
from jax_ai_stack.recipes.compile_cache import Setting as CompileCacheSetting
from jax_ai_stack.recipes.configlib import ConfigError, config_dataclass
from jax_ai_stack.recipes.data.config import DataConfig
from jax_ai_stack.recipes.finetune.config import FinetuneConfig, QuantConfig, experts_refuse
from jax_ai_stack.recipes.optim_config import OptimConfig
from jax_ai_stack.recipes.rl.config import RlConfig
from jax_ai_stack.recipes.sharding_config import MeshConfig
from jax_ai_stack.recipes.tasks import registry

DEFAULT_PRESET = "lm-tiny"
NO_PRESET = "none"
"""`--preset none` (or `preset: none` in a YAML file): start from the defaults alone."""

ModelConfig = Annotated[
    Union[tuple(entry.model_config for entry in registry.REGISTRY)],
    pydantic.Field(discriminator="kind"),
]


@config_dataclass
class TrainConfig:
  steps: int = 500
  """Optimizer steps to train for."""
  seed: int = 0
  """Seeds parameters, dropout and the data order: same seed, same bits."""
  deterministic: bool = True
  """Bitwise-reproducible steps on every backend: on a GPU the command line sets
  XLA_FLAGS=--xla_gpu_deterministic_ops=true before JAX starts (about 0.82x throughput
  on an H100); CPU and TPU are deterministic anyway. false: faster on a GPU, but two
  identical runs differ and a resume is not bitwise."""
  eval_every: int = 100
  """Evaluate on the validation split every this many steps (and at the end); 0: never."""
  log_every: int = 10
  """Fetch the step metrics from the devices every this many steps (and before each
  evaluation and save): every step's record is still logged, but the host does not
  wait for each step, so the next batch is placed on the devices while a step runs.
  A non-finite loss is caught at the fetch, before anything is saved."""
  microbatch_size: int | None = None
  """The most global rows one forward and backward pass takes: a larger batch (say, one that
  `data.batch_schedule` grows) is split into micro-batches whose gradients are accumulated
  within the step. It must divide every batch size and the data-parallel ways. None: the
  whole batch at once."""
  eval_batches: int = 4
  """Validation batches per evaluation (the same ones every time)."""
  eval_tasks: tuple[str, ...] = ()
  """lm-evaluation-harness tasks also run at evaluations (the `eval` extra): registered names
  whose data is on disk, task directories, or 'stdlib' (the embedded ones); each metric is
  logged as eval_harness_<task>_<metric>. (): none."""
  eval_tasks_every: int | None = None
  """Run train.eval_tasks every this many steps (a multiple of eval_every) and at the end;
  None: at every evaluation."""
  eval_tasks_limit: int | None = None
  """The most documents of each of train.eval_tasks (None: all): keeps the evaluations short."""
  resume: Literal["auto", "never"] = "auto"
  """auto: continue from the newest checkpoint in the workdir; never: refuse a workdir that has one."""
  sample_prompt: str | None = None
  """LM recipes: the prompt of the sample generated at the end (a user turn for a chat, DPO
  or RL run); None: a chat, DPO or RL run answers the first held-out prompt of its own data,
  rendered with its chat template, and a text run continues "def "."""
  sample_tokens: int = 128
  """LM recipes: tokens generated for the sample."""
  sample_temperature: float = 0.8
  """LM recipes: sampling temperature of the sample (0: greedy)."""
  progress: bool = True
  """Show a progress bar (step, loss, the objective's headline metrics, throughput, ETA) on stderr."""
  autotune_attention: bool = False
  """Tune attention once (tokamax.autotune + timing) and pin the choice in
  <workdir>/attention_autotune.json; resume reloads it so numerics do not change."""
  profile: str | None = None
  """Trace steps START to STOP-1 ("10:15", in the logs' step numbers) with jax.profiler into
  <workdir>/profile/, each step annotated, with the device memory after the first; open it
  with `xprof --logdir <workdir>/profile` (the `profile` extra). None: no trace."""
  compile_cache: CompileCacheSetting = "auto"
  """Persistent XLA compilation cache of the command line (a rerun or resume skips
  compiling): 'auto' ($JAX_COMPILATION_CACHE_DIR, else ~/.cache/jax-ai-stack/xla
  under $XDG_CACHE_HOME), a directory, or 'off'. Library calls never turn it on."""

  def __post_init__(self):
    for name in ("steps", "eval_batches", "log_every"):
      if getattr(self, name) < 1:
        raise ValueError(f"train.{name} must be >= 1, got {getattr(self, name)}")
    if self.microbatch_size is not None and self.microbatch_size < 1:
      raise ValueError(f"train.microbatch_size must be >= 1 (None: whole batches), got "
                       f"{self.microbatch_size}")
    if self.eval_every < 0:
      raise ValueError(f"train.eval_every must be >= 0 (0: no evaluation), got {self.eval_every}")
    if self.eval_tasks and not self.eval_every:
      raise ValueError("train.eval_tasks run at evaluations: set train.eval_every (it is 0)")
    if self.eval_tasks_every is not None and (
        self.eval_tasks_every < 1 or self.eval_tasks_every % max(self.eval_every, 1)):
      raise ValueError(f"train.eval_tasks_every={self.eval_tasks_every} must be a multiple of "
                       f"train.eval_every={self.eval_every}")
    if self.eval_tasks_limit is not None and self.eval_tasks_limit < 1:
      raise ValueError(f"train.eval_tasks_limit must be >= 1 (None: all), got "
                       f"{self.eval_tasks_limit}")
    if self.sample_tokens < 0:
      raise ValueError(f"train.sample_tokens must be >= 0, got {self.sample_tokens}")
    if self.profile is not None:
      _ = self.profile_steps  # Raises on a bad range.

  @property
  def profile_steps(self) -> range | None:
    """The steps `profile` traces, as a range of step numbers; None: no profile."""
    if self.profile is None:
      return None
    match = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", self.profile)
    if not match or not 1 <= int(match[1]) < int(match[2]):
      raise ValueError(f"train.profile={self.profile!r}: give START:STOP with 1 <= START < STOP "
                       "(steps START to STOP-1, as the logs number them), e.g. '10:15'")
    return range(int(match[1]), int(match[2]))


@config_dataclass
class RecipeConfig:
  """Every setting of a training job: one frozen, validated tree.

  Build it with `load` (a preset, a YAML file, dotted overrides); print it with
  `configlib.to_yaml`. Each section is its own config dataclass, so a builder
  takes only the section it needs (`optim.build_optimizer(config.optim, ...)`).
  Which model family trains is `model.kind`; `tasks.for_config(config)` gives
  the family's Task.
  """

  name: str = "custom"
  """The preset, or the config file, this config came from (names the default workdir
  runs/<name>)."""
  model: ModelConfig = dataclasses.field(default_factory=registry.REGISTRY[0].model_config)
  """The model: `kind: llama` (decoder LM) or `kind: cnn` (image classifier)."""
  optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
  """Optimizer, schedule, clipping, weight decay, accumulation."""
  data: DataConfig = dataclasses.field(default_factory=DataConfig)
  """Corpus or data set, tokenizer, sequence length, global batch size."""
  checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
  """How often to save and what to keep."""
  train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
  """Steps, seed, evaluation, resume, the final sample."""
  mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
  """The device mesh (data x fsdp x expert x tensor) and the rules that place arrays on it."""
  finetune: FinetuneConfig = dataclasses.field(default_factory=FinetuneConfig)
  """Start from a trained run (`base`): every parameter, or LoRA adapters only (`lora`)."""
  quant: QuantConfig = dataclasses.field(default_factory=QuantConfig)
  """Quantization-aware training (`qat`: a scheme); `jax-ai-stack quantize` converts any run."""
  rl: RlConfig = dataclasses.field(default_factory=RlConfig)
  """Reinforcement learning on prompts (`data.source: prompts`): groups sampled, rewards,
  the GRPO-family loss."""

  def __post_init__(self):
    registry.registered(self.model).check(self)
    refused = self.quant.qat and experts_refuse(self.quant.qat, getattr(self.model, "kind", ""))
    if refused:
      raise ConfigError(f"quant.qat: {refused}")
    distills = self.finetune.distill.teacher is not None
    if self.data.is_prompts and not self.rl.rewards and not distills:
      raise ConfigError(f"rl.rewards is empty: a run on prompts (data.source="
                        f"{self.data.source!r}) needs at least one reward, 'module:function' "
                        "(or a teacher to distill from: finetune.distill.teacher)")
    if distills and self.data.is_preference:
      raise ConfigError(f"finetune.distill.teacher: distillation learns on text, chats or "
                        f"prompts, not data.source={self.data.source!r}")
    if distills and self.data.is_prompts and self.rl.dynamic_sampling:
      raise ConfigError("rl.dynamic_sampling drops groups whose rewards are equal, and an "
                        "on-policy distillation run learns from every completion: turn it off")
    updates = self.rl.updates_per_rollout
    for field, value in (("train.steps", self.train.steps),
                         ("checkpoint.save_every", self.checkpoint.save_every),
                         ("train.eval_every", self.train.eval_every)):
      if self.data.is_prompts and value % updates:
        raise ConfigError(f"{field}={value} is not a multiple of rl.updates_per_rollout="
                          f"{updates}: steps, saves and evaluations fall on rollout boundaries")
    micro = self.train.microbatch_size
    for field, size in self.data.batch_sizes() if micro is not None else ():
      if size > micro and size % micro:
        raise ConfigError(f"{field}={size} does not split into micro-batches of "
                          f"train.microbatch_size={micro} rows: make it a multiple of {micro}")


def _presets_dir() -> pathlib.Path:
  return pathlib.Path(str(importlib.resources.files("jax_ai_stack.recipes") / "presets"))


def list_presets() -> list[str]:
  return sorted(p.stem for p in _presets_dir().glob("*.yaml"))


def preset_description(preset: str) -> str:
  """The preset's own one-line summary: its file's first comment, `# NAME: what it is`."""
  first = (_presets_dir() / f"{preset}.yaml").read_text().splitlines()[0]
  return first.lstrip("# ").removeprefix(f"{preset}:").strip()


def _merge(base: dict, update: dict) -> dict:
  out = dict(base)
  for key, value in update.items():
    if isinstance(value, dict) and isinstance(out.get(key), dict):
      out[key] = _merge(out[key], value)
    else:
      out[key] = value
  return out


def _preset_data(preset: str) -> dict:
  path = _presets_dir() / f"{preset}.yaml"
  if not path.is_file():
    raise ConfigError(
        f"unknown preset {preset!r}; presets: {', '.join(list_presets())} (or {NO_PRESET!r})"
    )
  return _merge(configlib.load_yaml(path), {"name": preset})


def _merge_section(base: dict, update: dict) -> dict:
  """`update` over `base`; a model of another `kind` replaces the preset's model."""
  model = update.get("model")
  if isinstance(model, dict) and "kind" in model and model["kind"] != base.get("model", {}).get("kind"):
    base = {k: v for k, v in base.items() if k != "model"}
  return _merge(base, update)


def load(
    preset: str | None = None,
    *,
    config_file: str | pathlib.Path | None = None,
    overrides: list[str] = (),
) -> RecipeConfig:
  """A preset, then `config_file` merged over it, then dotted overrides; validated.

  Args:
    preset: a preset name (`list_presets()`), "none" for the defaults alone, or
      None: the `preset:` the config file names, else `DEFAULT_PRESET`.
    config_file: a YAML file of fields to change; any section may be partial
      (`model: {num_layers: 6}` keeps the preset's other model fields). A file
      may name its base with `preset: NAME` (or `none`); `preset` wins. Without
      `preset`, the run is named by the file's `name:`, else after the file
      (`my.yaml`: my); with it, after the preset.
    overrides: `dotted.field=value` strings, applied last.

  Raises:
    ConfigError: naming the field, the value and where it came from.
  """
  from_file = configlib.load_yaml(config_file) if config_file is not None else {}
  file_preset = from_file.pop("preset", None)
  preset_given = preset is not None
  preset = preset or file_preset or DEFAULT_PRESET
  data: dict = {}
  sources = []
  if preset != NO_PRESET:
    data = _preset_data(str(preset))
    sources.append(f"preset {preset}")
  if config_file is not None:
    # Alone, a file without a `name:` names the run (its label, runs/<name>), not the preset
    # under it: a model of one's own is not "lm-tiny", nor does it resume lm-tiny's workdir.
    named = {} if preset_given else {"name": pathlib.Path(config_file).stem}
    data = _merge_section(data, {**named, **from_file})
    sources.append(str(config_file))
  if overrides:
    data = configlib.apply_overrides(data, list(overrides))
    sources.append("overrides " + " ".join(overrides))
  return configlib.from_dict(RecipeConfig, data, source=" + ".join(sources) or "config")


def printed(config: RecipeConfig) -> str:
  """The YAML `train --print-config` shows: a field left null whose value is derived
  (`data.validation_fraction`, `model.head_dim`) says, in a comment, what applies.

  The comment keeps the file loadable as it is and the field still derived, so
  a printed file whose `data.source` or `model.d_model` is edited stays right.
  """
  derived = {("data", "validation_fraction"): config.data.holdout_fraction}
  if (head_dim := getattr(config.model, "resolved_head_dim", None)) is not None:
    derived[("model", "head_dim")] = head_dim
  lines, section = [], None
  for line in configlib.to_yaml(config).splitlines():
    if not line.startswith(" "):
      section = line.rstrip(":")
    elif not line.startswith("   ") and line.endswith(": null"):
      value = derived.get((section, line.strip().partition(":")[0]))
      line += "" if value is None else f"  # {value} applies"
    lines.append(line)
  return "\n".join(lines) + "\n"


def from_json(data: dict) -> RecipeConfig:
  """A config saved in checkpoint metadata, validated again."""
  model = data.get("model", {})
  if "vocab_size" in model and "vocab_multiple" not in model:
    # Saved before the vocabulary was padded: its arrays have vocab_size rows.
    data = {**data, "model": {**model, "vocab_multiple": 1}}
  return configlib.from_dict(RecipeConfig, data, source="checkpoint metadata")
