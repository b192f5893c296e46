"""`Task`: everything that differs between kinds of model, in one object.

The trainer and the command line ask a Task instead of asking
"is this a language model?": which model to build, its loss, what an
evaluation reports, which data it reads, what a step's throughput counts, what
a finished run leaves behind, and the shapes and logical axes of a batch (for
sharding). A new kind of model is a new Task subclass, listed in `registry`
with its recipe checks (what the config asks, without importing the Task), and
a preset; nothing else changes. A model of your own is a Task too: subclass
it (three members: `build_model`, `loss`, `dataset`) or build a `CustomTask`
from functions, with `model.kind: custom` in the config.

A Task is built from a recipe config (any config dataclass with the fields the
Task reads); it holds no arrays and no state, so building one is free.

Example: what the trainer asks the language-model Task of the lm-tiny preset.
  >>> from jax_ai_stack.recipes import config, tasks
  >>> task = tasks.for_config(config.load("lm-tiny"))
  >>> isinstance(task, Task), task.throughput_unit, task.items_per_step
  (True, 'tokens', 1024)
  >>> task.batch_axes()["inputs"], task.attention_request().describe()
  (('batch', 'length'), 'q [8,128,4,32] k/v [8,128,2,32] float32, causal, segment_ids')
  >>> task.evaluation({"eval_loss": 2.0})["eval_perplexity"]
  7.38905609893065
"""

from __future__ import annotations

import abc
import pathlib
from collections.abc import Mapping
from typing import Any, ClassVar

import grain
import jax
from flax import nnx

from jax_ai_stack import kernels
from jax_ai_stack.errors import UsageError
from jax_ai_stack.recipes import sharding
from jax_ai_stack.recipes.models import adapting
from jax_ai_stack.recipes.models.adapting import QuantLayers
from jax_ai_stack.recipes.models.configs import CustomModelConfig
from jax_ai_stack.recipes.step import Batch, LossFn
from jax_ai_stack.recipes.tasks import objectives
from jax_ai_stack.recipes.transforms import ModelTransform

__all__ = ["Batch", "LossFn", "QuantLayers", "Task"]


