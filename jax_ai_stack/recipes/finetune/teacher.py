"""A distillation run's teacher: a trained model, frozen beside the student.

`Teacher.of(recipe)` reads what `finetune.distill.teacher` names, a run (the config its
checkpoint holds) or a Hugging Face directory (its config.json), and checks, before
anything is built, that it speaks the student's tokens: the same tokenizer (file) and
vocabulary, else one line naming both. `apply` puts the teacher's decoder, as its own
config builds it and laid out on the student's mesh, under the student's `teacher`
attribute with its weights `Frozen`: the optimizer and the gradient pass them by, and
checkpoints leave them out. `load` reads them each time a run opens, a run's at the step it
first read (the checkpoint's pointer), and refuses a teacher whose weights changed since
(their checksum), as a fine-tuning run refuses a changed base: a resumed run is the run
that never stopped. `reference_model` hands the teacher to the objective
(`tasks.distillation`); the model that decodes and is exported is the student alone. The
memory plan counts the teacher's weights with the frozen ones ("reference").

A teacher that was itself a LoRA run is read with its adapters merged (`base_run`).

Example: a recipe without a teacher changes nothing.
  >>> from jax_ai_stack.recipes import config
  >>> plain = Teacher.of(config.load("lm-tiny"))
  >>> plain.provides_reference, plain.metadata()
  (False, {})
"""

from __future__ import annotations

import dataclasses
import hashlib
import pathlib
from collections.abc import Callable
from typing import Any

import numpy as np
from flax import nnx

from jax_ai_stack.errors import ConfigError
from jax_ai_stack.recipes.finetune import base_run, reference
from jax_ai_stack.recipes.transforms import Frozen, ModelTransform

ATTRIBUTE = "teacher"
"""The student's attribute that holds the teacher (state paths `teacher/<its path>`)."""
ORIGIN = "finetune.distill.teacher"


def _is_teacher(path, variable) -> bool:
  """The teacher's frozen weights in a (model, optimizer) state."""
  return path[:2] == (0, ATTRIBUTE) and isinstance(variable, Frozen)


@dataclasses.dataclass(frozen=True)
class Source:
  """A teacher: where it is and the decoder it is."""

  where: str
  model: Any
  """Its `DecoderConfig`."""
  hugging_face: bool
  """A Hugging Face directory (config.json and safetensors), not a run's checkpoints."""


def tokens_of(tokenizer: str, path: str | None, vocab_size: int) -> tuple:
  """What decides the ids a model speaks: the tokenizer's kind, its file's bytes, the vocab."""
  digest = hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest() if path else None
  return tokenizer, digest, vocab_size


def read_teacher(where: str, student: Any) -> Source:
  """The teacher at `where`, a trained run (its workdir's config.yaml) or a Hugging Face
  directory, checked to speak `student`'s tokens; ConfigError in one line otherwise."""
  from jax_ai_stack.recipes.models import hf  # pylint: disable=g-import-not-at-top
  from jax_ai_stack.recipes.models.configs import DecoderConfig  # pylint: disable=g-import-not-at-top

  if (pathlib.Path(where) / hf.CONFIG_FILE).is_file():
    model = DecoderConfig(**hf.read_config(where))
    tokenizer = pathlib.Path(where) / hf.TOKENIZER_FILE
    if not tokenizer.is_file():
      raise ConfigError(f"{ORIGIN}={where!r}: no {hf.TOKENIZER_FILE} there, so its tokens are "
                        "unknown")
    source, theirs = Source(where, model, True), tokens_of("huggingface", tokenizer, model.vocab_size)
  else:
    model, tokenizer, path = _run_config(where)
    source, theirs = Source(where, model, False), tokens_of(tokenizer, path, model.vocab_size)
  ours = tokens_of(student.data.tokenizer, student.data.tokenizer_path, student.model.vocab_size)
  if theirs != ours:
    said = lambda t: f"tokenizer {t[0]}{' (another file)' if t[1] != ours[1] else ''}, " \
                     f"vocab_size {t[2]}"
    raise ConfigError(f"{ORIGIN}={where!r} speaks other tokens than this run ({said(theirs)}; "
                      f"this run: tokenizer {ours[0]}, vocab_size {ours[2]}): a teacher needs the "
                      "student's tokenizer and vocabulary")
  return source


def _run_config(where: str) -> tuple[Any, str, str | None]:
  """(model, data.tokenizer, data.tokenizer_path) of the recipe the trained run at `where`
  saved with its checkpoint (the step it names, or the newest), a decoder's."""
  from jax_ai_stack.recipes import checkpoint  # pylint: disable=g-import-not-at-top
  from jax_ai_stack.recipes.configlib import from_dict  # pylint: disable=g-import-not-at-top
  from jax_ai_stack.recipes.models.configs import DecoderConfig  # pylint: disable=g-import-not-at-top

  directory, step = base_run.resolve_base(where)
  manager = checkpoint.build_manager(directory, checkpoint.CheckpointConfig(), read_only=True)
  try:
    saved = checkpoint.read_metadata(manager, step)["config"]
  finally:
    manager.close()
  model, data = saved.get("model", {}), saved.get("data", {})
  if model.get("kind") in ("cnn", "custom"):
    raise ConfigError(f"{ORIGIN}={where!r} trained a {model['kind']} model: a teacher is a "
                      "decoder language model")
  return (from_dict(DecoderConfig, model, source=f"{ORIGIN}={where!r}: its model"),
          data.get("tokenizer", "byte"), data.get("tokenizer_path"))


