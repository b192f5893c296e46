"""`build_run`: a workdir and a recipe in, a `Run` out (restored, or fresh from the seed).

The one way into a workdir. `train` opens one to train (`mode="train"`: train
data, writable, resumed from the newest checkpoint or initialised); `eval`,
`generate`, `quantize`, `lora merge` and `export-hf` open a finished one
read-only (`mode="read"`: the saved config and attention plan, no train data,
nothing written); `import-hf` opens a fresh one with given parameters. Each
caller passes what it knows as keywords; the environment comes in once, as a
mapping, from the command line (or the process's, for a notebook).

The attention plan is `kernels.plan_for_run`'s (one precedence: config,
environment, the workdir's autotune file, the checkpoint's plan, the backend's
preference); the model is built with it and reads nothing else.

A `Run` holds the pieces (Task, model, optimizer, jitted steps, state, step,
placement, checkpoints) and what works on them without a training loop:
`evaluate`, `generate`, `save`, `inference_model`. `train.Trainer` adds the loop.

Example:
  >>> from jax_ai_stack.recipes import config
  >>> cfg = config.load("lm-tiny", overrides=["train.steps=2", "model.num_layers=1"])
  >>> run = build_run(cfg, "/tmp/doctest-run", resume="never")  # doctest: +SKIP
  >>> build_run(None, "no-run-here", mode="read")
  Traceback (most recent call last):
  ...
  jax_ai_stack.errors.WorkdirError: no checkpoints in no-run-here: train there first
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import pathlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal

import grain
import jax
from flax import nnx

from jax_ai_stack import kernels
from jax_ai_stack.errors import CheckpointMismatchError, WorkdirError
from jax_ai_stack.recipes import (checkpoint, configlib, held_out, host_memory, opening, optim,
                                  phases, sharding, step, tasks)
from jax_ai_stack.recipes import workdir as workdir_lib
from jax_ai_stack.recipes.config import RecipeConfig
from jax_ai_stack.recipes.opening import TaskArg
from jax_ai_stack.recipes.transforms import ModelTransform

log = logging.getLogger(__name__)

Mode = Literal["train", "read"]
__all__ = ["Run", "build_run"]


def _warn_attention_change(metadata: dict, choice: kernels.Choice | None) -> None:
  """Warns when the attention kernel is not the one the checkpoint was trained with."""
  saved = metadata.get("attention", {}).get("implementation")
  if choice is not None and saved and saved != choice.name:
    log.warning("attention was %s when the checkpoint was written and is %s now: the resumed "
                "run will not be bitwise identical to one that never stopped", saved, choice.name)


@dataclasses.dataclass
class Run:
  """A run opened in a workdir: its Task, model, steps, state and checkpoints."""

  config: RecipeConfig
  task: tasks.Task
  workdir: pathlib.Path
  manager: checkpoint.Manager
  model: nnx.Module
  optimizer: nnx.Optimizer
  train_step: Callable[[nnx.State, tasks.Batch], tuple[nnx.State, dict]]
  eval_step: Callable[[nnx.State, tasks.Batch], dict]
  state: nnx.State
  step: int
  attention: kernels.AttentionPlan | None
  attention_choice: kernels.Choice | None
  placement: sharding.Placement
  """The mesh and the rules that lay out the state and each batch."""
  train_batches: Iterator[tasks.Batch] | None
  """The train iterator (Grain's, checkpointed with the state); None when read-only."""
  validation: grain.IterDataset | Mapping[str, grain.IterDataset] | None
  """None when evaluation is off (`train.eval_every=0`) and for generation; by name for
  a data mixture (each component's held-out split)."""
  transforms: ModelTransform = dataclasses.field(default_factory=ModelTransform)
  """What the run does to the Task's model (`Task.model_transforms`: QAT, a base run, LoRA):
  what trains, what is saved, what decodes."""
  converted: str | None = None
  """What the restore converted (a step of the other `model.scan_layers` layout), else None."""
  phases: list[dict] = dataclasses.field(default_factory=list)
  """Every phase of the run so far ({"step", "config"}: `phases`), the current one last."""
  phase_changes: list[tuple[str, Any, Any]] = dataclasses.field(default_factory=list)
  """What began the current phase at this resume ([]: it goes on, or a fresh run)."""

  def evaluate(self) -> dict[str, float]:
    """Mean metrics over the first `train.eval_batches` validation batches (`held_out`)."""
    def policy():
      step.merge(self.model, self.optimizer, self.state)  # The policy as it stands.
      return self.inference_model()

    return held_out.evaluate(
        self.validation, eval_batches=self.config.train.eval_batches,
        measure=lambda batch: self.eval_step(self.state, self.placement.batch(batch)),
        evaluation=self.task.evaluation, rollouts=self.task.rollouts, policy=policy)

  def checkpoint_metadata(self) -> dict[str, Any]:
    """What a checkpoint of this run records beside the arrays: step, config, plan, base."""
    metadata = {"step": self.step, "config": configlib.to_dict(self.config)}
    if self.phases:
      metadata["phases"] = self.phases
    if self.attention_choice is not None:
      metadata["attention"] = {**self.attention_choice.to_dict(), "plan": self.attention.to_dict()}
    metadata.update(self.transforms.metadata())  # E.g. the base, which LoRA checkpoints lack.
    return metadata

  def save(self, *, force: bool) -> bool:
    """Saves state, data position and metadata as one step (see `checkpoint.save`).

    Inside `Trainer.fit` the write goes on in the background; called alone, it
    returns when the step is on disk.
    """
    if not force and not self.manager.should_save(self.step):
      return False  # Asked every step: the metadata and state below cost ms each.
    # Orbax copies the arrays to host memory before save() returns, so the next
    # step may donate (reuse) their buffers; the resume tests check the bits.
    return checkpoint.save(self.manager, self.step, self.transforms.saved(self.state),
                           self.train_batches, self.checkpoint_metadata(), force=force)

  def generate(self, prompt: str, max_new_tokens: int | None, temperature: float, *,
               seed: int | None = None, top_k: int | None = None,
               top_p: float | None = None, ignore_eos: bool = False) -> str:
    """`prompt` continued, to the model's end-of-sequence ids unless `ignore_eos`; `seed`
    None: the run's `train.seed`."""
    seed = self.config.train.seed if seed is None else seed
    with self.kernel_configs():
      return self.task.generate(self.inference_model(), prompt, max_new_tokens, temperature,
                                seed, top_k=top_k, top_p=top_p, ignore_eos=ignore_eos)

  def chat(self, messages: list[dict], max_new_tokens: int | None, temperature: float, *,
           seed: int | None = None, top_k: int | None = None,
           top_p: float | None = None) -> str:
    """The assistant's reply to `messages` ({role, content} turns ending with a user turn),
    rendered with the run's chat template; `seed` None: the run's `train.seed`."""
    return self.chat_many([messages], max_new_tokens, temperature, seed=seed, top_k=top_k,
                          top_p=top_p)[0]

  def stream(self, items: list[dict], max_new_tokens: int | None, temperature: float, *,
             seed: int | None = None, top_k: int | None = None,
             top_p: float | None = None, ignore_eos: bool = False,
             speculation=None) -> Iterator[dict]:
    """Each item's result as it finishes ({"prompt"} continued, {"messages"} answered:
    `LanguageModel.stream`), decoded together by the generation engine (`speculation`:
    its guesses checked ahead, `inference.Speculation`)."""
    seed = self.config.train.seed if seed is None else seed
    with self.kernel_configs():
      yield from self.task.stream(self.inference_model(), items, max_new_tokens, temperature,
                                  seed, top_k=top_k, top_p=top_p, ignore_eos=ignore_eos,
                                  speculation=speculation)

  def chat_many(self, conversations: list[list[dict]], max_new_tokens: int | None,
                temperature: float, *, seed: int | None = None, top_k: int | None = None,
                top_p: float | None = None) -> list[str]:
    """Each conversation's reply as `chat` gives it, decoded together by the generation
    engine (a reply does not depend on the others)."""
    seed = self.config.train.seed if seed is None else seed
    with self.kernel_configs():
      return self.task.chat_many(self.inference_model(), conversations, max_new_tokens,
                                 temperature, seed, top_k=top_k, top_p=top_p)

  def inference_model(self) -> nnx.Module:
    """The model that decodes (`transforms.inference_model`: a LoRA run's base and adapters
    merged, since Qwix adds the adapters only inside `__call__`, not in `decode`)."""
    return self.transforms.inference_model(self.model, self._plain_model)

  def exported_model(self) -> tuple[nnx.Module, list[str]]:
    """The model `export-hf` writes (a LoRA run's merged; a QLoRA run's into its float base)
    and one line for each way it differs from what the run computes."""
    return self.transforms.exported_model(self.model, self._plain_model)

  def _plain_model(self) -> nnx.Module:
    """The Task's model, untransformed (its values are replaced by the caller)."""
    return self.task.build_model(self.config.train.seed, self.attention, self.placement.layout())

  def close(self) -> None:
    self.manager.close()

  def kernel_configs(self):
    """tokamax's tuned kernel configs (from an autotune file) while steps trace."""
    return self.attention.kernel_configs() if self.attention else contextlib.nullcontext()

  def describe(self) -> str:
    n_params = self.transforms.describe(self.model) or (
        f"{sum(x.size for x in jax.tree.leaves(nnx.state(self.model, nnx.Param))):,} parameters")
    return (f"recipe {self.config.name}: {n_params}{vocabulary_padding(self.config.model)} on "
            f"{jax.default_backend()} ({jax.device_count()} device(s), "
            f"{self.placement.describe()}); workdir {self.workdir}")


def vocabulary_padding(model: Any) -> str:
  """', of which N in R rows of vocabulary padding (...)' when the embedding (and head) hold
  rows past `vocab_size` (`model.vocab_multiple`): parameters that never see a token, which
  a count of the same model elsewhere (Hugging Face's) leaves out. `train` and `import-hf`
  say it after their parameter counts."""
  padded = getattr(model, "padded_vocab_size", None)
  if padded is None or padded == model.vocab_size:
    return ""
  rows = padded - model.vocab_size
  tables = 1 if model.tie_embeddings else 2
  return (f", of which {rows * model.d_model * tables:,} in {rows} rows of vocabulary padding "
          f"({model.vocab_size} -> {padded}, model.vocab_multiple={model.vocab_multiple})")


def build_run(
    config: RecipeConfig | None,
    workdir: str | pathlib.Path,
    *,
    mode: Mode = "train",
    environ: Mapping[str, str] | None = None,
    resume: str = "auto",
    initial_params: Callable[[nnx.State], nnx.State] | None = None,
    overrides: Sequence[str] = (),
    task: TaskArg = None,
    validation: bool | None = None,
    capture_stderr: bool = False,
    optimizer_state: bool = False,
) -> Run:
  """Opens `workdir` into a `Run`: restored from its newest checkpoint, else initialised.

  Either way the state is created already laid out on the run's mesh (never
  a full copy on one device first).

  Args:
    config: the recipe to train (`mode="train"`; any config with `train`,
      `optim`, `checkpoint` sections that `task` understands). None for
      `mode="read"`: the run's saved config.
    workdir: `mode="train"`: created if missing; must be writable. `mode="read"`:
      a workdir with checkpoints; nothing in it is written.
    mode: "train" or "read" (a finished run: no train data, its saved attention plan).
    environ: where `JAX_AI_STACK_ATTENTION` is read, once, here; None: the
      process's environment (the command line passes it).
    resume: "auto" continues a run; "never" refuses a workdir with checkpoints.
    initial_params: a fresh run's parameters instead of the seed's initialisation:
      called with the model's abstract parameter state (ShapeDtypeStructs with
      their shardings), returns it filled (e.g. by `models.hf.load_params`).
    overrides: `mode="read"`: dotted settings over the saved config
      (`data.validation_fraction=0.2`).
    task: the model family (a Task, or a function or Task subclass called with the
      config: `mode="read"` has only the saved one); default `tasks.for_config(config)`.
    validation: build the validation split; default: when `train.eval_every`
      asks for it (train), never (read).
    capture_stderr: while a damaged checkpoint step is read, send what the
      libraries print to the error log (`checkpoint.restore`'s). It redirects
      the process's stderr, so the command line asks for it; a notebook need not.
    optimizer_state: `mode="read"`: read the optimizer's state too. By default a
      finished run is read without it (AdamW's moments are twice the parameters): its
      `state` is the model's part alone, `state[0]`, and its optimizer stays abstract.

  Raises:
    WorkdirError: the workdir is unusable, has no checkpoint (read), or has
      checkpoints and `resume` is "never".
    ConfigError, DataError: as the Task and the builders raise them, before
      anything in the workdir is written.
  """
  environ = os.environ if environ is None else environ  # The one read of the environment.
  workdir = pathlib.Path(workdir)
  if mode == "read":
    opened = opening.open_finished(workdir, environ=environ, overrides=overrides, task=task,
                            validation=bool(validation), capture_stderr=capture_stderr)
  elif mode == "train":
    if config is None:
      raise ValueError("build_run(mode='train') needs the recipe config to train")
    opened = opening.open_to_train(config, workdir, environ=environ, resume=resume, task=task,
                            validation=validation, capture_stderr=capture_stderr)
  else:
    raise ValueError(f"mode must be 'train' or 'read', not {mode!r}")
  try:
    return _assemble(opened, initial_params=initial_params,
                     model_only=mode == "read" and not optimizer_state)
  except BaseException:
    opened.manager.close()
    raise


def _state_bytes(model: nnx.Module, optimizer: nnx.Optimizer, wrt: Any, *,
                 training: bool, model_only: bool) -> dict[str, int]:
  """Bytes of an abstract model's parameters and (unless `model_only`) its optimizer
  state, and of the gradients where it trains."""
  def size(state):  # Arrays only: a custom model's state may hold plain Python values.
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state)
               if hasattr(x, "size") and hasattr(x, "dtype"))

  parts = {"parameters": size(nnx.state(model))}
  if not model_only:
    parts["optimizer state"] = size(nnx.state(optimizer))
  return {**parts, "gradients": size(nnx.state(model, wrt))} if training else parts


