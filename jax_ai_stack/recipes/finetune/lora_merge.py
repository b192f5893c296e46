"""A LoRA run's adapters folded into full weights, written as a plain run (`lora merge`).

Above `recipes.run` (it opens the finished LoRA run through `build_run`),
while `lora` (the adapters, what a run builds with) stays below it.

Example:
  >>> default_out("runs/lm-tiny-lora")
  PosixPath('runs/lm-tiny-lora-merged')
  >>> merge("runs/lm-tiny-lora", "runs/lm-tiny-lora-merged")  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Mapping

from flax import nnx

from jax_ai_stack.errors import UsageError, WorkdirError
from jax_ai_stack.recipes import checkpoint, configlib, optim, tasks
from jax_ai_stack.recipes.finetune.config import FinetuneConfig
from jax_ai_stack.recipes.run import build_run
from jax_ai_stack.recipes.workdir import CHECKPOINT_DIR, prepare_workdir

__all__ = ["default_out", "merge"]


def default_out(workdir: str | pathlib.Path) -> pathlib.Path:
  """Where `merge` writes by default: `<workdir>-merged` beside the LoRA run."""
  workdir = pathlib.Path(workdir)
  return workdir.with_name(workdir.name + "-merged")


def merged_finetune(config) -> FinetuneConfig:
  """The merged run's `finetune` section: none (full weights need no base), except on
  preference data, whose DPO reference stays the LoRA run's base (now a frozen copy, as a
  full fine-tuning DPO run keeps it), so that the merged run evaluates and trains on."""
  if not config.data.is_preference:
    return FinetuneConfig()
  return dataclasses.replace(config.finetune, lora=None)


def merge(workdir: str | pathlib.Path, out: str | pathlib.Path | None = None, *,
          environ: Mapping[str, str] | None = None, capture_stderr: bool = False) -> pathlib.Path:
  """Writes a LoRA run's merged weights (base + adapters) as a plain run in `out`.

  `out` (default `<workdir>-merged`) is a normal workdir: one checkpoint at the
  LoRA run's step, its config without `finetune`, a fresh optimizer state, so
  `eval` and `generate` (and further training) work on it without the base (a DPO
  run's merged run keeps the base as its reference: `merged_finetune`).
  An `out` that already has checkpoints is refused; nothing there changes.
  `environ` and `capture_stderr` are `build_run`'s.
  """
  workdir = pathlib.Path(workdir)
  out = pathlib.Path(out) if out is not None else default_out(workdir)
  if out.absolute() == workdir.absolute():
    raise UsageError(f"--out {out} is the LoRA run's own workdir: choose another directory")
  if (out / CHECKPOINT_DIR).is_dir() and any((out / CHECKPOINT_DIR).iterdir()):
    raise WorkdirError(f"{out} already has checkpoints: choose another --out (nothing was changed)")
  run = build_run(None, workdir, mode="read", environ=environ, capture_stderr=capture_stderr)
  try:
    if run.config.finetune.lora is None:
      raise WorkdirError(f"{workdir} is not a LoRA run (no finetune.lora): its checkpoint "
                         "already holds full weights")
    pointer = run.transforms.metadata()["finetune"]
    config = dataclasses.replace(run.config, finetune=merged_finetune(run.config))
    model = run.inference_model()
    optimizer = optim.build_optimizer(config.optim, model, train_steps=config.train.steps)
    metadata = {"step": run.step, "config": configlib.to_dict(config),
                "merged_from": {"workdir": str(workdir.absolute()), **pointer}}
    if config.finetune.active:  # A DPO run's reference: the same base, as a frozen copy.
      metadata["finetune"] = pointer
    if run.attention_choice is not None:
      metadata["attention"] = {**run.attention_choice.to_dict(), "plan": run.attention.to_dict()}
    step = run.step
  finally:
    run.close()
  prepare_workdir(out, read_only=False)
  data = iter(tasks.for_config(config).dataset("train", config.train.seed))
  manager = checkpoint.build_manager(out / CHECKPOINT_DIR, config.checkpoint)
  try:
    checkpoint.save(manager, step, nnx.state((model, optimizer)), data, metadata, force=True)
  finally:
    manager.close()
  return out