class Teacher(ModelTransform):
  """What `finetune.distill.teacher` does to a run (see the module); inactive without one."""

  def __init__(self, source: Source | None):
    self.source = source
    self.where = source.where if source else None
    self.pointer: dict | None = None

  @classmethod
  def of(cls, recipe: Any) -> Teacher:
    """The recipe's teacher, its config read and checked now (before the run builds)."""
    distill = getattr(getattr(recipe, "finetune", None), "distill", None)
    where = getattr(distill, "teacher", None)
    return cls(None if where is None else read_teacher(where, recipe))

  @property
  def label(self) -> str:
    return ORIGIN

  @property
  def provides_reference(self) -> bool:
    return self.where is not None

  def apply(self, model: nnx.Module) -> nnx.Module:
    """The student with the teacher's decoder beside it, its weights frozen."""
    if self.where is None:
      return model
    from jax_ai_stack.recipes.models.decoder import Decoder  # pylint: disable=g-import-not-at-top

    teacher = Decoder(self.source.model, rngs=nnx.Rngs(0), layout=getattr(model, "layout", None))
    for _, module in nnx.iter_modules(teacher):
      for name, value in list(vars(module).items()):
        if isinstance(value, nnx.Param):
          setattr(module, name, Frozen(value.get_value(), **value.get_metadata()))
    setattr(model, ATTRIBUTE, teacher)
    return model

  def saved(self, state: nnx.State) -> nnx.State:
    return nnx.filter_state(state, nnx.Not(_is_teacher)) if self.where else state

  def load(self, state, abstract, shardings, metadata, *, model):
    """`state` with the teacher's weights read in, as the run first read them."""
    del model
    if self.source is None:
      return state
    import jax  # pylint: disable=g-import-not-at-top

    flat = nnx.to_flat_state(nnx.filter_state(abstract, _is_teacher))
    placed = dict(nnx.to_flat_state(nnx.filter_state(shardings, _is_teacher)))
    target = nnx.from_flat_state([  # The teacher's own paths, as its files name them.
        (path[2:], nnx.Param(jax.ShapeDtypeStruct(
            v.get_value().shape, v.get_value().dtype, sharding=placed[path].get_value())))
        for path, v in flat])
    weights, self.pointer = self._read(target, (metadata or {}).get(ATTRIBUTE))
    slots = dict(flat)
    frozen = [((0, ATTRIBUTE, *path), slots[(0, ATTRIBUTE, *path)].replace(v.get_value()))
              for path, v in nnx.to_flat_state(weights)]
    return nnx.merge_state(state, nnx.from_flat_state(frozen))

  def _read(self, target: nnx.State, pointer: dict | None) -> tuple[nnx.State, dict]:
    """The teacher's weights into `target` and the pointer that finds them again; a
    BaseCheckpointError where they differ from what `pointer` (a resumed run's) read."""
    dtype = self.source.model.param_dtype
    if self.source.hugging_face:
      from jax_ai_stack.recipes.models import hf  # pylint: disable=g-import-not-at-top

      weights = hf.load_params(self.where, self.source.model, target)
      found = np.asarray(base_run.checksum(nnx.to_pure_dict(weights))).tolist()
      read = {"base": str(pathlib.Path(self.where).absolute()), "step": None}
    else:  # A run's checkpoint holds the model at (0, <its path>) of (model, optimizer).
      as_run = nnx.from_flat_state([((0, *path), v) for path, v in nnx.to_flat_state(target)])
      if pointer:
        weights, step, found = base_run.read_checked(pointer, dtype, as_run, self.where,
                                                     then=dtype)
        directory = pointer["base"]
      else:
        directory, step = base_run.resolve_base(self.where)
        weights, step = base_run.read_base(directory, step, as_run, self.where,
                                           param_dtype=dtype)
        found = np.asarray(base_run.checksum(nnx.to_pure_dict(weights))).tolist()
      weights = nnx.from_flat_state([(path[1:], v) for path, v in nnx.to_flat_state(weights)])
      read = {"base": str(directory), "step": step}
    if pointer and found != pointer["checksum"]:
      where = read["base"] + (f" step {read['step']}" if read["step"] is not None else "")
      raise base_run.BaseCheckpointError(
          f"the teacher {where} has changed since this run started ({ORIGIN}; checksum "
          f"{found} != {pointer['checksum']}): restore it, or distill again in a new --workdir")
    return weights, {**read, "checksum": found, "dtype": dtype}

  def metadata(self) -> dict[str, Any]:
    """The pointer to the teacher's step and checksum, for a checkpoint's metadata."""
    return {ATTRIBUTE: self.pointer} if self.pointer else {}

  def reference_model(self, model: nnx.Module) -> nnx.Module | None:
    return getattr(model, ATTRIBUTE) if self.where else None

  def inference_model(self, model: nnx.Module, plain: Callable[[], nnx.Module]) -> nnx.Module:
    del plain
    return reference.without_attribute(model, ATTRIBUTE) if self.where else model

  def describe(self, model: nnx.Module) -> str | None:
    if self.where is None:
      return None
    import jax  # pylint: disable=g-import-not-at-top

    count = lambda state: sum(int(np.prod(a.shape)) for a in jax.tree.leaves(state))
    student = count(nnx.state(reference.without_attribute(model, ATTRIBUTE), nnx.Param))
    teacher = count(nnx.state(getattr(model, ATTRIBUTE), Frozen))
    return f"{student:,} parameters (and a frozen teacher of {teacher:,}: {self.where})"