def _model_part(state: nnx.State) -> nnx.State:
  """The model's half of a (model, optimizer) state (or of its shardings)."""
  return nnx.from_flat_state([(path, leaf) for path, leaf in nnx.to_flat_state(state)
                              if path[0] == 0])


def _assemble(opened: opening.Opened, *, initial_params=None, model_only: bool = False) -> Run:
  """Model, optimizer and steps, restored into (no initialisation) or initialised;
  `model_only`: a finished run's model alone is read (see `build_run`'s `optimizer_state`)."""
  config, task, plan, placement = opened.config, opened.task, opened.plan, opened.placement
  transforms = task.model_transforms()

  def create(params=None):
    model = task.build_model(config.train.seed, plan, placement.layout())
    if params is not None:  # Given parameters: the initialisers become dead code.
      nnx.update(model, params)
    model = transforms.apply(model)  # QAT, LoRA adapters, ...; else unchanged.
    return model, optim.build_optimizer(config.optim, model, train_steps=config.train.steps,
                                        wrt=transforms.wrt)

  model, optimizer = nnx.eval_shape(create)  # Shapes only: nothing allocated yet.
  if jax.default_backend() == "cpu":  # The devices' memory is the host's: before any weights.
    host_memory.check_fits(_state_bytes(model, optimizer, transforms.wrt,
                                        training=opened.train_data is not None,
                                        model_only=model_only),
                           processes=jax.process_count())
  state_sharding = placement.state_shardings(nnx.state((model, optimizer)))
  train_step, eval_step, abstract = step.make_steps(
      model, optimizer, task.training_loss(transforms), state_sharding=state_sharding,
      microbatch_size=getattr(config.train, "microbatch_size", None))
  train_data = opened.train_data
  train_batches = iter(train_data) if train_data is not None else None
  restored = None
  if opened.restore:  # Into shapes only: no initialisation when a checkpoint exists.
    abstract = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, state_sharding)
    read = _model_part if model_only else lambda state: state
    try:
      restored = checkpoint.restore(opened.manager, read(transforms.saved(abstract)),
                                    train_batches, capture_stderr=opened.capture_stderr,
                                    subset=model_only)
    except CheckpointMismatchError as e:
      metadata = checkpoint.read_metadata(opened.manager, capture_stderr=opened.capture_stderr)
      raise workdir_lib.name_changed_fields(e, metadata, config) from None
    if restored is None and train_data is None:
      raise WorkdirError(f"no readable checkpoint in {opened.manager.directory}")
  if restored is None:  # A fresh run (restore raises when steps exist and none reads).
    train_batches = iter(train_data)
    # One compiled program that writes each array straight to its devices
    # (eagerly, each initialiser would also compile on its own).
    if initial_params is None:  # What `load` reads instead (a base) is not initialised.
      fresh = lambda state: transforms.initialised(transforms.saved(state))  # noqa: E731
      state = jax.jit(lambda: fresh(nnx.state(create())), out_shardings=fresh(state_sharding))()
    else:  # Placed by `initial_params`, then donated: one copy on the devices.
      bare = nnx.state(nnx.eval_shape(  # The Task's model, before QAT or adapters.
          lambda: task.build_model(config.train.seed, plan, placement.layout())))
      params = initial_params(jax.tree.map(
          lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
          bare, placement.state_shardings(bare)))
      state = jax.jit(lambda p: transforms.saved(nnx.state(create(p))),
                      out_shardings=transforms.saved(state_sharding), donate_argnums=0)(params)
    start = 0
  else:
    state = jax.device_put(restored.state, read(transforms.saved(state_sharding)))
    start = restored.step
    if start:  # Step 0 (import-hf's) has trained under no config: nothing to keep bitwise.
      _warn_attention_change(restored.metadata, opened.choice)
    resumed = opened.resumed
    if resumed is not None and resumed.basis != phases.history(restored.metadata):
      raise WorkdirError(  # The newest step did not read (moved aside): its phases were read.
          f"step {restored.step} was restored, not the newest, whose phases this run was set up "
          "with (that step did not read and was moved aside): run the same command again")
  try:  # A fine-tune's base, read into this config's shapes.
    state = transforms.load(state, abstract, state_sharding,
                            restored.metadata if restored else None, model=model)
  except CheckpointMismatchError as e:  # An override the base cannot take: named.
    if restored is None:
      raise
    raise workdir_lib.name_changed_fields(e, restored.metadata, config) from None
  step.merge(model, optimizer, state)  # The abstract objects now hold the arrays.
  return Run(config=config, task=task, workdir=opened.workdir, manager=opened.manager,
             model=model, optimizer=optimizer, train_step=train_step, eval_step=eval_step,
             state=state, step=start, attention=plan, attention_choice=opened.choice,
             placement=placement, train_batches=train_batches, validation=opened.validation,
             transforms=transforms, converted=restored.converted if restored else None,
             phases=(opened.resumed.phases if opened.resumed is not None
                     else phases.history(restored.metadata) if restored else []),
             phase_changes=opened.resumed.started if opened.resumed is not None else [])