class Task(abc.ABC):
  """One kind of model: model, loss, data, evaluation and artefacts.

  Subclasses implement the three abstract methods; a built-in Task also sets
  `model_config` (the config dataclass of its model, whose `kind` tags it in a
  recipe) and `throughput_unit`. The other members have defaults that fit a
  model of one's own.
  """

  model_config: ClassVar[type] = CustomModelConfig
  """The model config dataclass this Task trains (tagged by its `kind`)."""
  throughput_unit: ClassVar[str] = "examples"
  """What `items_per_step` counts, for the progress bar and logs."""
  quant_layers: ClassVar[QuantLayers | None] = None
  """Where Qwix quantizes this Task's models (its model config's, `models.adapting`);
  None: nowhere, they cannot be quantized."""
  methods: ClassVar[tuple[str, ...]] = ("__call__",)
  """The model's methods that quantization can intercept ("decode": it generates
  token by token); a quantized model that lacks the one asked for runs `__call__`."""

  objective: Any = None
  """What the model learns (a `tasks.objectives.Objective`: a built-in Task's, from its
  config); None: `loss` alone says (a model of one's own)."""
  data_kind: str | None = None
  """The kind of data the config feeds ("tokens", "preference", "images"), which a given
  objective must read; None: not checked."""
  rollouts: Any = None
  """What makes each train batch from the policy as it stands (`rl.Rollouts`: completions
  sampled for a batch of prompts, scored) and evaluates it; None: batches come from the data
  as they are."""

  def __init__(self, config: Any, *, objective: Any = None):
    """`objective`: what the model learns (`tasks.objectives`), for a Task whose loss
    asks one (`LanguageModel`, `ImageClassification`); None: the one the config asks."""
    self.config = config
    if objective is not None:
      wanted = getattr(objective, "data_kind", "any")
      if self.data_kind is not None and wanted not in ("any", self.data_kind):
        raise UsageError(f"{type(objective).__name__} reads {wanted} data and this recipe's "
                         f"data.source={self.config.data.source!r} gives {self.data_kind}")
      self.objective = objective  # Takes the place of the Task's default.

  @classmethod
  def for_config(cls, config: Any) -> Task:
    """The Task that trains `config` (`tasks.for_config` asks the registered class)."""
    return cls(config)

  @abc.abstractmethod
  def build_model(self, seed: int, attention: kernels.AttentionPlan | None = None,
                  layout: sharding.Layout | None = None) -> nnx.Module:
    """The Task.s model, initialised from `seed`; `attention` where it has any.

    `layout`: where its activations live on a mesh of several devices, for a
    model that pins them (None on one device).
    """

  @staticmethod
  def example_inputs(model_config: Any, method: str = "__call__") -> tuple:
    """Zeros of the shapes one call of the model's `method` takes (`models.adapting`:
    the model owns them); a model that gives none cannot be quantized or adapted."""
    return adapting.example_inputs(model_config, method)

  @abc.abstractmethod
  def loss(self, model: nnx.Module, batch: Batch) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(scalar loss, auxiliary metrics); what `value_and_grad` differentiates."""

  def training_loss(self, transforms: ModelTransform) -> LossFn:
    """The train and eval steps' loss: the objective's, handed the reference model of the
    run's `transforms` (`objectives.training_loss`); without an objective, `loss`."""
    if self.objective is None:
      return self.loss
    return objectives.training_loss(self.objective, transforms.reference_model)

  @abc.abstractmethod
  def dataset(self, split: str, seed: int) -> grain.IterDataset | Mapping[str, grain.IterDataset]:
    """This process's batches of `split` ("train": endless; "validation": one pass, or
    several by name, each evaluated on its own: a data mixture's components)."""

  @property
  def items_per_step(self) -> int:
    """Tokens or examples in one global batch (the throughput's numerator);
    default: `data.batch_size` examples."""
    return self.config.data.batch_size

  def batch_axes(self) -> dict[str, tuple[str, ...]]:
    """Logical axis names of each batch entry, e.g. {"inputs": ("batch", "length")};
    an entry left out is split along its first axis ("batch") and kept whole along
    the others (the default: every entry)."""
    return {}

  def batch_spec(self, rows: int) -> dict[str, Any] | None:
    """One train step's batch for `rows` rows of data, as `jax.ShapeDtypeStruct`s, or None
    where only the data can say (then read from its first batch): what a step is compiled
    for ahead of time."""
    del rows
    return None

  def data_metrics(self, step: int) -> dict[str, float]:
    """What the data has fed by the end of `step`, logged with that step's metrics
    (a data mixture: the tokens of each component); default: nothing."""
    del step
    return {}

  def model_transforms(self) -> ModelTransform:
    """What the run does to the model (a `transforms.ModelTransform`, built anew per call: it
    keeps what it loads); default: what the recipe's `finetune` and `quant` sections ask."""
    from jax_ai_stack.recipes.finetune import transforms  # pylint: disable=g-import-not-at-top

    return transforms.for_config(self.config)

  def check_data(self) -> None:
    """Raises a UserError when the data does not fit the model (e.g. vocabulary)."""

  def attention_implementation(self) -> str:
    """The config's attention setting ("auto", a name, or a list), if the model attends."""
    return kernels.AUTO

  def attention_request(self) -> kernels.Request | None:
    """The attention call one training step makes, if the model attends."""
    return None

  def activation_bytes(self, ways: Mapping[str, int], attention: str | None,
                       platform: str = "cpu") -> tuple[int, str] | None:
    """Bytes one batch row keeps for the backward pass on one device, and how
    that was found; None: unknown, so `memory` measures the compiled step.

    `ways`: into how many parts the mesh splits each logical axis;
    `attention`: the kernel's name (Tasks whose models attend);
    `platform`: the devices' ("cpu", "gpu", "tpu"), whose XLA keeps more or less.
    """
    del ways, attention, platform
    return None

  def evaluation(self, means: dict[str, float]) -> dict[str, float]:
    """Derived metrics (e.g. perplexity) from the mean eval metrics."""
    return means

  def headline(self, metrics: dict[str, float]) -> dict[str, float]:
    """Of a step's metrics, those shown beside the loss in the progress line and the run's
    last line (the objective's `headline`: a reward, a preference accuracy); {} without."""
    return {} if self.objective is None else self.objective.headline(metrics)

  def kernel_report(self) -> list[str]:
    """Lines saying which kernels beyond attention the model runs, and why (the trainer
    prints them at start-up); default: none."""
    return []

  def finish(self, model: nnx.Module, workdir: pathlib.Path | None) -> list[str]:
    """Writes the end-of-run artefacts into `workdir`; returns lines to print.

    `workdir` None: a process of a multi-host job other than the first; it runs
    the same computations (they span every process) and writes nothing.
    """
    del model, workdir
    return []

  def artefacts(self) -> list[str]:
    """File names `finish` writes (a finished run must always have them)."""
    return []

  def generate(self, model: nnx.Module, prompt: str, max_new_tokens: int | None,
               temperature: float, seed: int, *, top_k: int | None = None,
               top_p: float | None = None, ignore_eos: bool = False) -> str:
    """Text continued from `prompt`; only Tasks that generate text override it."""
    del model, prompt, max_new_tokens, temperature, seed, top_k, top_p, ignore_eos
    raise UsageError(f"model.kind={self.config.model.kind!r} does not generate text")

  def chat_many(self, model: nnx.Module, conversations: list[list[dict]],
                max_new_tokens: int | None, temperature: float, seed: int, *,
                top_k: int | None = None, top_p: float | None = None) -> list[str]:
    """The assistant's reply to each conversation; only Tasks that chat override it."""
    del model, conversations, max_new_tokens, temperature, seed, top_k, top_p
    raise UsageError(f"model.kind={self.config.model.kind!r} does not generate text")

  def stream(self, model: nnx.Module, items: list[dict], max_new_tokens: int | None,
             temperature: float, seed: int, *, top_k: int | None = None,
             top_p: float | None = None, ignore_eos: bool = False, speculation=None):
    """Each item's result as it finishes (`generate --input`); only Tasks that generate
    text override it."""
    del model, items, max_new_tokens, temperature, seed, top_k, top_p, ignore_eos, speculation
    raise UsageError(f"model.kind={self.config.model.kind!r} does not generate text")
